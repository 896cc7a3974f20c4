"""``python -m launch bench serve``: vLLM's serving benchmark against an OpenAI endpoint.

Same semantics, flags, summary table and result-JSON keys as ``vllm bench serve``
with the random dataset: prompts of random token ids (lengths drawn uniformly in
``[len * (1 - ratio), len * (1 + ratio)]``) are streamed through ``/v1/completions``
with ``ignore_eos`` so each output has exactly its drawn length. Arrivals follow a
gamma process (``--burstiness 1`` is Poisson) at ``--request-rate``; ``inf`` sends
everything at once; ``--max-concurrency`` caps requests in flight.

Per request: TTFT = first streamed chunk - send; ITL = gaps between chunks;
E2EL = last byte - send; TPOT = (E2EL - TTFT) / (output_tokens - 1).
A request is "good" (``--goodput ttft:MS tpot:MS e2el:MS``) when it meets every SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from launch.bench.serve_client import (
    BenchTarget,
    RequestInput,
    RequestOutcome,
    add_target_args,
    resolve_target,
    send_request,
    target_flags_problem,
)
from launch.config_args import FlagParser
from launch.paths import output_dir_problem, output_file_problem, write_output_file

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                 "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


# ---------------------------------------------------------------- dataset and arrivals


def random_flags_problem(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                         prefix_len: int) -> str | None:
    """What is wrong with the random dataset's flags (one line naming the flag), or None."""
    if not 0.0 <= range_ratio < 1.0:
        return f"--random-range-ratio must be in [0, 1), got {range_ratio}"
    for flag, value in (("--num-prompts", num_prompts), ("--random-input-len", input_len),
                        ("--random-output-len", output_len)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if prefix_len < 0:
        return f"--random-prefix-len must be >= 0, got {prefix_len}"
    return None


def sample_random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                           vocab_size: int, *, prefix_len: int = 0, seed: int = 0,
                           avoid_ids: tuple[int, ...] = ()) -> list[RequestInput]:
    """Random-token prompts: a shared ``prefix_len`` prefix plus a per-request random body.

    Lengths: input ~ U{floor(input_len*(1-r)), ceil(input_len*(1+r))}, likewise output (>= 1).
    Token ids are drawn from ``[0, vocab_size)`` minus ``avoid_ids`` (EOS/BOS).
    """
    if (problem := random_flags_problem(num_prompts, input_len, output_len, range_ratio, prefix_len)) is not None:
        raise ValueError(problem)
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(avoid_ids, dtype=np.int64))
    if allowed.size == 0:
        raise ValueError(f"no token ids left to sample from (vocab_size={vocab_size})")
    in_lo, in_hi = int(np.floor(input_len * (1 - range_ratio))), int(np.ceil(input_len * (1 + range_ratio)))
    out_lo, out_hi = int(np.floor(output_len * (1 - range_ratio))), int(np.ceil(output_len * (1 + range_ratio)))
    input_lens = rng.integers(max(in_lo, 1), in_hi + 1, size=num_prompts)
    output_lens = rng.integers(max(out_lo, 1), out_hi + 1, size=num_prompts)
    prefix = rng.choice(allowed, size=prefix_len).tolist()
    return [RequestInput(prompt_token_ids=prefix + rng.choice(allowed, size=int(n)).tolist(),
                         output_len=int(m)) for n, m in zip(input_lens, output_lens)]


def arrival_flags_problem(request_rate: float, burstiness: float) -> str | None:
    """What is wrong with ``--request-rate`` / ``--burstiness`` (one line naming the flag), or None:
    a rate > 0 (``inf``: all at once) and a finite burstiness > 0. NaN is neither: its intervals
    would be NaN, which sends every request at once while the result still names the rate."""
    if not request_rate > 0:  # not >: NaN too
        return f"--request-rate must be > 0 (inf: all at once), got {request_rate}"
    if not (math.isfinite(burstiness) and burstiness > 0):
        return f"--burstiness must be a finite number > 0, got {burstiness}"
    return None


def arrival_intervals(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma(shape=burstiness, scale=1/(rate*burstiness)).

    Mean interval 1/rate whatever the burstiness; burstiness 1 is a Poisson process,
    lower is burstier. An infinite rate sends everything at once (all zeros).
    """
    if (problem := arrival_flags_problem(request_rate, burstiness)) is not None:
        raise ValueError(problem)
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests).tolist()


async def paced(requests: list[RequestInput], intervals: list[float]) -> AsyncIterator[RequestInput]:
    for request, interval in zip(requests, intervals):
        if interval > 0:
            await asyncio.sleep(interval)
        yield request


# ---------------------------------------------------------------- metrics


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes NAME:MS with NAME in ttft, tpot, e2el; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError as exc:
            raise ValueError(f"--goodput value for {name} must be a number of ms, got {value!r}") from exc
        if not slos[name] >= 0:  # not >=: NaN too (no request would ever be good)
            raise ValueError(f"--goodput value for {name} must be >= 0, got {value}")
    return slos


def parse_percentiles(spec: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``; ValueError naming ``--metric-percentiles`` for a
    value that is not a number in [0, 100] (np.percentile's range)."""
    percentiles = []
    for item in spec.split(","):
        try:
            p = float(item)
        except ValueError:
            raise ValueError(f"--metric-percentiles takes comma-separated numbers in [0, 100], got {item.strip()!r}"
                             ) from None
        if not (math.isfinite(p) and 0.0 <= p <= 100.0):
            raise ValueError(f"--metric-percentiles must be in [0, 100], got {item.strip()}")
        percentiles.append(p)
    return percentiles


def compute_tpot(outcome: RequestOutcome) -> float:
    """(E2EL - TTFT) / (output_tokens - 1) in seconds; 0 for outputs of one token."""
    if outcome.output_tokens <= 1:
        return 0.0
    return (outcome.latency - outcome.ttft) / (outcome.output_tokens - 1)


def summarize(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean / median / std / p{p} of ``values`` (seconds) in milliseconds; zeros when empty."""
    arr = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        stats[f"p{percentile_word(p)}"] = float(np.percentile(arr, p))
    return stats


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def is_good(outcome: RequestOutcome, slos_ms: dict[str, float]) -> bool:
    measured = {"ttft": outcome.ttft, "tpot": compute_tpot(outcome), "e2el": outcome.latency}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def compute_metrics(outcomes: list[RequestOutcome], duration_s: float, *, slos_ms: dict[str, float],
                    percentiles: list[float], selected: tuple[str, ...] = METRICS) -> dict[str, Any]:
    """vLLM's result keys from per-request outcomes (failed requests count 0 output tokens)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [o for o in outcomes if o.success]
    series = {"ttft": [o.ttft for o in ok], "tpot": [compute_tpot(o) for o in ok if o.output_tokens > 1],
              "itl": [gap for o in ok for gap in o.itl], "e2el": [o.latency for o in ok]}
    total_input = sum(o.prompt_len for o in ok)
    output_lens = [o.output_tokens if o.success else 0 for o in outcomes]
    good = sum(is_good(o, slos_ms) for o in ok) if slos_ms else len(ok)
    result: dict[str, Any] = {
        "duration": duration_s, "completed": len(ok), "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_input, "total_output_tokens": sum(output_lens),
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if slos_ms else None,
        "output_throughput": sum(output_lens) / duration_s,
        "total_token_throughput": (total_input + sum(output_lens)) / duration_s,
    }
    for name in selected:
        for stat, value in summarize(series[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    result["percentiles"] = {name: [[p, result[f"p{percentile_word(p)}_{name}_ms"]] for p in percentiles]
                             for name in selected}
    result.update(input_lens=[o.prompt_len for o in outcomes], output_lens=output_lens,
                  ttfts=[o.ttft for o in outcomes], itls=[o.itl for o in outcomes],
                  errors=[o.error for o in outcomes])
    return result


def failure_reasons(errors: list[str], limit: int = 3, width: int = 200) -> list[str]:
    """The ``limit`` most common distinct non-empty ``errors`` as ``"N x reason"`` lines (most
    frequent first, whitespace collapsed, cut to ``width`` characters), and one line counting the
    distinct reasons left out."""
    counts = Counter(" ".join(e.split()) for e in errors if e)
    lines = [f"{n} x {reason if len(reason) <= width else reason[:width - 3] + '...'}"
             for reason, n in counts.most_common(limit)]
    if len(counts) > limit:
        lines.append(f"... and {len(counts) - limit} other distinct reason(s)")
    return lines


def format_summary(result: dict[str, Any], *, max_concurrency: int | None, request_rate: float,
                   percentiles: list[float], selected: tuple[str, ...] = METRICS) -> str:
    """The table ``vllm bench serve`` prints."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "<10") -> None:
        lines.append(f"{label:<40} {value:{fmt}}")

    row("Successful requests:", result["completed"])
    if result.get("failed"):
        row("Failed requests:", result["failed"])
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, "<10.2f")
    row("Benchmark duration (s):", result["duration"], "<10.2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], "<10.2f")
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"], "<10.2f")
    row("Output token throughput (tok/s):", result["output_throughput"], "<10.2f")
    row("Total Token throughput (tok/s):", result["total_token_throughput"], "<10.2f")
    for name in selected:
        short, title = METRIC_TITLES[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], "<10.2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], "<10.2f")
        for p in percentiles:
            word = percentile_word(p)
            row(f"P{word} {short} (ms):", result[f"p{word}_{name}_ms"], "<10.2f")
    lines.append("=" * 50)
    # the table alone shows only zeros when requests fail: say why they did
    reasons = failure_reasons(result.get("errors", []))
    if reasons:
        lines.append("Failure reasons (requests x reason):")
        lines.extend(f"  {reason}" for reason in reasons)
    return "\n".join(lines)


# ---------------------------------------------------------------- running


async def run_benchmark(target: BenchTarget, requests: list[RequestInput], intervals: list[float], *,
                        max_concurrency: int | None, show_progress: bool = False,
                        ) -> tuple[list[RequestOutcome], float]:
    """Send ``requests`` on schedule; returns the outcomes (in request order) and the wall time."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    progress = None
    if show_progress:
        from tqdm import tqdm
        progress = tqdm(total=len(requests))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600),
                                     trust_env=False) as session:
        async def one(request: RequestInput) -> RequestOutcome:
            if limit is None:
                outcome = await send_request(session, target, request)
            else:
                async with limit:
                    outcome = await send_request(session, target, request)
            if progress is not None:
                progress.update(1)
            return outcome

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(r)) async for r in paced(requests, intervals)]
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return list(outcomes), duration


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m launch bench serve", description=__doc__.splitlines()[0])
    add_target_args(p)
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS")
    p.add_argument("--percentile-metrics", default=",".join(METRICS))
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def check_output(args: argparse.Namespace) -> str | None:
    """Why the result JSON could not be written at the end (naming the flag), or None; checked
    before the run so a long benchmark does not end in a write error."""
    if not (args.save_result or args.result_filename):
        return None
    if args.result_dir is not None and (problem := output_dir_problem(args.result_dir)) is not None:
        return f"--result-dir: {problem}"
    # a name with a separator (or . / ..) could land outside --result-dir
    if args.result_dir is not None and args.result_filename is not None and not is_plain_file_name(
            args.result_filename):
        return (f"--result-filename must be a plain file name (no path separator, not . or ..) inside "
                f"--result-dir, got {args.result_filename!r}")
    if args.result_filename is not None:
        path = Path(args.result_dir or ".") / args.result_filename
        if (problem := output_file_problem(path)) is not None:
            return f"--result-filename: {problem}"
    return None


def is_plain_file_name(name: str) -> bool:
    """``name`` names a file in a directory: not empty, not ``.`` / ``..``, no path separator."""
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return name not in ("", ".", "..") and not any(sep in name for sep in separators)


def context_problem(requests: list[RequestInput], max_model_len: int | None, model: str,
                    args: argparse.Namespace) -> str | None:
    """Why the longest drawn request (prompt + output tokens) does not fit the served model's
    ``max_model_len`` (the server would refuse it), naming the length flags; None when all fit or
    the server did not say its length."""
    if max_model_len is None or not requests:
        return None
    longest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    total = longest.prompt_len + longest.output_len
    if total <= max_model_len:
        return None
    flags = f"--random-input-len {args.random_input_len} + --random-output-len {args.random_output_len}"
    if args.random_prefix_len:
        flags += f" + --random-prefix-len {args.random_prefix_len}"
    if args.random_range_ratio:
        flags += f" (--random-range-ratio {args.random_range_ratio})"
    return (f"{flags} give requests of up to {total} tokens ({longest.prompt_len} prompt + "
            f"{longest.output_len} output), more than the max_model_len {max_model_len} of model {model}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        slos = parse_goodput(args.goodput)
        selected = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
        unknown = [m for m in selected if m not in METRICS]
        if unknown:
            raise ValueError(f"--percentile-metrics: unknown metric(s) {unknown}; choose from {list(METRICS)}")
        percentiles = parse_percentiles(args.metric_percentiles)
        # vLLM's benchmark takes None as unlimited; 0 would hang the semaphore, < 0 crash it
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1 (omit it for no limit), got {args.max_concurrency}")
        # before the server is asked for its model and vocabulary
        if (problem := random_flags_problem(args.num_prompts, args.random_input_len, args.random_output_len,
                                            args.random_range_ratio, args.random_prefix_len)) is not None:
            raise ValueError(problem)
        if (problem := arrival_flags_problem(args.request_rate, args.burstiness)) is not None:
            raise ValueError(problem)
        if (problem := check_output(args)) is not None:
            raise ValueError(problem)
        if (problem := target_flags_problem(args)) is not None:
            raise ValueError(problem)
        target, vocab_size, avoid = asyncio.run(resolve_target(args))
        requests = sample_random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                          args.random_range_ratio, vocab_size, prefix_len=args.random_prefix_len,
                                          seed=args.seed, avoid_ids=avoid)
        if (problem := context_problem(requests, target.max_model_len, target.model, args)) is not None:
            raise ValueError(problem)
        intervals = arrival_intervals(len(requests), args.request_rate, args.burstiness, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    outcomes, duration = asyncio.run(run_benchmark(target, requests, intervals, max_concurrency=args.max_concurrency,
                                                   show_progress=not args.disable_tqdm))
    result = compute_metrics(outcomes, duration, slos_ms=slos, percentiles=percentiles, selected=selected)
    print(format_summary(result, max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                         percentiles=percentiles, selected=selected))
    if args.save_result or args.result_filename:
        path = save_result(result, args, target)
        print(f"Saved result to {path}")
    if result["completed"] == 0:
        print(f"error: all {result['failed']} requests failed (reasons above)", file=sys.stderr)
        return 1
    return 0


def save_result(result: dict[str, Any], args: argparse.Namespace, target: BenchTarget) -> Path:
    now = datetime.now()
    record = {"date": now.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "endpoint_type": "openai",
              "model_id": target.model, "num_prompts": args.num_prompts,
              "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, **result}
    name = args.result_filename or (f"openai-{args.request_rate}qps-concurrency{args.max_concurrency}-"
                                    f"{os.path.basename(target.model.rstrip('/'))}-{record['date']}.json")
    return write_output_file(Path(args.result_dir or ".") / name, json.dumps(record, indent=2))
