"""``simulate calibrate --ray-ranks 2`` on real Ray ranks: each kind of two-rank instance is built,
stepped and timed (TP, EP, DP), and the hardware it writes charges each kind its own figure."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_each_kind_of_two_rank_instance_is_timed(ray_local, tmp_path):
    from launch.calibrate import measure_multi_rank_overheads
    from launch.tiny_checkpoint import make_tiny_checkpoint
    from parallel.costmodel import Deployment, Hardware

    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "tiny")
    hw = Hardware(name="t", flops={"float32": 5e10}, memory_bandwidth=1e10, memory_bytes=2**31,
                  intra_node_bandwidth=1e9, inter_node_bandwidth=1e9)
    lines: list[str] = []
    got = measure_multi_rank_overheads(hw, "float32", 2, lines.append, model=str(path), clock="cpu")
    assert set(got) == {"tp", "ep", "dp"} and all(v >= 0 for v in got.values())
    timed = [line for line in lines if line.startswith("engine decode step, ")]
    assert [line.split(",")[1].split()[0] for line in timed] == ["TP2", "EP2", "DP2"]
    assert all(float(line.split(": ")[1].split()[0]) > 0 for line in timed)  # each step measured, in ms
    measured = Hardware.from_dict({**hw.to_dict(), "multi_rank_overheads": got})
    for kind, dep in (("tp", Deployment(tp=2)), ("ep", Deployment(dp=2, ep=2)), ("dp", Deployment(dp=2))):
        assert measured.multi_rank_overhead(dep.multi_rank_kinds) == got[kind]
