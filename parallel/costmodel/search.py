"""Which layout? Enumerate layouts of a model on a cluster, rank them by goodput per GPU.

For every instance size (1..N nodes), TP degree, expert-parallel span, redundant-expert
count and two-batch overlap on/off, the search finds the largest decode batch per DP rank
whose mean time between tokens meets the TPOT objective and whose prompt prefill meets
the TTFT objective, within what KV capacity allows. Serving is colocated: every
``output_len`` decode steps each sequence also needs its prompt prefilled, so the mean
time per output token is ``decode_step + (B / output_len) x prefill_of_one_prompt``.
Goodput per GPU = output tokens/s of the instance meeting both objectives / its GPUs.
A layout that meets no point is ranked by how near it comes: those that fit in memory first,
each by ``miss_ratio`` (predicted / objective of the objective it misses first).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from moe.config import ModelConfig
from parallel.costmodel.deployment import Deployment
from parallel.costmodel.experts import RankLoad
from parallel.costmodel.hardware import Hardware
from parallel.costmodel.memory import kv_bytes_per_token_per_rank, kv_capacity_tokens, weight_bytes_per_rank
from parallel.costmodel.predict import build_rank_load
from parallel.costmodel.step import decode_work, predict_phase, prefill_work

BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True)
class SLO:
    """Objectives in ms; None means unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


@dataclass(frozen=True)
class Candidate:
    """One layout's best operating point (or why it has none).

    An infeasible layout's ``bound`` says why; ``fits_memory`` is False when one sequence's KV
    does not fit beside the weights, and ``miss_ratio`` (> 1) is how far it misses: memory needed /
    usable, else the predicted TTFT (or TPOT of one sequence per rank) / its objective. Its
    ``tpot_ms`` and ``decode_step_ms`` are those of one sequence when TPOT ruled it out."""

    deployment: Deployment
    feasible: bool
    batch_size: int = 0
    tpot_ms: float = 0.0
    decode_step_ms: float = 0.0
    ttft_ms: float = 0.0
    goodput_per_gpu: float = 0.0
    balancedness: float = 1.0
    bound: str = ""
    decode_bound: str = ""
    kv_capacity_tokens: int = 0
    fits_memory: bool = True
    miss_ratio: float = 0.0


def enumerate_layouts(cfg: ModelConfig, num_nodes: int, gpus_per_node: int, base: Deployment) -> list[Deployment]:
    """Layouts of one instance on 1..num_nodes nodes: TP in powers of two dividing a node's GPUs
    and the heads, and (GQA) dividing or a multiple of the kv heads, as the runtime takes; EP over
    the whole instance (what ``parallel.enable_expert_parallel`` lays out: the runtime has no EP
    group smaller than its world) or none (every rank holds every expert), the
    fewest redundant slots that split evenly and one more slot per rank, two-batch overlap on and
    off when experts are spread."""
    out = []
    tps = [t for t in (1, 2, 4, 8, 16) if gpus_per_node % t == 0 and cfg.tensor_parallel_problem(t) is None]
    for nodes, tp in itertools.product(range(1, num_nodes + 1), tps):
        world = nodes * gpus_per_node
        eps = sorted({world, 1})
        for ep in eps:
            if world % ep:
                continue
            pad = (-cfg.num_experts) % ep
            redundant = [pad] if ep == 1 else sorted({pad, pad + ep})
            for extra, tbo in itertools.product(redundant, (False, True) if ep > 1 else (False,)):
                out.append(replace(base, tp=tp, dp=world // tp, ep=ep, num_nodes=nodes, num_redundant_experts=extra,
                                   enable_eplb=ep > 1, enable_two_batch_overlap=tbo, kv_capacity_tokens=None))
    return out


def _prompt_prefill_ms(cfg: ModelConfig, dep: Deployment, hw: Hardware, rank_load: RankLoad | None,
                       input_len: int, prefix_len: int) -> float:
    new = max(1, input_len - prefix_len)
    chunks = -(-new // dep.max_num_batched_tokens)
    per_chunk = min(new, dep.max_num_batched_tokens)
    work = prefill_work(per_chunk, input_len, prefix_len, cfg.sliding_window)
    step = predict_phase(cfg, dep, hw, rank_load, work, decode=False)
    return chunks * step.step_ms


def evaluate(cfg: ModelConfig, dep: Deployment, hw: Hardware, slo: SLO, *, input_len: int, output_len: int,
             prefix_len: int = 0, rank_load: RankLoad | None = None) -> Candidate:
    """The best batch of one layout under ``slo`` (see the module docstring)."""
    capacity = kv_capacity_tokens(cfg, dep, hw.memory_bytes)
    context = input_len + output_len
    fit = capacity // context
    if fit < 1:
        need = memory_need_ratio(cfg, dep, hw.memory_bytes, context)
        return Candidate(dep, False, bound=f"memory: weights leave room for {capacity:,} KV tokens per rank, "
                                           f"not one {context:,}-token sequence ({need:.2f}x the usable memory)",
                         kv_capacity_tokens=capacity, fits_memory=False, miss_ratio=need)
    ttft = _prompt_prefill_ms(cfg, dep, hw, rank_load, input_len, prefix_len)
    if slo.ttft_ms is not None and ttft > slo.ttft_ms:
        return Candidate(dep, False, ttft_ms=ttft, bound=f"TTFT: one prompt's prefill takes {ttft:.0f} ms, over "
                                                         f"{slo.ttft_ms:g} ms", kv_capacity_tokens=capacity,
                         miss_ratio=ttft / slo.ttft_ms)
    kv_len = input_len + output_len // 2
    best = None
    for b in (x for x in BATCHES if x <= min(fit, dep.max_num_seqs)):
        step = predict_phase(cfg, dep, hw, rank_load, decode_work(b, kv_len, cfg.sliding_window), decode=True)
        tpot = step.step_ms + b / max(output_len, 1) * ttft
        if slo.tpot_ms is not None and tpot > slo.tpot_ms:
            if best is None:  # the smallest batch misses: how far, for ranking the near misses
                return Candidate(dep, False, tpot_ms=tpot, decode_step_ms=step.step_ms, ttft_ms=ttft,
                                 kv_capacity_tokens=capacity, miss_ratio=tpot / slo.tpot_ms,
                                 bound=f"TPOT: one sequence per rank takes {tpot:.1f} ms per token, over "
                                       f"{slo.tpot_ms:g} ms")
            break
        best = (b, step, tpot)
    assert best is not None, "fit >= 1 and max_num_seqs >= 1 leave batch 1 to try"
    b, step, tpot = best
    goodput = b * dep.dp / dep.world_size / (tpot / 1e3)
    nxt = [x for x in BATCHES if x > b]
    if not nxt:
        why = "batch grid end"
    elif nxt[0] > min(fit, dep.max_num_seqs):
        why = (f"KV capacity: {capacity:,} tokens per rank hold {fit} sequences" if fit < dep.max_num_seqs
               else f"max_num_seqs {dep.max_num_seqs}")
    elif slo.tpot_ms is not None:
        why = f"TPOT {slo.tpot_ms:g} ms: batch {nxt[0]} would exceed it"
    else:
        why = "batch grid end"
    return Candidate(dep, True, b, tpot, step.step_ms, ttft, goodput, rank_load.balancedness if rank_load else 1.0,
                     why, step.bound, capacity)


def memory_need_ratio(cfg: ModelConfig, dep: Deployment, memory_bytes: int, tokens: int) -> float:
    """Bytes one rank needs for its weights and the KV of ``tokens`` tokens / the bytes it may use
    (memory x utilization); above 1 when they do not fit. With a fixed ``dep.kv_capacity_tokens``:
    tokens / that capacity (inf when it is 0)."""
    if dep.kv_capacity_tokens is not None:
        return tokens / dep.kv_capacity_tokens if dep.kv_capacity_tokens else float("inf")
    usable = (dep.memory_bytes or memory_bytes) * dep.memory_utilization
    need = weight_bytes_per_rank(cfg, dep) + tokens * kv_bytes_per_token_per_rank(cfg, dep)
    return need / usable


def rank_key(c: Candidate) -> tuple:
    """Sort key, best first: feasible layouts by goodput per GPU; then those that fit in memory,
    nearest the objectives first (``miss_ratio``); then those that do not, by memory needed / usable;
    the smaller instance first among equals."""
    if c.feasible:
        return (0, -c.goodput_per_gpu, c.deployment.world_size)
    return (1 if c.fits_memory else 2, c.miss_ratio, c.deployment.world_size)


def search_layouts(cfg: ModelConfig, hw: Hardware, *, num_nodes: int, gpus_per_node: int, slo: SLO,
                   input_len: int, output_len: int, prefix_len: int = 0, base: Deployment | None = None,
                   load_skew: float = 0.0,
                   progress: Callable[[list[Deployment]], Iterable[Deployment]] | None = None,
                   kv_capacity: Callable[[Deployment], int] | None = None) -> list[Candidate]:
    """Every enumerated layout evaluated, best first (``rank_key``: by goodput per GPU, then the
    infeasible ones nearest the objectives first).
    progress: wraps the list of layouts as they are evaluated (a progress bar: the caller's).
    kv_capacity: a layout's KV tokens per rank as the engine sizes them (whole blocks: the caller's
    ``launch.hardware.compute_kv_capacity_tokens``); 0 or None: ``memory.kv_capacity_tokens``' budget."""
    base = base or Deployment()
    cache: dict[tuple, RankLoad | None] = {}
    out = []
    layouts = enumerate_layouts(cfg, num_nodes, gpus_per_node, base)
    for dep in progress(layouts) if progress is not None else layouts:
        if kv_capacity is not None and (tokens := kv_capacity(dep)):
            dep = replace(dep, kv_capacity_tokens=tokens)
        key = (dep.ep, dep.num_redundant_experts, dep.ranks_per_node, dep.enable_eplb)
        if key not in cache:
            cache[key] = build_rank_load(cfg, dep, load_skew=load_skew)
        out.append(evaluate(cfg, dep, hw, slo, input_len=input_len, output_len=output_len, prefix_len=prefix_len,
                            rank_load=cache[key]))
    return sorted(out, key=rank_key)
