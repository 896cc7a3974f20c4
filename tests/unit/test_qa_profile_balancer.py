"""QA of the balancer package's public API as docs/balancer.md shows it: the config example runs
as written, and RoutingStats takes numpy as the rest of the package does (rebalance_experts,
predict), with the same answers as torch."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from balancer import BalancerConfig, RoutingStats, rebalance_experts

DOC = Path(__file__).resolve().parents[2] / "docs" / "balancer.md"


def test_the_documented_config_example_runs_as_written():
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"^cfg = BalancerConfig\.from_dict\(.*?^cfg\.validate_for\([^\n]*\)$", text, re.S | re.M)
    assert match, "docs/balancer.md lost its BalancerConfig example"
    scope = {"BalancerConfig": BalancerConfig}
    exec(match.group(0), scope)  # noqa: S102 - the doc's own example
    assert scope["cfg"].num_physical_experts(256) == 288


def test_routing_stats_take_numpy_as_torch():
    num_layers, num_experts, num_ranks, num_slots = 3, 16, 4, 20
    phy2log = rebalance_experts(np.ones((num_layers, num_experts)), num_slots, 4, 2, num_ranks)[0]
    rng = np.random.default_rng(2)
    one, many = rng.integers(0, 5, (num_layers, num_slots)), rng.integers(0, 5, (3, num_layers, num_slots))
    from_numpy, from_torch = (RoutingStats(num_layers, num_slots, num_ranks, 10) for _ in range(2))
    from_numpy.record(one)
    from_numpy.record_many(many)
    from_numpy.set_global(from_numpy.allreduce_tensor().numpy())
    from_torch.record(torch.from_numpy(one))
    from_torch.record_many(torch.from_numpy(many))
    from_torch.set_global(from_torch.allreduce_tensor())
    assert torch.equal(from_numpy.logical_load(phy2log.numpy()), from_torch.logical_load(phy2log))
    assert from_numpy.balancedness()[1] == from_torch.balancedness()[1]
    assert from_numpy.diagnostics(phy2log.numpy()).to_dict() == from_torch.diagnostics(phy2log).to_dict()
    want = np.zeros((num_layers, num_experts), dtype=np.int64)
    window = one + many.sum(0)
    for layer in range(num_layers):
        np.add.at(want[layer], phy2log[layer].numpy(), window[layer])
    np.testing.assert_array_equal(from_numpy.logical_load(phy2log.numpy()).numpy(), want)
