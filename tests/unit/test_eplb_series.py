"""bench eplb --series: the competition's scoring by hand, the simulation protocol, the
trace generators and dump readers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from launch.bench.eplb_series import (
    SeriesSettings,
    modeled_time,
    num_calls,
    run_trace,
    score,
    simulate,
)
from launch.bench.eplb_traces import KINDS, TraceSpec, load_trace, make_trace


def test_modeled_time_and_score_by_hand():
    assert modeled_time(1.2, 0) == pytest.approx(72.0)
    assert modeled_time(1.0, 1000) == pytest.approx(60.0 + 1000 * 88_080_384 / 9e11)
    assert score(80.0, 64.0) == pytest.approx(125.0)


def test_simulate_counts_par_and_moved_slots_by_hand():
    # 1 layer, 3 experts, 2 GPUs, 4 slots; load 6:2:2 every step, 6 steps, warm-up 2, interval 2
    trace = np.tile(np.array([6.0, 2.0, 2.0]), (6, 1, 1))
    stacked = np.array([[0, 0, 1, 2]])  # GPU loads 6 | 4 -> PAR 1.2
    split = np.array([[0, 1, 2, 0]])  # 5 | 5 -> PAR 1.0
    calls = []

    def policy(tr, step, old):
        calls.append(step)
        return split

    result = simulate(trace, 2, policy, 2, 2, stacked)
    assert calls == [4]  # steps 2-3 run the initial placement, the call at 4 switches
    assert result.moved == 3  # slots 1, 2 and 3 changed expert
    assert result.mean_par == pytest.approx((1.2 * 2 + 1.0 * 2) / 4)
    assert result.time == pytest.approx(60 * 1.1 + 3 * 88_080_384 / 9e11)


def test_run_trace_reports_every_policy_and_reference_scores_100():
    spec = TraceSpec("bursts", "qwen3-moe", 16, 1536, seed=0, num_layers=2)
    trace = make_trace(spec)
    settings = SeriesSettings(warmup=1024, interval=128, ours_interval=64, reference_interval=256)
    results = run_trace(trace, 16, settings)
    assert set(results) == {"ours", "reference", "fixed-hl", "hindsight"}
    assert results["ours"].calls == 7 and results["reference"].calls == 1
    assert num_calls(1536, settings) == 7 + 1 + 3 + 3
    for r in results.values():
        assert r.mean_par >= 1.0 and r.moved >= 0
    assert score(results["reference"].time, results["reference"].time) == pytest.approx(100.0)


@pytest.mark.parametrize("kind", KINDS)
def test_generated_traces_are_deterministic_counts(kind):
    spec = TraceSpec(kind, "deepseek-r1", 32, 300, seed=7, num_layers=2)
    a, b = make_trace(spec), make_trace(spec)
    assert a.shape == (300, 2, 256) and a.dtype == np.int32
    assert np.array_equal(a, b) and (a >= 0).all()
    tokens = a.sum(-1).mean()
    expected = (64 if kind == "noisy-decode" else 4096) * 8
    assert tokens == pytest.approx(expected, rel=0.2)
    assert spec.name == f"{kind}:deepseek-r1:2/58L:ep32:s7"


def test_bursts_and_phases_change_the_hot_experts():
    for kind in ("bursts", "phases"):
        trace = make_trace(TraceSpec(kind, "qwen3-moe", 16, 4096, seed=1, num_layers=2)).astype(np.float64)
        early, late = trace[:512].mean(0), trace[-512:].mean(0)
        assert np.abs(early / early.sum(-1, keepdims=True) - late / late.sum(-1, keepdims=True)).sum() > 0.1
    steady = make_trace(TraceSpec("steady", "qwen3-moe", 16, 4096, seed=1, num_layers=2)).astype(np.float64)
    early, late = steady[:512].mean(0), steady[-512:].mean(0)
    assert np.abs(early / early.sum(-1, keepdims=True) - late / late.sum(-1, keepdims=True)).sum() < 0.1


def test_load_trace_reads_both_dump_formats(tmp_path):
    count = torch.randint(0, 50, (20, 3, 8))
    save_file({"logical_count": count}, str(tmp_path / "ours.safetensors"))
    torch.save({"logical_count": count, "rank": 0}, tmp_path / "sglang.pt")
    for name in ("ours.safetensors", "sglang.pt"):
        assert np.array_equal(load_trace(tmp_path / name), count.numpy())
    np.save(tmp_path / "plain.npy", count.numpy())  # what profile report takes: the same readers
    loaded = load_trace(tmp_path / "plain.npy")
    assert loaded.dtype == np.int64 and np.array_equal(loaded, count.numpy())
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="^trace .*junk.pt: "):
        load_trace(tmp_path / "junk.pt")
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.npy: not a readable .npy file \(No data left in file\)"):
        load_trace(tmp_path / "empty.npy")
    torch.save({"logical_count": count[:1]}, tmp_path / "short.pt")
    with pytest.raises(ValueError, match=r"must be \[steps >= 2, L, E\]"):
        load_trace(tmp_path / "short.pt")
    with pytest.raises(ValueError, match="no such file"):
        load_trace(tmp_path / "missing.pt")


def test_series_cli_on_a_dump_prints_the_table_and_json(tmp_path, capsys):
    from launch.bench.eplb import main

    trace = make_trace(TraceSpec("drift", "qwen3-moe", 16, 1300, seed=3, num_layers=2))[:, :, :16]
    save_file({"logical_count": torch.from_numpy(trace.astype(np.int64))}, str(tmp_path / "d.safetensors"))
    out = tmp_path / "series.json"
    assert main(["--series", "--trace", str(tmp_path / "d.safetensors"), "--num-gpus", "4", "--no-generated",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "file:d.safetensors:ep4" in text and "mean score: ours" in text
    row = json.loads(out.read_text())["rows"][0]
    assert row["score"]["reference"] == pytest.approx(100.0)
    assert set(row["policies"]) == {"ours", "reference", "fixed-hl", "hindsight"}
    short = tmp_path / "short.pt"
    torch.save({"logical_count": torch.ones(100, 2, 16, dtype=torch.int64)}, short)
    with pytest.raises(SystemExit) as exc:
        main(["--series", "--trace", str(short), "--no-generated", "--num-gpus", "4"])
    assert exc.value.code == 2 and "needs more than" in capsys.readouterr().err


@pytest.mark.parametrize("num_gpus", [None, "5", "32"])
def test_series_refuses_a_gpu_count_that_does_not_divide_the_experts(tmp_path, capsys, num_gpus):
    """8 experts over the default 32 GPUs (or 5): the series' placements of experts + GPUs replicas would
    not spread evenly; one line naming --num-gpus, not the policy's traceback."""
    from launch.bench.eplb import main

    trace = tmp_path / "mix8.pt"
    torch.save({"logical_count": torch.ones(1300, 2, 8, dtype=torch.int64)}, trace)
    flags = ["--series", "--trace", str(trace), "--no-generated", *(["--num-gpus", num_gpus] if num_gpus else [])]
    with pytest.raises(SystemExit) as exc:
        main(flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--num-gpus" in err and "does not divide the 8 experts" in err


def test_series_json_goes_into_a_folder_it_makes(tmp_path, capsys):
    from launch.bench.eplb import main

    trace = make_trace(TraceSpec("drift", "qwen3-moe", 16, 1300, seed=3, num_layers=2))[:, :, :16]
    save_file({"logical_count": torch.from_numpy(trace.astype(np.int64))}, str(tmp_path / "d.safetensors"))
    out = tmp_path / "new" / "series.json"
    assert main(["--series", "--trace", str(tmp_path / "d.safetensors"), "--num-gpus", "4", "--no-generated",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"]


@pytest.mark.slow
def test_series_default_quick_set_beats_the_reference(capsys):
    from launch.bench.eplb import main

    assert main(["--series", "--kind", "steady", "--kind", "phases"]) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.startswith(("steady:", "phases:"))]
    assert len(rows) == 2
    for r in rows:
        assert float(r[1]) > 100.0 and float(r[1]) > float(r[2])  # ours > reference and > fixed-hl


@pytest.mark.parametrize("check, full, pattern", [
    (16, 64, [False, True, True, True, False, True, True, True, False]),  # the default
    (32, 64, [False, True, False, True, False]),
    (64, 64, [False] * 4),  # every call full
    (50, 64, [False] * 4),  # the next check would come too late: full
])
def test_ours_checks_cheaply_between_full_evaluations(monkeypatch, check, full, pattern):
    from launch.bench import eplb_series

    calls = []

    def fake(window, *args, old_phy2log, early_stay, **options):
        calls.append(early_stay)
        # horizon: the next call for a check, the next full evaluation for a full one
        assert window.shape[0] <= 2048 and options["interval"] == (check if early_stay else max(check, full // check * check))
        return (torch.from_numpy(old_phy2log),)

    monkeypatch.setattr(eplb_series, "rebalance_from_history", fake)
    settings = SeriesSettings(ours_interval=check, ours_full_interval=full)
    ours, interval = eplb_series.build_policies(8, 4, settings, 0.01)["ours"]
    assert interval == check
    old = np.tile(np.arange(12) % 8, (2, 1))
    for i in range(len(pattern)):
        ours(np.zeros((2048, 2, 8), dtype=np.int32), 1024 + (i + 1) * check, old)
    assert calls == pattern
    assert (SeriesSettings().ours_interval, SeriesSettings().ours_full_interval) == (16, 64)


def test_the_table_keeps_its_columns_under_a_long_trace_name():
    """A trace name longer than the first column (noisy-decode:qwen3-moe:8/94L:ep32:s1, 36 characters)
    pushed that row's figures right of the header's."""
    from launch.bench.eplb_series import format_rows

    def row(name: str) -> dict:
        policy = {"mean_par": 1.25, "moved": 100, "seconds_per_call": 0.02}
        return {"trace": name, "score": {"ours": 110.0, "fixed-hl": 105.0, "hindsight": 108.0},
                "policies": {k: policy for k in ("ours", "reference", "fixed-hl", "hindsight")}}

    lines = format_rows([row("steady:deepseek-r1:8/58L:ep64:s1"), row("noisy-decode:qwen3-moe:8/94L:ep32:s1" * 2)])
    head, rows = lines.splitlines()[0], lines.splitlines()[2:]
    ends = {head.index("score") + len("score")} | {r.index("110.0") + len("110.0") for r in rows}
    assert len(ends) == 1 and len({len(line) for line in [head, *rows]}) == 1


def test_a_per_pass_dumps_rank_files_are_one_trace_and_one_alone_is_refused(tmp_path):
    """An SGLang per_pass dump whose ranks each counted their own slots: its files joined by commas are
    one trace (the ranks' counts summed, as profile report reads them); one rank's file alone would
    halve the load, and is refused naming the missing rank."""
    from tests.unit.test_profile_report_qa import _local_rank_files

    rank0, rank1 = _local_rank_files(tmp_path)
    both = load_trace(f"{rank0},{rank1}")
    assert both.shape == (5, 3, 16) and both.dtype == np.int64 and (both > 0).all()
    with pytest.raises(ValueError, match=r"^trace .*pp_0.pt: SGLang per_pass dump holds the records of rank\(s\) 0; "
                                         r".*rank\(s\) 1 are missing"):
        load_trace(rank0)
