"""``python -m launch bench overhead``: what the driver/actor round trip adds to each engine step.

    python -m launch bench overhead --model DIR [-dp N] [--enable-expert-parallel] [--steps 50]
        [--batch 8] [--context-len 32] [--warmup-steps 5] [--transports ray,socket] [--json FILE]
        [engine flags]
    python -m launch bench overhead --model DIR --stats-overhead [--batch 8] [--repeats 2000] [...]

Steady decode: ``--batch`` requests with ``--context-len``-token random prompts are prefilled,
then ``--steps`` engine steps in which every sequence decodes exactly one token are timed
(after ``--warmup-steps`` such steps). The executor is the engine's own: in-process for one
rank, one Ray actor per rank otherwise. Per timed step:

    step_ms       LLMEngine.step() wall time on the driver
    execute_ms    executor.execute(): send every rank its batch, wait for every reply
    worker_ms     max over the replies of StepResult.seconds (time inside Worker.execute)
    scheduler_ms  Scheduler.schedule() + Scheduler.update() on the driver
    overhead_ms   step - worker: everything the driver loop adds to the model's time
    transport_ms  execute - worker: serialisation, Ray round trip, waiting for the replies
    other_ms      step - execute - scheduler: token/capacity accounting, EPLB statistics
    step_cpu_ms   driver process CPU time over the step (steadier than wall on a shared box)
    execute_cpu_ms  driver process CPU time inside executor.execute (all threads: Ray's own too)
    execute_thread_cpu_ms  the calling thread's CPU time inside executor.execute (encoding,
                  sends, receives, decoding; Ray's submission work on this thread)
    sampler_ms    the worker's Sampler call (one in-process rank only; nan with Ray ranks)

The decoding requests sample with ``--temperature`` (0: greedy, the default), ``--top-p``,
``--top-k``, ``--min-p``, the penalties (``--repetition-penalty``, ``--presence-penalty``,
``--frequency-penalty``: the worker then keeps each request's token history) and, with
``--request-seeds``, a seed each (the seeded path). With one
in-process rank a closing line gives scheduler + sampler as a share of the median step's CPU.

``--transports ray,socket`` runs the same measurement once per step transport
(``parallel.step_transport``) in this process, one engine after the other, and prints the
medians side by side with their ratios to the first.

Steps in which a rebalance ran are left out (and counted). With tp > 1 only DP leaders
reply, so worker_ms is the max over those ranks.

``--stats-overhead`` (one in-process rank) times the routing-statistics recording with this
run's shapes against the same measured decode step: per MoE layer the ``slot_load``
bincount of ``MoELayer.forward``, the worker's stack + reset of those counters, and on the
driver the sum over DP replies plus ``balancer.RoutingStats.record``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from launch.bench.decode import check_batch_fits, check_step_flags, num_prefill_steps
from launch.config import ConfigError, RuntimeConfig
from launch.config_args import (
    FlagParser,
    add_runtime_args,
    fill_unset,
    restate_defaults,
    runtime_config_from_args,
)
from launch.core import SamplingParams, SchedulerOutput
from launch.paths import output_file_problem, write_output_file
from launch.worker import StepResult

STEP_FIELDS = ("step_ms", "execute_ms", "worker_ms", "scheduler_ms", "overhead_ms", "transport_ms", "other_ms",
               "step_cpu_ms", "execute_cpu_ms", "execute_thread_cpu_ms", "sampler_ms")
STATS_BUDGET = 0.02  # the bar: recording costs at most 2% of a step


@dataclass(frozen=True)
class StepTiming:
    """One timed engine step, milliseconds (definitions in the module docstring)."""

    step_ms: float
    execute_ms: float
    worker_ms: float
    scheduler_ms: float
    step_cpu_ms: float = 0.0
    execute_cpu_ms: float = 0.0
    execute_thread_cpu_ms: float = 0.0
    sampler_ms: float = float("nan")

    @property
    def overhead_ms(self) -> float:
        return self.step_ms - self.worker_ms

    @property
    def transport_ms(self) -> float:
        return self.execute_ms - self.worker_ms

    @property
    def other_ms(self) -> float:
        return self.step_ms - self.execute_ms - self.scheduler_ms


class TimedExecutor:
    """Wraps the engine's executor: wall time of each ``execute`` and the replies it got."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_nodes = inner.num_nodes
        self.last: tuple[SchedulerOutput, list[StepResult], float] | None = None
        self.last_cpu = self.last_thread_cpu = 0.0

    def execute(self, output: SchedulerOutput, collect_load: bool) -> list[StepResult]:
        started, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
        results = self.inner.execute(output, collect_load)
        self.last = (output, results, time.perf_counter() - started)
        self.last_cpu, self.last_thread_cpu = time.process_time() - cpu, time.thread_time() - thread
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Stopwatch:
    """Wraps ``inner``: ``seconds`` accumulates the wall time of the calls made through ``timed``
    since ``reset``; other attributes pass through to ``inner``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def reset(self) -> None:
        self.seconds = 0.0

    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class TimedScheduler(_Stopwatch):
    """Wraps the engine's scheduler: seconds spent in ``schedule`` + ``update`` since ``reset``."""

    def schedule(self) -> SchedulerOutput:
        return self.timed(self.inner.schedule)

    def update(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self.inner.update, *args, **kwargs)


class TimedSampler(_Stopwatch):
    """Wraps a worker's sampler: seconds spent in its calls since ``reset``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.timed(self.inner, *args, **kwargs)


def is_pure_decode(output: SchedulerOutput, batch_size: int) -> bool:
    """Whether every one of ``batch_size`` sequences decodes exactly one token this step."""
    num_seqs = sum(b.num_seqs for b in output.batches)
    return num_seqs == batch_size and output.num_scheduled_tokens == batch_size


def summarize(timings: list[StepTiming]) -> dict[str, dict[str, float]]:
    """Per field of STEP_FIELDS: median, mean, p90, min over the timed steps (ms)."""
    if not timings:
        raise ValueError("no timed steps to summarize")
    out = {}
    for name in STEP_FIELDS:
        values = sorted(getattr(t, name) for t in timings)
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        out[name] = {"median": statistics.median(values), "mean": statistics.fmean(values), "p90": p90,
                     "min": values[0]}
    return out


def run_decode(engine: Any, batch_size: int, context_len: int, steps: int, warmup_steps: int, *,
               seed: int, sampling: SamplingParams | None = None, request_seeds: bool = False,
               sampler: TimedSampler | None = None) -> tuple[list[StepTiming], int]:
    """Prefill ``batch_size`` requests, then time ``steps`` pure decode steps (the engine's
    executor and scheduler must be TimedExecutor / TimedScheduler). The requests sample with
    ``sampling``'s settings (default greedy), request i seeded with i when ``request_seeds``;
    ``sampler``, when given, is the in-process worker's timed sampler. Returns the timings and
    the number of decode steps left out because a rebalance ran in them."""
    executor, scheduler = engine.executor, engine.scheduler
    mc = engine.model_config
    vocab = [t for t in range(mc.vocab_size) if t not in engine.eos_token_ids]
    rng = random.Random(seed)
    prefill_steps = num_prefill_steps(batch_size, context_len, engine.config.engine.max_num_batched_tokens)
    max_steps = 2 * (warmup_steps + steps) + 4 * prefill_steps + 16
    params = dataclasses.replace(sampling or SamplingParams(temperature=0.0), max_tokens=max_steps + 1,
                                 ignore_eos=True)
    ids = [engine.next_request_id() for _ in range(batch_size)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [rng.choice(vocab) for _ in range(context_len)],
                           dataclasses.replace(params, seed=i) if request_seeds else params)
    timings: list[StepTiming] = []
    decode_steps = skipped = 0
    try:
        for _ in range(max_steps):
            scheduler.reset()
            if sampler is not None:
                sampler.reset()
            executor.last = None
            rebalances = engine.eplb.counters.num_rebalances if engine.eplb is not None else 0
            started, cpu = time.perf_counter(), time.process_time()
            engine.step()
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
            if executor.last is None or not is_pure_decode(executor.last[0], batch_size):
                continue
            decode_steps += 1
            if decode_steps <= warmup_steps:
                continue
            if engine.eplb is not None and engine.eplb.counters.num_rebalances != rebalances:
                skipped += 1
                continue
            _, results, execute = executor.last
            timings.append(StepTiming(wall * 1e3, execute * 1e3, max(r.seconds for r in results) * 1e3,
                                      scheduler.seconds * 1e3, cpu * 1e3, executor.last_cpu * 1e3,
                                      executor.last_thread_cpu * 1e3,
                                      sampler.seconds * 1e3 if sampler is not None else float("nan")))
            if len(timings) == steps:
                break
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    if len(timings) < steps:
        raise RuntimeError(f"only {len(timings)} of {steps} steps decoded all {batch_size} sequences "
                           "(preemption? raise --num-kv-blocks or lower --batch)")
    return timings, skipped


# ---------------------------------------------------------------- routing-statistics overhead


def time_call(fn: Callable[[], Any], repeats: int, rounds: int = 5) -> float:
    """Seconds per call of ``fn``: the median over ``rounds`` of the mean of ``repeats`` calls."""
    if repeats < 1 or rounds < 1:
        raise ValueError(f"repeats and rounds must be >= 1, got {repeats}, {rounds}")
    fn()  # first-call allocations stay out of the figure
    means = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        means.append((time.perf_counter() - started) / repeats)
    return statistics.median(means)


def measure_recording(num_layers: int, num_slots: int, num_ranks: int, tokens_per_rank: int, top_k: int,
                      window_size: int, *, repeats: int, seed: int = 0,
                      counted_in_fused_op: bool = False) -> dict[str, float]:
    """Microseconds per step of each part of the routing-statistics recording, with the same
    expressions and shapes as the runtime: slot_ids [T, K] int64 in [0, P), slot_load [P] int64
    per MoE layer, the worker's [L, P] stack, R replies summed into RoutingStats.record.
    counted_in_fused_op: the layers count their slots inside ``kernels.moe_ffn`` (T x K integer
    adds in C++, part of the step itself), so there is no per-layer bincount to add (0).

    Returns bincount_per_layer_us, bincount_us (x L), worker_collect_us, driver_record_us, total_us.
    """
    from balancer import RoutingStats

    if min(num_layers, num_slots, num_ranks, tokens_per_rank, top_k, window_size) < 1:
        raise ValueError("num_layers, num_slots, num_ranks, tokens_per_rank, top_k and window_size must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    slot_ids = torch.randint(0, num_slots, (tokens_per_rank, top_k), generator=gen)  # [T, K]
    counters = [torch.zeros(num_slots, dtype=torch.int64) for _ in range(num_layers)]  # L x [P]
    replies = [torch.randint(0, 64, (num_layers, num_slots), generator=gen) for _ in range(num_ranks)]  # R x [L, P]
    stats = RoutingStats(num_layers, num_slots, num_ranks if num_slots % num_ranks == 0 else 1, window_size)
    load = counters[0]

    def bincount() -> None:  # MoELayer.forward
        nonlocal load
        load += torch.bincount(slot_ids.reshape(-1), minlength=num_slots)

    def worker_collect() -> None:  # Worker._read_counters: stack, then reset each layer's counter
        torch.stack(counters)
        for c in counters:
            c.zero_()

    def driver_record() -> None:  # LLMEngine._account + EplbDriver.record
        stats.record(torch.stack(replies).sum(0))

    per_layer = 0.0 if counted_in_fused_op else time_call(bincount, repeats) * 1e6
    collect = time_call(worker_collect, repeats) * 1e6
    driver = time_call(driver_record, repeats) * 1e6
    return {"bincount_per_layer_us": per_layer, "bincount_us": per_layer * num_layers,
            "worker_collect_us": collect, "driver_record_us": driver,
            "total_us": per_layer * num_layers + collect + driver}


# ---------------------------------------------------------------- command line


STATS_REPEATS = 2000  # calls per timing round of --stats-overhead


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m launch bench overhead", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(parser, server=False)
    restate_defaults(parser, {"max_num_seqs": "--batch", "max_num_batched_tokens": "--batch + 512, at least 512"})
    g = parser.add_argument_group("benchmark")
    g.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    g.add_argument("--context-len", type=int, default=32, help="prompt tokens per sequence before decoding")
    g.add_argument("--steps", type=int, default=50, help="timed decode steps")
    g.add_argument("--warmup-steps", type=int, default=5)
    g.add_argument("--stats-overhead", action="store_true",
                   help="time the routing-statistics recording against the decode step (one rank)")
    g.add_argument("--repeats", type=int, default=None,
                   help=f"calls per timing round in --stats-overhead (default {STATS_REPEATS})")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads on the driver (default: torch's)")
    g.add_argument("--transports", default=None, metavar="LIST",
                   help="comma-separated step transports to run one after another in this process "
                        "(e.g. ray,socket: before/after side by side); default: the configured one")
    g.add_argument("--json", default=None, metavar="FILE", help="write the result JSON here")
    s = parser.add_argument_group("sampling of the decoding requests")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--request-seeds", action="store_true", help="give request i the seed i (seeded sampling)")
    return parser


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The decoding requests' sampling settings from the flags (ValueError names a bad one)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty)


def build_config(args: argparse.Namespace) -> RuntimeConfig:
    """The runtime config with room for the batch (max_num_seqs, KV blocks) so no step is preempted."""
    if args.repeats is not None and not args.stats_overhead:
        raise ValueError("--repeats sets --stats-overhead's timing rounds, which this run does not time: add "
                         "--stats-overhead or leave --repeats out")
    if args.repeats is None:
        args.repeats = STATS_REPEATS
    check_step_flags(args, ("batch", "context_len", "steps", "repeats"))
    if args.json is not None and (problem := output_file_problem(args.json)) is not None:
        raise ValueError(f"--json: {problem}")  # now, not after the whole benchmark
    # room for the batch, and to prefill beside its decode tokens (num_prefill_steps), unless flags,
    # --config or --set say otherwise
    fill_unset(args, {"max_num_seqs": args.batch, "max_num_batched_tokens": max(512, args.batch + 512)})
    config = runtime_config_from_args(args)
    check_batch_fits(args, config, args.batch, f"--batch {args.batch}", "the batch")
    if args.stats_overhead and config.parallel.world_size != 1:
        raise ValueError("--stats-overhead runs one in-process rank (tensor_parallel_size = data_parallel_size = 1)")
    from launch.engine import check_runtime_config

    # model path, layout, KV budget: before any engine or rank starts
    plan = check_runtime_config(config)
    max_len = plan.max_model_len
    # a sequence decodes while the rest of the batch prefills, then the warm-up and timed steps
    prefill_steps = num_prefill_steps(args.batch, args.context_len, config.engine.max_num_batched_tokens)
    tokens = args.context_len + prefill_steps + args.warmup_steps + args.steps
    if tokens > max_len:
        raise ValueError(f"--context-len {args.context_len} + {tokens - args.context_len} tokens decoded per sequence "
                         f"= {tokens} exceeds max_model_len={max_len} (the model's max_position_embeddings unless "
                         "--max-model-len)")
    if config.engine.num_kv_blocks is None:  # no flag, file or --set sized the pool: room for what a sequence
        # decodes while the rest of the batch prefills, within the sequence's max_model_len, and within what the
        # memory budget holds (plan.num_kv_blocks: sized from it)
        block = config.engine.block_size
        room = min(max_len, args.context_len + 2 * (args.warmup_steps + args.steps) + 4 * prefill_steps + 64)
        want = args.batch * -(-room // block) + 1
        need = args.batch * -(-tokens // block) + 1
        if need > plan.num_kv_blocks:
            budget = f"--memory {config.engine.memory}" if config.engine.memory is not None else \
                "the engine's default memory budget"
            raise ValueError(f"--batch {args.batch} x {tokens} tokens need {need:,} KV blocks of {block}, more than "
                             f"the {plan.num_kv_blocks:,} that {budget} holds beside the weights: lower --batch or "
                             "--context-len, or raise --memory")
        config = dataclasses.replace(config, engine=dataclasses.replace(
            config.engine, num_kv_blocks=min(want, plan.num_kv_blocks)))
    return config


def format_steps(summary: dict[str, dict[str, float]], label: str) -> str:
    widths = {n: max(14, len(n) + 1) for n in STEP_FIELDS}  # a space between every two columns
    head = f"{'executor':<22} {'stat':<7}" + "".join(f"{name:>{widths[name]}}" for name in STEP_FIELDS)
    lines = [head]
    for stat in ("median", "p90"):
        lines.append(f"{label:<22} {stat:<7}" + "".join(f"{summary[n][stat]:>{widths[n]}.3f}" for n in STEP_FIELDS))
    return "\n".join(lines)


def without_nan(value: Any) -> Any:
    """``value`` with every float nan (a figure not measured, e.g. sampler_ms with Ray ranks) as
    None, so the JSON stays standard."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: without_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_nan(v) for v in value]
    return value


def loop_share(summary: dict[str, dict[str, float]]) -> str | None:
    """'scheduler + sampler: X ms of a Y ms step (Z%)' from the medians (step CPU time), or None
    without a sampler timing (Ray ranks)."""
    sampler, scheduler, step = (summary[k]["median"] for k in ("sampler_ms", "scheduler_ms", "step_cpu_ms"))
    if sampler != sampler or step <= 0:  # nan: not measured
        return None
    return (f"# scheduler + sampler (detokenization in the scheduler's update): {scheduler:.3f} + {sampler:.3f} ms "
            f"of a {step:.3f} ms step's CPU ({100 * (scheduler + sampler) / step:.2f}%)")


def describe_executor(config: RuntimeConfig) -> str:
    p = config.parallel
    if p.world_size == 1:
        return "in-process (1 rank)"
    ep = f" ep{p.expert_parallel_size}" if p.expert_parallel_size > 1 else ""
    return f"ray tp{p.tensor_parallel_size} dp{p.data_parallel_size}{ep}"


def stats_overhead(engine: Any, batch_size: int, step_ms: float, min_step_ms: float, repeats: int) -> dict[str, Any]:
    """Recording cost (measure_recording with this engine's shapes) against the median decode
    step ``step_ms`` (``ratio``) and against the fastest one (``ratio_at_min_step``, the bound)."""
    mc = engine.model_config
    shapes = {"num_layers": len(mc.moe_layer_ids), "num_slots": engine.placement.num_physical,
              "num_ranks": engine.config.parallel.data_parallel_size, "tokens_per_rank": batch_size,
              "top_k": mc.num_experts_per_tok, "window_size": engine.config.balancer.window_size}
    if shapes["num_layers"] == 0:
        raise ValueError(f"{engine.config.model} has no MoE layers: nothing records routing statistics")
    fused = counts_in_fused_op(engine, batch_size)
    cost = measure_recording(**shapes, repeats=repeats, seed=engine.config.engine.seed, counted_in_fused_op=fused)
    ratio = cost["total_us"] / (step_ms * 1e3)
    worst = cost["total_us"] / (min_step_ms * 1e3)
    return {"shapes": shapes, **cost, "counted_in_fused_op": fused, "step_ms": step_ms, "min_step_ms": min_step_ms, "ratio": ratio,
            "ratio_at_min_step": worst, "budget": STATS_BUDGET, "within_budget": worst <= STATS_BUDGET}


def counts_in_fused_op(engine: Any, batch_size: int) -> bool:
    """Whether every MoE layer of the in-process rank counts its slots inside the fused CPU op
    (``MoELayer.fused_ffn_op``) for a decode batch of ``batch_size`` tokens, so that no bincount
    runs per layer; False where there is no in-process worker."""
    worker = getattr(engine.executor, "worker", None)
    if worker is None:
        return False
    layers = list(worker.model.moe_layers())
    x = torch.zeros(batch_size, engine.model_config.hidden_size, dtype=worker.dtype, device=worker.device)
    return bool(layers) and all(layer.fused_ffn_op(x) is not None for layer in layers)


def format_stats(s: dict[str, Any]) -> str:
    sh = s["shapes"]
    return "\n".join([
        f"# routing statistics: L={sh['num_layers']} MoE layers, P={sh['num_slots']} slots, T={sh['tokens_per_rank']} "
        f"tokens x K={sh['top_k']}, window {sh['window_size']}",
        *([f"bincount per layer (us)   {'in the op':>10}  (counted inside the fused CPU op: T x K integer adds)"]
          if s["counted_in_fused_op"] else
          [f"bincount per layer (us)   {s['bincount_per_layer_us']:>10.2f}",
           f"bincount, all layers (us) {s['bincount_us']:>10.2f}"]),
        f"worker stack + reset (us) {s['worker_collect_us']:>10.2f}",
        f"driver sum + record (us)  {s['driver_record_us']:>10.2f}",
        f"total per step (us)       {s['total_us']:>10.2f}",
        f"decode step median (ms)   {s['step_ms']:>10.3f}",
        f"decode step min (ms)      {s['min_step_ms']:>10.3f}",
        f"ratio to median step      {100 * s['ratio']:>9.2f}%",
        f"ratio to fastest step     {100 * s['ratio_at_min_step']:>9.2f}%  (budget {100 * s['budget']:.0f}%: "
        f"{'within' if s['within_budget'] else 'OVER'})",
    ])


def measure(config: RuntimeConfig, args: argparse.Namespace) -> dict[str, Any]:
    """One engine on ``config``: the timed decode steps, their summary, and the statistics
    overhead when asked. Returns timings, summary, skipped, stats, the transport used and the compute
    dtype the engine ran ("auto" resolved)."""
    from launch.engine import LLMEngine

    engine = LLMEngine(config)
    try:
        if args.stats_overhead and not engine.model_config.moe_layer_ids:
            raise ValueError(f"{config.model} has no MoE layers: nothing records routing statistics")
        transport = getattr(engine.executor, "active_transport", "in-process")
        worker = getattr(engine.executor, "worker", None)  # the in-process executor's one rank
        sampler = None
        if worker is not None:
            sampler = worker.sampler = TimedSampler(worker.sampler)
        engine.executor = TimedExecutor(engine.executor)
        engine.scheduler = TimedScheduler(engine.scheduler)
        timings, skipped = run_decode(engine, args.batch, args.context_len, args.steps, args.warmup_steps,
                                      seed=config.engine.seed, sampling=sampling_params(args),
                                      request_seeds=args.request_seeds, sampler=sampler)
        summary = summarize(timings)
        step = summary["step_ms"]
        stats = stats_overhead(engine, args.batch, step["median"], step["min"], args.repeats) \
            if args.stats_overhead else None
    finally:
        engine.shutdown()
    return {"timings": timings, "summary": summary, "skipped": skipped, "stats": stats, "transport": transport,
            "dtype": engine.dtype}


def parse_transports(text: str | None, config: RuntimeConfig) -> list[str]:
    """``--transports ray,socket`` -> ["ray", "socket"]; None -> the config's own."""
    from launch.config import STEP_TRANSPORTS

    if text is None:
        return [config.parallel.step_transport]
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in STEP_TRANSPORTS]
    if bad or not names:
        raise ValueError(f"--transports takes a comma-separated list of {list(STEP_TRANSPORTS)}, got {text!r}")
    if config.parallel.world_size == 1:  # one rank steps in this process: no transport to pick, even one
        raise ValueError(f"--transports {text}: a step transport carries steps between Ray ranks; it needs more "
                         "than one rank (-dp/-tp)")
    return names


def format_comparison(runs: list[dict[str, Any]]) -> str:
    """Each run's driver-side medians against the first run's: transport wall, execute CPU."""
    base = runs[0]["summary"]
    keys = ("transport_ms", "execute_cpu_ms", "execute_thread_cpu_ms", "step_cpu_ms")
    lines = [f"# {'transport':<10}" + "".join(f"{k:>22}" for k in keys) + f"  ratios to {runs[0]['transport']}"]
    for run in runs:
        s = run["summary"]
        ratios = [s[k]["median"] / base[k]["median"] if base[k]["median"] > 0 else float("nan") for k in keys]
        lines.append(f"# {run['transport']:<10}" + "".join(f"{s[k]['median']:>22.3f}" for k in keys) + "  "
                     + " ".join(f"{r:.2f}" for r in ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sampling_params(args)
        config = build_config(args)
        transports = parse_transports(args.transports, config)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    runs = []
    try:
        for name in transports:
            run_config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, step_transport=name))
            runs.append(measure(run_config, args))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    label = describe_executor(config)
    for run in runs:
        run_label = label if config.parallel.world_size == 1 else f"{label} {run['transport']}"
        print(f"# {args.steps} decode steps of {args.batch} sequences (context {args.context_len}), {run_label}, "
              f"{run['skipped']} rebalance steps left out; times in ms (cpu: driver process CPU time)")
        print(format_steps(run["summary"], run_label))
        share = loop_share(run["summary"])
        if share is not None:
            print(share)
        if run["stats"] is not None:
            print(format_stats(run["stats"]))
    if len(runs) > 1:
        print(format_comparison(runs))
    if args.json:
        result = {"model": config.model, "executor": label, "world_size": config.parallel.world_size,
                  "data_parallel_size": config.parallel.data_parallel_size,
                  "expert_parallel_size": config.parallel.expert_parallel_size,
                  "enable_eplb": config.balancer.enable_eplb, "dtype": runs[0]["dtype"],
                  "num_threads": torch.get_num_threads(), "batch": args.batch, "context_len": args.context_len,
                  "steps": args.steps,
                  "runs": [{"transport": r["transport"], "rebalance_steps_skipped": r["skipped"],
                            "summary": r["summary"], "timings": [asdict(t) for t in r["timings"]],
                            "stats_overhead": r["stats"]} for r in runs]}
        # the first run's figures also at the top level (the layout before --transports)
        first = result["runs"][0]
        result.update(rebalance_steps_skipped=first["rebalance_steps_skipped"], summary=first["summary"],
                      timings=first["timings"], stats_overhead=first["stats_overhead"])
        write_output_file(args.json, json.dumps(without_nan(result), indent=2) + "\n")
    return 0
