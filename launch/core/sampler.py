"""Token sampling from logits: penalties, min_tokens, greedy, temperature, min-p, top-k, top-p,
seeded per request.

Shape letters: B rows (sequences sampling this step), V vocabulary, N top logprobs, S sequences
with a token history on this worker, Q scored prompt positions.

Before anything else, as vLLM V1 (``Sampler.apply_logits_processors``): rows short of their
``min_tokens`` get -inf at the EOS ids and their ``stop_token_ids``; then the repetition,
frequency and presence penalties (``apply_penalties_inplace``, ``launch.core.token_history``) change the
raw logits of the rows that have them, from the sequence's token history (``TokenHistory``: its
distinct prompt and output tokens,
with the output ones' counts, kept on the worker), at those tokens only. Greedy rows take the
argmax of those logits. Rows without either never build a history and sample from the logits as
given.

Filters run in vLLM's order: temperature, then min-p (on the tempered probabilities), then
top-k, then top-p, all on each row's tempered probabilities (a dropped token's is 0). Top-k and
top-p each keep a prefix of the row's tokens in probability order, so together they keep the
row's ``m`` most likely survivors. ``m`` comes from the row's largest probabilities:
``torch.topk`` when top-k is small, else the whole row sorted by value (on CPU numpy's
vectorised sort of the values alone: no index sort over V). Logprobs are the raw model's
(log-softmax of the unprocessed logits, before any filter), as vLLM returns by default.

A random row draws by inverting its cumulative distribution with one uniform number u: the
token whose interval of the running sum of its kept probabilities holds ``u * total``
(``search_fraction``: one fp64 pass up to V = 4096, else fp32 block sums and fp64 running
sums). A row keeping at most V / ``FEW`` tokens sums over its ``torch.topk`` candidates in
probability order, any other row over the whole vocabulary in id order; which of the two
depends on the row and V alone. A seeded row's u is ``seeded_uniform(seed, output_index)``: distinct
seeds (any int64) give distinct streams, and the draw for a request's k-th token depends on its
logits row and nothing else. Given the same logits, then, seeded output does not change with batch
composition, preemption, chunking, worker restarts or the device. The logits themselves are not
always bit-identical: a row's can move in the last bits with the rows batched beside it (about
1e-6 in float32). With float32 weights and the default KV cache that has been too small to move a
draw in testing; bf16 weights or ``kv_cache_dtype="fp8"`` magnify it, and there a draw whose u lies
at the edge between two tokens' intervals (a near-tie) can differ between a batched run and the
request alone, or after a preemption. Unseeded rows take u from the sampler's generator.

On one core (Zen 5), a seeded [32, V] batch with top-k 50 and top-p 0.9 takes 0.44 ms at
V = 1024 and 7.6 ms at V = 129280, against 3.4 ms and 504 ms with an index sort of every row
and an exponential race over V (``python -m launch bench sampler``; docs/serving.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from launch.core.batch import SampledTokens
from launch.core.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, resolve_num_logprobs
from launch.core.token_history import (
    TokenHistory,
    apply_penalties_inplace,
    bad_word_pairs,
    min_tokens_pairs,
    token_ranks,
)

_SEED_KEY = struct.Struct("<qQ")  # (seed int64, output index uint64): 16 bytes, one-to-one
# Rows keeping at most V / FEW tokens work on torch.topk candidates: on CPU, topk of V / 256
# columns costs about what numpy's value sort of the whole row does ([32, V] float32 rows,
# V = 1024 .. 129280, one thread).
FEW = 256
# Columns per block of the two-level running sums (search_fraction), and the vocabulary size up to
# which one fp64 running sum over the row is used instead: below it the two-level search's ~30 small
# ops per call cost more than the pass they save. Decided by V, never by a batch's widths, so a row's
# draws do not depend on the rows beside it.
BLOCK = 64
ONE_PASS_MAX_VOCAB = 4096


@dataclass
class SamplerOutput:
    """token_ids: [B] int64. When any row asked for logprobs: sampled_logprobs [B] float32
    (raw logprob of each sampled token), sampled_ranks [B] int64 (its rank over the whole
    vocabulary, ``token_ranks``), topn_token_ids [B, N] int64 and topn_logprobs [B, N] float32
    with N the largest ``logprobs`` asked for, V for -1 (None otherwise)."""

    token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor | None = None
    topn_token_ids: torch.Tensor | None = None
    topn_logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None

    def to_sampled_tokens(self, params: Sequence[SamplingParams]) -> SampledTokens:
        """Plain-python result for ``Scheduler.update``: per row a dict token id -> logprob
        (sampled token first, then its own top-n) and the sampled token's rank for rows that
        asked, else None."""
        ids = self.token_ids.tolist()
        if self.sampled_logprobs is None:
            return SampledTokens(token_ids=ids, logprobs=None)
        sampled = self.sampled_logprobs.tolist()
        top_ids = self.topn_token_ids.tolist()
        top_lp = self.topn_logprobs.tolist()
        ranks = self.sampled_ranks.tolist() if self.sampled_ranks is not None else [None] * len(ids)
        rows: list[dict[int, float] | None] = []
        row_ranks: list[int | None] = []
        for b, p in enumerate(params):
            if p.logprobs is None:
                rows.append(None)
                row_ranks.append(None)
                continue
            n = len(top_ids[b]) if p.logprobs < 0 else p.logprobs  # -1: all V (the top-n is V wide then)
            d = {ids[b]: sampled[b]}
            for t, lp in zip(top_ids[b][:n], top_lp[b][:n]):
                d.setdefault(t, lp)
            rows.append(d)
            row_ranks.append(ranks[b])
        return SampledTokens(token_ids=ids, logprobs=rows, logprob_ranks=row_ranks)


class Sampler:
    """Samples one token per row. ``seed`` seeds the generator of unseeded rows; ``eos_token_ids``
    are the model's EOS ids, which ``min_tokens`` masks beside each row's ``stop_token_ids``."""

    def __init__(self, seed: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def __call__(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int] | None = None,
        *, seq_ids: Sequence[int] | None = None, history: TokenHistory | None = None,
    ) -> SamplerOutput:
        """logits: [B, V] float (upcast to float32); params: B entries; output_indices: B
        ints, the index of the output token each row samples (seeds row noise; min_tokens counts
        it; default 0); seq_ids: B ints, each row's sequence in ``history`` (read for rows with a
        penalty only; needed when one has). Returns SamplerOutput with token_ids [B] int64 and the
        raw logprobs (of ``logits`` as given) when a row asks."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        if len(params) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(params)} SamplingParams")
        output_indices = [0] * num_rows if output_indices is None else list(output_indices)
        if len(output_indices) != num_rows:
            raise ValueError(f"{num_rows} logits rows but {len(output_indices)} output indices")
        logits = logits.float().contiguous()
        # min_tokens and the penalties change the (row, token) pairs they touch in place; the raw
        # values go back before the logprobs (raw, as vLLM) and before the caller sees the tensor
        undo = self._adjust_inplace(logits, params, output_indices, seq_ids, history)
        try:
            token_ids = self._draw(logits, params, output_indices)
        finally:
            for flat, raw in undo:
                logits.view(-1).index_copy_(0, flat, raw)
        return _with_logprobs(logits, token_ids, params)

    def _draw(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: list[int]) -> torch.Tensor:
        """logits: [B, V] float32 -> [B] int64: greedy rows' argmax, the others' draws."""
        random = [b for b, p in enumerate(params) if not p.is_greedy]
        if not random:
            return logits.argmax(dim=-1)
        if len(random) == len(params):
            return self._sample(logits, list(params), output_indices)
        greedy = [b for b, p in enumerate(params) if p.is_greedy]
        token_ids = torch.empty(len(params), dtype=torch.int64, device=logits.device)
        token_ids[greedy] = logits[greedy].argmax(dim=-1)
        token_ids[random] = self._sample(logits[random], [params[b] for b in random], [output_indices[b] for b in random])
        return token_ids

    def _adjust_inplace(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: list[int],
                        seq_ids: Sequence[int] | None, history: TokenHistory | None,
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Apply, in vLLM's order, ``allowed_token_ids`` (every other logit -inf), the bad words'
        bans, min_tokens' masks, ``logit_bias`` and then the penalties to logits [B, V] float32 (contiguous) in place,
        at the pairs they touch only (no [B, V] copy: 3 ms for [32, 129280] on one core; a row with
        allowed_token_ids is saved whole). Returns per change (flat indices [M] into
        logits.view(-1), raw values [M]): what writing back undoes it ([] when no row has
        allowed_token_ids, min_tokens to wait for, a bias or a penalty)."""
        masked = [b for b, p in enumerate(params) if p.min_tokens > output_indices[b]]
        penalised = [b for b, p in enumerate(params) if p.has_penalties]
        allowed = [b for b, p in enumerate(params) if p.allowed_token_ids is not None]
        biased = [b for b, p in enumerate(params) if p.logit_bias is not None]
        bad = [b for b, p in enumerate(params) if p.bad_words_token_ids is not None]
        if not masked and not penalised and not allowed and not biased and not bad:
            return []
        if (penalised or bad) and (history is None or seq_ids is None):
            raise ValueError("rows with a penalty or bad words need their sequences' token history (seq_ids, history)")
        flat_logits, vocab = logits.view(-1), logits.shape[1]
        device = logits.device
        changed: dict[str, torch.Tensor] = {}
        if allowed:  # whole rows
            rows = torch.tensor(allowed, dtype=torch.int64, device=device)
            changed["allowed"] = (rows[:, None] * vocab + torch.arange(vocab, device=device)).view(-1)
        if bad:
            pairs = bad_word_pairs(bad, [params[b].bad_words_token_ids for b in bad],
                                   [history.output_tokens(seq_ids[b]) for b in bad])
            if pairs:
                changed["bad"] = torch.tensor([b * vocab + t for b, t in pairs], dtype=torch.int64, device=device)
        if masked:
            rows, ids = min_tokens_pairs(masked, [self._banned_ids(params[b]) for b in masked], vocab, device)
            changed["masked"] = rows * vocab + ids
        if biased:
            pairs = [(b, token, bias) for b in biased for token, bias in params[b].logit_bias]
            changed["biased"] = torch.tensor([b * vocab + token for b, token, _ in pairs], dtype=torch.int64,
                                             device=device)
            biases = torch.tensor([bias for _, _, bias in pairs], dtype=logits.dtype, device=device)
        if penalised:
            rows, token_ids, counts = history.entries([seq_ids[b] for b in penalised], penalised)
            changed["penalised"] = rows * vocab + token_ids
        undo = [(flat, flat_logits.index_select(0, flat)) for flat in changed.values()]  # raw: before any write
        if allowed:
            keep = [(b, torch.tensor(params[b].allowed_token_ids, dtype=torch.int64, device=device)) for b in allowed]
            kept = [logits[b].index_select(0, ids) for b, ids in keep]
            logits[allowed] = float("-inf")
            for (b, ids), values in zip(keep, kept):
                logits[b].index_copy_(0, ids, values)
        if "bad" in changed:
            flat_logits.index_fill_(0, changed["bad"], float("-inf"))
        if masked:
            flat_logits.index_fill_(0, changed["masked"], float("-inf"))
        if biased:
            flat_logits.index_add_(0, changed["biased"], biases)
        if penalised:
            factors = [torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype, device=logits.device)
                       for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")]
            apply_penalties_inplace(logits, rows, token_ids, counts, *factors)
        return undo

    def _banned_ids(self, params: SamplingParams) -> list[int]:
        """The ids min_tokens masks: the row's stop_token_ids and the EOS ids, whatever ignore_eos
        says (vLLM adds the EOS id to ``_all_stop_token_ids`` unconditionally)."""
        return sorted(set(params.stop_token_ids).union(self.eos_token_ids))

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> torch.Tensor:
        """logits: [R, V] float32 of random rows -> [R] int64 drawn from the filtered distribution."""
        u = torch.rand(len(params), dtype=torch.float64, generator=self._generator).tolist()
        for b, p in enumerate(params):
            if p.seed is not None:
                u[b] = seeded_uniform(p.seed, output_indices[b])
        return sample_filtered(logits, params, torch.tensor(u, dtype=torch.float64, device=logits.device))


def rank_seed(seed: int, dp_rank: int) -> int:
    """The engine seed of data-parallel rank ``dp_rank`` for the engine's ``seed`` in [0, 2**63 - 1]:
    seed + dp_rank, wrapping around within [0, 2**63) (a torch generator's seed range)."""
    return (seed + dp_rank) % 2**63


def seeded_uniform(seed: int, output_index: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, output_index): the top 53 bits of
    BLAKE2b (8-byte digest) of the pair packed as a little-endian int64 and uint64. The packing is
    one-to-one on seed in [SEED_MIN, SEED_MAX] and output_index in [0, 2**64), so distinct seeds
    never share a stream (unlike an integer hash reduced modulo a prime); the same in every
    process and on every device. ValueError outside those ranges."""
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must be in [-2**63, 2**63 - 1] (int64), got {seed}")
    if not 0 <= output_index < 1 << 64:
        raise ValueError(f"output_index must be in [0, 2**64), got {output_index}")
    digest = hashlib.blake2b(_SEED_KEY.pack(seed, output_index), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def sample_filtered(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] float32; params: R non-greedy rows; u: [R] float64 in [0, 1). Returns [R]
    int64: each row's draw from the distribution ``apply_sampling_filters`` leaves it."""
    probs = tempered_probs(logits, params)
    num_rows, vocab = probs.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    small_k, by_value, plain = [], [], []
    for b, p in enumerate(params):
        if 0 < p.top_k * FEW <= vocab:
            small_k.append(b)
        elif 0 < p.top_k < vocab or p.top_p_enabled:
            by_value.append(b)
        else:
            plain.append(b)
    if small_k:
        rows = [params[b] for b in small_k]
        out[small_k] = _draw_among_top(_rows(probs, small_k), max(p.top_k for p in rows), rows, None, u[small_k])
    if by_value:
        counts, threshold = kept_counts(_rows(probs, by_value), [params[b] for b in by_value])
        few = (counts * FEW <= vocab).tolist()
        if any(few):
            i = [j for j, f in enumerate(few) if f]
            rows = [by_value[j] for j in i]
            out[rows] = _draw_among_top(_rows(probs, rows), int(counts[i].max()), None, counts[i], u[rows])
        if not all(few):
            i = [j for j, f in enumerate(few) if not f]
            rows = [by_value[j] for j in i]
            sub = _rows(probs, rows)
            out[rows] = draw_from_weights(sub * keep_top(sub, counts[i], threshold[i]), u[rows], vocab=vocab)
    if plain:
        out[plain] = draw_from_weights(_rows(probs, plain), u[plain], vocab=vocab)
    return out


def _draw_among_top(probs: torch.Tensor, width: int, params: Sequence[SamplingParams] | None,
                    counts: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """probs: [R, V]; the rows keep their ``counts`` (or, from ``params``, their ``top_counts``)
    most likely tokens, all within the ``width`` largest. Returns [R] int64 ids drawn among
    those candidates, summed in value order."""
    vocab = probs.shape[1]
    values, ids = probs.topk(width, dim=-1)  # [R, width], descending
    if counts is None:
        counts = top_counts(values, params, vocab=vocab)
    values = values * (torch.arange(width, device=probs.device) < counts.unsqueeze(1))
    return ids.gather(1, draw_from_weights(values, u, vocab=vocab).unsqueeze(1)).squeeze(1)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for increasing row ids; x itself (no copy) when they are all of its rows."""
    return x if len(rows) == x.shape[0] else x[rows]


def draw_from_weights(weights: torch.Tensor, u: torch.Tensor, *, vocab: int | None = None) -> torch.Tensor:
    """Inverse-CDF draw. weights: [R, W] float32 >= 0, unnormalised, at least one positive per
    row; u: [R] float64 in [0, 1); vocab: the vocabulary the rows come from (default W). Returns
    [R] int64 column indices: per row the column whose interval of the running sum of the weights
    holds u times the row's total."""
    return search_fraction(weights, u, right=True, vocab=vocab)


def search_fraction(weights: torch.Tensor, fraction: torch.Tensor, *, right: bool,
                    vocab: int | None = None) -> torch.Tensor:
    """weights: [R, W] float32 >= 0, at least one positive per row; fraction: [R] float64 in
    [0, 1]. Returns [R] int64: per row the first column whose running sum of the weights reaches
    fraction x the row's total (``right``: exceeds it; the column found then has a positive
    weight, and a fraction below 1 never runs past the row). Up to a vocabulary (``vocab``,
    default W) of ONE_PASS_MAX_VOCAB, one fp64 running sum over the row; past it two levels, so no
    [R, W] fp64 running sum is built: fp32 sums of blocks of BLOCK columns, their fp64 running sum
    picks the block, and an fp64 running sum inside that block the column."""
    num_rows, width = weights.shape
    if (width if vocab is None else vocab) <= ONE_PASS_MAX_VOCAB:
        cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [R, W]
        total = cdf[:, -1:]
        target = fraction.unsqueeze(1) * total
        if right:  # u * total can round up to total: stay below it
            target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=right).clamp_(max=width - 1).squeeze(1)
    whole = width // BLOCK * BLOCK
    parts = [weights[:, :whole].reshape(num_rows, -1, BLOCK).sum(dim=-1)] if whole else []
    if whole < width:
        parts.append(weights[:, whole:].sum(dim=-1, keepdim=True))
    sums = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [R, blocks] float32
    block_cdf = sums.cumsum(dim=-1, dtype=torch.float64)
    target = (fraction * block_cdf[:, -1]).unsqueeze(1)  # [R, 1]
    block = torch.searchsorted(block_cdf, target, right=right).clamp_(max=sums.shape[1] - 1)  # [R, 1]
    before = block_cdf.gather(1, block) - sums.gather(1, block).double()
    cols = block * BLOCK + torch.arange(BLOCK, device=weights.device)  # [R, BLOCK]
    inside = weights.gather(1, cols.clamp(max=width - 1)) * (cols < width)
    cdf = before + inside.cumsum(dim=-1, dtype=torch.float64)  # [R, BLOCK]
    # the block's fp32 sum and this fp64 sum can differ in their last bits: stay inside the block
    last = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(last, before) if right else last)
    return (cols.gather(1, torch.searchsorted(cdf, target, right=right).clamp_(max=BLOCK - 1))).squeeze(1)


def tempered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [B, V] float32 -> [B, V] float32 softmax(logits / temperature) per row, with min-p's
    dropped tokens (probability below ``min_p`` x the row's largest) at 0."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    probs = (logits / temps.unsqueeze(1)).softmax(dim=-1)
    if any(p.min_p_enabled for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
        probs = probs * (probs >= threshold)  # a multiply: masked_fill is several times slower on CPU
    return probs


def apply_sampling_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [B, V] float32 of non-greedy rows -> [B, V] float32 scaled by 1/temperature
    with filtered-out tokens at -inf: the distribution ``Sampler`` draws from. Min-p drops tokens
    whose tempered probability is below ``min_p`` x the row's largest; top-k keeps each row's k
    most likely; top-p then keeps the smallest set of most likely tokens whose probability
    reaches p. The most likely token always survives; of tokens tied at the last kept
    probability, the lowest ids are kept; a token whose float32 probability is 0 is dropped."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    probs = tempered_probs(logits, params)
    vocab = probs.shape[1]
    rows = [b for b, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p_enabled]
    kept = probs > 0
    if rows:
        kept[rows] = keep_top(_rows(probs, rows), *kept_counts(_rows(probs, rows), [params[b] for b in rows]))
    return (logits / temps.unsqueeze(1)).masked_fill(~kept, float("-inf"))


def kept_counts(probs: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: [B, V] float32 (``tempered_probs``). Returns counts [B] int64 (``top_counts``) and
    threshold [B, 1] float32, the counts[b]-th largest probability of row b (> 0)."""
    vocab = probs.shape[1]
    # a top-p row without top-k needs its whole row in value order; otherwise its top-k suffices
    width = max(p.top_k if 0 < p.top_k < vocab else vocab for p in params)
    values = sorted_values(probs, width)  # [B, width]
    counts = top_counts(values, params, vocab=vocab)
    return counts, values.gather(1, (counts - 1).unsqueeze(1))


def top_counts(values: torch.Tensor, params: Sequence[SamplingParams], *, vocab: int | None = None) -> torch.Tensor:
    """values: [B, W] each row's W largest probabilities, descending (0: dropped), W at least the
    row's top-k when it has one, else its whole row. Returns [B] int64: how many of them top-k
    and then top-p keep, from 1 to the nonzero ones. Top-p's mass is relative to the top-k
    survivors; it keeps ranks up to the first whose running sum reaches p of them. vocab: the
    vocabulary the rows come from (default W; it picks ``search_fraction``'s method)."""
    width = values.shape[1]
    cut = torch.tensor([p.top_k if 0 < p.top_k < width else width for p in params], device=values.device)
    if bool((values[:, -1] > 0).all()):
        counts = cut
    else:
        counts = torch.minimum(cut, (values > 0).sum(dim=-1, dtype=torch.int32).long())
    if any(p.top_p_enabled for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=values.device)
        survivors = values if bool((cut == width).all()) else values * (torch.arange(width, device=values.device) < cut.unsqueeze(1))
        nucleus = search_fraction(survivors, top_p, right=False, vocab=vocab) + 1
        counts = torch.where(top_p < 1.0, torch.minimum(counts, nucleus), counts)
    return counts.clamp_(min=1)


def sorted_values(x: torch.Tensor, width: int) -> torch.Tensor:
    """x: [B, V] float32 -> [B, width] each row's ``width`` largest values, descending. On CPU a
    whole row sorts by value with numpy (vectorised, no indices) unless ``width`` <= V / FEW;
    elsewhere torch.topk / torch.sort."""
    vocab = x.shape[1]
    if x.device.type == "cpu":
        if width * FEW <= vocab:
            return x.topk(width, dim=-1).values
        ascending = np.sort(x.detach().numpy(), axis=-1)
        return torch.from_numpy(ascending[:, ::-1][:, :width].copy())  # a copy: positive strides
    if width < vocab:
        return x.topk(width, dim=-1).values
    return x.sort(dim=-1, descending=True).values


def keep_top(probs: torch.Tensor, counts: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """probs: [B, V] float32; counts: [B] int64 in 1..(nonzero values per row); threshold: [B, 1]
    the counts[b]-th largest value of row b. Returns kept [B, V] bool: each row's counts[b]
    largest values, i.e. every value above the threshold and of those equal to it the lowest ids."""
    kept = probs >= threshold
    if bool((kept.sum(dim=-1, dtype=torch.int32) > counts).any()):  # ties at the threshold
        above = probs > threshold
        ties = probs == threshold
        room = counts - above.sum(dim=-1, dtype=torch.int32)
        kept = above | (ties & (ties.cumsum(dim=-1) <= room.unsqueeze(1)))
    return kept


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]) -> SamplerOutput:
    vocab = logits.shape[1]
    max_n = max((resolve_num_logprobs(p.logprobs, vocab) for p in params if p.logprobs is not None), default=None)
    if max_n is None:
        return SamplerOutput(token_ids=token_ids)
    logprobs = logits.log_softmax(dim=-1)  # raw model logprobs  [B, V]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_lp, top_ids = logprobs.topk(max_n, dim=-1)
    return SamplerOutput(token_ids=token_ids, sampled_logprobs=sampled, topn_token_ids=top_ids, topn_logprobs=top_lp,
                         sampled_ranks=token_ranks(logprobs, sampled))
