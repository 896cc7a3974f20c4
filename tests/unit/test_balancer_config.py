"""BalancerConfig (strict, vLLM names) and the should_rebalance trigger."""

from __future__ import annotations

import json

import pytest
import torch

from balancer import BalancerConfig, RoutingStats, should_rebalance


def test_defaults_match_vllm():
    c = BalancerConfig()
    assert (c.enable_eplb, c.num_redundant_experts, c.window_size, c.resolved_step_interval,
            c.log_balancedness) == (False, 0, 1000, 3000, False)
    assert c.min_balancedness_to_skip == 0.95 and c.policy == "auto"


def test_from_dict_accepts_vllm_eplb_config_json():
    c = BalancerConfig.from_dict(json.loads(
        '{"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 32, "log_balancedness": true,'
        ' "use_async": true, "policy": "default"}'))
    assert c.num_redundant_experts == 32 and c.log_balancedness and c.use_async
    assert c.resolved_policy == "auto"


def test_forecast_trigger_is_the_default_and_interval_keeps_vllms_schedule():
    c = BalancerConfig.from_dict({"window_size": 500, "check_interval": 32, "move_margin": 2.0,
                                  "step_seconds": 0.01})
    assert (c.resolved_trigger, c.check_interval, c.move_margin, c.step_seconds) == ("forecast", 32, 2.0, 0.01)
    assert BalancerConfig().resolved_trigger == "forecast"
    # cheap checks every 16 steps, a full evaluation at least every 64 (the series benchmark's choice)
    assert (BalancerConfig().check_interval, BalancerConfig().full_check_interval) == (16, 64)
    assert BalancerConfig.from_dict({"full_check_interval": 128}).full_check_interval == 128
    # vLLM's names give vLLM's behaviour; an explicit trigger wins
    assert BalancerConfig.from_dict({"window_size": 1000, "step_interval": 3000}).resolved_trigger == "interval"
    assert BalancerConfig(trigger="forecast", step_interval=500).resolved_trigger == "forecast"
    assert BalancerConfig(trigger="interval").resolved_step_interval == 3000


def test_from_dict_names_unknown_key():
    with pytest.raises(ValueError, match="window_sise"):
        BalancerConfig.from_dict({"window_sise": 10})


@pytest.mark.parametrize("kwargs, match", [
    ({"window_size": 0}, "window_size=0"),
    ({"num_redundant_experts": -1}, "num_redundant_experts=-1"),
    ({"step_interval": -5}, "step_interval=-5"),
    ({"policy": "fastest"}, "fastest"),
    ({"min_balancedness_to_skip": 1.5}, "min_balancedness_to_skip=1.5"),
    ({"window_size": 2.5}, "must be an int"),
    ({"trigger": "sometimes"}, "trigger 'sometimes'"),
    ({"check_interval": 0}, "check_interval=0"),
    ({"full_check_interval": 0}, "full_check_interval=0"),
    ({"full_check_interval": 1.5}, "full_check_interval must be an int"),
    ({"move_margin": -1.0}, "move_margin=-1.0"),
    ({"transfer_bytes_per_s": 0.0}, "transfer_bytes_per_s=0.0"),
])
def test_bad_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BalancerConfig(**kwargs)


def test_validate_for_names_the_numbers():
    BalancerConfig(enable_eplb=True, num_redundant_experts=32).validate_for(256, 32)
    with pytest.raises(ValueError, match=r"256 \+ num_redundant_experts=30 = 286 .* ep_size=32"):
        BalancerConfig(enable_eplb=True, num_redundant_experts=30).validate_for(256, 32)
    with pytest.raises(ValueError, match="enable_eplb"):
        BalancerConfig(num_redundant_experts=8).validate_for(8, 8)
    with pytest.raises(ValueError, match="ep_size=0"):
        BalancerConfig().validate_for(8, 0)


def _stats(loads):
    stats = RoutingStats(1, 4, 2, window_size=2)
    for row in loads:
        stats.record(torch.tensor([row]))
    return stats


def test_should_rebalance_on_interval_unless_balanced():
    cfg = BalancerConfig(enable_eplb=True, step_interval=10, min_balancedness_to_skip=0.9)
    skewed = _stats([[9, 1, 1, 1]])
    balanced = _stats([[1, 1, 1, 1]])
    assert should_rebalance(10, skewed, cfg)
    assert not should_rebalance(9, skewed, cfg)
    decision = should_rebalance(20, balanced, cfg)
    assert not decision and "skipped" in decision.reason and decision.balancedness == 1.0
    assert not should_rebalance(10, skewed, BalancerConfig(step_interval=10))
    assert not should_rebalance(0, skewed, cfg)


def test_should_rebalance_early_below_threshold_once_window_full():
    cfg = BalancerConfig(enable_eplb=True, step_interval=1000, rebalance_below_balancedness=0.8)
    assert not should_rebalance(3, _stats([[9, 1, 1, 1]]), cfg)  # window not full yet
    decision = should_rebalance(3, _stats([[9, 1, 1, 1], [9, 1, 1, 1]]), cfg)
    assert decision and "< 0.8" in decision.reason
