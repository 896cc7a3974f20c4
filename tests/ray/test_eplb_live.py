"""EPLB on a live EP4 cluster: a router biased toward two experts makes them hot; after a
rebalance they hold replicas, measured balancedness rises, and greedy tokens do not change.
The forecasting trigger (the default): the rebalance asked for is rebalance_from_history's."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from launch import LLM, SamplingParams
from tests.oracles import make_prompts


def biased_checkpoint(src, dst):
    """Copy of ``src`` whose routers prefer experts 0 and 1 (selection bias only)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            t.zero_()
            t[:2] = 5.0
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_hot_experts_gain_replicas_and_balance_rises(ray_local, hf_checkpoints, tmp_path):
    path = biased_checkpoint(hf_checkpoints["deepseek_v3"], tmp_path / "biased")
    prompts = make_prompts(9, 8, 96)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    with LLM(str(path), dtype="float32") as llm:
        single = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    with LLM(str(path), dtype="float32", data_parallel_size=4, enable_expert_parallel=True, enable_eplb=True,
             num_redundant_experts=4, eplb_config={"window_size": 1000, "check_interval": 100000}) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(requests, params)] == single
        eplb = llm.engine.eplb
        assert eplb.config.resolved_trigger == "forecast"
        _, before = eplb.balancedness()
        load = eplb.stats.logical_load(eplb.placement.phy2log)  # [L, E]
        assert (load[:, :2].sum(1) > load[:, 2:].sum(1) / 2).all()  # experts 0, 1 are hot
        info = llm.engine.rebalance()
        assert info["predicted"] > before
        logcnt = llm.engine.placement.logcnt  # [L, E]
        assert (logcnt[:, :2] >= 2).all(), logcnt
        assert [o.outputs[0].token_ids for o in llm.generate(requests, params)] == single
        _, after = eplb.balancedness()
        assert after > before + 0.05, (before, after)
        # every rank now hosts what the new placement says, and replicas hold identical weights
        prints = llm.engine.executor.call("expert_fingerprint")
        phy2log = llm.engine.placement.phy2log
        per_rank = phy2log.shape[1] // 4
        for layer in range(phy2log.shape[0]):
            by_expert: dict[int, float] = {}
            for rank, fp in enumerate(prints):
                for s, value in enumerate(fp[layer]):
                    e = int(phy2log[layer, rank * per_rank + s])
                    assert torch.isclose(torch.tensor(by_expert.setdefault(e, value)), torch.tensor(value))
