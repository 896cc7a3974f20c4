"""Attention over the paged KV cache: batched decode, per-sequence prefill chunks.

Shape legend: T tokens, B sequences, H query heads, L gathered context length.

Sequences with one new token are gathered together by block table and attended in one
batched call (padding masked by context_lens); sequences with several new tokens
(prefill chunks, possibly after a cached prefix) are attended one at a time with a
causal mask offset by the cached length, or all in one call by a kernel that reads the
cache itself (``prefill_paged_fn``). An optional sliding window narrows both masks to
the last ``sliding_window`` positions (Mixtral / Qwen3-MoE ``sliding_window``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from moe.cpu_gemm import has_fast_bf16_gemm
from moe.kv_cache import AttentionMetadata, KVLayerView, copy_to_device

# (queries [B, H, Lq, dq], gathered cache [B, L, *entry], mask [B, 1, Lq, L] bool) -> [B, H, Lq, dv]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (decode queries [B, H, dq], the layer's cache, block_tables [B, nb], context_lens [B]) -> [B, H, dv]:
# attention that reads the paged cache itself (each query sees its whole context)
PagedDecodeFn = Callable[[torch.Tensor, KVLayerView, torch.Tensor, torch.Tensor], torch.Tensor]
# (the prefill sequences' rows q [Tp, H, dq], the layer's cache, their block_tables [Bp, nb], context_lens
# [Bp], query_starts [Bp + 1]: sequence b's rows at [query_starts[b], query_starts[b + 1]), its last
# positions) -> [Tp, H, dv]: causal attention that reads the paged cache itself
PagedPrefillFn = Callable[[torch.Tensor, KVLayerView, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, Lq, dk]; k: [B, Hk, L, dk]; v: [B, Hk, L, dv] (H multiple of Hk); mask:
    [B, 1, Lq, L] bool (True = attend; every row needs one). Returns [B, H, Lq, dv] in q's dtype.

    Query heads sharing a kv head are folded into the query-length dim, so k/v are never
    expanded per head (MLA's absorbed decode is one bmm against the shared latent). Softmax
    runs in float32, like transformers' eager attention.
    """
    b, h, lq, _ = q.shape
    hk = k.shape[1]
    rep = h // hk
    qf = q.reshape(b, hk, rep * lq, q.shape[-1])  # query head i uses kv head i // rep
    upcast = _slow_half_gemm(q)
    if upcast:  # products in fp32, rounded where the half-precision GEMM rounds
        kf = k.float()
        vf = kf if v is k else v.float()  # MLA's absorbed decode: keys and values are one latent
        scores = torch.matmul(qf.float(), kf.transpose(-1, -2)).to(q.dtype).float() * scale
    else:
        scores = torch.matmul(qf, k.transpose(-1, -2)).float() * scale  # [B, Hk, rep * Lq, L]
    scores = scores.view(b, hk, rep, lq, -1).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hk, rep * lq, -1)
    if upcast:
        return torch.matmul(probs.float(), vf).to(q.dtype).view(b, h, lq, v.shape[-1])
    return torch.matmul(probs, v).view(b, h, lq, v.shape[-1])


def _slow_half_gemm(x: torch.Tensor) -> bool:
    """bf16 on a CPU without native bf16 GEMMs, where PyTorch's bf16 matmul runs at ~1 GFLOP/s:
    the same products are ~50x faster upcast to fp32 (rounded back to bf16 after each)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not has_fast_bf16_gemm()


def window_sees_every_key(context_lens: Sequence[int], sliding_window: int | None) -> bool:
    """Whether decode queries at the ends of contexts of ``context_lens`` tokens see every key of
    their context: full attention, or no context longer than the window (the query at L - 1 sees
    keys L - w .. L - 1). The decode kernels, which take no window, serve exactly those."""
    return sliding_window is None or max(context_lens) <= sliding_window


def paged_attention(
    q: torch.Tensor, meta: AttentionMetadata, view: KVLayerView, out_dim: int,
    decode_fn: AttendFn, prefill_fn: AttendFn, sliding_window: int | None = None,
    decode_paged_fn: PagedDecodeFn | None = None, prefill_paged_fn: PagedPrefillFn | None = None,
) -> torch.Tensor:
    """q: [T, H, dq] (rows ordered as meta). Returns [T, H, out_dim] in q's dtype.

    The current step's entries must already be written to ``view``. ``sliding_window`` w
    (None: full causal) lets the query at position p see keys k with p - w < k <= p, the rule
    of transformers' ``sliding_window_overlay``; blocks wholly before every query's window are
    not gathered. ``decode_paged_fn``, when given, serves the decode rows from the block tables
    instead of a gathered copy (full attention, or every decode context within the window);
    ``prefill_paged_fn``, when given, serves the rows of every sequence with several new tokens in
    one call (it applies the window itself).
    """
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    size = meta.block_size
    dec = meta.decode_seq_ids()
    # every row one sequence's decode token, in batch order (a steady decode step): no row
    # gather or scatter
    all_decode = bool(dec) and len(dec) == q.shape[0]
    out = None if all_decode else q.new_empty(q.shape[0], q.shape[1], out_dim)
    if dec:
        idx = None if all_decode else _decode_index(meta, dec, q.device)
        ctx = meta.context_lens if all_decode else meta.context_lens[idx]
        tables = meta.block_tables if all_decode else meta.block_tables[idx]
        rows = None if all_decode else meta.query_start_loc[idx]
        lens = meta.context_lens_list if all_decode else [meta.context_lens_list[b] for b in dec]
        if decode_paged_fn is not None and window_sees_every_key(lens, sliding_window):
            if all_decode:
                return decode_paged_fn(q, view, tables, ctx)
            out[rows] = decode_paged_fn(q[rows], view, tables, ctx)
            return _prefill(q, meta, view, prefill_fn, sliding_window, out, prefill_paged_fn)
        nb = -(-max(lens) // size)
        first = _first_block(min(lens) - 1, sliding_window, size)
        cache = view.gather(tables[:, first:nb])  # [Bd, (nb - first) * S, ...]
        kpos = first * size + torch.arange(cache.shape[1], device=q.device)[None, :]  # [1, L]
        mask = kpos < ctx[:, None]  # [Bd, L]: query at ctx - 1 sees keys <= ctx - 1
        if sliding_window is not None:
            mask &= kpos >= (ctx - sliding_window)[:, None]
        if all_decode:
            return decode_fn(q.unsqueeze(2), cache, mask[:, None, None, :]).squeeze(2)
        out[rows] = decode_fn(q[rows].unsqueeze(2), cache, mask[:, None, None, :]).squeeze(2)
    return _prefill(q, meta, view, prefill_fn, sliding_window, out, prefill_paged_fn)


def _prefill(q: torch.Tensor, meta: AttentionMetadata, view: KVLayerView, prefill_fn: AttendFn,
             sliding_window: int | None, out: torch.Tensor, paged_fn: PagedPrefillFn | None) -> torch.Tensor:
    """The prefill sequences' rows into ``out`` [T, H, dv]: all in one ``paged_fn`` call when
    given, else one sequence at a time (``_prefill_rows``). Returns out (or the call's result when
    every row is a prefill row)."""
    seqs = meta.prefill_seq_ids()
    if paged_fn is None or not seqs:
        return _prefill_rows(q, meta, view, prefill_fn, sliding_window, out)
    lens = [meta.query_lens_list[b] for b in seqs]
    starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64, device=q.device)
    if len(seqs) == len(meta.query_lens_list):  # every sequence a prefill one: rows and tables in order
        return paged_fn(q, view, meta.block_tables, meta.context_lens, starts)
    ids = torch.tensor(seqs, dtype=torch.int64, device=q.device)
    rows = torch.cat([torch.arange(meta.query_start_loc_list[b], meta.query_start_loc_list[b] + n, device=q.device)
                      for b, n in zip(seqs, lens)])
    out[rows] = paged_fn(q[rows], view, meta.block_tables[ids], meta.context_lens[ids], starts)
    return out


# A group of prefill sequences attended in one padded call may cost at most this many times the
# query x key area of its sequences attended one at a time (``prefill_groups``).
PREFILL_GROUP_WASTE = 2.0
# Whether the CPU groups them too. No: a CPU pays for the padded work and little per call (its
# prefill attention is the C++ kernel's anyway, which takes every sequence in one call); a GPU
# pays per launch (47bf8ac: 4.5x the prefill throughput on an H200 for 64 prompts).
GROUP_PREFILL_ON_CPU = False


def prefill_groups(query_lens: Sequence[int], context_lens: Sequence[int],
                   waste: float = PREFILL_GROUP_WASTE) -> list[list[int]]:
    """Indices of the prefill sequences grouped for one padded attention call per group: sorted by
    context length, a group grows while its padded area (members x longest query x longest
    context) stays within ``waste`` x the sum of its members' own areas (query x context), so the
    padding at most doubles the work however uneven the lengths. One launch sequence per group
    instead of per sequence: what a GPU, bound by launches at these sizes, pays for."""
    order = sorted(range(len(query_lens)), key=lambda i: (context_lens[i], query_lens[i]))
    groups: list[list[int]] = []
    own = qmax = cmax = 0
    for i in order:
        q, c = query_lens[i], context_lens[i]
        if groups:
            n = len(groups[-1]) + 1
            if n * max(qmax, q) * max(cmax, c) <= waste * (own + q * c):
                groups[-1].append(i)
                own, qmax, cmax = own + q * c, max(qmax, q), max(cmax, c)
                continue
        groups.append([i])
        own, qmax, cmax = q * c, q, c
    return groups


def _prefill_rows(q: torch.Tensor, meta: AttentionMetadata, view: KVLayerView, prefill_fn: AttendFn,
                  sliding_window: int | None, out: torch.Tensor) -> torch.Tensor:
    """Attend the rows of every sequence with several new tokens into ``out`` [T, H, dv]; returns it.
    Off the CPU (see ``GROUP_PREFILL_ON_CPU``) sequences of similar lengths share one ``prefill_fn``
    call (``prefill_groups``, ``_prefill_group``); a sequence alone gets its own call, its keys
    exactly its context."""
    size = meta.block_size
    seqs = meta.prefill_seq_ids()
    qlens = [meta.query_lens_list[b] for b in seqs]
    ctxs = [meta.context_lens_list[b] for b in seqs]
    waste = PREFILL_GROUP_WASTE if q.device.type != "cpu" or GROUP_PREFILL_ON_CPU else 0.0
    for group in prefill_groups(qlens, ctxs, waste):
        if len(group) > 1:
            _prefill_group(q, meta, view, prefill_fn, sliding_window, out, [seqs[i] for i in group])
            continue
        b = seqs[group[0]]
        start, qlen, ctx = int(meta.query_start_loc_list[b]), meta.query_lens_list[b], meta.context_lens_list[b]
        first = _first_block(ctx - qlen, sliding_window, size)
        cache = view.gather(meta.block_tables[b : b + 1, first : -(-ctx // size)])[:, : ctx - first * size]
        kpos = torch.arange(first * size, ctx, device=q.device)[None, :]  # [1, L]
        qpos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]  # [qlen, 1]
        mask = kpos <= qpos  # [qlen, L]
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        rows = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, qlen, dq]
        out[start : start + qlen] = prefill_fn(rows, cache, mask[None, None])[0].transpose(0, 1)
    return out


def _prefill_group(q: torch.Tensor, meta: AttentionMetadata, view: KVLayerView, prefill_fn: AttendFn,
                   sliding_window: int | None, out: torch.Tensor, members: list[int]) -> None:
    """One ``prefill_fn`` call for the prefill sequences ``members`` (batch indices): their query
    rows padded to the longest [n, H, qmax, dq], the keys to the longest context [n, L, ...],
    every key past a sequence's own context (or before its window) masked; a padded query row
    attends one real key (no empty softmax) and is dropped. Writes their rows of ``out``."""
    size = meta.block_size
    gq = [meta.query_lens_list[b] for b in members]
    gc = [meta.context_lens_list[b] for b in members]
    qmax, cmax = max(gq), max(gc)
    first = min(_first_block(c - n, sliding_window, size) for n, c in zip(gq, gc))
    index = _group_index(meta, members, gq, gc, q.device)
    tables = meta.block_tables[index.members]
    cache = view.gather(tables[:, first : -(-cmax // size)])[:, : cmax - first * size]  # [n, L, ...]
    qlen, ctx, start = index.lens[0][:, None], index.lens[1][:, None], index.lens[2][:, None]
    steps = torch.arange(qmax, device=q.device)[None, :]  # [1, qmax]
    real = steps < qlen  # [n, qmax]: rows that exist
    rows = start + torch.minimum(steps, qlen - 1)  # [n, qmax] (padding repeats the last row)
    qpos = ctx - qlen + steps  # [n, qmax] absolute positions
    kpos = torch.arange(first * size, cmax, device=q.device)[None, None, :]  # [1, 1, L]
    mask = (kpos <= qpos[..., None]) & real[..., None]  # [n, qmax, L]
    if sliding_window is not None:
        mask &= kpos > (qpos - sliding_window)[..., None]
    mask[..., 0] |= ~real
    res = prefill_fn(q[rows].transpose(1, 2), cache, mask[:, None]).transpose(1, 2)  # [n, qmax, H, dv]
    out[index.dst] = res.reshape(-1, *res.shape[2:])[index.src]  # the real rows (no boolean index: no host read)


class _GroupIndex:
    """A prefill group's index tensors on the device, made once per step (every layer reuses them).
    members [n] int64 (batch indices); lens [3, n] int64 (query lens, context lens, first rows);
    src [R] int64: the flat positions of the group's R real rows in its padded [n * qmax] grid, in
    order; dst [R] int64: their rows of the step. query_lens, context_lens: the members' (n each)."""

    def __init__(self, meta: AttentionMetadata, members: list[int], query_lens: list[int], context_lens: list[int],
                 device: torch.device) -> None:
        gq, gc = np.array(query_lens, dtype=np.int64), np.array(context_lens, dtype=np.int64)
        qmax = int(gq.max())
        starts = np.array([meta.query_start_loc_list[b] for b in members], dtype=np.int64)
        within = np.arange(int(gq.sum()), dtype=np.int64) - np.repeat(np.cumsum(gq) - gq, gq)
        src = np.repeat(np.arange(len(members), dtype=np.int64) * qmax, gq) + within
        dst = np.repeat(starts, gq) + within
        on_host = [torch.tensor(members, dtype=torch.int64), torch.tensor(np.stack([gq, gc, starts])),
                   torch.from_numpy(src), torch.from_numpy(dst)]
        self.members, self.lens, self.src, self.dst = copy_to_device(on_host, device)  # one copy


# the step whose index tensors are kept (a weak reference to its metadata) and them: a prefill
# group's _GroupIndex by its members, the decode rows' index under "decode"
_step_indices: tuple[weakref.ref | None, dict] = (None, {})


def _kept_for(meta: AttentionMetadata) -> dict:
    """The index tensors kept for ``meta``'s step (a new, empty dict for a new step)."""
    global _step_indices
    ref, kept = _step_indices
    if ref is None or ref() is not meta:
        kept = {}
        _step_indices = (weakref.ref(meta), kept)
    return kept


def _group_index(meta: AttentionMetadata, members: list[int], query_lens: list[int], context_lens: list[int],
                 device: torch.device) -> _GroupIndex:
    """``_GroupIndex`` of ``members`` (their query and context lengths given) in this step, made by the
    first layer that asks."""
    kept = _kept_for(meta)
    key = tuple(members)
    index = kept.get(key)
    if index is None or index.members.device != device:
        index = kept[key] = _GroupIndex(meta, members, query_lens, context_lens, device)
    return index


def _decode_index(meta: AttentionMetadata, dec: list[int], device: torch.device) -> torch.Tensor:
    """The decode sequences ``dec`` of a mixed step as a [Bd] int64 tensor on ``device``, made once
    per step and sent without waiting on the device."""
    kept = _kept_for(meta)
    index = kept.get("decode")
    if index is None or index.device != device:
        index = kept["decode"] = copy_to_device([torch.tensor(dec, dtype=torch.int64)], device)[0]
    return index


def _first_block(first_query_pos: int, sliding_window: int | None, block_size: int) -> int:
    """The first cache block any query at or after ``first_query_pos`` can see under the window."""
    if sliding_window is None:
        return 0
    return max(first_query_pos - sliding_window + 1, 0) // block_size
