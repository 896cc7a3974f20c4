"""``python -m launch bench sampler``: the token sampler's time per step, against an index sort.

    python -m launch bench sampler [--batch 32] [--vocab 1024 32000 129280]
        [--settings greedy temperature seeded top-k-top-p top-p min-p] [--num-threads 1]
        [--min-seconds 0.3] [--logit-scale 3] [--json FILE]

Times one sampler call on [batch, V] float32 logits (standard normal x ``--logit-scale``: a
flat distribution, so top-p keeps many tokens, the slow case) per setting and vocabulary size,
CPU time of this process, two implementations side by side in one run:

    ours   launch.core.sampler.Sampler (top-k / top-p from values sorted without indices,
           an inverse-CDF draw with one uniform number per row)
    sort   the same filters with one index sort of every row, then the exponential race
           argmax(probs / q), q ~ Exp(1) over the whole row, one seeded torch.Generator per
           seeded row: PyTorch-native samplers' method (vLLM's forward_native), and this
           project's sampler before

Each setting also compares the tokens both filters keep: the rows whose kept sets differ and
the most tokens by which one does. Top-p's last kept token can differ where the sort's fp32
running sum over thousands of sorted probabilities drifts (ours sums in fp64); the command
fails if any row differs by more than that one token. A token whose float32 probability is 0
counts as dropped on either side: it can never be drawn (ours drops such underflowed tokens, the
sort leaves them finite).
As in a serving worker, freed heap memory is kept for reuse (``keep_freed_heap_memory``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from launch.bench import repeated_value_problem
from launch.config_args import FlagParser
from launch.core.sampler import Sampler, apply_sampling_filters
from launch.core.sampling_params import SamplingParams
from launch.paths import output_file_problem, write_output_file

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "seeded": {"temperature": 0.8, "seed": 0},
    "top-k-top-p": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "top-k-top-p-seeded": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "seed": 0},
    "top-p": {"temperature": 0.8, "top_p": 0.9},
    "min-p": {"temperature": 0.8, "min_p": 0.05},
}
_SEED_MASK = (1 << 63) - 1


def sort_reference_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The filters the obvious way. logits: [B, V] float32 -> [B, V] tempered, dropped tokens at
    -inf: min-p mask, then (when any row has top-k or top-p) one full index sort per row, top-k
    by rank, top-p by the running sum of the softmax over the survivors in sorted order, scattered
    back."""
    vocab = logits.shape[1]
    x = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)
    if any(p.min_p_enabled for p in params):
        probs = x.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
    if not any(0 < p.top_k < vocab or p.top_p_enabled for p in params):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).unsqueeze(1)
    sorted_x = sorted_x.masked_fill(ranks >= k, float("-inf"))
    p_sorted = sorted_x.softmax(dim=-1)
    before = p_sorted.cumsum(dim=-1) - p_sorted  # probability of strictly more likely tokens
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    sorted_x = sorted_x.masked_fill((before >= top_p) & (ranks > 0) & (top_p < 1), float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


class SortSampler:
    """The baseline: ``sort_reference_filters``, then the exponential race over the whole row
    (a fresh torch.Generator per seeded row). Greedy rows take the argmax."""

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 output_indices: Sequence[int]) -> torch.Tensor:
        """logits: [B, V] float32 -> [B] int64."""
        token_ids = torch.empty(logits.shape[0], dtype=torch.int64)
        greedy = [b for b, p in enumerate(params) if p.is_greedy]
        random = [b for b, p in enumerate(params) if not p.is_greedy]
        if greedy:
            token_ids[greedy] = logits[greedy].argmax(dim=-1)
        if random:
            rows = [params[b] for b in random]
            probs = sort_reference_filters(logits[random], rows).softmax(dim=-1)
            q = torch.empty_like(probs).exponential_(generator=self._generator)
            for i, (b, p) in enumerate(zip(random, rows)):
                if p.seed is not None:
                    gen = torch.Generator().manual_seed(hash((p.seed, output_indices[b])) & _SEED_MASK)
                    q[i].exponential_(generator=gen)
            token_ids[random] = (probs / q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        return token_ids


def drawable(filtered: torch.Tensor) -> torch.Tensor:
    """filtered: [B, V] float32 logits with dropped tokens at -inf -> [B, V] bool, the tokens a draw
    can return: float32 probability > 0. A finite logit far below the row's max underflows to
    probability 0 and is as unreachable as -inf, so comparing -inf masks alone reports false
    differences at large logit scales."""
    return filtered.softmax(dim=-1) > 0


def cpu_ms_per_call(fn: Callable[[], Any], min_seconds: float) -> float:
    """CPU milliseconds per call of ``fn``: the best of 3 rounds, each repeating the call until it
    has run ``min_seconds`` of CPU time (one warm-up call first)."""
    fn()
    best = float("inf")
    for _ in range(3):
        calls, started = 0, time.process_time()
        while True:
            fn()
            calls += 1
            spent = time.process_time() - started
            if spent >= min_seconds:
                break
        best = min(best, spent / calls)
    return best * 1e3


def measure(batch: int, vocab: int, setting: str, *, min_seconds: float, logit_scale: float,
            seed: int = 0) -> dict[str, Any]:
    """One cell: ours_ms, sort_ms, speedup (sort / ours), and rows_differing / max_tokens_differing
    between the two filters' kept sets, for ``setting`` on [batch, vocab] logits."""
    gen = torch.Generator().manual_seed(seed + vocab)
    logits = torch.randn(batch, vocab, generator=gen) * logit_scale
    base = SETTINGS[setting]
    params = [SamplingParams(**{**base, "seed": b}) if "seed" in base else SamplingParams(**base)
              for b in range(batch)]
    indices = list(range(batch))
    ours, sort = Sampler(seed), SortSampler(seed)
    ours_ms = cpu_ms_per_call(lambda: ours(logits, params, indices), min_seconds)
    sort_ms = cpu_ms_per_call(lambda: sort(logits, params, indices), min_seconds)
    differ = torch.zeros(batch, dtype=torch.int64)
    if not params[0].is_greedy:
        differ = (drawable(apply_sampling_filters(logits, params))
                  ^ drawable(sort_reference_filters(logits, params))).sum(dim=-1)
    return {"batch": batch, "vocab": vocab, "setting": setting, "ours_ms": ours_ms, "sort_ms": sort_ms,
            "speedup": sort_ms / ours_ms, "rows_differing": int((differ > 0).sum()),
            "max_tokens_differing": int(differ.max())}


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'vocab':>8} {'setting':<20} {'ours ms':>10} {'sort ms':>10} {'sort/ours':>10}  kept sets"]
    for r in rows:
        kept = "equal" if r["rows_differing"] == 0 else \
            f"{r['rows_differing']} rows differ by <= {r['max_tokens_differing']} token(s)"
        lines.append(f"{r['vocab']:>8} {r['setting']:<20} {r['ours_ms']:>10.3f} {r['sort_ms']:>10.3f} "
                     f"{r['speedup']:>9.1f}x  {kept}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m launch bench sampler", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="rows sampled per call")
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 32000, 129280], help="vocabulary sizes")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), metavar="NAME",
                        help=f"sampling settings, of: {' '.join(SETTINGS)}")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--min-seconds", type=float, default=0.3, help="CPU seconds per timing round")
    parser.add_argument("--logit-scale", type=float, default=3.0, help="logits = N(0, 1) x this")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON here")
    return parser


def peak_copies(setting: str) -> int:
    """Peak memory of one ``measure`` cell in units of its [batch, V] float32 logits (measured with
    freed heap memory kept: ~4x greedy, ~7x temperature / seeded / min-p, ~16x top-k / top-p,
    whose index sort holds int64 indices and several [batch, V] temporaries), rounded up."""
    base = SETTINGS[setting]
    if "top_k" in base or "top_p" in base:
        return 17
    return 5 if base.get("temperature") == 0.0 else 8


def check_args(args: argparse.Namespace) -> str | None:
    """One line naming the first bad flag (settings already checked), or None. Sizes whose logits and
    the samplers' temporaries would not fit the memory available now are refused."""
    from moe.kv_cache import available_memory_bytes

    for flag, value, least in (("--batch", args.batch, 1), ("--num-threads", args.num_threads, 1)):
        if value < least:
            return f"{flag} must be >= {least}, got {value}"
    if min(args.vocab) < 2:
        return f"--vocab sizes must be >= 2, got {min(args.vocab)}"
    if not (math.isfinite(args.min_seconds) and args.min_seconds >= 0):
        return f"--min-seconds must be a finite number >= 0, got {args.min_seconds}"
    if not (math.isfinite(args.logit_scale) and args.logit_scale > 0):
        return f"--logit-scale must be a finite number > 0, got {args.logit_scale}"
    if args.json is not None and (problem := output_file_problem(args.json)) is not None:
        return f"--json: {problem}"
    available = available_memory_bytes()
    vocab = max(args.vocab)
    logits = args.batch * vocab * 4
    need = logits * max(peak_copies(s) for s in args.settings)
    if available is not None and need > available:
        return (f"--batch {args.batch} x --vocab {vocab}: float32 logits of {logits / 2**30:.2f} GiB, about "
                f"{need / 2**30:.2f} GiB with the samplers' temporaries, exceed the {available / 2**30:.2f} GiB of "
                "memory available (MemAvailable): lower --batch or --vocab")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        print(f"error: unknown --settings {' '.join(unknown)} (known: {' '.join(SETTINGS)})", file=sys.stderr)
        return 2
    problem = repeated_value_problem("--settings", args.settings) or check_args(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from launch.worker import keep_freed_heap_memory

    torch.set_num_threads(args.num_threads)
    kept = keep_freed_heap_memory()
    rounds = "one call" if args.min_seconds == 0 else f">= {args.min_seconds} s"  # each round runs at least one call
    print(f"# [{args.batch}, V] float32 logits, N(0, 1) x {args.logit_scale}; {args.num_threads} thread(s); CPU ms "
          f"per call (best of 3 rounds of {rounds}); freed heap memory {'kept' if kept else 'returned'}")
    rows = [measure(args.batch, v, s, min_seconds=args.min_seconds, logit_scale=args.logit_scale)
            for v in args.vocab for s in args.settings]
    print(format_table(rows))
    if args.json:
        write_output_file(args.json, json.dumps({"batch": args.batch, "num_threads": args.num_threads,
                                                 "logit_scale": args.logit_scale, "rows": rows}, indent=2) + "\n")
    failed = [r for r in rows if r["max_tokens_differing"] > 1]
    if failed:
        cells = ", ".join(f"{r['setting']} at vocab {r['vocab']} ({r['rows_differing']} rows, "
                          f"<= {r['max_tokens_differing']} tokens)" for r in failed)
        print(f"error: the two filters' kept sets differ by more than one token: {cells}", file=sys.stderr)
        return 1
    return 0
