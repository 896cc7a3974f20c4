"""``python -m launch simulate``: predicted step times and throughput of a layout, or a ranked search.

    python -m launch simulate --config CONFIG.yaml --hardware h800 [--input-len N --output-len N
        --prefix-hit-rate R] [--batch-size B] [--kv-len N] [--two-batch-overlap] [--json OUT]
    python -m launch simulate --search --model deepseek-ai/DeepSeek-V3|CONFIG.yaml --cluster 4x8xH100
        --slo ttft_ms=1000,tpot_ms=50 [--input-len N --output-len N] [--top 5] [--json OUT]
    python -m launch simulate calibrate --out FILE        (this machine; see launch.calibrate)

The first form predicts one runtime config: a decode step of ``--batch-size`` sequences per
DP rank (default ``engine.max_num_seqs``, capped by the KV tokens that fit) at a context of
``--kv-len`` (default input + output / 2), and a prefill step of
``engine.max_num_batched_tokens`` new tokens per DP rank from prompts of ``--input-len``
tokens whose first ``--prefix-hit-rate`` share is cached. Per-node throughput counts every
input token, cache hits included (as DeepSeek's figures do). The second form ranks layouts
by goodput per GPU (``parallel.costmodel.search``); its ``--model`` may also be a runtime
config YAML, whose model (and ``model_overrides``) it then searches. The arithmetic is
``parallel.costmodel``; the hardware is ``configs/hardware/NAME.yaml`` or a file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from launch.config import ConfigError, EngineConfig, RuntimeConfig, load_runtime_config
from launch.config_args import FlagParser
from launch.core.kv_sizing import NoKVRoomError, format_memory
from launch.hardware import (
    compute_dtype,
    compute_kv_capacity_tokens,
    deployment_from_config,
    load_hardware,
    model_raw_config,
    resolve_weight_dtype,
    stored_weight_dtype,
)
from launch.kvcalc import model_runtime_config
from launch.paths import output_file_problem, write_output_file
from launch.simulate_point import load_expert_load
from moe.config import ModelConfig
from parallel.costmodel import (
    Deployment,
    Hardware,
    kv_bytes_per_token_per_rank,
    predict_point,
    weight_bytes_per_rank,
)
from parallel.costmodel.search import SLO, Candidate, search_layouts


def parse_slo(text: str) -> SLO:
    """'ttft_ms=1000,tpot_ms=50' -> SLO; ValueError naming a bad item."""
    values: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("ttft_ms", "tpot_ms"):
            raise ValueError(f"--slo item {item!r}: expected ttft_ms=MS or tpot_ms=MS")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo {key}: {value!r} is not a number") from None
        if not math.isfinite(values[key]) or values[key] <= 0:
            raise ValueError(f"--slo {key} must be a positive number of ms, got {value}")
    return SLO(**values)


def parse_cluster(text: str) -> tuple[int, int, Hardware]:
    """'4x8xH100' -> (4 nodes, 8 GPUs per node, the H100 hardware)."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*(\S+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--cluster {text!r}: expected NODESxGPUSxHARDWARE, e.g. 4x8xH100")
    return int(m.group(1)), int(m.group(2)), load_hardware(m.group(3))


def _check_expert_load(load: np.ndarray, model: ModelConfig, model_name: str, path: str) -> None:
    """ValueError when ``load`` [L, E] cannot stand for the model's routed experts; a warning on stderr
    when its depth differs from the model's MoE layers (the cost model cycles its layers)."""
    num_moe = len(model.moe_layer_ids)
    if num_moe == 0:
        raise ValueError(f"--expert-load {path}: {model_name} has no MoE layers to load")
    if load.shape[1] != model.num_experts:
        raise ValueError(f"--expert-load {path}: {load.shape[1]} experts per layer, but {model_name} routes over "
                         f"{model.num_experts}")
    if load.shape[0] != num_moe:
        print(f"warning: simulate: --expert-load {path} has {load.shape[0]} MoE layer(s), {model_name} has {num_moe}: "
              f"the load's layers are cycled (MoE layer i takes its layer i mod {load.shape[0]})", file=sys.stderr)


def _phase_json(step_ms: float, breakdown: dict[str, float], bound: str) -> dict[str, Any]:
    return {"step_ms": step_ms, "bound": bound, "breakdown_ms": breakdown}


def simulate_config(args: argparse.Namespace) -> dict[str, Any]:
    """The first form's report (a JSON-able dict). Every refusal (limits, memory, lengths, the
    expert load) comes before the prediction, which allocates per expert slot and token."""
    cfg = load_runtime_config(args.config, overrides=args.set)
    _check_int64_limits(cfg)
    model_name = args.model or cfg.model
    raw = model_raw_config(model_name, cfg.model_overrides)
    model = ModelConfig.from_hf(raw, strict=False)
    cfg.validate_for_model(model)
    hw = load_hardware(args.hardware)
    weight_dtype = resolve_weight_dtype(args.weight_dtype, raw, compute_dtype(cfg.engine.dtype, model))
    dep = deployment_from_config(cfg, model, weight_dtype=weight_dtype,
                                 enable_two_batch_overlap=args.two_batch_overlap, dispatch_dtype=args.dispatch_dtype)
    _check_kv_blocks_fit(model, dep, hw)
    capacity = _kv_capacity_tokens(model, dep, hw, cfg.engine.block_size)
    prefix = int(round(args.input_len * args.prefix_hit_rate))
    prefix = min(prefix, args.input_len - 1)
    kv_len = args.kv_len if args.kv_len is not None else args.input_len + args.output_len // 2
    _check_sequence_fits(args, kv_len, cfg.engine.max_model_len or model.max_position_embeddings,
                         "engine.max_model_len" if cfg.engine.max_model_len else "the model's max_position_embeddings")
    # a sequence holds all its tokens' KV at its end (input + output), whatever the average decode context
    whole = max(args.input_len + args.output_len, kv_len)
    if capacity < whole and dep.kv_capacity_tokens is not None:
        raise ValueError(f"{dep.describe()}: engine.num_kv_blocks={cfg.engine.num_kv_blocks} x block_size="
                         f"{cfg.engine.block_size} hold {dep.kv_capacity_tokens:,} KV tokens per rank, not one "
                         f"{whole:,}-token sequence (more KV blocks, or a shorter --input-len / --output-len / "
                         "--kv-len)")
    if capacity < whole:
        raise ValueError(f"{dep.describe()} on {hw.name}: the weights leave room for {capacity:,} KV "
                         f"tokens per rank, not one {whole:,}-token sequence (more expert parallelism, fp8 "
                         "weights or a bigger memory)")
    expert_load = None
    if args.expert_load:
        expert_load = load_expert_load(args.expert_load)
        _check_expert_load(expert_load, model, model_name, args.expert_load)
    pred = predict_point(model, replace(dep, kv_capacity_tokens=capacity), hw,
                         batch_size=args.batch_size or dep.max_num_seqs, kv_len=kv_len, prompt_len=args.input_len,
                         prefix_len=prefix, prefill_tokens=dep.max_num_batched_tokens,
                         expert_load=expert_load, load_skew=args.load_skew or 0.0)
    dp_per_node = dep.dp / dep.num_nodes
    hit = prefix / args.input_len
    prefill_tps = pred.prefill_tokens * dp_per_node / (pred.prefill_step_ms / 1e3) / (1 - hit)
    decode_tps = pred.batch_size * dp_per_node / (pred.decode_step_ms / 1e3) if pred.batch_size else 0.0
    return {
        "model": model_name, "hardware": hw.name, "layout": dep.describe(), "deployment": asdict(dep),
        "input_len": args.input_len, "output_len": args.output_len, "prefix_hit_rate": hit, "kv_len": kv_len,
        "kv_capacity_tokens": pred.kv_capacity_tokens, "kv_blocks": pred.kv_capacity_tokens // cfg.engine.block_size,
        "block_size": cfg.engine.block_size, "balancedness": pred.balancedness,
        "decode": {"batch_size": pred.batch_size, "batch_limited_by": pred.batch_limited_by,
                   **_phase_json(pred.decode_step_ms, pred.decode_breakdown, pred.decode_bound)},
        "prefill": {"tokens_per_step": pred.prefill_tokens,
                    **_phase_json(pred.prefill_step_ms, pred.prefill_breakdown, pred.prefill_bound)},
        "prefill_input_tokens_per_s_per_node": prefill_tps,
        "decode_output_tokens_per_s_per_node": decode_tps,
        "notes": _hardware_notes(hw, dep),
    }


INT64_MAX = 2**63 - 1
# Runtime-config integers the cost model computes with (numpy int64 / float64 arrays, step times)
_INT64_KEYS = (("engine", "max_num_seqs"), ("engine", "max_num_batched_tokens"), ("engine", "max_model_len"),
               ("engine", "block_size"), ("engine", "num_kv_blocks"), ("balancer", "num_redundant_experts"),
               ("parallel", "tensor_parallel_size"), ("parallel", "data_parallel_size"), ("parallel", "num_nodes"))


def _check_int64_limits(cfg: RuntimeConfig) -> None:
    """ValueError naming a config integer past int64: the cost model's arithmetic would overflow or
    predict nonsense (a step of 1e19 ms) rather than the layout."""
    for section, key in _INT64_KEYS:
        value = getattr(getattr(cfg, section), key)
        if value is not None and value > INT64_MAX:
            raise ValueError(f"{section}.{key} {value:,} is past what the cost model computes with (at most "
                             f"2**63 - 1 = {INT64_MAX:,})")


def _kv_capacity_tokens(model: ModelConfig, dep: Deployment, hw: Hardware, block_size: int) -> int:
    """KV tokens one rank holds: a config's fixed engine.num_kv_blocks, else what its memory leaves
    beside the weights in whole blocks (``compute_num_blocks``, as the engine allocates them).
    ValueError naming the weights (or the block size) when they leave no room."""
    try:
        return compute_kv_capacity_tokens(model, dep, hw.memory_bytes, block_size, strict=True)
    except NoKVRoomError as e:
        hint = "" if "block_size" in str(e) else " (more expert parallelism, fp8 weights or a bigger memory)"
        raise ValueError(f"{dep.describe()} on {hw.name}: {e}{hint}") from None


def _hardware_notes(hw: Hardware, dep: Deployment) -> list[str]:
    """What the prediction assumed for lack of a hardware figure (one line each)."""
    notes = []
    if dep.ranks_per_node > 1 and hw.intra_node_bandwidth <= 0 and not hw.collectives:
        notes.append(f"{hw.name} gives no intra_node_bandwidth and no collective tables: the ranks of one node "
                     f"exchange at its memory bandwidth ({hw.memory_bandwidth / 1e9:,.0f} GB/s x network_efficiency "
                     f"{hw.network_efficiency:g}); set intra_node_bandwidth for NVLink-class links")
    return notes


def _check_sequence_fits(args: argparse.Namespace, kv_len: int, max_len: int, limit: str) -> None:
    """ValueError when a sequence of the flags' lengths is longer than the engine would take."""
    total = args.input_len + args.output_len
    if total > max_len:
        raise ValueError(f"--input-len {args.input_len:,} + --output-len {args.output_len:,} = {total:,} tokens per "
                         f"sequence exceed {limit} {max_len:,}")
    if kv_len > max_len:
        raise ValueError(f"--kv-len {kv_len:,} exceeds {limit} {max_len:,}")


def _check_kv_blocks_fit(model: ModelConfig, dep: Deployment, hw: Hardware) -> None:
    """A config that fixes engine.num_kv_blocks skips the cost model's memory sizing: ValueError
    when its weights and those KV blocks do not fit one rank's memory x utilization."""
    if dep.kv_capacity_tokens is None:
        return
    memory = dep.memory_bytes or hw.memory_bytes
    usable = int(memory * dep.memory_utilization)
    weights = weight_bytes_per_rank(model, dep)
    kv = dep.kv_capacity_tokens * kv_bytes_per_token_per_rank(model, dep)
    if weights + kv > usable:
        raise ValueError(f"{dep.describe()} on {hw.name}: the weights take {format_memory(weights)} per rank and "
                         f"engine.num_kv_blocks holds {format_memory(kv)} of KV, over the {dep.memory_utilization:g} x "
                         f"{format_memory(memory)} = {format_memory(usable)} usable (fewer KV blocks, more expert or "
                         "tensor parallelism, fp8 weights or a bigger memory)")


def format_config_report(r: dict[str, Any]) -> str:
    d, p = r["decode"], r["prefill"]
    lines = [f"{r['model']} on {r['hardware']}: {r['layout']}",
             f"KV capacity per rank: {r['kv_capacity_tokens']:,} tokens ({r['kv_blocks']:,} blocks of "
             f"{r['block_size']}); expert balancedness {r['balancedness']:.3f}",
             f"decode: batch {d['batch_size']} per DP rank at {r['kv_len']:,} context -> step {d['step_ms']:.2f} ms "
             f"(bound: {d['bound']}{', batch cut by ' + d['batch_limited_by'] if d['batch_limited_by'] else ''})",
             f"prefill: {p['tokens_per_step']:,} new tokens per DP rank -> step {p['step_ms']:.2f} ms "
             f"(bound: {p['bound']})",
             f"per node: prefill {r['prefill_input_tokens_per_s_per_node']:,.0f} input tok/s (cache hits "
             f"{r['prefix_hit_rate']:.1%} included), decode {r['decode_output_tokens_per_s_per_node']:,.0f} output tok/s",
             *(f"note: {n}" for n in r.get("notes", ())),
             "", *format_breakdown(d["breakdown_ms"], p["breakdown_ms"])]
    return "\n".join(lines)


def format_breakdown(decode: dict[str, float], prefill: dict[str, float]) -> list[str]:
    """The per-operator table, each column as wide as its widest cell (plus a space) whatever the values."""
    keys = list(dict.fromkeys([*decode, *prefill]))
    cells = [(k, f"{decode.get(k, 0.0):,.3f}", f"{prefill.get(k, 0.0):,.3f}") for k in keys]
    rows = [("operator", "decode ms", "prefill ms"), *cells]
    w0 = max(len(r[0]) for r in rows) + 2
    w1, w2 = (max(len(r[i]) for r in rows) + 2 for i in (1, 2))
    return [f"{a:<{w0}}{b:>{w1}}{c:>{w2}}" for a, b, c in rows]


def _candidate_json(c: Candidate) -> dict[str, Any]:
    """One layout's JSON: a time the search never reached for an infeasible layout (its decode batch and
    steps; the TTFT where memory ruled it out first) is null, not 0; its goodput is 0, and its
    ``miss_ratio`` how far it misses (``Candidate.miss_ratio``; null for a feasible layout)."""
    ran = c.feasible
    return {"layout": c.deployment.describe(), "feasible": c.feasible, "goodput_per_gpu": c.goodput_per_gpu,
            "miss_ratio": None if ran else c.miss_ratio,
            "batch_size": c.batch_size if ran else None, "tpot_ms": c.tpot_ms if ran else None,
            "decode_step_ms": c.decode_step_ms if ran else None,
            "ttft_ms": c.ttft_ms if ran or c.ttft_ms > 0 else None, "balancedness": c.balancedness, "bound": c.bound,
            "decode_bound": c.decode_bound, "kv_capacity_tokens": c.kv_capacity_tokens,
            "deployment": asdict(c.deployment)}


def _search_bar(layouts: list[Deployment]) -> Iterable[Deployment]:
    """A progress bar on stderr over the layouts a search evaluates, shown once it has run a second."""
    from tqdm import tqdm

    return tqdm(layouts, desc="searching layouts", unit="layout", delay=1.0)


def run_search(args: argparse.Namespace) -> dict[str, Any]:
    if not args.model or not args.cluster:
        raise ValueError("--search needs --model (a config.json, checkpoint, model name or runtime config YAML) "
                         "and --cluster NxGxHW")
    runtime = model_runtime_config(args.model)
    model_name = runtime.model if runtime is not None else args.model
    raw = model_raw_config(model_name, runtime.model_overrides if runtime is not None else None)
    model = ModelConfig.from_hf(raw, strict=False)
    nodes, gpus, hw = parse_cluster(args.cluster)
    max_len = runtime.engine.max_model_len if runtime is not None else None
    _check_sequence_fits(args, 0, max_len or model.max_position_embeddings,
                         "engine.max_model_len" if max_len else "the model's max_position_embeddings")
    slo = parse_slo(args.slo or "")
    if args.output_len < 1:
        raise ValueError("--search ranks layouts by output tokens/s: give --output-len >= 1")
    if slo.tpot_ms is not None and args.output_len < 2:  # TPOT: the time between a request's output tokens
        raise ValueError(f"--slo tpot_ms needs --output-len >= 2: {args.output_len} output token(s) leave no time "
                         "between tokens to hold to it (give a longer --output-len or leave tpot_ms out)")
    weight = "fp8" if stored_weight_dtype(raw, "bfloat16") == "fp8" else None
    if args.weight_dtype != "auto":
        weight = args.weight_dtype
    base = Deployment(dtype="bfloat16", weight_dtype=weight, kv_cache_dtype=args.kv_cache_dtype or "fp8",
                      dispatch_dtype=args.dispatch_dtype, max_num_seqs=1024, max_num_batched_tokens=16384)
    prefix = min(int(round(args.input_len * args.prefix_hit_rate)), args.input_len - 1)
    started = time.perf_counter()
    block_size = runtime.engine.block_size if runtime is not None else EngineConfig().block_size
    ranked = search_layouts(model, hw, num_nodes=nodes, gpus_per_node=gpus, slo=slo, input_len=args.input_len,
                            output_len=args.output_len, prefix_len=prefix, base=base, load_skew=args.load_skew or 0.0,
                            progress=None if args.no_progress else _search_bar,
                            kv_capacity=lambda dep: compute_kv_capacity_tokens(model, dep, hw.memory_bytes, block_size))
    return {"model": model_name, "cluster": args.cluster, "slo": asdict(slo), "input_len": args.input_len,
            "output_len": args.output_len, "seconds": time.perf_counter() - started,
            "num_layouts": len(ranked), "ranked": [_candidate_json(c) for c in ranked]}


def format_search(r: dict[str, Any], top: int) -> str:
    slo = ", ".join(f"{k}={v:g}" for k, v in r["slo"].items() if v is not None) or "none"
    lines = [f"{r['model']} on {r['cluster']} (SLO {slo}; input {r['input_len']}, output {r['output_len']}): "
             f"{r['num_layouts']} layouts ranked in {r['seconds']:.1f} s by goodput per GPU", ""]
    feasible = [c for c in r["ranked"] if c["feasible"]]
    for i, c in enumerate(feasible[:top], 1):
        lines.append(f"{i}. {c['layout']}: {c['goodput_per_gpu']:,.0f} output tok/s per GPU at batch {c['batch_size']} "
                     f"per DP rank (TPOT {c['tpot_ms']:.1f} ms, decode step {c['decode_step_ms']:.1f} ms, "
                     f"TTFT {c['ttft_ms']:.0f} ms)")
        lines.append(f"   bounded by {c['bound']}; decode step dominated by {c['decode_bound']}")
    if not feasible:  # the search ranks the rest nearest first: in memory, then by predicted / objective
        lines.append("no layout meets the objectives; the closest, and why:")
        for c in r["ranked"][:top]:
            lines.append(f"- {c['layout']}: {c['bound']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m launch simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="runtime config YAML to predict")
    p.add_argument("--hardware", default=None, help="h800 | h100 | h200 | b200 or a hardware YAML (calibrate's)")
    p.add_argument("--model", help="model for --search (config.json, checkpoint dir, name or runtime config YAML); "
                   "overrides --config's")
    p.add_argument("--search", action="store_true", help="rank layouts on --cluster under --slo")
    p.add_argument("--cluster", help="NODESxGPUSxHARDWARE, e.g. 4x8xH100")
    p.add_argument("--slo", default="", help="ttft_ms=MS,tpot_ms=MS")
    p.add_argument("--top", type=int, default=None, help="layouts to print (--search; default 5)")
    p.add_argument("--input-len", type=int, default=2000)
    p.add_argument("--output-len", type=int, default=500)
    p.add_argument("--prefix-hit-rate", type=float, default=0.0)
    p.add_argument("--kv-len", type=int, default=None, help="decode context (default input + output / 2)")
    p.add_argument("--batch-size", type=int, default=None, help="decode sequences per DP rank")
    p.add_argument("--weight-dtype", default="auto", choices=("auto", "fp8", "bfloat16", "float16", "float32"),
                   help="auto: fp8 when the checkpoint ships fp8 weights, else the compute dtype")
    p.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8"),
                   help="(--search; default fp8; a --config's is its engine.kv_cache_dtype)")
    p.add_argument("--dispatch-dtype", default=None, choices=("fp8", "bfloat16", "float32"),
                   help="wire format of dispatched rows (DeepEP: fp8); default the compute dtype")
    p.add_argument("--two-batch-overlap", action="store_true", help="overlap dispatch/combine with compute")
    p.add_argument("--expert-load", help="measured expert load: an expert-distribution dump as `profile report` "
                   "reads (profile run's .safetensors, SGLang .pt, .npy, .npz, .csv) or a JSON [L, E] array")
    p.add_argument("--load-skew", type=float, default=None,
                   help="synthetic Zipf skew of the expert load (default 0: uniform); not with --expert-load")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar for a long --search")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.input_len < 1 or args.output_len < 0:
        raise ValueError("--input-len must be >= 1 and --output-len >= 0")
    if not 0.0 <= args.prefix_hit_rate < 1.0:
        raise ValueError(f"--prefix-hit-rate must be in [0, 1), got {args.prefix_hit_rate}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    if args.kv_len is not None and args.kv_len < 1:
        raise ValueError(f"--kv-len must be >= 1, got {args.kv_len}")
    if args.top is not None and args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.load_skew is not None and (not math.isfinite(args.load_skew) or args.load_skew < 0):
        raise ValueError(f"--load-skew must be a finite number >= 0, got {args.load_skew}")
    if args.json is not None and (problem := output_file_problem(args.json)) is not None:
        raise ValueError(f"--json: {problem}")  # before the search, not after it
    if not args.search and (not args.config or not args.hardware):
        raise ValueError("give --config CONFIG.yaml and --hardware NAME|FILE (or --search --model ... --cluster ...)")
    _check_flags_of_the_other_form(args)
    if args.load_skew is not None and args.expert_load:
        raise ValueError(f"--load-skew {args.load_skew:g} and --expert-load {args.expert_load} both give the expert "
                         "load (a synthetic Zipf skew, a measured one): pass one")


# Flags that only one form reads, with what to do instead in the other: a flag the form
# would silently ignore is refused rather than leaving a prediction that looks like it applied.
_CONFIG_ONLY = {
    "config": ("--config", "give the runtime config as --model"),
    "hardware": ("--hardware", "the hardware is the last part of --cluster NODESxGPUSxHARDWARE (a name or a file)"),
    "batch_size": ("--batch-size", "the search finds the largest batch that meets --slo"),
    "kv_len": ("--kv-len", "the search decodes at input + output / 2"),
    "expert_load": ("--expert-load", "the search takes a synthetic --load-skew"),
    "set": ("--set", "put the overrides in a runtime config YAML given as --model"),
    "two_batch_overlap": ("--two-batch-overlap", "the search tries two-batch overlap on and off itself"),
}
_SEARCH_ONLY = {
    "cluster": ("--cluster", None),
    "slo": ("--slo", None),
    "top": ("--top", None),
    "kv_cache_dtype": ("--kv-cache-dtype", "the config's is engine.kv_cache_dtype: --set engine.kv_cache_dtype=fp8"),
}


def _check_flags_of_the_other_form(args: argparse.Namespace) -> None:
    """ValueError naming a flag the chosen form does not read (defaults are None / empty / False)."""
    other, form = (_CONFIG_ONLY, "--config prediction") if args.search else (_SEARCH_ONLY, "--search")
    for name, (flag, instead) in other.items():
        if getattr(args, name) not in (None, "", [], False):
            raise ValueError(f"{flag} applies only to a {form}" + (f"; {instead}" if instead else ""))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check(args)
        report = run_search(args) if args.search else simulate_config(args)
    except (ConfigError, ValueError, OSError, KeyError) as e:
        print(f"error: simulate: {e}", file=sys.stderr)
        return 2
    print(format_search(report, args.top or 5) if args.search else format_config_report(report))
    if args.json is not None:
        write_output_file(args.json, json.dumps(report, indent=2) + "\n")
    return 0
