"""``python -m launch bench decode``: steady-state decode step time against the memory-bandwidth bound.

    python -m launch bench decode --model DIR [--batch-sizes 1 8 32 128] [--context-len 128]
        [--steps 20] [--warmup-steps 3] [--num-threads N] [--breakdown] [--ab-fused-ops] [--json FILE]
        [engine flags]

For each batch size B, B requests with ``--context-len``-token random prompts are prefilled
through the engine, then ``--steps`` engine steps in which every one of the B sequences
decodes exactly one token are timed (``--warmup-steps`` such steps first go untimed).

A decode step must at least read, once each: every dense weight (attention, dense MLPs,
shared experts, routers, norms, lm_head; of the embedding only the B rows looked up), the
routed experts the batch's tokens actually touch (distinct physical slots with load > 0 in
that step, per MoE layer, counted from the worker's per-step slot load), and the KV entries
of every sequence's context (context_len x the cache's bytes per token, all layers; with a
sliding window w, min(context_len, w) tokens: the keys it attends to).
``bound_ms`` = those bytes / the copy bandwidth measured in this run (a large tensor copy,
read + write bytes / time, best of a few); ``ratio`` = measured step / bound (1.0 would
be running at the memory-bandwidth limit). One core often reads faster than it copies:
``cpu/read`` divides the step's CPU time by the bytes at the fastest read measured in the run
(``moe_layer.measure_read_bandwidth``: fp32 and int64 sums, and where the kernel has dot tiles
their one-row weight stream), the stricter floor. Large batches are compute-bound instead:
``compute ms`` = the step's FLOPs (every token through the dense weights and its top-k
experts, plus attention over its context) / the rate of the faster GEMM path measured in
the run (PyTorch's matmul or linear, or the packed CPU linear kernel, in the model's dtype); the
roof is the larger of the two bounds. ``cpu ms`` is the CPU time this process spent in
the step (the one rank runs in-process): on a shared machine it moves less with other
people's load than the wall-clock ``step ms``; ``cpu ratio`` and ``cpu/roof`` divide it by
the bandwidth bound and by the roof. ``--breakdown`` profiles extra steps (torch.profiler
self CPU time) and splits them into the whole-block ops (the attention op: MLA's or GQA's
whole decode attention; the MoE FFN op), the routed/shared expert kernel, the linear kernel,
PyTorch GEMMs (attention products, fallbacks), gathers/scatters (paged KV, dispatch),
copies/casts, other ops, and "outside ops" (Python, scheduler, sampler): the stepping
thread's times (with ``--num-threads`` > 1 the other threads' CPU inside the ops is in no
column).

On a CUDA machine the rank runs on the GPU (as the engine places it) and the copy bandwidth and
the matmul rate are measured there (CUDA events; an 8192^3 matmul).

``--ab-fused-ops`` times every batch size with the small fused CPU ops (RMSNorm, router
selection, MLA rope + cache write, MLA / GQA paged decode attention, MLA's and GQA's whole
decode attention, routed experts from the router's output, the whole MoE FFN:
``MoEModel.set_fused_ops``) on and off in alternating steps of the same
run, so a noisy machine's slow minutes hit both sides alike; the extra table gives both
CPU medians and their ratio. Each switch makes the next step rebuild the decode plan, so an
untimed step follows every switch: a timed "on" step costs what it costs without the flag.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from launch.bench import BENCH_DTYPE, repeated_value_problem
from launch.config import ConfigError, RuntimeConfig
from launch.config_args import (
    FlagParser,
    add_runtime_args,
    fill_unset,
    restate_defaults,
    runtime_config_from_args,
    value_source,
)
from launch.core import SamplingParams, SchedulerOutput
from launch.paths import output_file_problem, write_output_file
from launch.worker import StepResult


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of the model's weights as a decode step reads them.

    dense: every parameter except routed experts and the embedding table; embed_row: one
    embedding row; per_slot: one routed expert slot (w13 + w2), per MoE layer [L_moe].
    dense_params / slot_params: the same as parameter counts (what one token multiplies by).
    """

    dense: int
    embed_row: int
    per_slot: tuple[int, ...]
    dense_params: int = 0
    slot_params: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecodeResult:
    """One batch size's figures (times are medians over the timed steps)."""

    batch_size: int
    step_ms: float
    step_cpu_ms: float
    worker_ms: float
    tokens_per_s: float
    mean_context_len: float
    experts_touched_per_layer: float
    weight_bytes: int
    kv_bytes: int
    bytes_read: int
    bound_ms: float
    ratio: float
    gflop: float = 0.0
    compute_bound_ms: float = 0.0
    cpu_ratio: float = 0.0  # step CPU time / bound
    roof_ms: float = 0.0  # max(bandwidth bound, compute bound)
    cpu_roof_ratio: float = 0.0  # step CPU time / roof
    read_bound_ms: float = 0.0  # the bytes at the fastest read measured (moe_layer.measure_read_bandwidth)
    cpu_read_ratio: float = 0.0  # step CPU time / read_bound_ms
    fused_off_cpu_ms: float | None = None  # --ab-fused-ops: median CPU ms of the steps with the fused ops off
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # per step, by kind of work (--breakdown)


# (wall seconds, CPU seconds of this process, the step's SchedulerOutput, the rank-0 StepResult)
TimedStep = tuple[float, float, SchedulerOutput, StepResult]


class RecordingExecutor:
    """Wraps an executor so the benchmark sees each step's batch and worker results."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_nodes = inner.num_nodes
        self.last: tuple[SchedulerOutput, list[StepResult]] | None = None

    def execute(self, output: SchedulerOutput, collect_load: bool) -> list[StepResult]:
        results = self.inner.execute(output, True)  # always collect: slot load counts touched experts
        self.last = (output, results)
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def measure_copy_bandwidth(num_bytes: int = 256 * 1024**2, repeats: int = 10,
                           device: torch.device | None = None) -> float:
    """Bytes/s of a large tensor copy on ``device`` (default CPU), counting read + write bytes (best
    of ``repeats``; on CUDA timed with events, from a synchronized start)."""
    if num_bytes < 1024 or repeats < 1:
        raise ValueError(f"need num_bytes >= 1024 and repeats >= 1, got {num_bytes}, {repeats}")
    device = device or torch.device("cpu")
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            from launch.bench.moe_layer import cuda_seconds

            seconds = cuda_seconds(lambda: dst.copy_(src))
        else:
            started = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - started
        best = min(best, seconds)
    return 2 * src.numel() * src.element_size() / best


def compute_weight_bytes(model: torch.nn.Module) -> WeightBytes:
    """Split ``moe.model.MoEModel``'s parameters into dense bytes, one embedding row and one
    routed-expert slot per MoE layer (with ``--quantization``, the bytes of the copy the kernel reads)."""
    embed = model.model.embed_tokens.weight
    expert_params = set()
    per_slot = []
    for layer in model.moe_layers():
        w13, w2 = layer.experts.w13, layer.experts.w2
        expert_params.update((id(w13), id(w2)))
        packed = layer.experts.packed_weights() if layer.experts.quantization else None
        if packed is not None:  # int8 experts: the kernel reads its packed copy (int8 and the scales)
            per_slot.append(packed.nbytes() // w13.shape[0])
        else:
            per_slot.append(w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size())
    dense_tensors = [p for p in model.parameters() if id(p) not in expert_params and p is not embed]
    if model.config.tie_word_embeddings:
        dense_tensors.append(embed)  # lm_head reads the whole (shared) table
    slot_params = tuple(layer.experts.w13[0].numel() + layer.experts.w2[0].numel() for layer in model.moe_layers())
    return WeightBytes(sum(p.numel() * p.element_size() for p in dense_tensors), embed.shape[1] * embed.element_size(),
                       tuple(per_slot), sum(p.numel() for p in dense_tensors), slot_params)


def measure_matmul_flops(dtype: torch.dtype, size: int = 1024, repeats: int = 5,
                         device: torch.device | None = None) -> tuple[float, str]:
    """(FLOP/s, what was timed): the compute rate the compute bound divides by, that of the
    fastest GEMM path the model may run on this machine: PyTorch's square ``size`` matmul in
    ``dtype``, its ``linear`` (``x @ w.T``, what the model's PyTorch layers call) on 96 rows of a
    ``size`` x ``size`` weight, and (on CPU, when built) the packed linear kernel on the same.
    Best of ``repeats`` each (fewer where a path is slow here: ``best_call_seconds``). The linear
    counts where the square matmul has no fast kernel: float16 and bfloat16 matmuls on CPUs
    without their instructions ran at ~0.9 GFLOP/s on an AVX2 Zen 3 against ~10-13 for the
    linear. On CUDA: an 8192^3 matmul on the GPU, CUDA events."""
    from moe import kernels
    from parallel.costmodel.microbench import best_call_seconds

    device = device or torch.device("cpu")
    if device.type == "cuda":
        from launch.bench.moe_layer import cuda_matmul_flops

        n = 8192
        return cuda_matmul_flops(dtype, device, n, repeats), f"torch matmul {n}^3 on {torch.cuda.get_device_name(device)}"
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    x = a[:96].contiguous()
    rates = {"torch matmul": 2 * size**3 / best_call_seconds(lambda: a @ b, repeats=repeats),
             "torch linear": 2 * 96 * size * size / best_call_seconds(lambda: torch.nn.functional.linear(x, b),
                                                                      repeats=repeats)}
    if dtype in (torch.float32, torch.bfloat16) and kernels.is_available():
        packed = kernels.pack_linear(b)
        seconds = best_call_seconds(lambda: kernels.linear_forward(x, packed), repeats=repeats)
        rates[f"linear kernel, isa {kernels.isa()}"] = 2 * 96 * size * size / seconds
    name = max(rates, key=rates.__getitem__)
    return rates[name], name


def attention_flops_per_key(config: Any) -> int:
    """FLOPs one query token spends on one cached key over all layers: scores plus the weighted
    sum of values (MLA's absorbed decode attends over the latent: kv_lora + rope wide keys,
    kv_lora wide values)."""
    if config.attention == "mla":
        width = 2 * config.kv_lora_rank + config.qk_rope_head_dim
    else:
        width = 2 * config.head_dim
    return 2 * config.num_hidden_layers * config.num_attention_heads * width


def attended_keys(context_len: int, sliding_window: int | None) -> int:
    """Keys a decode query at the end of a ``context_len``-token context attends to: all of them,
    or with a sliding window w the last w (``moe.layers.paged``: blocks wholly before the window
    are not read)."""
    return context_len if sliding_window is None else min(context_len, sliding_window)


def step_flops(output: SchedulerOutput, weights: WeightBytes, top_k: int, flops_per_key: int,
               sliding_window: int | None = None) -> int:
    """Multiply-add FLOPs of one decode step: every token through the dense weights and its
    top-k experts per MoE layer, plus attention over its context (its window's keys)."""
    seqs = output.batches[0].seqs
    per_token = weights.dense_params + top_k * sum(weights.slot_params)
    return 2 * len(seqs) * per_token + flops_per_key * sum(attended_keys(s.context_len, sliding_window) for s in seqs)


def step_bytes(output: SchedulerOutput, result: StepResult, weights: WeightBytes,
               kv_bytes_per_token: int, sliding_window: int | None = None) -> tuple[int, int, float]:
    """(weight bytes, KV bytes, mean distinct slots touched per MoE layer) of one decode step; with
    a ``sliding_window`` each sequence's KV is only its window's entries.
    result.slot_load: [L_moe, P] int64 assignments per physical slot this step."""
    seqs = output.batches[0].seqs
    touched = [0] * len(weights.per_slot)
    if weights.per_slot:
        if result.slot_load is None:
            raise RuntimeError("the worker returned no slot load: cannot count touched experts")
        touched = (result.slot_load > 0).sum(dim=1).tolist()
    weight = weights.dense + len(seqs) * weights.embed_row + sum(n * b for n, b in zip(touched, weights.per_slot))
    kv = sum(attended_keys(s.context_len, sliding_window) for s in seqs) * kv_bytes_per_token
    return weight, kv, sum(touched) / max(len(touched), 1)


def num_prefill_steps(batch_size: int, context_len: int, max_num_batched_tokens: int) -> int:
    """Steps the scheduler needs to prefill the batch. Sequences prefilled early decode in the later
    steps (so they need that many more tokens of headroom), and their decode tokens come first out of
    each step's token budget: with thousands of sequences decoding, the rest of the batch prefills
    from what they leave (a batch near the budget prefills over many more steps than tokens / budget).
    The scheduler's chunked prefill fills sequences in order; so does this count."""
    total, budget = batch_size * context_len, max_num_batched_tokens
    prefilled, steps = 0, 0
    while prefilled < total:
        decoding = prefilled // context_len  # whole sequences prefilled by the earlier steps
        room = budget - decoding
        if room <= 0:  # a budget below the batch (bench overhead sizes its pool with this before its checks)
            raise ValueError(f"a budget of {budget} tokens a step cannot prefill {batch_size} sequences")
        prefilled = min(total, prefilled + room)
        steps += 1
    return steps


def run_batch(engine: Any, recorder: RecordingExecutor, batch_size: int, context_len: int, steps: int,
              warmup_steps: int, *, vocab: Sequence[int], seed: int,
              breakdown: dict[str, float] | None = None, fused_off: list[float] | None = None,
              set_fused: Callable[[bool], Any] | None = None) -> list[TimedStep]:
    """Prefill ``batch_size`` requests, then time ``steps`` pure decode steps. Returns per timed
    step (wall seconds, CPU seconds of this process, its SchedulerOutput, the rank-0 StepResult).
    Given a ``breakdown`` dict, ``steps`` more decode steps then run under torch.profiler and
    fill it with ``profile_steps``' CPU ms per step by kind of work. Given ``fused_off`` (and
    ``set_fused(on)``), every timed step is followed by one with the fused ops off, whose CPU
    seconds go to ``fused_off`` (an untimed step after each switch settles the decode plan)."""
    rng = random.Random(seed)
    budget = engine.config.engine.max_num_batched_tokens
    extra = (steps if breakdown is not None else 0) + (3 * steps if fused_off is not None else 0)
    max_tokens = warmup_steps + steps + extra + num_prefill_steps(batch_size, context_len, budget) + 2
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = []
    for _ in range(batch_size):
        request_id = engine.next_request_id()
        engine.add_request(request_id, [rng.choice(vocab) for _ in range(context_len)], params)
        ids.append(request_id)
    timed: list[TimedStep] = []
    decode_steps, max_steps = 0, warmup_steps + steps + 4 * (batch_size * context_len // 64 + 8)
    for _ in range(max_steps):
        started, cpu = time.perf_counter(), time.process_time()
        engine.step()
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        output, results = recorder.last
        if _decoded_every_sequence(recorder, batch_size):
            decode_steps += 1
            if decode_steps > warmup_steps:
                timed.append((wall, cpu, output, results[0]))
                if fused_off is not None and set_fused is not None:
                    fused_off.append(_step_with_fused_off(engine, recorder, set_fused, batch_size))
        if len(timed) == steps:
            break
    if breakdown is not None and len(timed) == steps:
        breakdown.update(profile_steps(engine, steps))
    for request_id in ids:
        engine.abort_request(request_id)
    if len(timed) < steps:
        raise RuntimeError(f"batch size {batch_size}: only {len(timed)} of {steps} steps decoded all "
                           f"{batch_size} sequences (preemption? raise --num-kv-blocks)")
    return timed


def _decoded_every_sequence(recorder: RecordingExecutor, batch_size: int) -> bool:
    """Whether the last step was a pure decode step of all ``batch_size`` sequences."""
    batch = recorder.last[0].batches[0]
    return batch.num_seqs == batch_size and batch.num_tokens == batch_size


def _step_with_fused_off(engine: Any, recorder: RecordingExecutor, set_fused: Callable[[bool], Any],
                         batch_size: int) -> float:
    """One engine step with the fused ops off; its CPU seconds. Raises if a step was not a pure decode step.

    Each switch changes what the model's decode plan resolved (``moe.decode_plan``), so the first
    step after it rebuilds the plan: an untimed step follows each switch (off, then back on), and
    neither side's timed steps pay for the other's plan."""

    def decode_step(what: str) -> None:
        engine.step()
        if not _decoded_every_sequence(recorder, batch_size):
            raise RuntimeError(f"batch size {batch_size}: a step {what} did not decode every sequence")

    set_fused(False)
    try:
        decode_step("with the fused ops off")  # untimed: it rebuilds the plan
        started = time.process_time()
        decode_step("with the fused ops off")
        cpu = time.process_time() - started
    finally:
        set_fused(True)
    decode_step("after the fused ops came back on")  # untimed: the plan for the fused ops again
    return cpu


def summarize_batch(batch_size: int, timed: list[TimedStep], weights: WeightBytes, kv_bytes_per_token: int,
                    bandwidth: float, *, top_k: int = 0, flops_per_key: int = 0,
                    matmul_flops: float = 0.0, sliding_window: int | None = None,
                    read_bandwidth: float = 0.0) -> DecodeResult:
    """Medians of the timed steps against the bandwidth bound (and, given the matmul rate,
    the compute bound: step FLOPs / ``matmul_flops``; given ``read_bandwidth``, the bytes at that
    read rate); ``sliding_window``: the model's attention window (KV read and attended per
    sequence: at most that many tokens)."""
    per_step = [step_bytes(out, res, weights, kv_bytes_per_token, sliding_window) for _, _, out, res in timed]
    flops = statistics.mean(step_flops(out, weights, top_k, flops_per_key, sliding_window) for _, _, out, _ in timed)
    weight = round(statistics.mean(w for w, _, _ in per_step))
    kv = round(statistics.mean(k for _, k, _ in per_step))
    step_s = statistics.median(wall for wall, _, _, _ in timed)
    cpu_s = statistics.median(cpu for _, cpu, _, _ in timed)
    bound_s = (weight + kv) / bandwidth
    compute_s = flops / matmul_flops if matmul_flops > 0 else 0.0
    roof_s = max(bound_s, compute_s)
    read_s = (weight + kv) / read_bandwidth if read_bandwidth > 0 else 0.0
    return DecodeResult(
        batch_size=batch_size, step_ms=step_s * 1e3, step_cpu_ms=cpu_s * 1e3,
        worker_ms=statistics.median(res.seconds for _, _, _, res in timed) * 1e3,
        tokens_per_s=batch_size / step_s,
        mean_context_len=statistics.mean(s.context_len for _, _, out, _ in timed for s in out.batches[0].seqs),
        experts_touched_per_layer=statistics.mean(t for _, _, t in per_step),
        weight_bytes=weight, kv_bytes=kv, bytes_read=weight + kv, bound_ms=bound_s * 1e3, ratio=step_s / bound_s,
        gflop=flops / 1e9, compute_bound_ms=compute_s * 1e3, cpu_ratio=cpu_s / bound_s, roof_ms=roof_s * 1e3,
        cpu_roof_ratio=cpu_s / roof_s, read_bound_ms=read_s * 1e3, cpu_read_ratio=cpu_s / read_s if read_s else 0.0,
    )


def format_table(rows: Sequence[DecodeResult], bandwidth: float, matmul_flops: float, matmul_name: str = "",
                 read_bandwidth: float = 0.0) -> str:
    read = read_bandwidth > 0
    head = (f"{'batch':>6} {'step ms':>9} {'cpu ms':>8} {'worker ms':>10} {'tok/s':>9} {'ctx':>6} {'experts/layer':>14} "
            f"{'weights MB':>11} {'KV MB':>8} {'bound ms':>9} {'ratio':>7} {'cpu ratio':>9} {'GFLOP':>7} "
            f"{'compute ms':>11} {'cpu/roof':>9}" + (f" {'cpu/read':>9}" if read else ""))
    fastest = (f"; fastest read: {read_bandwidth / 1e9:.1f} GB/s (cpu/read: CPU ms over the bytes read at that rate)"
               if read else "")
    lines = [f"# copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s (the bound's){fastest}; "
             f"compute: {matmul_flops / 1e9:.1f} GFLOP/s ({matmul_name or 'matmul'}); roof = max(bound, compute)", head]
    for r in rows:
        lines.append(f"{r.batch_size:>6} {r.step_ms:>9.2f} {r.step_cpu_ms:>8.2f} {r.worker_ms:>10.2f} {r.tokens_per_s:>9.1f} "
                     f"{math.floor(r.mean_context_len + 0.5):>6d} {r.experts_touched_per_layer:>14.1f} {r.weight_bytes / 1e6:>11.1f} "
                     f"{r.kv_bytes / 1e6:>8.2f} {r.bound_ms:>9.2f} {r.ratio:>7.2f} {r.cpu_ratio:>9.2f} {r.gflop:>7.2f} "
                     f"{r.compute_bound_ms:>11.2f} {r.cpu_roof_ratio:>9.2f}" + (f" {r.cpu_read_ratio:>9.2f}" if read else ""))
    under = [r.batch_size for r in rows if r.ratio < 0.95]  # wall time: on CUDA cpu ms is the host's alone
    if under:  # a step that reads its bytes faster than the copy ran: the ratios are not against DRAM's rate
        lines.append(f"# note: batch {', '.join(map(str, under))} stepped faster than its bandwidth floor: the copy "
                     f"({bandwidth / 1e9:.1f} GB/s) ran slow this time (other load on the machine? rerun), or the "
                     "step's bytes sit in a cache the copy's --copy-mib does not fit")
    with_ab = [r for r in rows if r.fused_off_cpu_ms]
    if with_ab:
        lines += ["", "# fused small ops on vs off (their PyTorch ops), alternating steps of this run: median CPU ms",
                  f"{'batch':>6} {'cpu ms on':>10} {'cpu ms off':>11} {'off / on':>9} {'on / bound':>11} "
                  f"{'off / bound':>12}"]
        lines += [f"{r.batch_size:>6} {r.step_cpu_ms:>10.2f} {r.fused_off_cpu_ms:>11.2f} "
                  f"{r.fused_off_cpu_ms / r.step_cpu_ms:>9.2f} {r.cpu_ratio:>11.2f} "
                  f"{r.fused_off_cpu_ms / r.bound_ms:>12.2f}" for r in with_ab]
    with_breakdown = [r for r in rows if r.breakdown_ms]
    if with_breakdown:
        kinds = list(with_breakdown[0].breakdown_ms)
        lines += ["", "# CPU ms per decode step by kind of work (torch.profiler, self time on the stepping thread; "
                  "'outside ops' = that thread's CPU time no op accounts for: Python, scheduler, sampler, and the "
                  "profiler's own cost per op; at one thread 'total' exceeds the table's cpu ms by it, most where "
                  "steps are short; with more, the other threads' CPU inside the ops is in no column)", f"{'batch':>6} " + " ".join(f"{k:>14}" for k in kinds)]
        lines += [f"{r.batch_size:>6} " + " ".join(f"{r.breakdown_ms[k]:>14.2f}" for k in kinds) for r in with_breakdown]
    return "\n".join(lines)


# profiler op name -> kind of work in the --breakdown table (anything else: "other ops")
BREAKDOWN_KINDS = {
    "moe_kernels::experts_forward": "experts kernel", "moe_kernels::experts_forward_topk": "experts kernel",
    "moe_kernels::linear_forward": "linear kernel",
    "moe_kernels::mla_decode": "attention kernel", "moe_kernels::gqa_decode": "attention kernel",
    # the whole-block ops (their projections, attention, router and experts run inside them)
    "moe_kernels::mla_decode_attention": "attention op", "moe_kernels::gqa_decode_attention": "attention op",
    "moe_kernels::moe_ffn": "MoE FFN op",
    "aten::mm": "torch GEMMs", "aten::addmm": "torch GEMMs", "aten::bmm": "torch GEMMs",
    "aten::_grouped_mm": "torch GEMMs",
    "aten::index_select": "gather/scatter", "aten::index": "gather/scatter", "aten::index_put_": "gather/scatter",
    "aten::index_copy_": "gather/scatter", "aten::scatter_add_": "gather/scatter", "aten::index_add_": "gather/scatter",
    "aten::copy_": "copies/casts", "aten::_to_copy": "copies/casts",
}


@contextlib.contextmanager
def _stderr_fd_quiet() -> Iterator[None]:
    """File descriptor 2 onto /dev/null for the block (what C++ writes there included), then back."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_steps(engine: Any, steps: int) -> dict[str, float]:
    """CPU ms per engine step by kind of work (``BREAKDOWN_KINDS``, self CPU time of each op,
    plus "outside ops": the stepping thread's CPU time no op accounts for), over ``steps`` steps.
    The profiler times each op on the thread that calls it; with intra-op threads the others' CPU
    inside the ops is not in any column (the process's CPU time counted it as "outside ops": 22 of
    a 43 ms step at two threads)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _stderr_fd_quiet():  # kineto's "USDT: ... profiler_start" lines, written from C++
        prof.start()
    try:
        started = time.thread_time()
        for _ in range(steps):
            engine.step()
        cpu = time.thread_time() - started
    finally:
        with _stderr_fd_quiet():
            prof.stop()
    kinds = dict.fromkeys(["attention op", "MoE FFN op", "experts kernel", "linear kernel", "attention kernel",
                           "torch GEMMs", "gather/scatter", "copies/casts", "other ops"], 0.0)
    for event in prof.key_averages():
        kinds[BREAKDOWN_KINDS.get(event.key, "other ops")] += event.self_cpu_time_total / 1e3
    in_ops = sum(kinds.values())
    kinds["outside ops"] = max(0.0, cpu * 1e3 - in_ops)
    kinds["total"] = max(cpu * 1e3, in_ops)
    return {k: v / steps for k, v in kinds.items()}


DEFAULT_BATCH_SIZES = (1, 8, 32, 128)


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m launch bench decode", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_runtime_args(parser, server=False, dtype_default=BENCH_DTYPE)
    restate_defaults(parser, {"max_num_seqs": "the largest --batch-sizes",
                              "max_num_batched_tokens": "the largest --batch-sizes + 8192, at least 8192"})
    g = parser.add_argument_group("benchmark")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                   help=f"batch sizes to time (default: {' '.join(map(str, DEFAULT_BATCH_SIZES))}, those that "
                        "max_num_seqs, max_num_batched_tokens, max_model_len and the KV pool allow)")
    g.add_argument("--context-len", type=int, default=128, help="prompt tokens per sequence before decoding")
    g.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="untimed decode steps first (default 3; with --cuda-graphs on a CUDA device, enough for "
                        "the batch's graph to be recorded: moe.cuda_graphs.CAPTURE_AFTER + 1)")
    g.add_argument("--copy-mib", type=int, default=256, help="tensor size of the bandwidth measurement")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the result JSON here")
    g.add_argument("--ab-fused-ops", action="store_true",
                   help="also time each batch size with the small fused CPU ops off (their PyTorch ops), "
                        "alternating with the timed steps, and print both medians")
    g.add_argument("--breakdown", action="store_true",
                   help="after the timed steps, profile as many more and split their CPU time by kind of work "
                        "(attention op: MLA's or GQA's whole decode attention, MoE FFN op, experts kernel, linear kernel, attention kernel, "
                        "torch GEMMs, gathers, casts, other ops, outside ops)")
    return parser


def check_step_flags(args: argparse.Namespace, positive: tuple[str, ...]) -> None:
    """ValueError naming the first of the flags ``positive`` (attribute names) below 1, a negative
    ``--warmup-steps`` or a ``--num-threads`` below 1 (the step benchmarks' shared flags)."""
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")


def check_batch_fits(args: argparse.Namespace, config: RuntimeConfig, batch: int, limit: str, subject: str) -> None:
    """ValueError unless the engine's max_num_seqs and max_num_batched_tokens each take ``batch``
    sequences' decode tokens in one step (``limit`` names the flag that asked for the batch, ``subject``
    the batch), naming where the short value came from (``value_source``)."""
    for dest in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(config.engine, dest)
        if value < batch:  # else every step runs, none decodes the whole batch, and only then the error
            raise ValueError(f"{value_source(args, dest)} {value} < {limit}: {subject} could never decode in one step")


def _check_args(args: argparse.Namespace) -> None:
    if args.warmup_steps is None:
        from moe.cuda_graphs import CAPTURE_AFTER

        # graphs are recorded only on a CUDA device (elsewhere the worker says it decodes without them)
        graphs = getattr(args, "cuda_graphs", None) and torch.cuda.is_available()
        args.warmup_steps = CAPTURE_AFTER + 1 if graphs else 3
    check_step_flags(args, ("context_len", "steps", "copy_mib"))
    if any(b < 1 for b in args.batch_sizes):
        raise ValueError(f"--batch-sizes must all be >= 1, got {args.batch_sizes}")
    if (problem := repeated_value_problem("--batch-sizes", args.batch_sizes)) is not None:
        raise ValueError(problem)
    if args.json is not None and (problem := output_file_problem(args.json)) is not None:
        raise ValueError(f"--json: {problem}")  # now, not after the whole benchmark


def build_config(args: argparse.Namespace) -> RuntimeConfig:
    """The runtime config with decode-bench defaults for flags not given: room for the
    largest batch (max_num_seqs, KV blocks) so no step is preempted. Everything the run needs is
    checked here, before any weights load (ValueError / ConfigError / FileNotFoundError naming the
    problem): the flags, what the engine would refuse (``check_runtime_config``), every sequence's
    tokens against max_model_len, and every batch's KV against the pool: ``--num-kv-blocks``, else
    what the memory budget holds (``--memory``, or the engine's default), as the engine sizes it."""
    from launch.engine import DEFAULT_CPU_MEMORY, check_runtime_config

    defaulted = args.batch_sizes is None  # the defaults are cut to what the config allows, not refused
    if defaulted:
        args.batch_sizes = list(DEFAULT_BATCH_SIZES)
    _check_args(args)
    biggest = max(args.batch_sizes)
    # the benchmark's dtype whatever the checkpoint stores; room to prefill beside the batch's decode
    # tokens (num_prefill_steps); unless flags, --config or --set say otherwise
    fill_unset(args, {"dtype": BENCH_DTYPE, "max_num_batched_tokens": max(8192, biggest + 8192),
                      "max_num_seqs": max(biggest, 1)})
    config = runtime_config_from_args(args)
    if config.parallel.world_size != 1:
        raise ValueError("bench decode runs one in-process rank (tensor_parallel_size = data_parallel_size = 1)")
    e = config.engine
    if defaulted:
        _keep_batch_sizes(args, lambda b: b <= min(e.max_num_seqs, e.max_num_batched_tokens))
        biggest = max(args.batch_sizes)
    check_batch_fits(args, config, biggest, f"the largest --batch-sizes {biggest}", "that batch")
    plan = check_runtime_config(config)  # model path, layout, KV budget (--memory), before any weights load
    max_len = plan.max_model_len
    tokens = {b: seq_tokens(args, b, e.max_num_batched_tokens) for b in args.batch_sizes}
    if defaulted:
        _keep_batch_sizes(args, lambda b: tokens[b] <= max_len)
    too_long = sorted(b for b in args.batch_sizes if tokens[b] > max_len)
    if too_long:
        b = too_long[0]
        raise ValueError(f"--context-len {args.context_len} + {tokens[b] - args.context_len} tokens decoded per "
                         f"sequence (warm-up, timed and profiled steps, prefill headroom at batch size {b}) = "
                         f"{tokens[b]} exceeds max_model_len={max_len} (the model's max_position_embeddings unless "
                         "--max-model-len)")
    need = {b: b * -(-tokens[b] // e.block_size) for b in args.batch_sizes}
    pool = plan.num_kv_blocks  # --num-kv-blocks, else what the memory budget holds
    if e.memory is not None:
        budget = f"--memory {e.memory}"
    else:
        budget = "the GPU's memory" if torch.cuda.is_available() else f"the engine's default {DEFAULT_CPU_MEMORY}"
    source = (f"--num-kv-blocks {e.num_kv_blocks}" if e.num_kv_blocks is not None
              else f"the {pool} that {budget} x memory_utilization {e.memory_utilization:g} holds after the weights")
    if defaulted:
        _keep_batch_sizes(args, lambda b: need[b] <= pool)
        biggest = max(args.batch_sizes)
    too_big = sorted(b for b in args.batch_sizes if need[b] > pool)
    if too_big:
        b = too_big[0]
        raise ValueError(f"--batch-sizes {b}: {b} sequences x {tokens[b]} tokens need {need[b]} KV blocks of "
                         f"{e.block_size}, more than {source}: lower the batch size or --context-len, or raise "
                         f"{'--num-kv-blocks' if e.num_kv_blocks is not None else '--memory'}")
    if e.num_kv_blocks is None:  # only what the largest batch uses (and a spare block), within the budget
        config = replace(config, engine=replace(e, num_kv_blocks=min(need[biggest] + 1, pool)))
    return config


def _keep_batch_sizes(args: argparse.Namespace, fits: Callable[[int], bool]) -> None:
    """Drop the default batch sizes that do not fit; the smallest stays (its check then names the
    problem, as for sizes the user gave)."""
    args.batch_sizes = [b for b in args.batch_sizes if fits(b)] or args.batch_sizes[:1]


def seq_tokens(args: argparse.Namespace, batch_size: int, max_num_batched_tokens: int) -> int:
    """Tokens one sequence of a ``batch_size`` batch can reach in the run: its prompt, the decode
    steps (warm-up, timed, profiled) and the ones it decodes while the rest of the batch prefills."""
    headroom = num_prefill_steps(batch_size, args.context_len, max_num_batched_tokens) + 4
    profiled = (args.steps if args.breakdown else 0) + (3 * args.steps if args.ab_fused_ops else 0)
    return args.context_len + args.warmup_steps + args.steps + profiled + headroom


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = build_config(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    from launch.engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except (ConfigError, ValueError) as e:  # e.g. no room for the KV cache in --memory
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        recorder = RecordingExecutor(engine.executor)
        engine.executor = recorder
        mc, worker = engine.model_config, recorder.inner.worker
        # on the rank's device (the GPU when the worker runs on CUDA)
        bandwidth = measure_copy_bandwidth(args.copy_mib * 1024**2, device=worker.device)
        matmul_flops, matmul_name = measure_matmul_flops(worker.dtype, device=worker.device)
        from launch.bench.moe_layer import measure_read_bandwidth

        read_bandwidth = measure_read_bandwidth(device=worker.device)
        weights = compute_weight_bytes(worker.model)
        kv_per_token = mc.kv_bytes_per_token(worker.kv_cache.pools[0].element_size())
        vocab = [t for t in range(mc.vocab_size) if t not in engine.eos_token_ids]
        rows = []
        for b in args.batch_sizes:
            breakdown: dict[str, float] | None = {} if args.breakdown else None
            fused_off: list[float] | None = [] if args.ab_fused_ops else None
            timed = run_batch(engine, recorder, b, args.context_len, args.steps, args.warmup_steps,
                              vocab=vocab, seed=config.engine.seed + b, breakdown=breakdown, fused_off=fused_off,
                              set_fused=worker.model.set_fused_ops)
            row = summarize_batch(b, timed, weights, kv_per_token, bandwidth, top_k=mc.num_experts_per_tok,
                                  flops_per_key=attention_flops_per_key(mc), matmul_flops=matmul_flops,
                                  sliding_window=mc.sliding_window, read_bandwidth=read_bandwidth)
            off_ms = statistics.median(fused_off) * 1e3 if fused_off else None
            rows.append(replace(row, breakdown_ms=breakdown or {}, fused_off_cpu_ms=off_ms))
    except (ValueError, RuntimeError) as e:  # e.g. a batch that never decoded together: one line, as bench overhead
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()
    if worker.device.type == "cuda":
        print(f"# device {torch.cuda.get_device_name(worker.device)}, torch {torch.__version__}: step ms is wall "
              "time to the step's tokens on the host; cpu ms the driver's CPU time")
    quant = f", {config.engine.quantization} experts" if config.engine.quantization else ""
    from moe import kernels

    isa, modes, asks = None, None, None
    if worker.device.type == "cpu" and kernels.is_available():
        isa, modes, asks = kernels.isa(), kernels.tile_modes_text(), kernels.attention_asks_text()
    kernel = (f"; kernel isa {isa}" + (f", tiles [{modes}]" if modes else "")
              + (f", decode attention asks {asks}" if asks else "")) if isa else ""
    print(f"# {config.model}: {engine.dtype}{quant}, KV cache {config.engine.kv_cache_dtype}, "
          f"{torch.get_num_threads()} thread(s){kernel}")
    print(format_table(rows, bandwidth, matmul_flops, matmul_name, read_bandwidth))
    if args.json:
        result = {"model": config.model, "dtype": engine.dtype, "quantization": config.engine.quantization,
                  "kv_cache_dtype": config.engine.kv_cache_dtype, "num_threads": torch.get_num_threads(),
                  "device": str(worker.device), "isa": isa, "tile_modes": modes, "attention_asks": asks,
                  "context_len": args.context_len, "steps": args.steps, "copy_bandwidth_bytes_per_s": bandwidth,
                  "read_bandwidth_bytes_per_s": read_bandwidth,
                  "matmul_flops_per_s": matmul_flops, "matmul_path": matmul_name,
                  "dense_weight_bytes": weights.dense, "expert_slot_bytes": list(weights.per_slot),
                  "kv_bytes_per_token": kv_per_token, "results": [asdict(r) for r in rows]}
        write_output_file(args.json, json.dumps(result, indent=2) + "\n")
    return 0
