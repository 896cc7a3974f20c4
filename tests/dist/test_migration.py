"""Weight migration on 2 gloo ranks against the checkpoint: after ``apply_move_plan`` (p2p or
reload from the checkpoint) every rank's slots hold exactly the checkpoint weights of the
experts the new placement names, and ``slot_to_logical`` says so."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from balancer.move_plan import compute_move_plan
from moe.config import ModelConfig
from moe.experts import Experts
from moe.loader import load_experts
from moe.tiny import write_tiny_checkpoint
from tests.dist.conftest import run_ranks

WORLD = 2
# [L=2, P=10] placements of the tiny DeepSeek-V3's 8 experts over 2 ranks (5 slots each).
OLD = [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 2, 3]]
NEW = [[5, 1, 2, 0, 4, 3, 6, 7, 0, 7], [7, 1, 2, 3, 4, 0, 6, 5, 6, 6]]


def _experts(config: ModelConfig, row: list[int], rank: int) -> Experts:
    per_rank = len(row) // WORLD
    mine = torch.tensor(row[rank * per_rank:(rank + 1) * per_rank], dtype=torch.int64)
    return Experts(per_rank, config.hidden_size, config.moe_intermediate_size, mine, dtype=torch.float32)


def _migrate(rank: int, world: int, path: str, method: str) -> dict:
    config = ModelConfig.from_hf(path)
    layers = config.moe_layer_ids[: len(OLD)]
    names = [f"model.layers.{i}.mlp.experts" for i in layers]
    experts = [_experts(config, OLD[j], rank) for j in range(len(layers))]
    for e, name in zip(experts, names):
        load_experts(path, e, name)
    plan = compute_move_plan(torch.tensor(OLD), torch.tensor(NEW), world, world, expert_bytes=1)
    from parallel.migration import apply_move_plan

    result = apply_move_plan(plan, experts, torch.tensor(NEW), rank, dist.group.WORLD, method=method,
                             checkpoint=path, module_names=names)
    expected = [_experts(config, NEW[j], rank) for j in range(len(layers))]
    for e, name in zip(expected, names):
        load_experts(path, e, name)
    return {"equal": [torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2) for a, b in zip(experts, expected)],
            "slot_to_logical": [e.slot_to_logical.tolist() for e in experts],
            "received": result.num_received, "local": result.num_local_copies}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["p2p", "reload"])
def test_apply_move_plan_matches_checkpoint(tmp_path, method):
    path = str(write_tiny_checkpoint("deepseek_v3", tmp_path / "ckpt"))
    results = run_ranks(_migrate, WORLD, path, method, timeout_s=180.0)
    plan = compute_move_plan(torch.tensor(OLD), torch.tensor(NEW), WORLD, WORLD, expert_bytes=1)
    for rank, res in enumerate(results):
        assert res["equal"] == [True, True]
        assert res["slot_to_logical"] == [row[rank * 5:(rank + 1) * 5] for row in NEW]
        assert res["received"] == sum(len(plan.recvs(rank, layer)) for layer in plan.layers())
    assert sum(r["received"] for r in results) > 0  # the plan really crosses ranks
