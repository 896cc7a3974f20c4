"""Capacity settings travel typed (``moe.capacity.CapacityConfig``) from the runtime config to
every MoE layer: each accepted scope/policy/overflow combination runs end to end through ``LLM``
and the ``generate`` CLI, rejected ones fail at config time naming the combination."""

from __future__ import annotations

import json

import pytest
import torch

from launch import LLM, SamplingParams
from launch.config import RuntimeConfig
from launch.config_schema import ConfigError
from launch.generate import main as generate_main
from moe.capacity import CapacityConfig, compute_capacity
from moe.config import ModelConfig
from moe.moe_layer import MoELayer, compute_slot_scores
from tests.oracles import make_prompts, run

ACCEPTED = [("local", "position", "drop"), ("local", "score", "drop"), ("local", "position", "reroute"),
            ("local", "score", "reroute"), ("global", "position", "drop")]
REJECTED = [("global", "score", "drop"), ("global", "position", "reroute"), ("global", "score", "reroute")]


def _kwargs(scope: str, policy: str, overflow: str, cf: float) -> dict:
    return dict(capacity_factor=cf, capacity_scope=scope, capacity_policy=policy, capacity_overflow=overflow)


@pytest.mark.parametrize("scope,policy,overflow", REJECTED)
def test_unsupported_global_combinations_are_rejected_at_config_time(scope, policy, overflow):
    with pytest.raises(ConfigError, match=f"capacity_scope 'global' supports .*got policy '{policy}' with "
                                          f"overflow '{overflow}'"):
        RuntimeConfig.from_dict({"model": "m", "moe": {"capacity_factor": 1.0, "capacity_scope": scope,
                                                       "capacity_policy": policy, "capacity_overflow": overflow}})
    # dropless: the other fields are inert, nothing to reject
    RuntimeConfig.from_dict({"model": "m", "moe": {"capacity_scope": scope, "capacity_policy": policy,
                                                   "capacity_overflow": overflow}})


def test_runtime_config_carries_a_typed_capacity():
    cfg = RuntimeConfig.from_dict({"model": "m", "moe": {"capacity_factor": 1.25, "capacity_policy": "score",
                                                         "capacity_overflow": "reroute", "min_capacity": 2}})
    assert cfg.moe.capacity == CapacityConfig(1.25, "local", "score", "reroute", 2)
    assert cfg.moe.capacity.is_local and not cfg.moe.capacity.is_global


def test_slot_scores_mask_every_copy_of_a_used_expert():
    scores = torch.tensor([[0.1, 0.5, 0.3, float("-inf")]])  # [T=1, E=4]
    phy2log = torch.tensor([0, 1, 2, 3, 1, 2])  # P=6: experts 1 and 2 have two copies
    out = compute_slot_scores(scores, torch.tensor([[1]]), phy2log)
    assert out.shape == (1, 6)
    inf = float("-inf")
    assert torch.equal(out, torch.tensor([[0.1, inf, 0.3, inf, inf, 0.3]]))


@pytest.mark.parametrize("policy", ["position", "score"])
def test_moe_layer_reroutes_within_capacity_to_unused_experts(hf_checkpoints, policy):
    config = ModelConfig.from_hf(hf_checkpoints["deepseek_v3"])
    cap = CapacityConfig(0.6, policy=policy, overflow="reroute")
    layer = MoELayer(config, 1, dtype=torch.float32, capacity=cap)
    layer.set_placement(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, 2]), num_ranks=1, rank=0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        layer.gate.weight[0] += 2.0  # expert 0 hot: its slots overflow
    x = torch.randn(40, config.hidden_size, generator=gen)
    seen = {}
    layer.dispatcher.dispatch_combine = lambda x, ids, w, experts, layer_id: seen.update(ids=ids, w=w) or x.float()
    out = layer(x)
    assert out.shape == (40, config.hidden_size)
    ids = seen["ids"]  # [T, K] physical slots after capacity
    assert ids.shape == (40, config.num_experts_per_tok)
    capacity = compute_capacity(40, 12, config.num_experts_per_tok, 0.6)
    assert torch.bincount(ids[ids >= 0], minlength=12).max() <= capacity
    overflow = int((layer.slot_load - capacity).clamp(min=0).sum())  # demand past C, slot by slot
    assert layer.counters["rerouted"] > 0
    assert layer.counters["rerouted"] + layer.counters["dropped"] == overflow
    assert int((ids >= 0).sum()) == 40 * config.num_experts_per_tok - layer.counters["dropped"]
    logical = torch.where(ids >= 0, layer.phy2log[ids.clamp(min=0)], -1)
    for row in logical.tolist():  # a token never reaches the same expert twice
        kept = [e for e in row if e >= 0]
        assert len(kept) == len(set(kept))


@pytest.mark.slow
@pytest.mark.parametrize("scope,policy,overflow", ACCEPTED)
def test_each_accepted_combination_runs_through_llm(hf_checkpoints, scope, policy, overflow):
    path = hf_checkpoints["deepseek_v3"]
    prompts = make_prompts(4, 6, 96)
    assert run(path, prompts, n=4, **_kwargs(scope, policy, overflow, 100.0)) == run(path, prompts, n=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(path), dtype="float32", **_kwargs(scope, policy, overflow, 0.5)) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        counters = llm.engine.counters
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    if overflow == "reroute":
        assert counters.tokens_rerouted > 0
    else:
        assert counters.tokens_rerouted == 0 and counters.tokens_dropped > 0


def _write_inputs(tmp_path, n: int = 3):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": [5 + i, 9, 17, 33], "max_tokens": 3,
                                       "temperature": 0, "ignore_eos": True}) + "\n" for i in range(n)))
    return src


def test_generate_cli_reroute_does_not_crash(hf_checkpoints, tmp_path):
    """The reported crash: --capacity-factor 1.0 --set moe.capacity_overflow=reroute."""
    src, dst = _write_inputs(tmp_path), tmp_path / "out.jsonl"
    rc = generate_main(["--model", str(hf_checkpoints["mixtral"]), "--input", str(src), "--output", str(dst),
                        "--dtype", "float32", "--capacity-factor", "1.0", "--set", "moe.capacity_overflow=reroute"])
    assert rc == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["token_ids"]) == 3 for r in rows)


def test_generate_cli_names_a_rejected_combination(hf_checkpoints, tmp_path, capsys):
    src, dst = _write_inputs(tmp_path), tmp_path / "out.jsonl"
    rc = generate_main(["--model", str(hf_checkpoints["mixtral"]), "--input", str(src), "--output", str(dst),
                        "--capacity-factor", "1.0", "--set", "moe.capacity_scope=global",
                        "--set", "moe.capacity_policy=score"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "capacity_scope 'global' supports" in err and len(err.splitlines()) == 1
    assert not dst.exists()
