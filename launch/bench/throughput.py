"""``python -m launch bench throughput``: offline generation throughput, ours vs transformers.

    python -m launch bench throughput --model DIR [--num-prompts 32] [--input-len-range 16 200]
        [--output-len-range 8 96] [--seed 0] [--baseline hf|none] [--hf-batch-size 8]
        [--dtype bfloat16 (default)] [--hf-dtype same|float32|bfloat16|float16] [--num-threads N]
        [--json FILE] [engine flags: --max-num-seqs ...]

Requests are random token ids with input and output lengths drawn uniformly from the two
ranges (seeded), decoded greedily with ``ignore_eos`` so every output has exactly its drawn
length. Ours: ``LLM.generate`` with all requests at once (the engine batches continuously).
Baseline ``hf``: transformers' ``generate`` on the same checkpoint and prompts in static
batches of ``--hf-batch-size`` (left-padded; each batch runs until its longest output).
Both sides count only the requested output tokens, use the same thread count, get one
untimed warm-up call, and run in this one process, one after the other. transformers runs
in ours' dtype unless ``--hf-dtype`` names another: on CPUs without native bf16 GEMMs its bf16
matmuls run at ~1 GFLOP/s, so its fastest choice for a bf16 checkpoint is float32 there
(``--dtype bfloat16 --hf-dtype float32`` compares each side at its fastest; the greedy
agreement then also measures the two dtypes' rounding, not only the runtimes). transformers' experts
run on its default, ``grouped_mm``, except for a checkpoint whose expert widths PyTorch's grouped GEMM
cannot take in that dtype (hidden or expert intermediate size not whole 16-byte rows): its eager loop.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from launch.bench import BENCH_DTYPE
from launch.config import ConfigError, RuntimeConfig
from launch.config_args import FlagParser, add_runtime_args, fill_unset, runtime_config_from_args
from launch.core import SamplingParams
from launch.core.scheduler import request_kv_tokens
from launch.paths import output_file_problem, write_output_file

HF_BATCH_SIZE = 8  # transformers' static batch unless --hf-batch-size


@dataclass(frozen=True)
class BenchRequest:
    """One request: prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass
class RunResult:
    """One side's timed run. outputs: generated token ids per request (requested length).
    cpu_s: CPU seconds this process spent in the timed region (None when the work ran in
    other processes): on a shared box it moves less with other people's load than wall time."""

    elapsed_s: float
    outputs: list[list[int]]
    cpu_s: float | None = None


def sample_requests(num_prompts: int, input_len_range: Sequence[int], output_len_range: Sequence[int],
                    vocab_size: int, *, seed: int = 0, avoid_ids: Sequence[int] = ()) -> list[BenchRequest]:
    """Random-token prompts; lengths uniform in the inclusive ranges; ids avoid ``avoid_ids``."""
    (in_lo, in_hi), (out_lo, out_hi) = input_len_range, output_len_range
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    check_len_ranges(input_len_range, output_len_range)
    allowed = [t for t in range(vocab_size) if t not in set(avoid_ids)]
    if not allowed:
        raise ValueError(f"no token ids left in a vocabulary of {vocab_size} after excluding {list(avoid_ids)}")
    rng = random.Random(seed)
    return [BenchRequest([rng.choice(allowed) for _ in range(rng.randint(in_lo, in_hi))], rng.randint(out_lo, out_hi))
            for _ in range(num_prompts)]


def check_len_ranges(input_len_range: Sequence[int], output_len_range: Sequence[int],
                     max_model_len: int | None = None, num_kv_blocks: int | None = None,
                     block_size: int = 16) -> None:
    """ValueError naming the flag when a range is not 1 <= LO <= HI, or (given the engine's
    ``max_model_len`` / a DP rank's ``num_kv_blocks``) when the longest request the ranges allow,
    input HI + output HI tokens, would not fit in a sequence or in the KV pool."""
    (in_lo, in_hi), (out_lo, out_hi) = input_len_range, output_len_range
    for name, lo, hi in (("--input-len-range", in_lo, in_hi), ("--output-len-range", out_lo, out_hi)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} needs 1 <= LO <= HI, got {lo} {hi}")
    longest = in_hi + out_hi
    if max_model_len is not None and longest > max_model_len:
        raise ValueError(f"--input-len-range HI {in_hi} + --output-len-range HI {out_hi} = {longest} tokens exceeds "
                         f"max_model_len={max_model_len} (the model's max_position_embeddings unless --max-model-len)")
    kv_tokens = request_kv_tokens(in_hi, out_hi, max_model_len or longest)  # as the scheduler counts
    blocks = -(-kv_tokens // block_size)
    if num_kv_blocks is not None and blocks > num_kv_blocks:
        raise ValueError(f"a request of up to {longest} tokens (input + output HI) needs KV for {kv_tokens} "
                         f"tokens ({blocks} blocks of {block_size}) but a DP rank's pool has only {num_kv_blocks} "
                         "blocks (raise --memory or --num-kv-blocks, or lower the ranges)")


def run_ours(config: RuntimeConfig, requests: Sequence[BenchRequest]) -> RunResult:
    """All requests at once through ``LLM.generate`` (after one untimed warm-up request)."""
    from launch.llm import LLM

    llm = LLM(config=config)
    try:
        warm = requests[0]
        llm.generate([{"prompt_token_ids": warm.prompt_token_ids}], _greedy(2))
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [_greedy(r.output_len) for r in requests]
        started, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        llm.shutdown()
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    for r, got in zip(requests, outputs):
        if len(got) != r.output_len:
            raise RuntimeError(f"engine returned {len(got)} tokens for a request of {r.output_len}")
    return RunResult(elapsed, outputs, cpu if config.parallel.world_size == 1 else None)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_hf(model_path: str, requests: Sequence[BenchRequest], batch_size: int, dtype: torch.dtype,
           pad_token_id: int) -> RunResult:
    """transformers' greedy ``generate`` in static left-padded batches of ``batch_size``
    (request order); each batch generates max(output_len) tokens, truncated per request."""
    import transformers

    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                              **hf_experts_kwargs(model_path, dtype))
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every batch runs its full length
    batches = [list(requests[i: i + batch_size]) for i in range(0, len(requests), batch_size)]
    with torch.inference_mode():
        _hf_batch(model, batches[0][:1], 2, pad_token_id)  # warm-up
        started, cpu = time.perf_counter(), time.process_time()
        outputs = [out for batch in batches
                   for out in _hf_batch(model, batch, max(r.output_len for r in batch), pad_token_id)]
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    short = [i for i, (r, out) in enumerate(zip(requests, outputs)) if len(out) < r.output_len]
    if short:
        raise RuntimeError(f"transformers stopped early for requests {short[:5]} (an EOS it was not told to ignore?)")
    return RunResult(elapsed, [out[: r.output_len] for r, out in zip(requests, outputs)], cpu)


def hf_experts_kwargs(model_path: str, dtype: torch.dtype) -> dict[str, str]:
    """``from_pretrained`` arguments for the baseline's experts: none (transformers' default,
    ``grouped_mm``, its fastest) unless PyTorch's grouped GEMM cannot run the checkpoint's expert
    widths in ``dtype`` (``moe_layer.grouped_mm_width_problem``), then its eager loop."""
    from launch.bench.moe_layer import grouped_mm_width_problem
    from moe.config import ModelConfig

    cfg = ModelConfig.from_hf(model_path, strict=False)
    if grouped_mm_width_problem(cfg.hidden_size, cfg.moe_intermediate_size, dtype) is None:
        return {}
    return {"experts_implementation": "eager"}


def _hf_batch(model: Any, batch: Sequence[BenchRequest], new_tokens: int, pad_token_id: int) -> list[list[int]]:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_token_id, dtype=torch.int64)  # [b, width] left-padded
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        mask[i, width - len(r.prompt_token_ids):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad_token_id)
    return out[:, width:].tolist()


def agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> float:
    """Mean over requests of (common greedy prefix length / output length), in [0, 1]."""
    fractions = []
    for a, b in zip(ours, theirs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fractions.append(n / max(len(a), 1))
    return sum(fractions) / max(len(fractions), 1)


def summarize(config: RuntimeConfig, requests: Sequence[BenchRequest], ours: RunResult, hf: RunResult | None,
              *, num_threads: int, seed: int, dtype: str, hf_batch_size: int | None, hf_dtype: str | None = None,
              input_len_range: Sequence[int], output_len_range: Sequence[int],
              hf_differs: str | None = None) -> dict[str, Any]:
    """The result JSON (vLLM ``bench throughput`` keys for our side, ``hf_*`` for the baseline;
    ``hf_differs``: where transformers runs another model, ``ModelConfig.transformers_differs``)."""
    out_tokens = sum(r.output_len for r in requests)
    in_tokens = sum(len(r.prompt_token_ids) for r in requests)
    result: dict[str, Any] = {
        "model": config.model, "dtype": dtype, "quantization": config.engine.quantization,
        "kv_cache_dtype": config.engine.kv_cache_dtype, "num_threads": num_threads, "seed": seed,
        "num_requests": len(requests), "input_len_range": list(input_len_range),
        "output_len_range": list(output_len_range), "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens, "elapsed_time": ours.elapsed_s,
        "requests_per_second": len(requests) / ours.elapsed_s,
        "output_tokens_per_second": out_tokens / ours.elapsed_s,
        "tokens_per_second": (in_tokens + out_tokens) / ours.elapsed_s,
        "cpu_time": ours.cpu_s, "baseline": "hf" if hf is not None else "none",
    }
    if hf is not None:
        result.update({
            "hf_batch_size": hf_batch_size, "hf_dtype": hf_dtype or dtype, "hf_elapsed_time": hf.elapsed_s,
            "hf_output_tokens_per_second": out_tokens / hf.elapsed_s,
            "speedup": hf.elapsed_s / ours.elapsed_s, "hf_cpu_time": hf.cpu_s,
            "speedup_cpu_time": hf.cpu_s / ours.cpu_s if ours.cpu_s else None,
            "greedy_agreement": agreement(ours.outputs, hf.outputs),
        })
        if hf_differs:
            result["hf_differs"] = hf_differs
    return result


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"{'=' * 16} Offline Throughput Benchmark Result {'=' * 16}",
        f"{'Model:':<40}{result['model']}",
        f"{'Dtype / threads:':<40}{result['dtype']} / {result['num_threads']}",
        f"{'Ours: routed experts / KV cache:':<40}{result['quantization'] or result['dtype']} / "
        f"{result['kv_cache_dtype']}",
        f"{'Requests:':<40}{result['num_requests']}",
        f"{'Total input tokens:':<40}{result['total_input_tokens']}",
        f"{'Total output tokens (requested):':<40}{result['total_output_tokens']}",
        f"{'Ours: elapsed (s):':<40}{seconds_text(result['elapsed_time'])}",
        f"{'Ours: output tokens/s:':<40}{result['output_tokens_per_second']:.1f}",
        f"{'Ours: requests/s:':<40}{result['requests_per_second']:.2f}",
    ]
    if result["cpu_time"] is not None:
        lines.append(f"{'Ours: CPU time (s):':<40}{seconds_text(result['cpu_time'])}")
    if result["baseline"] == "hf":
        lines += [
            f"{'HF generate: dtype:':<40}{result['hf_dtype']}",
            f"{'HF generate (batch ' + str(result['hf_batch_size']) + '): elapsed (s):':<40}"
            f"{seconds_text(result['hf_elapsed_time'])}",
            f"{'HF generate: output tokens/s:':<40}{result['hf_output_tokens_per_second']:.1f}",
            f"{'HF generate: CPU time (s):':<40}{seconds_text(result['hf_cpu_time'])}",
            f"{'Speedup (ours / HF):':<40}{result['speedup']:.2f}x",
            *([f"{'Speedup in CPU time:':<40}{result['speedup_cpu_time']:.2f}x"]
              if result["speedup_cpu_time"] is not None else []),
            f"{'Greedy agreement with HF:':<40}{result['greedy_agreement']:.3f}"
            + (f" (not a rounding measure: {result['hf_differs']})" if result.get("hf_differs") else ""),
        ]
    lines.append("=" * 68)
    return "\n".join(lines)


def seconds_text(seconds: float) -> str:
    """Seconds as the result table shows them: two decimals from 1 s on, three significant digits below
    (a run of a few milliseconds is not "0.00")."""
    return f"{seconds:.2f}" if seconds >= 0.995 else f"{seconds:.3g}"


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m launch bench throughput", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(parser, server=False, dtype_default=BENCH_DTYPE)
    g = parser.add_argument_group("benchmark")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len-range", type=int, nargs=2, default=[16, 200], metavar=("LO", "HI"))
    g.add_argument("--output-len-range", type=int, nargs=2, default=[8, 96], metavar=("LO", "HI"))
    g.add_argument("--baseline", choices=("hf", "none"), default="hf")
    g.add_argument("--hf-batch-size", type=int, default=None, help="transformers' static batch (default: 8)")
    g.add_argument("--hf-dtype", choices=("same", "float32", "bfloat16", "float16"), default="same",
                   help="transformers' dtype (default: ours', --dtype); float32 is its fastest on CPUs "
                        "without native bf16 GEMMs")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the result JSON here")
    return parser


def check_args(args: argparse.Namespace) -> tuple[RuntimeConfig, Any]:
    """The runtime config and the model's ``moe.config.ModelConfig``, after every check that needs no
    weights: the flags, what the engine would refuse (``check_runtime_config``: model path, layout,
    KV budget), the request lengths against the engine's max_model_len and KV pool, and that
    ``--json`` can be written (``launch.paths.output_file_problem``). Raises
    ConfigError, ValueError or FileNotFoundError naming the problem."""
    from launch.engine import check_runtime_config

    if args.json is not None and (problem := output_file_problem(args.json)) is not None:
        raise ValueError(f"--json: {problem}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
    if args.baseline == "none":
        given = [flag for flag, value in (("--hf-batch-size", args.hf_batch_size), ("--hf-dtype", args.hf_dtype))
                 if value not in (None, "same")]
        if given:
            raise ValueError(f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} transformers' side, which "
                             "--baseline none does not run: leave it out, or use --baseline hf")
    elif args.hf_batch_size is None:
        args.hf_batch_size = HF_BATCH_SIZE
    if args.baseline == "hf" and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    check_len_ranges(args.input_len_range, args.output_len_range)
    config = runtime_config_from_args(args)
    plan = check_runtime_config(config)
    check_len_ranges(args.input_len_range, args.output_len_range, plan.max_model_len, plan.num_kv_blocks,
                     config.engine.block_size)
    return config, plan.model_config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # the benchmark's dtype whatever the checkpoint stores, unless --dtype, --config or --set says
        fill_unset(args, {"dtype": BENCH_DTYPE})
        config, model_config = check_args(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    seed = config.engine.seed
    avoid = tuple(model_config.eos_token_ids) + ((model_config.bos_token_id,) if model_config.bos_token_id is not None
                                                 else ())
    try:
        requests = sample_requests(args.num_prompts, args.input_len_range, args.output_len_range,
                                   model_config.vocab_size, seed=seed, avoid_ids=avoid)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from launch.engine import resolve_dtype
    from launch.worker import DTYPES

    dtype = resolve_dtype(config.engine.dtype, model_config)  # "auto": the checkpoint's, as the engine does
    hf_dtype = dtype if args.hf_dtype == "same" else args.hf_dtype
    try:
        ours = run_ours(config, requests)
    except (ConfigError, ValueError) as e:  # e.g. no room for the KV cache in --memory
        print(f"error: {e}", file=sys.stderr)
        return 2
    hf = None
    if args.baseline == "hf":
        hf = run_hf(config.model, requests, args.hf_batch_size, DTYPES[hf_dtype],
                    pad_token_id=model_config.eos_token_ids[0] if model_config.eos_token_ids else 0)
    result = summarize(config, requests, ours, hf, num_threads=torch.get_num_threads(), seed=seed, dtype=dtype,
                       hf_batch_size=args.hf_batch_size, hf_dtype=hf_dtype, input_len_range=args.input_len_range,
                       output_len_range=args.output_len_range, hf_differs=model_config.transformers_differs())
    print(format_report(result))
    if args.json:
        write_output_file(args.json, json.dumps(result, indent=2) + "\n")
    return 0


__all__ = ["BenchRequest", "RunResult", "agreement", "hf_experts_kwargs", "main", "run_hf", "run_ours",
           "sample_requests", "summarize"]
