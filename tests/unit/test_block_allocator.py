"""BlockAllocator: allocation, ref counts, prefix reuse, LRU eviction, invariants (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.core.block_allocator import BlockAllocator
from launch.core.request import Sequence
from launch.core.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(tokens: list[int], max_model_len: int = 4096) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", index=0, prompt_token_ids=list(tokens),
                    params=SamplingParams(max_tokens=None), max_model_len=max_model_len, arrival_order=i)


def compute_all(alloc: BlockAllocator, seq: Sequence) -> int:
    """Allocate and 'compute' the whole sequence in one go, registering its full blocks."""
    hit = alloc.allocate(seq, seq.num_tokens - alloc.num_cached_tokens(seq))
    seq.num_computed_tokens = seq.num_tokens
    alloc.cache_computed_blocks(seq)
    return hit


def test_allocate_counts_blocks_and_usage():
    alloc = BlockAllocator(num_blocks=10, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    assert alloc.can_allocate(seq, 10)
    assert alloc.allocate(seq, 10) == 0
    assert len(seq.block_ids) == 3 and len(set(seq.block_ids)) == 3
    assert alloc.num_free_blocks == 7
    assert alloc.usage == pytest.approx(0.3)
    alloc.free(seq)
    assert seq.block_ids == [] and alloc.num_free_blocks == 10 and alloc.usage == 0.0
    whole = make_seq(list(range(9)))
    assert alloc.can_allocate(whole) and alloc.allocate(whole) == 0  # default: every uncached token
    assert len(whole.block_ids) == 3


def test_append_slots_grows_only_at_block_boundary():
    alloc = BlockAllocator(num_blocks=4, block_size=4, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3])
    alloc.allocate(seq, 3)
    seq.num_computed_tokens = 3
    assert alloc.append_slots(seq, 1) == []  # token 3 still fits in block 0
    seq.num_computed_tokens = 4
    assert len(alloc.append_slots(seq, 1)) == 1
    assert len(seq.block_ids) == 2
    seq.num_computed_tokens = 5
    assert alloc.can_append(seq, 11) and not alloc.can_append(seq, 12)  # 16 tokens = all 4 blocks
    with pytest.raises(RuntimeError, match="needs 3 more KV blocks"):
        alloc.append_slots(seq, 12)


def test_allocate_refuses_when_full_and_rejects_bad_calls():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    seq = make_seq(list(range(9)))
    assert not alloc.can_allocate(seq, 9)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        alloc.allocate(seq, 9)
    small = make_seq([1, 2])
    alloc.allocate(small, 2)
    with pytest.raises(ValueError, match="already holds"):
        alloc.allocate(small, 2)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)


def test_prefix_reuse_across_sequences_and_ref_counts():
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_seq(prefix + [1, 2])
    assert compute_all(alloc, a) == 0
    b = make_seq(prefix + [7, 8, 9])
    assert alloc.num_cached_tokens(b) == 12
    assert alloc.allocate(b, 3) == 12
    assert b.num_computed_tokens == 12
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert [alloc.ref_count(x) for x in b.block_ids] == [2, 2, 2, 1]
    stats = alloc.prefix_cache_stats()
    assert (stats.queries, stats.hits) == (14 + 15, 12)
    assert stats.hit_rate == pytest.approx(12 / 29)
    alloc.free(a)
    assert [alloc.ref_count(x) for x in b.block_ids] == [1, 1, 1, 1]
    # a's own last block was never full: plainly free; shared ones are still referenced.
    assert alloc.num_free_blocks == 16 - 4


def test_divergent_suffix_hits_only_common_full_blocks():
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    compute_all(alloc, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = make_seq([1, 2, 3, 4, 5, 6, 0, 8, 9])  # differs inside block 1
    assert alloc.num_cached_tokens(other) == 4
    # Same block-1 tokens but a different parent: chained hashes must not match.
    shifted = make_seq([0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert alloc.num_cached_tokens(shifted) == 0


def test_full_hit_leaves_last_token_to_compute():
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    tokens = list(range(8))  # exactly 2 blocks
    compute_all(alloc, make_seq(tokens))
    again = make_seq(tokens)
    assert alloc.num_cached_tokens(again) == 4  # block 1 would leave nothing to compute
    assert alloc.allocate(again, 4) == 4
    assert again.num_computed_tokens == 4 and len(again.block_ids) == 2


def test_freed_cached_blocks_are_evictable_and_evicted_lru():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    a, b = make_seq([1, 2, 3]), make_seq([5, 6, 7])
    compute_all(alloc, a)
    compute_all(alloc, b)
    alloc.free(a)  # a's full block [1, 2] becomes evictable first (LRU)
    alloc.free(b)  # then b's [5, 6]
    assert alloc.num_free_blocks == 4 and alloc.num_cached_blocks == 2
    # Needs 2 blocks: the 2 never-cached free blocks are used before any eviction.
    c = make_seq([9, 9, 9, 9])
    alloc.allocate(c, 4)
    assert alloc.num_cached_blocks == 2
    # One more block must evict the least recently used cached block: a's.
    d = make_seq([8])
    alloc.allocate(d, 1)
    assert alloc.num_cached_tokens(make_seq([1, 2, 3])) == 0
    assert alloc.num_cached_tokens(make_seq([5, 6, 7])) == 2


def test_hit_refreshes_lru_position():
    alloc = BlockAllocator(num_blocks=3, block_size=2)
    a, b = make_seq([1, 2, 3]), make_seq([5, 6, 7])
    compute_all(alloc, a)
    alloc.free(a)
    compute_all(alloc, b)
    alloc.free(b)  # evictable, oldest first: a's [1, 2], b's [5, 6]
    reuse = make_seq([1, 2, 9])  # hits a's block, which becomes the most recently used
    assert compute_all(alloc, reuse) == 2
    alloc.free(reuse)
    alloc.allocate(make_seq([0, 0, 0]), 3)  # 1 never-cached block + 1 eviction
    assert alloc.num_cached_tokens(make_seq([1, 2, 3])) == 2
    assert alloc.num_cached_tokens(make_seq([5, 6, 7])) == 0


def test_tail_blocks_evicted_before_prefix():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    seq = make_seq([1, 2, 3, 4, 5])  # 2 full cached blocks + 1 partial
    compute_all(alloc, seq)
    alloc.free(seq)
    alloc.allocate(make_seq([0] * 6), 6)  # 2 never-cached blocks + 1 eviction
    assert alloc.num_cached_tokens(make_seq([1, 2, 3, 4, 5])) == 2  # prefix kept, tail evicted


def test_double_free_is_detected():
    alloc = BlockAllocator(num_blocks=4, block_size=2, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3])
    alloc.allocate(seq, 3)
    blocks = list(seq.block_ids)
    alloc.free(seq)
    seq.block_ids = blocks
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(seq)


def test_prefix_caching_disabled_never_hits():
    alloc = BlockAllocator(num_blocks=8, block_size=2, enable_prefix_caching=False)
    compute_all(alloc, make_seq([1, 2, 3, 4, 5]))
    assert alloc.num_cached_tokens(make_seq([1, 2, 3, 4, 5])) == 0
    assert alloc.prefix_cache_stats().queries == 0


# ---- invariants under random operations ------------------------------------------------

def check_invariants(alloc: BlockAllocator, live: list[Sequence]) -> None:
    refs = {}
    for s in live:
        assert len(set(s.block_ids)) == len(s.block_ids), "a sequence holds a block twice"
        for b in s.block_ids:
            refs[b] = refs.get(b, 0) + 1
    for b in range(alloc.num_blocks):
        assert alloc.ref_count(b) == refs.get(b, 0), f"block {b} ref count drifted"
    free = set(alloc._free_uncached) | set(alloc._evictable)
    assert len(free) == len(alloc._free_uncached) + len(alloc._evictable), "a block is free twice"
    assert free.isdisjoint(refs), "a referenced block is on a free list"
    assert len(free) + len(refs) == alloc.num_blocks, "a block leaked"
    for h, b in alloc._cached.items():
        assert alloc._blocks[b].block_hash == h
    for b in alloc._evictable:
        assert alloc._blocks[b].block_hash is not None


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "step", "free"]), st.integers(0, 7), st.integers(1, 9)),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_random_operations_never_leak_or_double_free(ops, caching):
    alloc = BlockAllocator(num_blocks=12, block_size=3, enable_prefix_caching=caching)
    live: list[Sequence] = []
    for op, pick, size in ops:
        if op == "alloc":
            # Few distinct prompts so prefixes are shared often.
            seq = make_seq([pick % 2] * 3 + [pick] * size)
            hit = alloc.num_cached_tokens(seq)
            num_new = min(seq.num_tokens - hit, size)
            if alloc.can_allocate(seq, num_new):
                assert alloc.allocate(seq, num_new) == hit
                seq.num_computed_tokens += num_new  # the step ran
                alloc.cache_computed_blocks(seq)
                live.append(seq)
        elif op == "step" and live:
            seq = live[pick % len(live)]
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(pick)  # a token was sampled: decode it next
            num_new = min(size, seq.num_tokens - seq.num_computed_tokens)
            if alloc.can_append(seq, num_new):
                alloc.append_slots(seq, num_new)
                assert len(seq.block_ids) * alloc.block_size >= seq.num_computed_tokens + num_new
                seq.num_computed_tokens += num_new
                alloc.cache_computed_blocks(seq)
            else:
                alloc.free(seq)
                live.remove(seq)
        elif op == "free" and live:
            alloc.free(live.pop(pick % len(live)))
        check_invariants(alloc, live)
    for seq in live:
        alloc.free(seq)
    check_invariants(alloc, [])
    assert alloc.num_free_blocks == alloc.num_blocks
