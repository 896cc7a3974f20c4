"""``predict_runtime_point``: the cost model's step times for a runtime config (what sweeps call)."""

from __future__ import annotations

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
    ``launch.hardware.compute_kv_capacity_tokens``, what ``kvcalc`` and ``simulate`` report."""
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    raw = model_raw_config(cfg.model, cfg.model_overrides)
    model = ModelConfig.from_hf(raw, strict=False)
    dep = deployment_from_config(cfg, model, weight_dtype=weight_dtype,
                                 enable_two_batch_overlap=enable_two_batch_overlap)
    dep = replace(dep, kv_capacity_tokens=compute_kv_capacity_tokens(model, dep, hw.memory_bytes))
    return predict_point(model, dep, hw, batch_size=batch_size, kv_len=kv_len, prefill_tokens=prefill_tokens,
                         prompt_len=prompt_len, expert_load=expert_load, placement=placement)
