"""Paged KV-cache block allocator with prefix caching (one per DP rank).

Shape letters: N blocks, S block size (tokens per block).

A block is a slot range ``[b * S, (b + 1) * S)`` of the KV pool. Each block has a
reference count (how many live sequences use it). With prefix caching, a *full* block
whose KV has been computed is registered under the chained hash
``hash((parent_block_hash, block_tokens))``, so a later sequence whose prompt starts with
the same tokens reuses it instead of recomputing it. Only full blocks are shared; a
sequence's partly filled last block is always its own.

Free blocks live in two pools: never-cached blocks, and cached blocks with refcount 0
(evictable, kept in least-recently-freed order). A new block comes from the first pool
if possible, else by evicting the least recently used cached block. Blocks of a freed
sequence are released tail-first so a prefix outlives its continuations.

Hashes use Python's ``hash`` of int tuples, which is deterministic across processes;
lookups compare the block's stored (parent hash, tokens) key, so equal hashes of
different token blocks cannot alias, up to a collision of 64-bit parent hashes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from launch.core.request import Sequence

_ROOT_HASH = 0x5EED


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    key: tuple[int, tuple[int, ...]] | None = None  # (parent hash, tokens) once cached
    block_hash: int | None = None


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups since construction, in tokens."""

    queries: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    """Allocates KV blocks to sequences; verb pairs ``can_allocate``/``allocate``,
    ``can_append``/``append_slots``, ``free``; ``cache_computed_blocks`` registers blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._queries = 0
        self._hits = 0

    # ---- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never-cached plus evictable cached)."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(queries=self._queries, hits=self._hits)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s prefix found in the cache (a multiple of S; no side effects).

        At most ``num_tokens - 1`` so one token is always left to compute logits from.
        """
        return len(self._find_cached_prefix(seq)) * self.block_size

    # ---- allocation ----------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> bool:
        """Whether ``allocate(seq, num_new_tokens)`` would succeed."""
        hit = self._find_cached_prefix(seq)
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - len(hit) * self.block_size
        revived = sum(1 for b in hit if self._blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(hit) * self.block_size + num_new_tokens) - len(hit)
        return needed + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> int:
        """Give a sequence with no blocks its cached prefix plus room for ``num_new_tokens``
        more tokens (default: all its uncached tokens). Sets ``seq.block_ids`` and
        ``seq.num_computed_tokens`` (= the hit) and returns the number of cached tokens hit.
        Raises if it does not fit."""
        if seq.block_ids:
            raise ValueError(f"sequence {seq.seq_id} already holds {len(seq.block_ids)} blocks")
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - self.num_cached_tokens(seq)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}")
        hit = self._find_cached_prefix(seq)
        for b in hit:
            self._ref(b)
        seq.block_ids = list(hit)
        seq.num_cached_blocks = len(hit)
        num_hit_tokens = len(hit) * self.block_size
        seq.num_computed_tokens = num_hit_tokens
        if self.enable_prefix_caching:
            self._queries += seq.num_tokens
            self._hits += num_hit_tokens
        self.append_slots(seq, num_new_tokens)
        return num_hit_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the sequence can get slots for ``num_new_tokens`` more computed tokens."""
        return self._extra_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow ``seq.block_ids`` to hold ``num_computed_tokens + num_new_tokens`` tokens.
        Returns the new block ids. Raises if there are not enough free blocks."""
        extra = self._extra_blocks(seq, num_new_tokens)
        if extra > self.num_free_blocks:
            raise RuntimeError(
                f"sequence {seq.seq_id} needs {extra} more KV blocks, {self.num_free_blocks} free"
            )
        new = [self._take_free_block() for _ in range(extra)]
        seq.block_ids.extend(new)
        return new

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks at refcount 0 become free (cached ones
        evictable). Tail blocks are released first so they are evicted before the prefix."""
        for b in reversed(seq.block_ids):
            block = self._blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {b} by sequence {seq.seq_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._evictable[b] = None
                else:
                    self._free_uncached.append(b)
        seq.block_ids = []
        seq.num_cached_blocks = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register every full block whose KV is now computed (call after each step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if num_full <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            block = self._blocks[seq.block_ids[i]]
            if block.block_hash is not None:
                continue
            h = seq.block_hashes[i]
            if h in self._cached:
                continue  # same content computed concurrently by another sequence: keep the first
            parent = seq.block_hashes[i - 1] if i else _ROOT_HASH
            block.key = (parent, tuple(seq.token_slice(i * self.block_size, (i + 1) * self.block_size)))
            block.block_hash = h
            self._cached[h] = block.block_id
        seq.num_cached_blocks = num_full

    # ---- internals -----------------------------------------------------------------

    def _extra_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids))

    def _find_cached_prefix(self, seq: Sequence) -> list[int]:
        # a sequence that still scores its prompt (prompt_logprobs) computes every position, as
        # vLLM's skip_reading_prefix_cache; the blocks it computes are cached for others as usual
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, max_blocks)
        hit: list[int] = []
        for i in range(max_blocks):
            b = self._cached.get(seq.block_hashes[i])
            if b is None:
                break
            parent = seq.block_hashes[i - 1] if i else _ROOT_HASH
            key = (parent, tuple(seq.token_slice(i * self.block_size, (i + 1) * self.block_size)))
            if self._blocks[b].key != key:
                break
            hit.append(b)
        return hit

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        s = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash((parent, tuple(seq.token_slice(i * s, (i + 1) * s)))))

    def _ref(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self._free_uncached:
            b = self._free_uncached.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)  # least recently used cached block
            block = self._blocks[b]
            del self._cached[block.block_hash]
            block.block_hash, block.key = None, None
        self._blocks[b].ref_count = 1
        return b
