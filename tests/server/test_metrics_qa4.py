"""``vllm:cache_config_info``: vLLM's info gauge (value 1) whose labels carry the KV cache config,
with vLLM's ``CacheConfig`` label names and ``str()`` values, read from ``engine.stats().kv_cache``.

One in-process check of the exposition, one engine built without a block override (the pool sized
from memory), one live server on the tiny real engine.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import LLM
from launch.async_llm import EngineStats, KVCacheInfo, kv_cache_info
from launch.server.metrics import ServerMetrics
from tests.server.test_server_live import LiveServer, runtime_config

LABELS = {"model_name", "block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
          "num_gpu_blocks", "num_gpu_blocks_override"}


def cache_config_samples(text: str) -> list:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get("vllm:cache_config_info")
    if family is None:
        return []
    assert family.type == "gauge"
    return family.samples


def test_cache_config_info_is_a_gauge_of_one_with_vllms_labels_and_str_values():
    info = KVCacheInfo(num_blocks=1234, block_size=16, cache_dtype="auto", memory_utilization=0.9,
                       enable_prefix_caching=True, num_blocks_override=None)
    metrics = ServerMetrics("m", stats=lambda: EngineStats(kv_cache=info))
    (sample,) = cache_config_samples(metrics.exposition().decode())
    assert sample.name == "vllm:cache_config_info" and sample.value == 1.0
    assert sample.labels == {"model_name": "m", "block_size": "16", "cache_dtype": "auto",
                             "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
                             "num_gpu_blocks": "1234", "num_gpu_blocks_override": "None"}
    # an engine that reports no pool: left out, as any field the engine does not report
    assert cache_config_samples(ServerMetrics("m", stats=EngineStats).exposition().decode()) == []


def test_the_engine_reports_its_pool_as_sized(tiny_ckpt_with_tokenizer):
    """No block override: the pool is sized from memory; num_gpu_blocks is that size (per DP rank)."""
    with LLM(str(tiny_ckpt_with_tokenizer), dtype="float32", max_model_len=48, block_size=8,
             enable_prefix_caching=False, kv_cache_dtype="fp8_e4m3", gpu_memory_utilization=0.5) as llm:
        info = kv_cache_info(llm.engine)
        pool = llm.engine.scheduler.allocators[0]
    assert info == KVCacheInfo(num_blocks=pool.num_blocks, block_size=8, cache_dtype="fp8", memory_utilization=0.5,
                               enable_prefix_caching=False, num_blocks_override=None)


@pytest.fixture(scope="module")
def live(tiny_ckpt_with_tokenizer, tmp_path_factory):
    with LiveServer(runtime_config(tiny_ckpt_with_tokenizer, tmp_path_factory.mktemp("dist"))) as srv:
        yield srv


def test_live_cache_config_info(live):
    (sample,) = cache_config_samples(httpx.get(live.base_url + "/metrics").text)
    assert sample.value == 1.0 and set(sample.labels) == LABELS
    # runtime_config: num_kv_blocks 64, block_size 8; the rest at their defaults
    assert sample.labels == {"model_name": live.engine.model_name, "block_size": "8", "cache_dtype": "auto",
                             "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
                             "num_gpu_blocks": "64", "num_gpu_blocks_override": "64"}
