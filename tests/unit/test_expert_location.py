"""Expert-distribution dumps round-trip into an initial placement."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from balancer import compute_balancedness, predict, rebalance_experts
from launch.expert_location import (
    load_expert_location,
    placement_from_dump,
    read_expert_distribution_dump,
    write_expert_distribution_dump,
)

L, E, P, R = 3, 8, 10, 2


def skewed_counts(steps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([50, 1, 1, 1, 1, 1, 30, 1]).repeat(L, 1)
    return base.unsqueeze(0) * torch.randint(1, 4, (steps, L, E), generator=g)


def test_dump_with_placement_round_trips(tmp_path):
    phy2log = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 6]] * L)
    path = write_expert_distribution_dump(tmp_path, skewed_counts(), phy2log)
    tensors = read_expert_distribution_dump(path)
    assert tensors["logical_count"].shape == (5, L, E) and tensors["logical_count"].dtype == torch.int64
    assert tensors["log2phy"].shape == (L, E, 2) and tensors["logcnt"].shape == (L, E)
    placement = placement_from_dump(path, num_layers=L, num_experts=E, num_physical_experts=P, num_gpus=R)
    assert torch.equal(placement.phy2log, phy2log)
    assert placement.log2phy.shape == (L, E, 2) and placement.logcnt[0, 0] == 2 and placement.logcnt[0, 1] == 1
    assert placement.log2phy[0, 0].tolist() == [0, 8]


def test_counts_only_dump_is_rebalanced(tmp_path):
    counts = skewed_counts()
    path = write_expert_distribution_dump(tmp_path, counts)
    placement = placement_from_dump(path, num_layers=L, num_experts=E, num_physical_experts=P, num_gpus=R)
    expected, _, _ = rebalance_experts(counts.sum(0), P, 1, 1, R)
    assert placement.phy2log.shape == (L, P) and torch.equal(placement.phy2log, expected)
    assert (placement.logcnt[:, 0] == 2).all()  # the hottest expert got the redundant copy
    identity = torch.arange(P) % E
    load = counts.sum(0).to(torch.float64)
    better = predict(load, placement.phy2log, R).overall
    naive = predict(load, identity.repeat(L, 1), R).overall
    assert better > naive
    assert compute_balancedness(torch.ones(L, R))[1] == pytest.approx(1.0)


def test_placement_for_another_layout_falls_back_to_counts(tmp_path):
    path = write_expert_distribution_dump(tmp_path, skewed_counts(), torch.arange(E).repeat(L, 1))
    placement = placement_from_dump(path, num_layers=L, num_experts=E, num_physical_experts=P, num_gpus=R)
    assert placement.phy2log.shape == (L, P)


def test_bad_dumps_are_named(tmp_path):
    with pytest.raises(FileNotFoundError):
        placement_from_dump(tmp_path / "missing.safetensors", num_layers=L, num_experts=E,
                             num_physical_experts=P, num_gpus=R)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        read_expert_distribution_dump(junk)
    save_file({"other": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="neither logical_count nor phy2log"):
        read_expert_distribution_dump(tmp_path / "other.safetensors")
    save_file({"logical_count": torch.zeros(2, L, E)}, str(tmp_path / "float.safetensors"))
    with pytest.raises(ValueError, match="integer"):
        read_expert_distribution_dump(tmp_path / "float.safetensors")
    path = write_expert_distribution_dump(tmp_path, skewed_counts())
    with pytest.raises(ValueError, match="MoE layers"):
        placement_from_dump(path, num_layers=L + 1, num_experts=E, num_physical_experts=P, num_gpus=R)
    save_file({"phy2log": torch.arange(E).repeat(L, 1)}, str(tmp_path / "placement_only.safetensors"))
    with pytest.raises(ValueError, match="no logical_count"):
        placement_from_dump(tmp_path / "placement_only.safetensors", num_layers=L, num_experts=E,
                             num_physical_experts=P, num_gpus=R)
    with pytest.raises(ValueError, match=r"\[steps, L, E\]"):
        write_expert_distribution_dump(tmp_path, torch.zeros(L, E, dtype=torch.int64))


def test_load_expert_location_reads_the_layout_from_the_configs(tmp_path):
    from types import SimpleNamespace

    from launch.config import RuntimeConfig

    config = RuntimeConfig.from_dict({"model": str(tmp_path),
                                      "parallel": {"data_parallel_size": 2, "enable_expert_parallel": True},
                                      "balancer": {"enable_eplb": True, "num_redundant_experts": 2}})
    model_config = SimpleNamespace(num_experts=E, n_group=4, moe_layer_ids=tuple(range(1, L + 1)))
    phy2log = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 6]] * L)
    path = write_expert_distribution_dump(tmp_path, skewed_counts(), phy2log)
    placement = load_expert_location(path, model_config, config)
    assert placement.num_gpus == 2 and torch.equal(placement.phy2log, phy2log)
    plain = RuntimeConfig.from_dict({"model": str(tmp_path), "parallel": {"data_parallel_size": 2,
                                                                         "enable_expert_parallel": True}})
    rebalanced = load_expert_location(path, model_config, plain)  # P = E now: rebalanced from counts
    assert rebalanced.phy2log.shape == (L, E) and rebalanced.num_gpus == 2
    assert sorted(rebalanced.phy2log[0].tolist()) == list(range(E))
