"""``profile run`` on a live EP2 Ray cluster: routers biased toward experts 0 and 1 make them the
hot experts of every layer, and the report's rank loads are the recorded per-slot counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from launch import cli
from tests.ray.test_eplb_live import biased_checkpoint


@pytest.mark.slow
def test_profile_run_on_ep2_ray_reports_the_biased_experts(ray_local, tmp_path):
    pytest.importorskip("launch.workloads")
    assert cli.main(["make-tiny", "--arch", "deepseek_v3", "--out", str(tmp_path / "tiny")]) == 0
    model = biased_checkpoint(tmp_path / "tiny", tmp_path / "biased")
    (tmp_path / "a.txt").write_text("the river runs to the sea\nstones and water\n")
    out = tmp_path / "profile"
    rc = cli.main(["profile", "run", "--model", str(model), "--workload", str(tmp_path / "a.txt"), "--steps", "8",
                   "--max-tokens", "4", "--max-num-seqs", "2", "-dp", "2", "--enable-expert-parallel",
                   "--dtype", "float32", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recorded_ep"] == 2 and summary["steps"] == 8
    assert summary["run"]["layout"] == "TP 1 x DP 2, EP 2"
    for layer in summary["layers"]:
        assert sorted(layer["hot_experts"][:2]) == [0, 1]
    dump = load_file(str(next(out.glob("expert_distribution_*.safetensors"))))
    physical = dump["physical_count"].sum(0)  # [L, P]: experts 0..3 on rank 0
    ranks = physical.reshape(physical.shape[0], 2, -1).sum(-1).astype(float)
    assert summary["overall_balancedness"] == pytest.approx(ranks.mean(1).sum() / ranks.max(1).sum(), rel=1e-12)
    assert (ranks[:, 0] > ranks[:, 1]).all()
    np.testing.assert_array_equal(dump["logical_count"].sum((0, 2)), physical.sum(1))
