"""``kvcalc``: how much KV cache fits, from a model's config.json alone (no weights needed).

Prints bytes per token (MLA latent or GQA heads, and what full MHA would need), the
weights per TP rank, the tokens that fit in the rest of the memory budget, and how many
sequences of ``--max-model-len`` tokens fit at once, in whole blocks of ``--block-size`` as the
engine allocates them (JSON ``kv_capacity_tokens``; ``max_num_tokens`` is the budget before
rounding to blocks). The arithmetic is
``launch.hardware.compute_layout_kv_sizing``, the same call ``simulate`` sizes its KV
capacity with: same model, hardware and layout, same tokens (tests/unit/test_kv_capacity_agreement.py).

``--model`` is a checkpoint directory, its config.json, a released model's name
(``deepseek-ai/DeepSeek-V3``, shipped offline in ``configs/models``), or a runtime config
YAML (``configs/deepseek-v3-decode-ep144.yaml``): then its model, TP and EP sizes,
redundant experts, KV-cache dtype, dtype, memory, max_model_len, block size, memory
utilization and model_overrides are the defaults (flags still win). A rank's weights are
``parallel.costmodel.weight_bytes_per_rank``: with expert parallelism its P / ep routed
expert slots, without it every routed expert (TP splits attention and dense MLPs, not
experts), in the checkpoint's stored dtype (``quantization_config`` fp8: 1 byte).
Memory per rank is ``--memory``, or the ``--hardware`` spec's ``memory_bytes`` (one of the two
flags), else the runtime config's ``engine.memory``, else ``h100``'s (as ``simulate --hardware h100``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from launch.config_args import FlagParser, memory_size
from launch.core.kv_sizing import KVSizing, format_memory, parse_memory
from launch.hardware import (
    compute_dtype,
    compute_layout_kv_sizing,
    compute_num_blocks,
    load_hardware,
    model_raw_config,
    resolve_weight_dtype,
)
from moe.config import ModelConfig
from parallel.costmodel import Deployment

if TYPE_CHECKING:
    from launch.config import RuntimeConfig

_DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_HARDWARE = "h100"
EXIT_USAGE = 2  # bad input, as across the CLI (launch.cli.EXIT_USAGE)


def _build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m launch kvcalc", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="checkpoint dir, config.json, model name (deepseek-ai/DeepSeek-V3) or runtime config YAML")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default=None, help="default: auto")
    p.add_argument("--dtype", choices=("auto", *_DTYPES), default=None,
                   help="compute dtype (and 'auto' KV); default auto: the checkpoint's, else bfloat16")
    p.add_argument("--weight-dtype", choices=("auto", "fp8", *_DTYPES), default="auto",
                   help="stored weight dtype; auto: fp8 when quantization_config says so, else --dtype")
    p.add_argument("--memory", type=memory_size, default=None, metavar="SIZE",
                   help="accelerator memory per rank, e.g. 80GiB, 141GB, 80e9 (default: --hardware's)")
    p.add_argument("--hardware", default=None,
                   help=f"h800 | h100 | h200 | b200 or a hardware YAML: its memory_bytes (default {DEFAULT_HARDWARE})")
    p.add_argument("--gpu-memory-utilization", "--memory-utilization", dest="memory_utilization",
                   type=float, default=None, help="default: 0.9")
    p.add_argument("--max-model-len", type=int, default=None, help="default: max_position_embeddings")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="default: 1")
    p.add_argument("--expert-parallel-size", "-ep", type=int, default=None,
                   help="ranks the routed experts are spread over (default 1: every rank holds all)")
    p.add_argument("--num-redundant-experts", type=int, default=None, help="extra expert slots per layer (EP)")
    p.add_argument("--block-size", type=int, default=None, help="default: 16")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _is_runtime_config(path: Path) -> bool:
    return path.is_file() and path.suffix in (".yaml", ".yml")


def model_runtime_config(model: str) -> RuntimeConfig | None:
    """The runtime config a ``--model`` argument names (a .yaml / .yml file), else None;
    ValueError saying what ``--model`` takes when the YAML is not a runtime config."""
    if not _is_runtime_config(Path(model)):
        return None
    from launch.config import ConfigError, load_runtime_config

    try:
        return load_runtime_config(model)
    except ConfigError as e:
        raise ValueError(f"{model} is not a runtime config ({e}); {EXPECTED}") from None


def _apply_runtime_config(args: argparse.Namespace, cfg: RuntimeConfig) -> None:
    """Fill unset flags from the runtime config named by --model, and point --model at its model."""
    p, e, b = cfg.parallel, cfg.engine, cfg.balancer
    args.model = cfg.model
    defaults = {"tensor_parallel_size": p.tensor_parallel_size, "expert_parallel_size": p.expert_parallel_size,
                "num_redundant_experts": b.num_redundant_experts if b.enable_eplb else 0,
                "kv_cache_dtype": e.kv_cache_dtype, "max_model_len": e.max_model_len,
                "memory_utilization": e.memory_utilization, "block_size": e.block_size}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = e.dtype
    if e.memory is not None and args.memory is None:
        args.memory = e.memory
    args.model_overrides = cfg.model_overrides


EXPECTED = ("expected a checkpoint directory, its config.json, a runtime config YAML (configs/*.yaml) or a "
            "model name such as deepseek-ai/DeepSeek-V3")


def _raw_model_config(model: str, overrides: dict | None) -> dict:
    path = Path(model)
    if path.is_file():
        try:
            json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{model} is neither a model config.json nor a runtime config: {EXPECTED}") from None
    return model_raw_config(model, overrides)


def _fill_defaults(args: argparse.Namespace) -> None:
    for name, value in (("tensor_parallel_size", 1), ("expert_parallel_size", 1), ("num_redundant_experts", 0),
                        ("kv_cache_dtype", "auto"), ("memory_utilization", 0.9), ("block_size", 16),
                        ("dtype", "auto"), ("model_overrides", None)):
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def _check_args(args: argparse.Namespace) -> None:
    """Refuse sizes no deployment has (flags, or the runtime config's values)."""
    for name in ("tensor_parallel_size", "expert_parallel_size", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    if args.num_redundant_experts < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {args.num_redundant_experts}")
    if not 0.0 < args.memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.memory_utilization}")
    ep, tp = args.expert_parallel_size, args.tensor_parallel_size
    if args.num_redundant_experts and ep == 1:  # as the runtime: redundant slots need EPLB, which needs EP
        raise ValueError(f"num_redundant_experts {args.num_redundant_experts} needs expert parallelism (-ep N, N > 1): "
                         "redundant slots are the balancer's replicas spread over the EP ranks")
    if ep > 1 and ep % tp:
        # The runtime spreads the experts over every rank of the instance: ep = tp x dp.
        nearest = " or ".join(str(n) for n in (tp * (ep // tp), tp * (ep // tp + 1)) if n > 1)
        raise ValueError(f"expert_parallel_size {ep} is not a multiple of tensor_parallel_size {tp}: experts are "
                         f"spread over all tp x dp ranks, so ep is tp x dp (the nearest: {nearest})")


def _check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """TP splits the attention heads (MLA's too): the runtime needs tp to divide them."""
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide num_attention_heads {cfg.num_attention_heads}")


def _check_max_model_len(cfg: ModelConfig, max_model_len: int | None) -> None:
    """``launch config``'s check of ``engine.max_model_len`` against the model's context length
    (``RuntimeConfig.validate_for_model``: max_position_embeddings, or YaRN's longer one), same words."""
    if max_model_len is None:
        return
    from launch.config import EngineConfig, RuntimeConfig

    # the rest of the layout at its defaults (tp 1, no EP, chunked prefill): only max_model_len is checked here
    RuntimeConfig(model="-", engine=EngineConfig(max_model_len=max_model_len)).validate_for_model(cfg)


def _deployment(cfg: ModelConfig, raw: dict, args: argparse.Namespace) -> Deployment:
    """The flags as the cost model's layout: one EP group of ep = tp x dp ranks (dp 1 without EP:
    a rank's memory does not depend on how many DP replicas there are)."""
    tp, ep = args.tensor_parallel_size, args.expert_parallel_size
    dtype = compute_dtype(args.dtype, cfg)
    return Deployment(tp=tp, dp=max(1, ep // tp), ep=ep, num_redundant_experts=args.num_redundant_experts,
                      dtype=dtype, weight_dtype=resolve_weight_dtype(args.weight_dtype, raw, dtype),
                      kv_cache_dtype=args.kv_cache_dtype, memory_utilization=args.memory_utilization)


def _memory(args: argparse.Namespace) -> tuple[int, str]:
    """(bytes per rank, where they come from): --memory / engine.memory, else --hardware's."""
    if args.memory is not None:
        return parse_memory(args.memory), str(args.memory)
    hw = load_hardware(args.hardware or DEFAULT_HARDWARE)
    return hw.memory_bytes, f"{hw.name} memory_bytes {hw.memory_bytes:,}"


def _layout_line(cfg: ModelConfig) -> str:
    if cfg.attention == "mla":
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return f"MLA latent: {cfg.kv_lora_rank} + {cfg.qk_rope_head_dim} rope = {width} values per layer"
    return (f"GQA: 2 x {cfg.num_key_value_heads} KV heads x {cfg.head_dim} = "
            f"{2 * cfg.num_key_value_heads * cfg.head_dim} values per layer")


def _count(n: float) -> str:
    """A parameter count in the largest of B, M, K that keeps it >= 1 ('671.03B', '386.37K')."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:,.0f}"


def block_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """Sequences of ``max_model_len`` tokens that ``num_blocks`` whole blocks hold at once (each
    takes ceil(max_model_len / block_size) blocks)."""
    return num_blocks / -(-max_model_len // block_size)


def format_report(cfg: ModelConfig, s: KVSizing, block_size: int, dtype: str, ep: int = 1,
                  memory_source: str = "") -> str:
    """The human-readable kvcalc table: the tokens that fit are whole blocks of ``block_size``, as
    the engine allocates them (``compute_num_blocks``: a block size no block fits is refused)."""
    blocks = compute_num_blocks(s, block_size)
    lines = [
        f"model: {cfg.architecture}, {cfg.num_hidden_layers} layers, {_count(cfg.num_parameters())} parameters "
        f"({dtype} weights)",
        f"attention: {_layout_line(cfg)}",
        f"kv cache dtype: {s.kv_cache_dtype} ({s.kv_dtype_bytes:g} B per value)",
        f"KV bytes per token (all layers): {s.kv_bytes_per_token:,} B",
        f"  as full multi-head attention: {s.mha_bytes_per_token:,} B ({s.savings_vs_mha:.1f}x more)",
        f"  per rank at tensor_parallel_size={s.tensor_parallel_size}: {s.kv_bytes_per_token_per_rank:,} B",
        f"memory per rank: {format_memory(s.memory_bytes)} x {s.memory_utilization:g} utilization"
        + (f" ({memory_source})" if memory_source else ""),
        f"weights per rank: {format_memory(s.weight_bytes_per_rank)}"
        + (f" (routed experts spread over expert_parallel_size={ep})" if ep > 1 else ""),
        f"KV budget per rank: {format_memory(s.kv_budget_bytes)}",
        f"tokens that fit: {blocks * block_size:,} ({blocks:,} blocks of {block_size})",
        f"concurrent sequences at max_model_len {s.max_model_len:,}: "
        f"{block_concurrency(blocks, block_size, s.max_model_len):.2f}",
    ]
    if cfg.unsupported:
        lines.append("note: config fields the runtime does not implement: " + "; ".join(cfg.unsupported))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``kvcalc``: KV-cache capacity of one rank for a model config."""
    args = _build_parser().parse_args(argv)
    model_arg = args.model
    try:
        if args.memory is not None and args.hardware is not None:
            raise ValueError(f"--memory {args.memory} and --hardware {args.hardware} both give the memory per rank "
                             "(the hardware's is its memory_bytes): pass one")
        runtime_config = model_runtime_config(args.model)
        if runtime_config is not None:
            _apply_runtime_config(args, runtime_config)
            if args.hardware is not None:
                args.memory = None  # the flag over the runtime config's engine.memory
        _fill_defaults(args)
        _check_args(args)
        raw = _raw_model_config(args.model, args.model_overrides)
        cfg = ModelConfig.from_hf(raw, strict=False)
        _check_tensor_parallel(cfg, args.tensor_parallel_size)
        _check_max_model_len(cfg, args.max_model_len)
        dep = _deployment(cfg, raw, args)
        memory, memory_source = _memory(args)
        sizing = compute_layout_kv_sizing(cfg, dep, memory, max_model_len=args.max_model_len)
        blocks = compute_num_blocks(sizing, args.block_size)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: kvcalc {model_arg}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({"model": args.model, "architecture": cfg.architecture, "attention": cfg.attention,
                          "num_parameters": cfg.num_parameters(), "num_blocks": blocks,
                          "block_size": args.block_size, "expert_parallel_size": args.expert_parallel_size,
                          "dtype": dep.dtype, "weight_dtype": dep.weight_dtype or dep.dtype, **asdict(sizing),
                          "kv_capacity_tokens": blocks * args.block_size,
                          "max_concurrency": block_concurrency(blocks, args.block_size, sizing.max_model_len)}))
    else:
        print(format_report(cfg, sizing, args.block_size, dep.weight_dtype or dep.dtype, args.expert_parallel_size,
                            memory_source))
    return 0
