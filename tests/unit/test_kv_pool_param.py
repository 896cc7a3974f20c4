"""A request that needs more KV than a DP rank's pool: a 400 whose param names the field to change."""

from __future__ import annotations

import pytest

from launch.core import BlockAllocator, SamplingParams, Scheduler, SchedulerConfig


def test_a_request_past_the_kv_pool_names_the_field_to_change():
    """The 400's param: the prompt when it alone needs more blocks than a rank's pool, else max_tokens."""
    from launch.server.generation import engine_error

    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, dp_size=1, block_size=4)
    sched = Scheduler(cfg, [BlockAllocator(4, 4)])  # blocks of 4 tokens: 16 tokens of KV per rank
    with pytest.raises(ValueError, match="pool has only 4 blocks") as long_output:
        sched.add_request("r", [1, 2, 3], SamplingParams(max_tokens=40))
    assert engine_error(long_output.value).param == "max_tokens"
    with pytest.raises(ValueError, match="pool has only 4 blocks") as long_prompt:
        sched.add_request("q", list(range(1, 21)), SamplingParams(max_tokens=1))
    assert engine_error(long_prompt.value).param == "prompt"
    assert str(long_prompt.value).startswith("request 'q': needs KV for")
