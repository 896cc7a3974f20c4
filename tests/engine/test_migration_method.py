"""``balancer.migration_method`` reaches the workers: a one-rank engine with redundant slots
rebalances by re-reading experts from the checkpoint and keeps its greedy tokens."""

from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from launch.config import RuntimeConfig
from launch.config_schema import ConfigError
from tests.oracles import make_prompts


def test_migration_method_is_validated():
    cfg = RuntimeConfig.from_dict({"model": "m", "balancer": {"migration_method": "reload"}})
    assert cfg.balancer.migration_method == "reload"
    with pytest.raises(ConfigError, match="migration_method 'rsync' is not one of"):
        RuntimeConfig.from_dict({"model": "m", "balancer": {"migration_method": "rsync"}})


@pytest.mark.slow
def test_reload_migration_keeps_tokens(hf_checkpoints):
    path = hf_checkpoints["deepseek_v3"]
    requests = [{"prompt_token_ids": p} for p in make_prompts(2, 5, 96)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(path), dtype="float32") as llm:
        single = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    # One rank balances any placement perfectly, so ours keeps the one in force; DeepSeek's policy
    # places afresh from the recorded load, which moves the redundant copies.
    with LLM(str(path), dtype="float32", enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=2,
             eplb_config={"migration_method": "reload", "step_interval": 100000, "policy": "deepseek"}) as llm:
        assert llm.engine.executor.worker.spec.migration_method == "reload"
        assert [o.outputs[0].token_ids for o in llm.generate(requests, params)] == single
        before = llm.engine.placement.phy2log.clone()
        llm.engine.rebalance()
        assert not llm.engine.placement.phy2log.equal(before)
        assert [o.outputs[0].token_ids for o in llm.generate(requests, params)] == single
