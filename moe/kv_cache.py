"""Paged KV cache and the flat varlen batch description attention reads it with.

Shape legend: B sequences, T tokens in the step (sum of query_lens), N blocks, S block size,
nb blocks per sequence (padded), L_kv layers.

A sequence's token at position p lives at slot ``block_tables[b][p // S] * S + p % S`` of
each layer's pool. MLA pools hold the latent ``[N, S, kv_lora_rank + qk_rope_head_dim]``
(``[c_kv | k_pe]``); GQA pools hold ``[N, 2, S, Hkv, head_dim]``: each block's S keys, then its
S values, so that decode attention's two passes (scores over the keys, then the values) each read
whole cache lines in a row (slot s's key at ``pool[s // S, 0, s % S]``). With
``kv_cache_dtype="fp8"`` entries are stored as float8_e4m3fn divided by a per-layer scale
and dequantised to the compute dtype on read. Scales default to 1.0 (vLLM's default);
``set_scale`` installs calibrated ones, and ``calculate_kv_scales=True`` sets each layer's
scale from the first entries written to it (amax / 224, 2x headroom under the fp8 max).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe import kernels
from moe.config import ModelConfig
from moe.host_memory import anonymous_tensor, proc_bytes, tensor_bytes

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# first-write calibration leaves 2x headroom under the fp8 maximum
_FP8_CALIBRATION_TARGET = FP8_MAX / 2


def copy_to_device(tensors: Sequence[torch.Tensor], device: torch.device | str | None) -> list[torch.Tensor]:
    """CPU int64 tensors (any shapes) on ``device``, same shapes. To CUDA: one copy for all of
    them, from pinned memory and asynchronous (a pageable ``.to("cuda")`` waits for the stream to
    drain: one host wait per tensor per step); PyTorch's pinned allocator keeps the staging buffer
    until the copy has run. To the CPU (or None): the tensors themselves."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cpu":
        return list(tensors)
    if device.type != "cuda" or not torch.cuda.is_available():
        return [t.to(device) for t in tensors]
    sizes = [t.numel() for t in tensors]
    staged = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    torch.cat([t.reshape(-1).to(torch.int64) for t in tensors], out=staged)
    flat = staged.to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(flat.split(sizes), tensors, strict=True)]


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's flat batch. Token rows of sequence b are
    ``query_start_loc[b] : query_start_loc[b + 1]`` and sit at positions
    ``context_lens[b] - query_lens[b] ... context_lens[b] - 1``.

    query_lens, context_lens: [B] int64 (context = cached + new, after this step);
    query_start_loc: [B + 1] int64; slot_mapping: [T] int64; block_tables: [B, nb] int64
    (padded with block 0, masked by context_lens).
    """

    query_lens: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    query_lens_list: tuple[int, ...]
    context_lens_list: tuple[int, ...]
    query_start_loc_list: tuple[int, ...]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """From python lists: per sequence its new-token count, total length after the step,
        and its block ids (enough blocks for context_len tokens)."""
        qs, cs = [int(q) for q in query_lens], [int(c) for c in context_lens]
        if not len(qs) == len(cs) == len(block_tables):
            raise ValueError(f"query_lens ({len(qs)}), context_lens ({len(cs)}) and block_tables "
                             f"({len(block_tables)}) must have one entry per sequence")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        for b, (q, c, table) in enumerate(zip(qs, cs, block_tables)):
            if q < 1 or c < q:
                raise ValueError(f"sequence {b}: need 1 <= query_len ({q}) <= context_len ({c})")
            if len(table) * block_size < c:
                raise ValueError(f"sequence {b}: {len(table)} blocks of {block_size} cannot hold {c} tokens")
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        tables = tables.reshape(len(qs), width)
        if all(q == 1 for q in qs):  # a decode step: its slots in plain Python, no tensor ops
            slots, starts = _decode_slots(cs, block_tables, block_size), list(range(len(qs) + 1))
        else:
            slots, starts = _token_slots(qs, cs, tables, block_size)
        on_host = [torch.tensor(qs, dtype=torch.int64), torch.tensor(cs, dtype=torch.int64),
                   torch.tensor(starts, dtype=torch.int64), slots.to(torch.int64), tables]
        query_lens, context_lens, query_start_loc, slot_mapping, block_tables = copy_to_device(on_host, device)
        return cls(
            query_lens=query_lens,
            context_lens=context_lens,
            query_start_loc=query_start_loc,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            block_size=block_size,
            query_lens_list=tuple(qs),
            context_lens_list=tuple(cs),
            query_start_loc_list=tuple(starts),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def logits_indices(self) -> torch.Tensor:
        """[B] int64: row of each sequence's last token in the flat [T, ...] batch."""
        return self.query_start_loc[1:] - 1

    def decode_seq_ids(self) -> list[int]:
        """Sequences with exactly one new token (served by the batched decode path)."""
        return [b for b, q in enumerate(self.query_lens_list) if q == 1]

    def prefill_seq_ids(self) -> list[int]:
        """Sequences with more than one new token (prefill chunks, per-sequence path)."""
        return [b for b, q in enumerate(self.query_lens_list) if q > 1]


def _token_slots(qs: Sequence[int], cs: Sequence[int], tables: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, list[int]]:
    """Every new token's cache slot [T] int64 and the sequences' row offsets [B + 1], for query_lens
    qs, context_lens cs and block tables [B, nb]."""
    q_t, c_t = torch.tensor(qs, dtype=torch.int64), torch.tensor(cs, dtype=torch.int64)
    starts_t = torch.zeros(len(qs) + 1, dtype=torch.int64)
    starts_t[1:] = torch.cumsum(q_t, 0)
    seq_of_token = torch.repeat_interleave(torch.arange(len(qs)), q_t)  # [T]
    token_pos = c_t[seq_of_token] - q_t[seq_of_token] + torch.arange(seq_of_token.numel()) - starts_t[seq_of_token]
    slots = tables[seq_of_token, token_pos // block_size] * block_size + token_pos % block_size
    return slots, starts_t.tolist()


def _decode_slots(cs: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int) -> torch.Tensor:
    """``_token_slots`` for one new token per sequence (position c - 1): [B] int64. A decode step
    builds this every step; at batch 1 the tensor ops cost ~0.1 ms of a ~7 ms step."""
    return torch.tensor([int(t[(c - 1) // block_size]) * block_size + (c - 1) % block_size
                         for c, t in zip(cs, block_tables, strict=True)], dtype=torch.int64)


class KVLayerView:
    """One layer's pool in the storage dtype: MLA [N, S, *entry_shape]; GQA [N, 2, S, Hkv, hd] (a block's
    keys, then its values) for entries [2, Hkv, hd]."""

    def __init__(self, cache: PagedKVCache, layer_id: int) -> None:
        self.cache = cache
        self.layer_id = layer_id
        self.pool = cache.pools[layer_id]
        self.split = cache.split  # keys and values in their own runs of each block (GQA)

    @property
    def scale(self) -> torch.Tensor:
        return self.cache.scales[self.layer_id]

    def write(self, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
        """slot_mapping: [T] int64; entries: [T, *entry_shape] (any float dtype)."""
        entry = self.cache.entry_shape
        if entries.shape[1:] != entry:
            raise ValueError(f"KV entries {tuple(entries.shape[1:])} do not match pool entries {entry}")
        if self.cache.is_fp8:
            if self.cache.calculate_kv_scales and not self.cache.calibrated[self.layer_id] and entries.numel():
                amax = entries.detach().abs().max().float().clamp_min(1e-8)
                self.cache.scales[self.layer_id] = amax / _FP8_CALIBRATION_TARGET
                self.cache.calibrated[self.layer_id] = True
            entries = (entries.float() / self.scale).clamp(-FP8_MAX, FP8_MAX)
        entries = entries.to(self.pool.dtype)
        if not self.split:
            self.pool.view(-1, *entry)[slot_mapping] = entries
            return
        # [N * 2 * S, Hkv, hd] rows: slot s's key at row (s // S) 2S + s % S, its value S rows on
        size = self.pool.shape[2]
        keys = slot_mapping + torch.div(slot_mapping, size, rounding_mode="floor") * size
        rows = torch.cat((keys, keys + size))  # [2T]
        self.pool.view(-1, *entry[1:])[rows] = entries.transpose(0, 1).reshape(-1, *entry[1:])

    @property
    def scale_settled(self) -> bool:
        """Whether writes quantize with a scale fixed already: not an fp8 cache waiting for its
        first write to calibrate it (``calculate_kv_scales``). The fused decode ops, which write
        the cache themselves, take only such a cache."""
        cache = self.cache
        return not (cache.is_fp8 and cache.calculate_kv_scales and not cache.calibrated[self.layer_id])

    def kernel_scale(self) -> float:
        """The scale the CPU decode kernels take with this pool: the fp8 cache's (its entries are
        value / scale), 1.0 for any other."""
        return float(self.cache.scales[self.layer_id]) if self.cache.is_fp8 else 1.0

    def set_scale(self, scale: float) -> None:
        """Fix this layer's fp8 scale (skips first-write calibration)."""
        self.cache.scales[self.layer_id] = float(scale)
        self.cache.calibrated[self.layer_id] = True

    def gather(self, block_tables: torch.Tensor) -> torch.Tensor:
        """block_tables: [B, nb] int64. Returns [B, nb * S, *entry_shape] in the compute dtype."""
        # index_select on the flattened table: one contiguous copy per block (advanced
        # indexing with a 2-D index is several times slower for the same bytes)
        src = self.pool.transpose(1, 2) if self.split else self.pool  # GQA: [N, S, 2, Hkv, hd] strided
        g = src.index_select(0, block_tables.reshape(-1))  # [B * nb, S, ...], a new contiguous tensor
        g = g.view(block_tables.shape[0], -1, *self.cache.entry_shape)
        if self.cache.is_fp8:
            dtype = self.cache.dtype
            if (dtype == torch.float32 or dtype == torch.bfloat16) and kernels.cpu_kernel_applies(g):
                return kernels.fp8_dequantize(g, self.scale, dtype)  # the same bits, one pass
            return (g.float() * self.scale).to(dtype)
        return g


# Pools from this many bytes up take lazily zeroed memory (zeroed_pool).
LAZY_POOL_MIN_BYTES = 1 << 20


def zeroed_pool(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.zeros(shape, dtype, device)``; on Linux CPUs, pools of ``LAZY_POOL_MIN_BYTES`` or more
    come from anonymous memory the kernel zeroes page by page on first touch (asking for
    transparent huge pages where the system allows them on request).

    ``torch.zeros`` writes every byte at start-up: an 8 GiB cache (``--memory 8GiB``) took 23 s of
    ``LLM()`` start on a KVM guest with THP "madvise" (1.95 M page faults, 21.8 s of system time)
    and held all of it resident. Here only the blocks a step writes are ever faulted in. The
    tensor keeps the mapping alive; it is freed with the last view of the tensor.
    """
    dev = torch.device(device) if device is not None else torch.get_default_device()
    nbytes = tensor_bytes(shape, dtype)
    if dev.type != "cpu" or not sys.platform.startswith("linux") or nbytes < LAZY_POOL_MIN_BYTES:
        return torch.zeros(*shape, dtype=dtype, device=dev)
    return anonymous_tensor(shape, dtype)


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable from ``meminfo`` in bytes (None where there is none: not Linux)."""
    return proc_bytes(meminfo, "MemAvailable")


def warn_if_pools_outgrow_memory(pools: Sequence[torch.Tensor], available: int | None) -> bool:
    """Log one warning when CPU pools (lazily zeroed: nothing resident yet) add up to more than
    ``available`` bytes: steps that fill them could then run out of memory. Returns whether it warned."""
    total = sum(p.numel() * p.element_size() for p in pools if p.device.type == "cpu")
    if available is None or total <= available:
        return False
    log.warning("KV cache pools of %.2f GiB exceed the %.2f GiB of memory available now: steps that fill "
                "them may run out of memory (lower --memory or --num-kv-blocks)", total / 2**30, available / 2**30)
    return True


class PagedKVCache:
    """One pool per layer. MLA: [N, S, kv_lora_rank + rope]; GQA: [N, 2, S, Hkv / tp_size, head_dim]
    (each block's keys, then its values)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        *,
        tp_size: int = 1,
        calculate_kv_scales: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        entry = list(config.kv_entry_shape)
        if config.attention == "gqa":
            if entry[1] % tp_size and tp_size % entry[1]:
                raise ValueError(f"tp_size {tp_size} must divide or be a multiple of num_key_value_heads {entry[1]}")
            entry[1] = max(1, entry[1] // tp_size)  # more ranks than kv heads: one (replicated) head each
        self.config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.is_fp8 = kv_cache_dtype == "fp8"
        self.calculate_kv_scales = calculate_kv_scales
        store = FP8_DTYPE if self.is_fp8 else dtype
        n = config.num_hidden_layers
        self._entry_shape = tuple(entry)
        self.split = config.attention == "gqa"  # [N, 2, S, Hkv, hd]: a block's keys, then its values
        shape = (num_blocks, 2, block_size, *entry[1:]) if self.split else (num_blocks, block_size, *entry)
        self.pools = [zeroed_pool(shape, store, device) for _ in range(n)]
        warn_if_pools_outgrow_memory(self.pools, available_memory_bytes())
        self.scales = torch.ones(n, dtype=torch.float32, device=device)
        self.calibrated = [False] * n

    def layer(self, i: int) -> KVLayerView:
        return KVLayerView(self, i)

    @property
    def entry_shape(self) -> tuple[int, ...]:
        """One token's entry in one layer: MLA (C + R,), GQA (2, Hkv, hd)."""
        return self._entry_shape
