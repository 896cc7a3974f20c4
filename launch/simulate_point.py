"""One point of the cost model for a runtime config: ``predict_runtime_point`` (the step times, what
sweeps call) and ``load_expert_load`` (the measured expert load a file holds, what
``simulate --expert-load`` reads)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from launch.config import RuntimeConfig
from launch.hardware import (
    compute_kv_capacity_tokens,
    deployment_from_config,
    load_hardware,
    model_raw_config,
)
from launch.profile.dumps import DumpError, check_logical
from launch.profile.readers import DUMP_SUFFIXES, read_recording
from moe.config import ModelConfig
from parallel.costmodel import Hardware, StepPrediction, predict_point


def predict_runtime_point(cfg: RuntimeConfig, hardware: Hardware | str | Path, *, batch_size: int, kv_len: int,
                          expert_load: np.ndarray | None = None, placement: np.ndarray | None = None,
                          prefill_tokens: int | None = None, prompt_len: int | None = None,
                          weight_dtype: str | None = None, enable_two_batch_overlap: bool = False
                          ) -> StepPrediction:
    """Predict one runtime config's decode/prefill step on ``hardware`` (a ``Hardware``, a
    shipped name, or a calibration file). batch_size: decoding sequences per DP rank;
    kv_len: their mean context. expert_load: [L_moe, E] measured tokens per expert (e.g.
    the warm-up's window); placement: [L_moe, P] phy2log the run used (None: the
    balancer's placement of the load when EPLB is on, else the identity). KV capacity is
    ``launch.hardware.compute_kv_capacity_tokens`` in whole ``engine.block_size`` blocks, what
    ``kvcalc`` and ``simulate`` report."""
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    raw = model_raw_config(cfg.model, cfg.model_overrides)
    model = ModelConfig.from_hf(raw, strict=False)
    dep = deployment_from_config(cfg, model, weight_dtype=weight_dtype,
                                 enable_two_batch_overlap=enable_two_batch_overlap)
    dep = replace(dep, kv_capacity_tokens=compute_kv_capacity_tokens(model, dep, hw.memory_bytes,
                                                                      cfg.engine.block_size))
    return predict_point(model, dep, hw, batch_size=batch_size, kv_len=kv_len, prefill_tokens=prefill_tokens,
                         prompt_len=prompt_len, expert_load=expert_load, placement=placement)


_JSON_LOAD = "a JSON [L, E] (or [steps, L, E]) array or object with 'logical_count'"
_EXPECTED_LOAD = ("expected an expert-distribution dump as `profile report` reads them (`profile run`'s "
                  f".safetensors, SGLang's .pt, .npy, .npz or .csv) or {_JSON_LOAD}")


def load_expert_load(path: str) -> np.ndarray:
    """[L, E] tokens per expert, summed over steps: any expert-distribution dump ``profile report``
    reads (``launch.profile.readers.read_recording``: ``profile run``'s .safetensors, SGLang's .pt,
    .npy, .npz, .csv), or a JSON array ([L, E] or [steps, L, E]) or object with ``logical_count``.
    ValueError naming the file and what was expected."""
    p = Path(path)
    if p.is_file() and _is_json_text(p):
        return _load_json_load(p)
    try:
        return read_recording([p]).logical_count.sum(0)
    except DumpError as e:  # a file of no dump suffix that the reader could not sniff may have meant JSON
        sniffed = p.is_file() and p.suffix.lower() not in DUMP_SUFFIXES
        raise ValueError(f"{e}; --expert-load also takes {_JSON_LOAD}" if sniffed else str(e)) from None


def _is_json_text(p: Path) -> bool:
    """A .json file, or one of no dump suffix whose text starts like a JSON array or object."""
    if p.suffix.lower() == ".json":
        return True
    if p.suffix.lower() in DUMP_SUFFIXES:
        return False
    with p.open("rb") as f:
        head = f.read(64).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head[:1] in (b"[", b"{")


def _load_json_load(p: Path) -> np.ndarray:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not JSON (not UTF-8 text); {_EXPECTED_LOAD}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e}); {_EXPECTED_LOAD}") from None
    if isinstance(data, dict) and "logical_count" not in data:
        raise ValueError(f"{p}: expected an [L, E] array or a dump with 'logical_count', got an object "
                         f"with keys {sorted(data)[:5]}")
    try:
        arr = np.asarray(data["logical_count"] if isinstance(data, dict) else data, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{p}: expected an [L, E] array of numbers") from None
    if arr.ndim not in (2, 3):
        raise ValueError(f"{p}: expected an [L, E] (or [steps, L, E]) array, got shape {arr.shape}")
    return check_logical(p, arr).sum(0)  # the dumps' checks: finite, non-negative, some steps
