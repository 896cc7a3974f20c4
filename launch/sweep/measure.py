"""Measure one sweep point for real: build the engine, warm it up, run the workload, read its counters.

The figures come from the engine itself: per-step wall time (``EngineCounters.step_seconds_total``),
the slowest rank's CPU time per step (``worker_cpu_seconds_total``), capacity drops
(``tokens_dropped``), the balancer's run totals (``EplbDriver.run_totals``: tokens per EP rank and
per expert over the timed run, whatever rebalanced in it), and each request's
``RequestMetrics`` (TTFT, TPOT). A step is a *decode* step when every scheduled
sequence on every DP rank takes exactly one token.

Protocol per point: (1) warm-up: the first ``warmup_prompts`` prompts without their first
token (so no block of them is a prefix-cache hit for the timed run), ``warmup_tokens``
tokens each; with EPLB on, the balancer then rebalances once from the warm-up's load (the
placement a server reaches after running a while); the statistics window is cleared.
(2) timed run: every prompt queued at once, greedy, ``ignore_eos``, ``max_tokens`` each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from balancer.balancedness import compute_balancedness
from launch.config import RuntimeConfig
from launch.core import SamplingParams, SchedulerOutput
from launch.sweep.shared_cluster import SharedCluster
from launch.worker import StepResult


@dataclass(frozen=True)
class Workload:
    """Prompts as text (tokenized by each point's model) or token ids, and the output length."""

    prompts: tuple[str | tuple[int, ...], ...]
    max_tokens: int
    name: str = ""

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError(f"workload {self.name!r} has no prompts")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class StepRecord:
    """One engine step of the timed run."""

    wall_s: float
    cpu_s: float
    num_tokens: int
    is_decode: bool
    mean_context: float = 0.0


@dataclass
class PointRun:
    """Raw outcome of a timed run: per-step records, per-request outputs and latencies."""

    steps: list[StepRecord] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    tokens_dropped: int = 0
    num_rebalances: int = 0
    balancedness: float | None = None
    kv_tokens: int = 0
    ep_size: int = 1
    dp_size: int = 1
    num_moe_layers: int = 0
    top_k: int = 0
    expert_load: list[list[int]] | None = None  # [L_moe, E] tokens per logical expert, timed run
    phy2log: list[list[int]] | None = None  # [L_moe, P] the placement in force at the end


class _StepRecorder:
    """Wraps the engine's executor to see which batches each step ran (decode or not)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_nodes = inner.num_nodes
        self.last: SchedulerOutput | None = None

    def execute(self, output: SchedulerOutput, collect_load: bool) -> list[StepResult]:
        self.last = output
        return self.inner.execute(output, collect_load)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def mean_context(output: SchedulerOutput) -> float:
    """Mean context length (tokens, the new one included) of the step's sequences."""
    lens = [c for b in output.batches if not b.is_empty for c in b.context_lens]
    return statistics.fmean(lens) if lens else 0.0


def is_decode_step(output: SchedulerOutput) -> bool:
    """Every non-empty batch's sequences take one token each (no prefill chunk)."""
    batches = [b for b in output.batches if not b.is_empty]
    return bool(batches) and all(q == 1 for b in batches for q in b.query_lens)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _tokenize(engine: Any, prompts: Sequence[str | tuple[int, ...]]) -> list[list[int]]:
    out = []
    for p in prompts:
        if isinstance(p, str):
            if engine.tokenizer is None:
                raise ValueError("the model has no tokenizer.json: the workload must give token ids")
            out.append(engine.tokenizer.encode(p))
        else:
            out.append([int(t) for t in p])
    return out


def _drain(engine: Any, ids: list[str], on_step: Callable[[list[Any]], None] | None = None) -> dict[str, Any]:
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        if on_step is not None:
            on_step(outs)
        for out in outs:
            if out.finished:
                finished[out.request_id] = out
    return {i: finished[i] for i in ids}


def _submit(engine: Any, token_lists: Sequence[list[int]], max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = []
    for tokens in token_lists:
        rid = engine.next_request_id()
        engine.add_request(rid, tokens, params)
        ids.append(rid)
    return ids


def warm_up(engine: Any, token_lists: Sequence[list[int]], num_prompts: int, num_tokens: int) -> None:
    """Untimed warm-up on shifted prompts; EPLB on: one rebalance from its load. Clears the window."""
    warm = [t[1:] if len(t) > 1 else t for t in token_lists[:num_prompts]]
    if warm and num_tokens > 0:
        _drain(engine, _submit(engine, warm, num_tokens))
    if engine.eplb is not None:
        if engine.config.balancer.enable_eplb and engine.eplb.stats.num_steps:
            engine.rebalance()  # commits and clears the statistics window
        engine.eplb.stats.reset()


def run_point(config: RuntimeConfig, workload: Workload, *, warmup_prompts: int = 8, warmup_tokens: int = 4,
              on_tokens: Callable[[int], None] | None = None, cluster: SharedCluster | None = None) -> PointRun:
    """Build the engine for ``config``, warm it up, time the workload; always shuts it down.
    cluster: the sweep's local Ray cluster, acquired before the engine is built and released
    (nothing of this point left on it) after it is shut down."""
    from launch.engine import LLMEngine

    try:
        if cluster is not None:
            cluster.acquire(config.parallel.world_size)
        engine = LLMEngine(config)
        try:
            recorder = _StepRecorder(engine.executor)
            engine.executor = recorder
            tokens = _tokenize(engine, workload.prompts)
            warm_up(engine, tokens, warmup_prompts, warmup_tokens)
            return _timed_run(engine, recorder, tokens, workload.max_tokens, on_tokens)
        finally:
            engine.shutdown()
    finally:
        if cluster is not None:
            cluster.release()


def _timed_run(engine: Any, recorder: _StepRecorder, tokens: list[list[int]], max_tokens: int,
               on_tokens: Callable[[int], None] | None) -> PointRun:
    c = engine.counters
    run = PointRun()
    dropped0, rebalances0 = c.tokens_dropped, engine.eplb.counters.num_rebalances if engine.eplb else 0
    totals0 = engine.eplb.run_totals() if engine.eplb is not None else None
    prev = [c.num_steps, c.step_seconds_total, c.worker_cpu_seconds_total, c.generation_tokens_total]

    def on_step(_outs: list[Any]) -> None:
        if c.num_steps == prev[0] or recorder.last is None:
            return  # nothing ran (an empty schedule)
        last = recorder.last
        run.steps.append(StepRecord(c.step_seconds_total - prev[1], c.worker_cpu_seconds_total - prev[2],
                                    last.num_scheduled_tokens, is_decode_step(last), mean_context(last)))
        if on_tokens is not None:
            on_tokens(c.generation_tokens_total - prev[3])
        prev[:] = [c.num_steps, c.step_seconds_total, c.worker_cpu_seconds_total, c.generation_tokens_total]

    started = time.perf_counter()
    ids = _submit(engine, tokens, max_tokens)
    finished = _drain(engine, ids, on_step)
    run.elapsed_s = time.perf_counter() - started
    for rid in ids:
        out = finished[rid]
        run.outputs.append(list(out.outputs[0].token_ids))
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m.ttft is not None:
            run.ttft_s.append(m.ttft)
        if n > 1 and m.first_token_time is not None and m.finished_time is not None:
            run.tpot_s.append((m.finished_time - m.first_token_time) / (n - 1))
    run.tokens_dropped = c.tokens_dropped - dropped0
    mc, p = engine.model_config, engine.config.parallel
    if engine.eplb is not None:
        run.num_rebalances = engine.eplb.counters.num_rebalances - rebalances0
        # the timed run's every step, each under the placement in force at it: the balancer's window
        # starts over at each rebalance, and would cover only the steps since the last one
        rank_load, logical = (after - before for after, before in zip(engine.eplb.run_totals(), totals0))
        if rank_load.sum() > 0:
            run.balancedness = compute_balancedness(rank_load)[1]
            run.expert_load = logical.tolist()
            run.phy2log = engine.eplb.placement.phy2log.tolist()
    run.kv_tokens = engine.num_kv_blocks * engine.config.engine.block_size * p.data_parallel_size
    run.ep_size, run.dp_size = p.expert_parallel_size, p.data_parallel_size
    run.num_moe_layers, run.top_k = len(mc.moe_layer_ids), mc.num_experts_per_tok
    return run


def agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> float:
    """Mean over requests of (common greedy prefix length / output length), in [0, 1]."""
    from launch.bench.throughput import agreement as prefix_agreement

    return prefix_agreement(ours, theirs)


def summarize_run(run: PointRun, baseline: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    """The measured columns of a results row (times in ms)."""
    decode = [s for s in run.steps if s.is_decode]
    out_tokens = sum(len(o) for o in run.outputs)
    assignments = sum(s.num_tokens for s in run.steps) * run.top_k * run.num_moe_layers

    def ms(x: float | None) -> float | None:
        return None if x is None else 1000.0 * x

    return {
        "output_tokens_per_s": out_tokens / run.elapsed_s if run.elapsed_s > 0 else None,
        "measured_step_ms": ms(percentile([s.wall_s for s in decode], 50)),
        "measured_step_cpu_ms": ms(percentile([s.cpu_s for s in decode], 50)),
        "measured_step_ms_p99": ms(percentile([s.wall_s for s in decode], 99)),
        "prefill_step_ms": ms(percentile([s.wall_s for s in run.steps if not s.is_decode], 50)),
        "prefill_step_cpu_ms": ms(percentile([s.cpu_s for s in run.steps if not s.is_decode], 50)),
        "ttft_ms_p50": ms(percentile(run.ttft_s, 50)), "ttft_ms_p99": ms(percentile(run.ttft_s, 99)),
        "tpot_ms_p50": ms(percentile(run.tpot_s, 50)), "tpot_ms_p99": ms(percentile(run.tpot_s, 99)),
        "balancedness": run.balancedness,
        "drop_rate": run.tokens_dropped / assignments if assignments else 0.0,
        "kv_tokens": run.kv_tokens,
        "greedy_agreement": agreement(run.outputs, baseline) if baseline is not None else None,
        "num_requests": len(run.outputs), "num_output_tokens": out_tokens, "elapsed_s": run.elapsed_s,
        "num_steps": len(run.steps), "num_decode_steps": len(decode),
        "mean_decode_batch": statistics.fmean(s.num_tokens for s in decode) if decode else None,
        "decode_batch_per_rank_p50": (percentile([s.num_tokens for s in decode], 50) or 0) / run.dp_size
        if decode else None,
        "decode_context_mean": statistics.fmean(s.mean_context for s in decode) if decode else None,
        "num_rebalances": run.num_rebalances, "ep_size": run.ep_size,
    }
