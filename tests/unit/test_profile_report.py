"""``profile report``: readers of every format, the analysis numbers against an independent
oracle, bad input as one-line errors. End-to-end report folders are in test_profile_cli.py."""

from __future__ import annotations

import json
import pathlib
import re
from types import SimpleNamespace

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
    record_our_dump,
    skewed_counts,
    write_csv,
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
    np.save(tmp_path / "huge.npy", np.full((2, 1, 4), 1e300))  # finite, but its sums overflow the placement's
    rc, err = _run([tmp_path / "huge.npy", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "huge.npy: logical_count holds 1e+300, past 2**53" in err
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
    assert first["idle"] and first["balancedness"] == 1.0
    assert first["hot_experts"] == [] and first["load_share"] == []  # no tokens: no expert is hot
    assert all(len(x["hot_experts"]) == 5 for x in summary["layers"][1:])
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
    # 0 redundant already takes 97 % of the gain over no EPLB (0.756 -> 0.988 of 1.000): no doubling for 0.012
    rows = [WhatIfRow(4, r, "global", bal, 0.756, bal / 0.756, None, 1, 1) for r, bal in ((0, 0.988), (8, 1.0))]
    assert recommend_redundant(rows, 4)["value"] == 0
    assert recommend_redundant(rows, 8) is None


def test_stat_dump_of_bfloat16_or_nested_lists(tmp_path):
    count = skewed_counts(4, 2, 4, seed=8)
    torch.save({"logical_count": torch.from_numpy(count).to(torch.bfloat16)}, str(tmp_path / "bf16.pt"))
    torch.save({"logical_count": count.tolist()}, str(tmp_path / "lists.pt"))
    for name in ("bf16.pt", "lists.pt"):
        np.testing.assert_array_equal(read_dump(tmp_path / name).logical_count, count)  # small ints are exact


def test_idle_layer_shows_idle_in_the_page_and_phases(tmp_path):
    from launch.profile.html_report import render_page

    count = skewed_counts(20, L, E, seed=9)
    count[:10, 1] = 0  # layer 1 idle in the first phase only
    count[:, 2] = 0  # layer 2 idle throughout
    phases = json.dumps([{"name": "a", "start": 0, "end": 10}, {"name": "b", "start": 10, "end": 20}])
    save_file({"logical_count": count}, str(tmp_path / "d.safetensors"), metadata={"phases": phases})
    a = analyze(read_recording([tmp_path / "d.safetensors"]), ReportOptions(progress=False, ep_sizes=[2]))
    summary = summary_of(a)
    first, second = summary["phases"]
    assert first["hot_experts"][1] == [] and first["load_share"][1] == [] and len(first["hot_experts"][0]) == 5
    assert len(second["hot_experts"][1]) == 5 and second["hot_experts"][2] == []
    page = render_page(a, summary, [])
    assert "<td>2</td>" in page and "idle (no tokens)" in page and "2: idle" in page


def test_empty_dumps_among_several_are_skipped_with_one_warning(tmp_path, capsys):
    """The server writes a 0-step dump for a dump before /start, after /stop or twice in a row."""
    rng = np.random.default_rng(5)
    before = record_our_dump(tmp_path, [], E, 2)
    full = record_our_dump(tmp_path, [rng.integers(0, 9, size=(2, E)) for _ in range(6)], E, 2)
    after = record_our_dump(tmp_path, [], E, 2)
    assert "_0steps_" in before.name and "_0steps_" in after.name
    out = tmp_path / "r"
    rc, err = _run([before, full, after, "--out", out, "--ep", "2"], capsys)
    assert rc == 0
    assert err == f"warning: skipped 2 dump(s) with no recorded steps: {before}, {after}\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and [s["path"] for s in summary["sources"]] == [str(full)]
    assert summary["skipped_sources"] == [
        {"path": str(p), "reason": f"holds no recorded steps (logical_count is [0, 2, {E}])"} for p in (before, after)]
    assert f"<code>{before}</code>: skipped" in (out / "index.html").read_text()
    stat_empty = write_sglang_stat(tmp_path / "stat.pt", np.zeros((4, 2, E), dtype=np.int64))  # no tokens at all
    rc, err = _run([before, stat_empty, "--out", tmp_path / "r2"], capsys)
    assert rc == 2 and err == f"error: none of the 2 dumps given holds a recorded step: {before}, {stat_empty}\n"
    rc, err = _run([before, "--out", tmp_path / "r3"], capsys)  # one empty dump stays an error
    assert rc == 2 and err == f"error: {before}: holds no recorded steps (logical_count is [0, 2, {E}])\n"
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


def _per_pass(path, records, phy2log):
    torch.save({"records": records, "last_physical_to_logical_map": phy2log}, str(path))


def _bad_inputs(tmp_path) -> dict[str, tuple[pathlib.Path, str]]:
    """name -> (file, the one-line message it must give)."""
    phy = torch.arange(E).repeat(2, 1)
    rec = {"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary",
           "global_physical_count": torch.ones(2, E, dtype=torch.int32)}
    cases = {}
    _per_pass(tmp_path / "badid.pt", [{**rec, "forward_pass_id": "x"}], phy)
    cases["pass id"] = (tmp_path / "badid.pt", "records[0].forward_pass_id must be an integer, got 'x'")
    _per_pass(tmp_path / "badrank.pt", [{**rec, "rank": 1.5}], phy)
    cases["rank"] = (tmp_path / "badrank.pt", "records[0].rank must be an integer, got 1.5")
    _per_pass(tmp_path / "emptymap.pt", [{**rec, "global_physical_count": torch.zeros(2, 0)}],
              torch.zeros(2, 0, dtype=torch.int64))
    cases["empty map"] = (tmp_path / "emptymap.pt", "last_physical_to_logical_map [2, 0] has no layers or no slots")
    _per_pass(tmp_path / "hugeid.pt", [rec], torch.tensor([[0, 10**12]] * 2))
    cases["huge expert id"] = (tmp_path / "hugeid.pt",
                               "last_physical_to_logical_map names expert 1000000000000 but has only 2 slots")
    save_file({"logical_count": np.ones((2, 2, 4), dtype=np.int64), "num_gpus": np.zeros(0, dtype=np.int64)},
              str(tmp_path / "gpus.safetensors"))
    cases["num_gpus"] = (tmp_path / "gpus.safetensors", "num_gpus must be one integer, got int64 of shape [0]")
    (tmp_path / "huge.csv").write_text("step,layer,e0,e1\n0,0,1,2\n1000000000000,0,3,4\n")
    cases["huge step"] = (tmp_path / "huge.csv",
                          "row for step 1, layer 0 is missing (every step x layer needs exactly one row)")
    (tmp_path / "dup.csv").write_text("step,layer,e0,e1\n0,0,1,2\n1,0,3,4\n0,0,1,2\n")
    cases["repeated row"] = (tmp_path / "dup.csv",
                             "row for step 0, layer 0 is repeated (every step x layer needs exactly one row)")
    (tmp_path / "short.csv").write_text("step,layer,e0,e1\n0,0,1,2\n\n1,0,3\n")
    cases["short row"] = (tmp_path / "short.csv", "line 4 has 3 columns, the header has 4")
    (tmp_path / "long.csv").write_text("step,layer,e0,e1\n0,0,1,2,9\n1,0,3,4\n")
    cases["long row"] = (tmp_path / "long.csv", "line 2 has 5 columns, the header has 4")
    (tmp_path / "nan.csv").write_text("step,layer,e0,e1\n0,0,1,2\n1,0,3,four\n")
    cases["not a number"] = (tmp_path / "nan.csv", "line 3 holds a value that is not a number")
    save_file({"logical_count": np.ones((2, 2, 4), dtype=np.int64)}, str(tmp_path / "meta.safetensors"),
              metadata={"moe_layer_ids": "[1, 2, 3]"})
    cases["layer ids"] = (tmp_path / "meta.safetensors", "metadata 'moe_layer_ids' must be a JSON list of 2 layer ids")
    save_file({"logical_count": np.ones((2, 2, 4), dtype=np.int64)}, str(tmp_path / "group.safetensors"),
              metadata={"n_group": "two"})
    cases["n_group"] = (tmp_path / "group.safetensors", "metadata 'n_group' must be a positive integer, got 'two'")
    # more drops than assignments: the report drew drops of 600,000 %
    np.savez(tmp_path / "drops.npz", logical_count=np.ones((2, 2, 4), dtype=np.int64),
             dropped_count=np.array([[1, 2], [4, 5]]))
    cases["drops"] = (tmp_path / "drops.npz",
                      "dropped_count at step 1, layer 1 is 5, more than the 4 assignments logical_count routes there")
    save_file({"logical_count": np.ones((2, 2, 4), dtype=np.int64), "dropped_count": np.full((2, 2), 9)},
              str(tmp_path / "drops.safetensors"))
    cases["drops (ours)"] = (tmp_path / "drops.safetensors",
                             "dropped_count at step 0, layer 0 is 9, more than the 4 assignments logical_count "
                             "routes there")
    return cases


BAD = ["pass id", "rank", "empty map", "huge expert id", "num_gpus", "huge step", "repeated row", "short row",
       "long row", "not a number", "layer ids", "n_group", "drops", "drops (ours)"]


@pytest.mark.parametrize("name", BAD)
def test_malformed_dumps_are_one_line_errors_naming_the_problem(tmp_path, capsys, name):
    path, message = _bad_inputs(tmp_path)[name]
    rc, err = _run([path, "--out", tmp_path / "r"], capsys)
    assert (rc, err) == (2, f"error: {path}: {message}\n")
    assert not (tmp_path / "r").exists()


def test_csv_with_a_utf8_bom_and_npz_or_torch_dump_without_suffix(tmp_path):
    count = skewed_counts(5, 2, 4, seed=2)
    bom = write_csv(tmp_path / "excel.csv", count, encoding="utf-8-sig")
    assert bom.read_bytes().startswith(b"\xef\xbb\xbf")
    np.testing.assert_array_equal(read_dump(bom).logical_count, count)
    np.savez(tmp_path / "c.npz", logical_count=count)
    (tmp_path / "c.npz").rename(tmp_path / "counts")
    d = read_dump(tmp_path / "counts")
    assert d.format == "npz"
    np.testing.assert_array_equal(d.logical_count, count)
    write_sglang_stat(tmp_path / "s.pt", count).rename(tmp_path / "stat")  # torch.save's zip stays torch's
    assert read_dump(tmp_path / "stat").format == "sglang-stat"


def test_plain_pickle_with_code_is_refused_in_one_line_without_warnings(tmp_path, capsys):
    import pickle
    import warnings

    marker = tmp_path / "pwned"
    (tmp_path / "evil_plain.pt").write_bytes(pickle.dumps(_Payload(marker), protocol=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc, err = _run([tmp_path / "evil_plain.pt", "--out", tmp_path / "r"], capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"error: {tmp_path / 'evil_plain.pt'}: refused")
    assert [str(w.message) for w in caught] == []
    assert not marker.exists()


def test_dump_metadata_gives_the_report_the_models_groups_and_layer_ids(tmp_path):
    from launch.profile.dumps import model_metadata

    model = SimpleNamespace(n_group=4, moe_layer_ids=(1, 3), num_experts=E)
    loads = [np.random.default_rng(s).integers(0, 9, size=(2, E)) for s in range(8)]
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    new = record_our_dump(tmp_path / "new", loads, E, 2, metadata=model_metadata(model))
    old = record_our_dump(tmp_path / "old", loads, E, 2)  # written before the metadata existed
    summary = _summary([new], ep_sizes=[2])
    assert [x["model_layer"] for x in summary["layers"]] == [1, 3]
    assert {r["num_groups"] for r in summary["what_if"] if r["policy"] == "hierarchical"} == {4}
    summary = _summary([old], ep_sizes=[2])
    assert all("model_layer" not in x for x in summary["layers"])
    assert {r["num_groups"] for r in summary["what_if"] if r["policy"] == "hierarchical"} == {2}  # the nodes
    summary = _summary([new], ep_sizes=[2], num_groups=8)  # --num-groups still wins
    assert {r["num_groups"] for r in summary["what_if"] if r["policy"] == "hierarchical"} == {8}


def test_server_dump_carries_the_models_groups_and_layer_ids(tmp_path):
    """``/dump_expert_distribution_record`` goes through ``AsyncLLM.dump_expert_distribution_record``."""
    from launch.async_llm import AsyncLLM

    engine = SimpleNamespace(model_config=SimpleNamespace(n_group=4, moe_layer_ids=(1, 2), num_experts=E))
    driver = EplbDriver(BalancerConfig(), Placement.identity(2, E, 0, 2), num_groups=4, num_nodes=1, expert_bytes=1)
    driver.start_record()
    driver.record(torch.ones(2, E, dtype=torch.int64))
    server = SimpleNamespace(runtime_config=SimpleNamespace(server=SimpleNamespace(expert_distribution_dir=tmp_path)),
                             _eplb=lambda: driver, call=lambda fn: fn(engine))
    path = AsyncLLM.dump_expert_distribution_record(server)
    d = read_dump(path)
    assert (d.n_group, d.model_layers) == (4, (1, 2))


def test_the_worst_layer_card_names_the_layer_as_the_table_does(tmp_path):
    """With the model's layer ids known (a dense first layer), the headline card and the per-layer
    table both say "1 (L2)": the MoE-layer index and the model's layer id."""
    from launch.profile import html_report
    from launch.profile.dumps import model_metadata

    model = SimpleNamespace(n_group=1, moe_layer_ids=(1, 2), num_experts=E)
    loads = [np.random.default_rng(s).integers(0, 9, size=(2, E)) for s in range(8)]
    dump = record_our_dump(tmp_path, loads, E, 2, metadata=model_metadata(model))
    summary = _summary([dump], ep_sizes=[2])
    worst = min(summary["layers"], key=lambda x: x["balancedness"])
    name = f"{worst['layer']} (L{worst['model_layer']})"
    cards = html_report._cards(SimpleNamespace(overall=0.5, num_ranks=2, top=4), summary)
    assert f"worst layer {name}<" in cards
    assert f"<td>{name}</td>" in html_report._layer_table(summary)


def test_a_one_step_recording_draws_its_point(tmp_path, capsys):
    """One step is one point: a line alone draws nothing (the plot was empty axes)."""
    import matplotlib.image

    np.save(tmp_path / "one.npy", skewed_counts(1, 2, 8, seed=4))
    assert _run([tmp_path / "one.npy", "--out", tmp_path / "r"], capsys)[0] == 0
    png = matplotlib.image.imread(tmp_path / "r" / "balancedness_time.png")[..., :3]  # [H, W, 3] in [0, 1]
    h, w, _ = png.shape
    middle = png[int(0.15 * h):int(0.85 * h), int(0.45 * w):int(0.55 * w)]  # around step 1, away from the legend
    level = middle.mean(-1)  # the gray marker over white, not the black axes
    gray = (np.abs(middle - level[..., None]).max(-1) < 0.02) & (level > 0.5) & (level < 0.85)
    assert gray.sum() > 20  # the marker's pixels (its border line too)
