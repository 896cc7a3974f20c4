"""launch/bench_eplb.py: the bound is sound, the table and JSON come out."""

from __future__ import annotations

import json

import numpy as np

from balancer import predict, rebalance_experts
from launch.bench.eplb import balancedness_bound, main, make_load


def test_bound_is_never_beaten_and_is_tight_when_trivial():
    rng = np.random.default_rng(0)
    for kind in ("zipf", "lognormal", "hot-group"):
        load = make_load(kind, 4, 32, rng)
        assert load.shape == (4, 32)
        for args in [(48, 4, 2, 8), (48, 1, 1, 8), (32, 1, 1, 32)]:
            bound = balancedness_bound(load, args[0], args[3], args[1], args[2])
            for policy in ("auto", "deepseek"):
                phy = rebalance_experts(load, *args, policy=policy)[0]
                assert predict(load, phy, args[3]).overall <= bound + 1e-9
    uniform = np.ones((2, 16))
    assert balancedness_bound(uniform, 16, 4) == 1.0


def test_main_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "eplb.json"
    assert main(["--scenario", "mixtral-ep8", "--load", "lognormal", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "our re-implementation" in text and "mixtral-ep8" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1
    row = rows[0]
    assert row["balancedness_ours"] >= row["balancedness_reference"] - 1e-9
    assert row["balancedness_ours"] <= row["balancedness_bound"] + 1e-9
    assert 0 < row["moved_ours"] <= row["total_copies"]


def test_a_rows_loads_do_not_depend_on_the_other_rows_run(tmp_path, capsys):
    """--scenario / --load pick rows of the full table: each scenario x load draws from its own stream
    of --seed, so mixtral-ep8's rows read the same alone as after other scenarios and loads."""
    alone, after = tmp_path / "alone.json", tmp_path / "after.json"
    assert main(["--scenario", "mixtral-ep8", "--json", str(alone)]) == 0
    assert main(["--scenario", "qwen3-ep16", "--scenario", "mixtral-ep8", "--load", "hot-group", "--load", "zipf",
                 "--load", "lognormal", "--json", str(after)]) == 0
    fields = ("balancedness_ours", "balancedness_reference", "drift_balancedness_ours", "moved_ours", "moved_reference")
    rows = {(r["scenario"], r["load"]): [r[f] for f in fields] for r in json.loads(after.read_text())["rows"]}
    for r in json.loads(alone.read_text())["rows"]:
        assert rows[("mixtral-ep8", r["load"])] == [r[f] for f in fields]
    assert main(["--scenario", "mixtral-ep8", "--seed", "1", "--json", str(after)]) == 0
    seeded = [[r[f] for f in fields] for r in json.loads(after.read_text())["rows"]]
    assert seeded != [[r[f] for f in fields] for r in json.loads(alone.read_text())["rows"]]  # the seed still counts
