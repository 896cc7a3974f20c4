"""The PyTorch prefill path attends sequences of similar lengths in one padded call
(``moe.layers.paged.prefill_groups``): the same rows as one call per sequence, a bounded padding."""

from __future__ import annotations

import pytest
import torch

from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.layers import paged
from moe.layers.paged import paged_attention, prefill_groups, sdpa
from tests.conftest import HF_CASES


def test_groups_cover_every_sequence_once_within_the_waste_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        qlens = torch.randint(1, 300, (n,), generator=gen).tolist()
        ctxs = [q + int(p) for q, p in zip(qlens, torch.randint(0, 500, (n,), generator=gen))]
        groups = prefill_groups(qlens, ctxs)
        assert sorted(i for g in groups for i in g) == list(range(n))
        for g in groups:
            padded = len(g) * max(qlens[i] for i in g) * max(ctxs[i] for i in g)
            assert padded <= 2.0 * sum(qlens[i] * ctxs[i] for i in g)
    assert prefill_groups([128] * 32, [128] * 32) == [list(range(32))]  # equal lengths: one call
    # one long prompt beside short ones: alone, not the short ones padded to it
    assert [0] in prefill_groups([4096] + [16] * 8, [4096] + [16] * 8)
    assert prefill_groups([5, 6], [5, 6], waste=0.0) == [[0], [1]]
    assert prefill_groups([], []) == []


@pytest.mark.parametrize("window", [None, 3, 64])
def test_grouped_prefill_equals_one_call_per_sequence(monkeypatch, window: int | None) -> None:
    """A step of two decodes and five prefill chunks (some after cached prefixes, lengths close
    enough to share calls, scattered block tables): the grouped path's rows (what a GPU runs)
    equal the rows of one call per sequence (what the CPU runs), in fewer calls."""
    torch.manual_seed(1)
    cfg = ModelConfig.from_hf(dict(HF_CASES["mixtral"][1], architectures=["MixtralForCausalLM"]))
    size, heads, kv_heads, hd = 4, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qlens, ctxs = [1, 5, 6, 1, 7, 3, 9], [13, 17, 6, 3, 9, 11, 9]
    nblocks = 1 + sum(-(-c // size) for c in ctxs)
    ids = torch.randperm(nblocks - 1).add(1).tolist()
    tables = []
    view = PagedKVCache(cfg, nblocks, size, torch.float32).layer(0)
    for c in ctxs:
        n = -(-c // size)
        tables.append(ids[:n])
        ids = ids[n:]
        kv = torch.randn(c, 2, kv_heads, hd)
        view.write(torch.tensor([tables[-1][p // size] * size + p % size for p in range(c)]), kv)
    meta = AttentionMetadata.build(qlens, ctxs, tables, size)
    q = torch.randn(sum(qlens), heads, hd)
    calls: list[int] = []

    def attend(qb: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if qb.shape[2] > 1:
            calls.append(qb.shape[0])
        return sdpa(qb, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), mask, hd ** -0.5)

    alone = paged_attention(q, meta, view, hd, attend, attend, sliding_window=window)  # CPU: one call each
    assert calls == [1] * 5
    calls.clear()
    monkeypatch.setattr(paged, "GROUP_PREFILL_ON_CPU", True)  # as off the CPU
    made: list[tuple[int, ...]] = []
    make = paged._GroupIndex.__init__

    def spy(self, meta, members, *rest) -> None:  # type: ignore[no-untyped-def]
        made.append(tuple(members))
        make(self, meta, members, *rest)

    monkeypatch.setattr(paged._GroupIndex, "__init__", spy)
    grouped = paged_attention(q, meta, view, hd, attend, attend, sliding_window=window)
    assert len(calls) < 5 and sum(calls) == 5
    groups = list(made)
    assert len(groups) == len(calls) - calls.count(1)  # an index per group of several sequences
    # another layer of the same step reuses them; the next step's metadata makes its own
    again = paged_attention(q, meta, view, hd, attend, attend, sliding_window=window)
    assert made == groups and torch.equal(again, grouped)
    paged_attention(q, AttentionMetadata.build(qlens, ctxs, tables, size), view, hd, attend, attend,
                    sliding_window=window)
    assert made == groups * 2
    assert grouped.shape == alone.shape == (sum(qlens), heads, hd)
    assert torch.isfinite(grouped).all()
    torch.testing.assert_close(grouped, alone, rtol=1e-6, atol=1e-6)
