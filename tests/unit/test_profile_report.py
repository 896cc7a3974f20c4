"""``profile report``: readers of every format, the analysis numbers against an independent
oracle, bad input as one-line errors. End-to-end report folders are in test_profile_cli.py."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from balancer import BalancerConfig, Placement, rebalance_experts
from launch.balancing import EplbDriver
from launch.profile import analysis as an
from launch.profile.commands import report_main
from launch.profile.readers import DumpError, read_dump, read_recording
from launch.profile.report import summary_of
from launch.profile.study import ReportOptions, analyze
from launch.profile.whatif import WhatIfRow, recommend_eplb_config, recommend_redundant, simulate_eplb
from tests.unit.profile_dumps import (
    oracle_balancedness,
    oracle_hot,
    oracle_identity_rank_load,
    skewed_counts,
    write_sglang_per_pass,
    write_sglang_stat,
)

S, L, E = 40, 3, 8
QUIET = ReportOptions(progress=False)


def _summary(paths, **kw) -> dict:
    return summary_of(analyze(read_recording(paths), ReportOptions(progress=False, **kw)))


def test_sglang_stat_summary_equals_independent_computation(tmp_path):
    count = skewed_counts(S, L, E)
    path = write_sglang_stat(tmp_path / "expert_distribution_recorder_1.pt", count, empty_tail=25)
    summary = _summary([path], ep_sizes=[4, 2], redundant=[0, 4])
    assert (summary["steps"], summary["num_layers"], summary["num_experts"]) == (S, L, E)  # empty tail dropped
    assert summary["recorded_ep"] == 4  # the dump has no placement: the first --ep, identity placement
    load = count.sum(0)
    per_layer, overall = oracle_balancedness(oracle_identity_rank_load(load, 4))
    ids, shares = oracle_hot(load)
    assert summary["overall_balancedness"] == pytest.approx(overall, rel=1e-12)
    assert [x["layer"] for x in summary["layers"]] == list(range(L))
    for x, entry in enumerate(summary["layers"]):
        assert entry["balancedness"] == pytest.approx(per_layer[x], rel=1e-12)
        assert entry["hot_experts"] == ids[x]
        assert entry["load_share"] == pytest.approx(shares[x], rel=1e-12)
    rows = {(r["ep"], r["redundant"], r["policy"]): r for r in summary["what_if"]}
    assert set(rows) == {(ep, r, p) for ep in (4, 2) for r in (0, 4) for p in ("global", "hierarchical")}
    for (ep, r, policy), row in rows.items():
        groups, nodes = (2, 2) if policy == "hierarchical" else (1, 1)
        phy = rebalance_experts(load, E + r, groups, nodes, ep, policy=policy)[0].numpy()
        copies = np.array([[np.sum(phy[x] == e) for e in range(E)] for x in range(L)])
        slot = np.array([[load[x, phy[x, p]] / copies[x, phy[x, p]] for p in range(E + r)] for x in range(L)])
        want = oracle_balancedness(slot.reshape(L, ep, -1).sum(-1))[1]
        base = oracle_balancedness(oracle_identity_rank_load(load, ep))[1]
        assert row["balancedness"] == pytest.approx(want, rel=1e-9)
        assert row["no_eplb_balancedness"] == pytest.approx(base, rel=1e-12)
        assert row["gain_over_no_eplb"] == pytest.approx(want / base, rel=1e-9)
    json.dumps(summary)  # plain JSON types throughout


def test_sglang_per_pass_ranks_are_summed_and_read_exactly(tmp_path):
    phy2log = np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 5]] * L, dtype=np.int64)  # P = 10, experts 0 and 5 twice
    rng = np.random.default_rng(1)
    rank0 = rng.integers(0, 20, size=(6, L, 10))
    rank1 = rng.integers(0, 20, size=(6, L, 10))
    a = write_sglang_per_pass(tmp_path / "r0.pt", rank0, phy2log, 0, [3, 4, 5, 6, 7, 8])
    b = write_sglang_per_pass(tmp_path / "r1.pt", rank1, phy2log, 1, [3, 4, 5, 6, 7, 8])
    rec = read_recording([a, b])
    assert rec.logical_count.shape == (6, L, E) and len(rec.dumps) == 1
    physical = (rank0 + rank1).sum(0)  # [L, P]
    logical = np.zeros((L, E))
    for x in range(L):
        for p in range(10):
            logical[x, phy2log[x, p]] += physical[x, p]
    summary = summary_of(analyze(rec, QUIET))
    assert summary["recorded_ep"] == 2  # two ranks' files
    per_layer, overall = oracle_balancedness(physical.reshape(L, 2, 5).sum(-1))  # exact per-slot counts
    assert summary["overall_balancedness"] == pytest.approx(overall, rel=1e-12)
    assert [x["balancedness"] for x in summary["layers"]] == pytest.approx(per_layer, rel=1e-12)
    assert [x["hot_experts"] for x in summary["layers"]] == oracle_hot(logical)[0]
    assert summary["sources"][0]["placement"] == "physical counts"


def test_per_pass_single_rank_uses_recorded_ep_flag(tmp_path):
    phy2log = np.tile(np.arange(E), (L, 1))
    phys = np.random.default_rng(2).integers(0, 9, size=(4, L, E))
    path = write_sglang_per_pass(tmp_path / "r0.pt", phys, phy2log, 0, [0, 1, 2, 3])
    summary = _summary([path], recorded_ep=8, ep_sizes=[2])
    assert summary["recorded_ep"] == 8
    assert summary["layers"][0]["rank_load"] == [float(v) for v in phys.sum(0)[0]]


def test_npy_npz_csv_read_the_same_counts(tmp_path):
    count = skewed_counts(7, 2, 4, seed=3)
    np.save(tmp_path / "c.npy", count)
    np.savez(tmp_path / "c.npz", logical_count=count, dropped_count=np.ones((7, 2)))
    with (tmp_path / "c.csv").open("w") as f:
        f.write("step,layer," + ",".join(f"e{e}" for e in range(4)) + "\n")
        for s in reversed(range(7)):  # any row order
            for x in range(2):
                f.write(f"{s},{x}," + ",".join(str(v) for v in count[s, x]) + "\n")
    for name in ("c.npy", "c.npz", "c.csv"):
        d = read_dump(tmp_path / name)
        assert d.logical_count.shape == (7, 2, 4)
        np.testing.assert_array_equal(d.logical_count, count)
    assert read_dump(tmp_path / "c.npz").dropped.shape == (7, 2)
    np.save(tmp_path / "one.npy", count[0])  # [L, E] is one step
    assert read_dump(tmp_path / "one.npy").logical_count.shape == (1, 2, 4)
    rec = read_recording([tmp_path / "c.npy", tmp_path / "c.csv"])  # concatenated in order
    assert rec.num_steps == 14 and rec.offsets == [0, 7]


def test_our_dump_physical_counts_drops_and_phases(tmp_path):
    placement = Placement.identity(2, 4, 2, 2)  # slots [0 1 2 | 3 0 1] on 2 ranks
    driver = EplbDriver(BalancerConfig(), placement, num_groups=1, num_nodes=1, expert_bytes=1)
    driver.start_record()
    loads = [torch.tensor([[5, 1, 1, 1, 5, 0], [2, 2, 2, 2, 0, 0]]), torch.tensor([[0, 3, 0, 3, 0, 3]] * 2)]
    for i, slot_load in enumerate(loads):
        driver.record(slot_load, torch.tensor([i, 2 * i]))
    driver.stop_record()
    path = driver.dump_record(tmp_path, metadata={"phases": json.dumps([{"name": "a", "start": 0, "end": 1},
                                                                         {"name": "b", "start": 1, "end": 2}])})
    d = read_dump(path)
    assert d.format == "moe-serve" and d.num_ranks == 2 and d.physical_count.shape == (2, 2, 6)
    np.testing.assert_array_equal(d.logical_count[0, 0], [10, 1, 1, 1])
    summary = _summary([path], ep_sizes=[2, 4])
    physical = torch.stack(loads).sum(0).numpy()
    assert summary["recorded_ep"] == 2
    assert summary["overall_balancedness"] == pytest.approx(
        oracle_balancedness(physical.reshape(2, 2, 3).sum(-1))[1], rel=1e-12)
    assert summary["drops"]["per_layer"] == [1.0, 2.0]
    assert summary["drops"]["fraction_per_layer"] == pytest.approx([1 / 22, 2 / 17])
    phases = summary["phases"]
    assert [(p["name"], p["start"], p["end"]) for p in phases] == [("a", 0, 1), ("b", 1, 2)]
    assert phases[0]["hot_experts"][0][:2] == [0, 1] and phases[1]["hot_experts"][0][:2] == [1, 3]
    assert phases[0]["overlap_with_previous"] is None and phases[1]["overlap_with_previous"] == 0.5  # top-2


def test_trailing_mean_churn_and_hot_experts_by_hand():
    values = np.array([1.0, 0.0, 0.5, 0.5])
    np.testing.assert_allclose(an.trailing_mean(values, 2), [1.0, 0.5, 0.25, 0.5])
    count = np.zeros((4, 1, 4))
    count[0, 0] = count[1, 0] = [9, 5, 1, 0]  # window 0 (steps 0-1): top-2 {0, 1}
    count[2, 0] = count[3, 0] = [0, 5, 9, 1]  # window 1: top-2 {2, 1}
    np.testing.assert_allclose(an.hot_set_churn(count, 2, 2), [[0.5]])
    ids, share = an.hot_experts(count.sum(0), 3)
    assert ids.tolist() == [[1, 2, 0]] and share[0] == pytest.approx([20 / 60, 20 / 60, 18 / 60])  # ties: lower id
    assert an.hot_experts(np.zeros((1, 4)))[1].tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_drifting_load_recommends_a_short_interval():
    rng = np.random.default_rng(4)
    hot = np.repeat([0, 3, 6, 1], 30)  # the hot expert moves every 30 steps
    count = rng.integers(0, 3, size=(120, 2, 8)).astype(float)
    count[np.arange(120), :, hot] += 60
    rec = recommend_eplb_config(count, 4, 4, {10: 0.0}, progress=False)
    assert rec["step_interval"] <= 30 and rec["window_size"] == 10
    assert rec["balancedness"] > rec["no_eplb_balancedness"] + 0.1
    assert f"window 10, interval {rec['step_interval']}" in rec["basis"]
    still = rng.integers(0, 3, size=(120, 2, 8)).astype(float)
    still[:, :, 3] += 60  # a hot expert that never moves: rebalancing rarely is as good
    assert recommend_eplb_config(still, 4, 4, {}, progress=False)["step_interval"] == 100
    assert simulate_eplb(still, 4, 12, 10, 10, 10) == pytest.approx(simulate_eplb(still, 4, 12, 100, 100, 10), abs=0.02)


def test_recommendation_and_summary_keys(tmp_path):
    path = write_sglang_stat(tmp_path / "s.pt", skewed_counts(S, L, E, seed=5))
    summary = _summary([path], ep_sizes=[4])
    red = summary["recommendation"]["num_redundant_experts"]
    assert red["ep"] == 4 and red["value"] in {0, 4, 8} and "predicted balancedness" in red["basis"]
    eplb = summary["recommendation"]["eplb_config"]
    assert eplb["window_size"] == 10 and eplb["step_interval"] in (10, 30) and eplb["candidates"]
    time = summary["balancedness_over_time"]
    assert time["window_sizes"] == [10] and len(time["per_step"]) == S
    assert summary["hot_set_churn"]["windows"]["10"]["overlap"]


def _run(argv, capsys) -> tuple[int, str]:
    rc = report_main([str(a) for a in argv] + ["--no-progress"])
    return rc, capsys.readouterr().err


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    a = write_sglang_stat(tmp_path / "a.pt", skewed_counts(5, L, E))
    b = write_sglang_stat(tmp_path / "b.pt", skewed_counts(5, L, 6))
    rc, err = _run([a, b, "--out", tmp_path / "r"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "b.pt" in err and "6 experts" in err
    rc, err = _run([a, "--out", tmp_path / "r", "--ep", "3"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "EP size 3 does not divide the 8 experts" in err
    np.save(tmp_path / "bad.npy", np.ones((2, 3, 4, 5)))
    rc, err = _run([tmp_path / "bad.npy", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "bad.npy" in err and "[steps, L, E]" in err
    (tmp_path / "bad.csv").write_text("step,layer,e0,e1\n0,0,1,2\n0,1,1,2\n1,0,3,4\n")
    rc, err = _run([tmp_path / "bad.csv", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and "step 1, layer 1 is missing" in err
    save_file({"logical_count": -np.ones((2, 2, 2), dtype=np.int64)}, str(tmp_path / "neg.safetensors"))
    rc, err = _run([tmp_path / "neg.safetensors", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and "non-negative" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("content", [b"abc", b"", b"\x80", b"PK\x03\x04junk"], ids=["abc", "empty", "x80", "zip"])
def test_a_pt_file_torch_cannot_read_is_one_line(tmp_path, capsys, content):
    """Garbage in a .pt makes torch's weights-only unpickler raise anything (IndexError for ``abc``)."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    with pytest.raises(DumpError, match=f"^{re.escape(str(bad))}: not a readable torch.save file \\("):
        read_dump(bad)
    rc, err = _run([bad, "--out", tmp_path / "r"], capsys)
    assert rc == 2 and err.count("\n") == 1 and f"{bad}: not a readable torch.save file" in err
    assert not (tmp_path / "r").exists()


class _Payload:
    """Pickles as a call to Path.touch: loading it without weights_only would create the file."""

    def __init__(self, target: pathlib.Path) -> None:
        self.target = target

    def __reduce__(self):
        return pathlib.Path.touch, (self.target,)


def test_pickle_with_code_is_refused_without_running_it(tmp_path, capsys):
    marker = tmp_path / "pwned"
    torch.save({"logical_count": torch.ones(2, L, E, dtype=torch.int32), "extra": _Payload(marker)},
               str(tmp_path / "evil.pt"))
    rc, err = _run([tmp_path / "evil.pt", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "evil.pt" in err and "refused" in err
    assert not marker.exists()
    with pytest.raises(DumpError, match="neither an SGLang stat dump"):
        torch.save({"something": torch.ones(2)}, str(tmp_path / "other.pt"))
        read_dump(tmp_path / "other.pt")


def test_idle_layers_like_sglang_dense_layers(tmp_path):
    count = skewed_counts(30, L, E, seed=6)
    count[:, 0] = 0  # SGLang counts every model layer: dense ones stay zero
    summary = _summary([write_sglang_stat(tmp_path / "s.pt", count)], ep_sizes=[2])
    first = summary["layers"][0]
    assert first["idle"] and first["balancedness"] == 1.0 and first["load_share"] == [0.0] * 5
    want = oracle_balancedness(oracle_identity_rank_load(count.sum(0)[1:], 2))[1]
    assert summary["overall_balancedness"] == pytest.approx(want, rel=1e-12)
    churn = an.hot_set_churn(count.astype(float), 10, 2)
    assert churn.shape == (2, L) and np.isnan(churn[:, 0]).all() and not np.isnan(churn[:, 1:]).any()
    assert summary["hot_set_churn"]["windows"]["10"]["mean_overlap"] == pytest.approx(np.nanmean(churn))
    json.dumps(summary, allow_nan=False)


def test_redundant_recommendation_rule():
    def row(r, bal):
        return WhatIfRow(4, r, "global", bal, 0.5, bal / 0.5, None, 1, 1)

    rows = [row(0, 0.60), row(4, 0.88), row(8, 0.95), row(16, 0.96)]
    pick = recommend_redundant(rows, 4)  # 90 % of the 0.36 gain is 0.924: 8 is the first to reach it
    assert pick["value"] == 8 and "0.950" in pick["basis"] and "best 0.960 with 16" in pick["basis"]
    assert recommend_redundant([row(0, 0.990), row(4, 0.997)], 4)["value"] == 0  # gains < 0.01
    assert recommend_redundant(rows, 8) is None


def test_stat_dump_of_bfloat16_or_nested_lists(tmp_path):
    count = skewed_counts(4, 2, 4, seed=8)
    torch.save({"logical_count": torch.from_numpy(count).to(torch.bfloat16)}, str(tmp_path / "bf16.pt"))
    torch.save({"logical_count": count.tolist()}, str(tmp_path / "lists.pt"))
    for name in ("bf16.pt", "lists.pt"):
        np.testing.assert_array_equal(read_dump(tmp_path / name).logical_count, count)  # small ints are exact
