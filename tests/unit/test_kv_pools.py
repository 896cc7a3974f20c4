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
    assert len(cache.pools) == 3
    assert all(p.shape == (4096, 16, *config.kv_entry_shape) and not p.any() for p in cache.pools)


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
