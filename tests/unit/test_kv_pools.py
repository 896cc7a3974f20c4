"""KV cache pools: zeros at start-up without writing them (lazily zeroed anonymous memory on Linux CPUs)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from moe.config import ModelConfig
from moe.kv_cache import (
    LAZY_POOL_MIN_BYTES,
    PagedKVCache,
    available_memory_bytes,
    warn_if_pools_outgrow_memory,
    zeroed_pool,
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mmap pools: Linux only")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_pool_is_zeros_of_the_shape_and_takes_writes(dtype: torch.dtype) -> None:
    shape = (64, 16, 2, 4, 128)  # [blocks, block_size, 2, kv heads, head dim]: 2 MiB and up
    pool = zeroed_pool(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous() and pool.device.type == "cpu"
    assert not pool.float().any()
    pool[3, 5] = 1
    assert pool.float().sum() == 2 * 4 * 128 and pool[3, 5].float().all()
    small = zeroed_pool((2, 3), dtype)  # under LAZY_POOL_MIN_BYTES: torch.zeros
    assert small.shape == (2, 3) and not small.float().any()


@linux
def test_large_pool_is_not_resident_until_written() -> None:
    nbytes = 256 * 1024**2
    before = _resident_bytes()
    pool = zeroed_pool((nbytes // 2 // 4096, 4096), torch.bfloat16)
    assert _resident_bytes() - before < 32 * 1024**2  # torch.zeros would make all 256 MiB resident
    pool[0].fill_(1.0)
    assert pool[0].float().sum() == 4096
    assert nbytes >= LAZY_POOL_MIN_BYTES


def test_other_devices_get_torch_zeros() -> None:
    pool = zeroed_pool((512, 1024), torch.float32, "meta")
    assert pool.device.type == "meta" and pool.shape == (512, 1024)


def test_cache_pools_per_layer_start_at_zero() -> None:
    config = ModelConfig(architecture="mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention="gqa",
                         intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=128)
    cache = PagedKVCache(config, num_blocks=4096, block_size=16, dtype=torch.bfloat16)
    assert len(cache.pools) == 3 and cache.entry_shape == config.kv_entry_shape == (2, 2, 8)
    assert all(p.shape == (4096, 2, 16, 2, 8) and not p.any() for p in cache.pools)  # a block's keys, then values


def _gqa_config(kv_heads: int = 2) -> ModelConfig:
    return ModelConfig(architecture="mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, attention="gqa",
                       intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=128)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gqa_writes_land_in_their_blocks_key_and_value_runs_and_gather_gives_token_entries(
        kv_cache_dtype: str) -> None:
    """A GQA pool [N, 2, S, Hkv, hd] holds slot s's key at [s // S, 0, s % S] and its value at
    [s // S, 1, s % S]; ``gather`` gives each sequence's tokens as [B, nb * S, 2, Hkv, hd] entries again
    (fp8: dequantized, each value within half an e4m3 step), and nothing else in the pool moves."""
    cache = PagedKVCache(_gqa_config(), num_blocks=5, block_size=4, dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)
    view = cache.layer(1)
    entries = torch.randn(7, 2, 2, 8, generator=torch.Generator().manual_seed(0))  # [T, 2, Hkv, hd]
    slots = torch.tensor([13, 2, 3, 12, 0, 19, 14])  # blocks 3, 0, 0, 3, 0, 4, 3
    view.write(slots, entries)
    pool = view.pool.float()
    assert view.pool.shape == (5, 2, 4, 2, 8) and not cache.pools[0].float().any()
    tol = 0.0 if kv_cache_dtype == "auto" else 1 / 16
    for t, s in enumerate(slots.tolist()):
        for part in (0, 1):  # key, value
            got, want = pool[s // 4, part, s % 4], entries[t, part]
            assert (got - want).abs().max().item() <= tol * want.abs().max().item(), (t, part)
    written = torch.zeros(5, 4, dtype=torch.bool)
    written.view(-1)[slots] = True
    assert not pool.permute(0, 2, 1, 3, 4)[~written].any()  # [N, S, ...]: the slots never written stay zero
    tables = torch.tensor([[3, 0], [4, 1]])
    gathered = view.gather(tables)
    assert gathered.shape == (2, 8, 2, 2, 8) and gathered.dtype == torch.float32
    for b, row in enumerate(tables.tolist()):
        for p in range(8):
            assert torch.equal(gathered[b, p], pool[row[p // 4], :, p % 4]), (b, p)
    with pytest.raises(ValueError, match=r"KV entries \(2, 3, 8\) do not match pool entries \(2, 2, 8\)"):
        view.write(slots[:1], torch.zeros(1, 2, 3, 8))


def test_pools_beyond_available_memory_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    pools = [torch.zeros(1024, dtype=torch.float32) for _ in range(3)]  # 12 KiB
    with caplog.at_level(logging.WARNING, logger="moe.kv_cache"):
        assert not warn_if_pools_outgrow_memory(pools, 1 << 20)
        assert not warn_if_pools_outgrow_memory(pools, None)
        assert warn_if_pools_outgrow_memory(pools, 8 * 1024)
    assert len(caplog.records) == 1 and "exceed" in caplog.records[0].getMessage()


@linux
def test_available_memory_reads_meminfo(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n")
    assert available_memory_bytes(str(meminfo)) == 1000 * 1024
    meminfo.write_text("MemTotal: 5 kB\n")
    assert available_memory_bytes(str(meminfo)) is None
    assert available_memory_bytes(str(tmp_path / "missing")) is None
    assert available_memory_bytes() > 0
