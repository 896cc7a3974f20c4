"""Hardware descriptions by name or file, and runtime configs turned into cost-model inputs.

``load_hardware("h100")`` reads ``configs/hardware/h100.yaml`` (names are the files there,
case-insensitive); any other argument is a YAML/JSON file in the same format, such as
what ``python -m launch simulate calibrate --out FILE`` wrote for this machine.
``deployment_from_config`` maps a ``RuntimeConfig`` onto ``parallel.costmodel.Deployment``, and
``compute_layout_kv_sizing`` is the one KV capacity of a rank of a layout: ``kvcalc`` and
``simulate`` both report it (tests/unit/test_kv_capacity_agreement.py keeps them equal).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from launch.config import RuntimeConfig
from launch.config_schema import ConfigError, load_yaml_text
from launch.core.kv_sizing import KVSizing, NoKVRoomError, compute_kv_sizing, format_memory
from moe.config import ModelConfig, read_config_json
from parallel.costmodel import Deployment, Hardware, weight_bytes_per_rank

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "configs" / "hardware"
_RUNTIME_DTYPES = ("bfloat16", "float16", "float32")


def hardware_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A shipped hardware by name (``h800``, ``H100``, ...) or a YAML/JSON file; ValueError
    naming the problem otherwise."""
    text = str(name_or_path)
    path = Path(text)
    if not path.is_file():
        shipped = HARDWARE_DIR / f"{text.lower()}.yaml"
        if not shipped.is_file():
            raise ValueError(f"hardware {text!r} is neither a file nor one of {hardware_names()}")
        path = shipped
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise ValueError(f"hardware file {path}: not a {kind} text file (it is not UTF-8 text); expected a mapping "
                         f"of hardware fields (name, flops, memory_bandwidth, ...) as configs/hardware/*.yaml "
                         "holds") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else load_yaml_text(text, str(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of hardware fields (name, flops, memory_bandwidth, ...)")
    return Hardware.from_dict(data)


def save_hardware(hw: Hardware, path: str | Path) -> None:
    """Write ``hw`` in the ``configs/hardware`` format (YAML, or JSON for a .json path)."""
    data = hw.to_dict()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        out.write_text(json.dumps(data, indent=2) + "\n")
    else:
        out.write_text(yaml.safe_dump(data, sort_keys=False))


def model_raw_config(model: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict of a checkpoint dir / config.json / shipped model name
    (``moe.config.read_config_json``: ValueError saying what was expected otherwise), with
    ``model_overrides`` applied on top."""
    return {**read_config_json(model), **(overrides or {})}


def stored_weight_dtype(raw: dict[str, Any], compute_dtype: str) -> str:
    """'fp8' when the checkpoint ships fp8 weights (quantization_config quant_method fp8),
    else the compute dtype. kvcalc and simulate size fp8 serving with it; the engine does not (it
    dequantizes fp8 weights at load and holds them in the compute dtype: ``compute_num_kv_blocks``)."""
    quant = raw.get("quantization_config") or {}
    return "fp8" if str(quant.get("quant_method", "")).lower() == "fp8" else compute_dtype


def resolve_weight_dtype(flag: str | None, raw: dict[str, Any], compute: str) -> str | None:
    """The ``Deployment.weight_dtype`` of a ``--weight-dtype`` flag: "auto" (or None) reads the
    checkpoint's quantization_config ("fp8" for fp8 weights, else None: the compute dtype)."""
    if flag in (None, "auto"):
        return "fp8" if stored_weight_dtype(raw, compute) == "fp8" else None
    return flag


def compute_dtype(engine_dtype: str, model_config: ModelConfig) -> str:
    """engine.dtype with "auto" resolved like the engine does (the checkpoint's, else bfloat16)."""
    if engine_dtype != "auto":
        return engine_dtype
    return model_config.dtype if model_config.dtype in _RUNTIME_DTYPES else "bfloat16"


def deployment_from_config(cfg: RuntimeConfig, model_config: ModelConfig, *, weight_dtype: str | None = None,
                           enable_two_batch_overlap: bool = False, dispatch_dtype: str | None = None,
                           memory_bytes: int | None = None) -> Deployment:
    """The cost model's view of a runtime config. weight_dtype None: the activation dtype;
    memory_bytes: per-rank memory when the config names none (``engine.memory``)."""
    p, e, b = cfg.parallel, cfg.engine, cfg.balancer
    kv_tokens = e.num_kv_blocks * e.block_size if e.num_kv_blocks is not None else None
    return Deployment(
        tp=p.tensor_parallel_size, dp=p.data_parallel_size, ep=p.expert_parallel_size, num_nodes=p.num_nodes,
        num_redundant_experts=b.num_redundant_experts if b.enable_eplb else 0, enable_eplb=b.enable_eplb,
        eplb_policy=b.resolved_policy, capacity_factor=cfg.moe.capacity_factor,
        dtype=compute_dtype(e.dtype, model_config), weight_dtype=weight_dtype, kv_cache_dtype=e.kv_cache_dtype,
        dispatch_dtype=dispatch_dtype, all2all_backend=p.dispatch_backend,
        enable_two_batch_overlap=enable_two_batch_overlap, max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens, memory_utilization=e.memory_utilization,
        memory_bytes=e.memory_bytes or memory_bytes, kv_capacity_tokens=kv_tokens,
    )


def compute_layout_kv_sizing(model: ModelConfig, dep: Deployment, memory_bytes: int | str, *,
                             max_model_len: int | None = None) -> KVSizing:
    """KV capacity of one rank of ``dep``: ``dep.memory_bytes`` (else ``memory_bytes``, the
    hardware's) x ``dep.memory_utilization``, less the rank's weights
    (``parallel.costmodel.weight_bytes_per_rank``: its P / ep routed expert slots, every
    routed expert when ep = 1, dense weights over TP, in ``dep.weight_dtype``), in KV of
    ``dep.kv_cache_dtype`` (MLA latent whole on every rank, GQA heads over TP).
    ``dep.kv_capacity_tokens`` (a config's fixed engine.num_kv_blocks) is not read here.
    Raises NoKVRoomError (a ValueError) when the weights leave no room."""
    return compute_kv_sizing(
        model, memory_bytes=dep.memory_bytes or memory_bytes, kv_cache_dtype=dep.kv_cache_dtype,
        dtype_bytes=dep.act_bytes, memory_utilization=dep.memory_utilization, max_model_len=max_model_len,
        tensor_parallel_size=dep.tp, weight_bytes_per_rank=weight_bytes_per_rank(model, dep),
    )


def compute_num_blocks(sizing: KVSizing, block_size: int) -> int:
    """Whole KV blocks of ``block_size`` tokens that ``sizing``'s budget holds (the engine allocates
    whole blocks). NoKVRoomError naming the block size when not one block fits."""
    blocks = sizing.num_blocks(block_size)
    if blocks < 1:
        raise NoKVRoomError(
            f"no room for one KV block: a block of {block_size:,} tokens takes "
            f"{format_memory(block_size * sizing.kv_bytes_per_token_per_rank)} of KV per rank, over the "
            f"{format_memory(sizing.kv_budget_bytes)} ({sizing.max_num_tokens:,} tokens) the weights leave; "
            "give a smaller block_size")
    return blocks


def compute_kv_capacity_tokens(model: ModelConfig, dep: Deployment, memory_bytes: int,
                               block_size: int | None = None, *, strict: bool = False) -> int:
    """KV tokens one rank of ``dep`` holds: a config's fixed ``dep.kv_capacity_tokens``, else
    ``compute_layout_kv_sizing``'s ``max_num_tokens``, in whole blocks of ``block_size`` when given.
    When the weights leave no room (or no block): 0, or with ``strict`` the ``NoKVRoomError`` that says why."""
    if dep.kv_capacity_tokens is not None:
        return dep.kv_capacity_tokens
    try:
        sizing = compute_layout_kv_sizing(model, dep, memory_bytes)
        return sizing.max_num_tokens if block_size is None else compute_num_blocks(sizing, block_size) * block_size
    except NoKVRoomError:
        if strict:
            raise
        return 0
