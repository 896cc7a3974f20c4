"""launch.sweep.runner on a fake engine run: rows, CSV, plots, resume, skipped and failed points."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from launch.sweep import runner
from launch.sweep.measure import PointRun, StepRecord, Workload, percentile, summarize_run
from launch.sweep.report import pareto_front, read_rows
from moe.tiny import build_tiny_config

ROW_KEYS = {"key", "settings", "status", "reason", "output_tokens_per_s", "measured_step_ms", "predicted_step_ms",
            "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "balancedness", "drop_rate", "kv_tokens",
            "greedy_agreement"}


def fake_run(config, workload, **_kw) -> PointRun:
    """Step time grows with max_num_seqs; a capacity factor drops tokens and changes output."""
    seqs = config.engine.max_num_seqs
    cf = config.moe.capacity_factor
    steps = [StepRecord(0.050, 0.040, 40, False)] + [StepRecord(0.010 * seqs, 0.008 * seqs, seqs, True)] * 9
    outputs = [[7] * workload.max_tokens for _ in workload.prompts]
    if cf > 0:
        outputs[0] = [8] * workload.max_tokens
    return PointRun(steps=steps, outputs=outputs, ttft_s=[0.1, 0.2], tpot_s=[0.01 * seqs, 0.02 * seqs],
                    elapsed_s=1.0 * seqs, tokens_dropped=10 if cf > 0 else 0, balancedness=0.5 + 0.1 * seqs,
                    kv_tokens=1024, ep_size=1, num_moe_layers=2, top_k=2)


def write_prompt_ids(path: Path, token_lists: list[list[int]]) -> Path:
    """A .jsonl workload of token ids (the fake checkpoints have no tokenizer.json)."""
    path.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in token_lists))
    return path


def sweep_base_args(tmp_path: Path) -> list[str]:
    """A sweep's flags up to ``--grid`` (no axes yet): a base config on a config.json-only
    checkpoint (the fake run never loads weights) and a two-prompt token-id workload."""
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_tiny_config("deepseek_v3")))
    base = tmp_path / "base.yaml"
    base.write_text(f"model: {model}\nengine: {{max_num_seqs: 4}}\n")
    prompts = write_prompt_ids(tmp_path / "p.jsonl", [[1, 2, 3], [4, 5]])
    return ["--config", str(base), "--workload", str(prompts), "--max-tokens", "3", "--out", str(tmp_path / "out"),
            "--no-progress", "--hardware", "none", "--grid"]


@pytest.fixture
def sweep_args(tmp_path: Path) -> list[str]:
    return [*sweep_base_args(tmp_path), "engine.max_num_seqs=[2,4]", "moe.capacity_factor=[0,1.5]",
            "balancer.num_redundant_experts=[0,2]"]


def test_outputs_have_the_right_keys_and_resume_skips_finished(sweep_args, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: calls.append(c) or fake_run(c, w))
    assert runner.main(sweep_args) == 0
    out = tmp_path / "out"
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 8
    ok = [r for r in rows if r["status"] == "ok"]
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert len(ok) == 4 and len(skipped) == 4  # redundant experts without EPLB: invalid, recorded
    assert all("num_redundant_experts=2 needs" in r["reason"] for r in skipped)
    for r in ok:
        assert ROW_KEYS <= set(r)
        # every column results.csv has, in results.jsonl too (this sweep runs with --hardware none)
        assert r["prediction_note"] == "--hardware none" and r["predicted_bound"] is None
        seqs = r["settings"]["engine.max_num_seqs"]
        assert r["measured_step_ms"] == pytest.approx(10.0 * seqs)
        assert r["output_tokens_per_s"] == pytest.approx(2 * 3 / seqs)
    capped = [r for r in ok if r["settings"]["moe.capacity_factor"] > 0]
    assert all(r["greedy_agreement"] == pytest.approx(0.5) and r["drop_rate"] > 0 for r in capped)
    assert all(r["greedy_agreement"] == 1.0 for r in ok if r["settings"]["moe.capacity_factor"] == 0)
    assert len(calls) == 5  # 4 valid points + the dropless single-process baseline
    base_cfg = calls[0]
    assert base_cfg.moe.capacity_factor == 0 and base_cfg.parallel.world_size == 1
    with (out / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == 8 and {"settings.engine.max_num_seqs", "measured_step_ms", "predicted_step_ms",
                                "tpot_ms_p99", "greedy_agreement"} <= set(table[0])
    assert (out / "throughput.png").stat().st_size > 1000 and (out / "tpot_vs_throughput.png").stat().st_size > 1000
    assert json.loads((out / "sweep.json").read_text())["workload"]["num_prompts"] == 2

    calls.clear()
    assert runner.main(sweep_args) == 0  # everything recorded: nothing runs again
    assert calls == [] and len(read_rows(out / "results.jsonl")) == 8


def test_failed_points_are_retried_and_a_grown_grid_adds_points(sweep_args, tmp_path, monkeypatch):
    def flaky(config, workload, **_kw):
        if config.engine.max_num_seqs == 4:
            raise RuntimeError("rank 1 died")
        return fake_run(config, workload)

    monkeypatch.setattr(runner, "run_point", flaky)
    args = sweep_args[:-3] + ["engine.max_num_seqs=[2,4]"]
    assert runner.main(args) == 1
    rows = read_rows(tmp_path / "out" / "results.jsonl")
    assert [r["status"] for r in rows] == ["ok", "error"] and "rank 1 died" in rows[1]["reason"]
    seen = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: seen.append(c.engine.max_num_seqs) or fake_run(c, w))
    assert runner.main(sweep_args[:-3] + ["engine.max_num_seqs=[2,4,8]"]) == 0
    assert seen == [4, 8]


def test_a_folder_of_another_sweep_is_refused(sweep_args, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_point", fake_run)
    assert runner.main(sweep_args) == 0
    capsys.readouterr()
    other = write_prompt_ids(tmp_path / "other.jsonl", [[6, 7, 8]])
    args = list(sweep_args)
    args[args.index("--workload") + 1] = str(other)
    assert runner.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a sweep with another workload" in err[0]


@pytest.mark.parametrize("grid, needle", [
    (["engine.max_num_sqs=[1,2]"], "'engine.max_num_sqs' (did you mean 'engine.max_num_seqs'?)"),
    (["engine.max_num_seqs=[1,"], "--grid engine.max_num_seqs:"),
])
def test_grid_errors_are_one_line_exit_2(sweep_args, grid, needle, capsys):
    args = sweep_args[: sweep_args.index("--grid") + 1] + grid
    assert runner.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


@pytest.mark.parametrize("grid, line", [
    (["engine.max_num_seqs=2,4"],
     "error: --grid engine.max_num_seqs: '2,4' is one value; a list needs brackets: engine.max_num_seqs=[2,4]"),
    (["engine.max_num_seqs=[abc,4]"], "error: --grid engine.max_num_seqs: expected int, found str 'abc'"),
    (["engine.max_num_seqs=[2]", "balancer.enable_eplb,moe.capacity_factor=[[true,0],[false,high]]"],
     "error: --grid moe.capacity_factor: expected float, found str 'high'"),
    (["engine=[1,2]"], "error: --grid: 'engine' is a section, not a setting: give one of its keys such as "
                       "engine.dtype, engine.max_num_seqs or engine.max_num_batched_tokens"),
])
def test_grid_values_are_type_checked_before_anything_runs(sweep_args, tmp_path, grid, line, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: calls.append(c) or fake_run(c, w))
    args = sweep_args[: sweep_args.index("--grid") + 1] + grid
    assert runner.main(args) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert calls == [] and not (tmp_path / "out").exists()


def _workload_args(sweep_args: list[str], workload: Path, *extra: str) -> list[str]:
    args = list(sweep_args[: sweep_args.index("--grid")]) + ["--grid", "engine.max_num_seqs=[2,4]", *extra]
    args[args.index("--workload") + 1] = str(workload)
    return args


def test_a_workload_the_model_cannot_run_is_refused_up_front(sweep_args, tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: calls.append(c) or fake_run(c, w))
    model = tmp_path / "ckpt"
    bad = write_prompt_ids(tmp_path / "bad.jsonl", [[1, 2], [3, 512, 4]])
    assert runner.main(_workload_args(sweep_args, bad)) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: workload bad.jsonl: prompt 2 has token id 512, outside the vocabulary [0, 512) of {model}"]
    text = tmp_path / "t.txt"
    text.write_text("hello there\n")
    assert runner.main(_workload_args(sweep_args, text)) == 2
    assert capsys.readouterr().err.splitlines() == [
        f'error: workload t.txt: prompt 1 is text but {model} has no tokenizer.json: give "prompt_token_ids" '
        "in a .jsonl workload"]
    assert calls == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["bad.txt", "bad.jsonl"])
def test_a_workload_that_is_not_utf8_is_one_line_naming_it(sweep_args, tmp_path, capsys, name):
    bad = tmp_path / name
    bad.write_bytes(b"\xff\xfehello\n")
    assert runner.main(_workload_args(sweep_args, bad)) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {bad}: not UTF-8 text (line 1)"]
    assert not (tmp_path / "out").exists()


def test_max_tokens_beyond_max_model_len_is_refused_up_front(sweep_args, tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: calls.append(c) or fake_run(c, w))
    prompts = write_prompt_ids(tmp_path / "p.jsonl", [[1, 2, 3], [4, 5]])
    args = _workload_args(sweep_args, prompts)
    args[args.index("--max-tokens") + 1] = "100000"
    assert runner.main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: workload p.jsonl: --max-tokens 100000 leaves no room for a prompt in max_model_len 2048 "
        "(the model's max_position_embeddings)"]
    args[args.index("--max-tokens") + 1] = "14"
    assert runner.main([*args, "--set", "engine.max_model_len=16"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: workload p.jsonl: prompt 1 of 3 tokens + --max-tokens 14 exceeds max_model_len 16"]
    assert calls == [] and not (tmp_path / "out").exists()
    assert runner.main([*args, "--set", "engine.max_model_len=17"]) == 0  # 3 + 14 fits exactly
    assert len(calls) == 2


def test_a_swept_max_model_len_too_short_skips_its_points(sweep_args, tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: calls.append(c) or fake_run(c, w))
    args = sweep_args[: sweep_args.index("--grid") + 1] + [
        "engine.max_model_len,moe.capacity_factor=[[5,0],[64,1.5]]", "--set", "engine.max_model_len=5"]
    assert runner.main(args) == 0
    rows = {r["settings"]["engine.max_model_len"]: r for r in read_rows(tmp_path / "out" / "results.jsonl")}
    assert rows[5]["status"] == "skipped"
    assert rows[5]["reason"] == "workload p.jsonl: prompt 1 of 3 tokens + --max-tokens 3 exceeds max_model_len 5"
    assert rows[64]["status"] == "ok" and rows[64]["greedy_agreement"] is None
    assert [c.engine.max_model_len for c in calls] == [64]  # no baseline: the base's length is too short
    assert "no greedy-agreement baseline: workload p.jsonl: prompt 1 of 3 tokens" in capsys.readouterr().err


def test_a_sweep_that_measures_no_point_exits_1(sweep_args, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(runner, "run_point", fake_run)
    args = sweep_args[: sweep_args.index("--grid") + 1] + ["balancer.num_redundant_experts=[2,4]"]
    assert runner.main(args) == 1  # redundant experts without EPLB: every point skipped
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"error: no point was measured: 2 skipped, 0 failed (reasons in {out / 'results.jsonl'})"
    assert runner.main(args) == 1  # still nothing measured when resumed
    assert capsys.readouterr().err.splitlines()[-1] == err[-1]

    def dead(config, workload, **_kw):
        raise RuntimeError("rank 1 died")

    monkeypatch.setattr(runner, "run_point", dead)
    assert runner.main(args[:-1] + ["balancer.num_redundant_experts=[0,2,4]"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: no point was measured: 2 skipped, 1 failed (reasons in {out / 'results.jsonl'})")


def test_summarize_run_percentiles_and_drop_rate():
    run = fake_run(type("C", (), {"engine": type("E", (), {"max_num_seqs": 4}),
                                  "moe": type("M", (), {"capacity_factor": 1.0})})(),
                   Workload(("a", "b"), 3))
    row = summarize_run(run, baseline=[[7, 7, 7], [7, 7, 7]])
    assert row["measured_step_ms"] == pytest.approx(40.0) and row["prefill_step_ms"] == pytest.approx(50.0)
    assert row["ttft_ms_p50"] == pytest.approx(150.0) and row["ttft_ms_p99"] == pytest.approx(199.0)
    assert row["drop_rate"] == pytest.approx(10 / ((40 + 9 * 4) * 2 * 2))
    assert row["num_decode_steps"] == 9 and row["greedy_agreement"] == pytest.approx(0.5)
    assert percentile([], 50) is None and percentile([3.0], 99) == 3.0


def test_pareto_front_by_hand():
    pts = [(10.0, 5.0), (20.0, 8.0), (15.0, 9.0), (5.0, 4.0), (20.0, 7.0)]
    # (15, 9) is beaten by (20, 8); (20, 8) by (20, 7)
    assert pareto_front(pts) == [3, 0, 4]


def test_predicted_step_ms_is_the_cost_model_at_the_measured_point(tmp_path, monkeypatch):
    from launch.simulate_point import predict_runtime_point
    from launch.sweep.grid import point_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_tiny_config("deepseek_v3")))
    base = tmp_path / "base.yaml"
    base.write_text(f"model: {model}\nparallel: {{data_parallel_size: 2, enable_expert_parallel: true}}\n")
    prompts = write_prompt_ids(tmp_path / "p.jsonl", [[1, 2], [3, 4]])
    load = [[100, 50, 10, 10, 5, 5, 5, 5], [10, 10, 10, 10, 80, 40, 5, 5]]  # [L_moe=2, E=8]

    def skewed(config, workload, **_kw):
        run = fake_run(config, workload)
        run.steps = [StepRecord(0.02, 0.01, 8, True, mean_context=40.0)] * 5
        run.expert_load, run.phy2log, run.dp_size = load, [list(range(8))] * 2, 2
        return run

    monkeypatch.setattr(runner, "run_point", skewed)
    assert runner.main(["--config", str(base), "--workload", str(prompts), "--out", str(tmp_path / "o"),
                        "--no-progress", "--hardware", "h100", "--grid", "engine.max_num_seqs=[4]"]) == 0
    row = read_rows(tmp_path / "o" / "results.jsonl")[0]
    cfg = point_config({"model": str(model), "parallel": {"data_parallel_size": 2, "enable_expert_parallel": True}},
                       {"engine.max_num_seqs": 4})
    import numpy as np

    want = predict_runtime_point(cfg, "h100", batch_size=4, kv_len=40, expert_load=np.array(load, dtype=float),
                                 placement=np.array([list(range(8))] * 2))
    assert row["decode_batch_per_rank_p50"] == 4 and row["decode_context_mean"] == 40.0
    assert row["predicted_step_ms"] == pytest.approx(want.decode_step_ms) and row["predicted_step_ms"] > 0
    assert row["prediction_error"] == pytest.approx((want.decode_step_ms - 20.0) / 20.0)
    assert row["prediction_error_cpu"] == pytest.approx((want.decode_step_ms - 10.0) / 10.0)
    assert row["predicted_balancedness"] == pytest.approx(want.balancedness) and row["predicted_balancedness"] < 1


def test_repeats_run_round_robin_and_resume(sweep_args, tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: order.append(c.engine.max_num_seqs) or fake_run(c, w))
    args = sweep_args[:-3] + ["engine.max_num_seqs=[2,4]", "balancer.num_redundant_experts=[0,2]", "--repeats", "2"]
    assert runner.main(args) == 0
    assert order == [2, 4, 2, 4]  # round-robin; the invalid points are recorded once, not repeated
    rows = read_rows(tmp_path / "out" / "results.jsonl")
    assert sorted(r["repeat"] for r in rows if r["status"] == "ok") == [0, 0, 1, 1]
    assert len([r for r in rows if r["status"] == "skipped"]) == 2
    with (tmp_path / "out" / "medians.csv").open() as f:
        medians = list(csv.DictReader(f))
    assert [m["num_repeats"] for m in medians] == ["2", "2"]
    assert float(medians[0]["measured_step_ms"]) == pytest.approx(20.0)
    order.clear()
    assert runner.main(args[:-1] + ["3"]) == 0
    assert order == [2, 4]


def test_a_point_this_cluster_cannot_place_is_skipped_with_the_reason(sweep_args, tmp_path, monkeypatch):
    """A placement the cluster can never make (launch.cluster.ClusterError, raised in seconds) skips
    its point with the reason, as an invalid layout does; the other points run."""
    from launch.cluster import ClusterError

    def place(config, workload, **_kw):
        if config.engine.max_num_seqs == 2:
            raise ClusterError("placement strategy STRICT_SPREAD puts each of the 2 ranks on its own node, and this "
                               "cluster has 1 node(s) that can hold one: use PACK or SPREAD, or add nodes")
        return fake_run(config, workload)

    monkeypatch.setattr(runner, "run_point", place)
    args = sweep_args[: sweep_args.index("--grid") + 1] + ["engine.max_num_seqs=[2,4]"]
    assert runner.main(args) == 0
    rows = {r["settings"]["engine.max_num_seqs"]: r for r in read_rows(tmp_path / "out" / "results.jsonl")}
    assert rows[2]["status"] == "skipped" and rows[2]["reason"].startswith("placement strategy STRICT_SPREAD")
    assert rows[4]["status"] == "ok"


def test_auto_hardware_times_ray_ranks_at_each_count_a_point_runs(tmp_path, monkeypatch):
    """``--hardware auto`` calibrates with ``ray_ranks`` = every rank count above one (TP x DP) a
    point runs, so each multi-rank point is predicted with what its own rank count adds per step."""
    asked = {}
    monkeypatch.setattr("launch.calibrate.calibrate", lambda **kw: asked.update(kw) or None)
    monkeypatch.setattr("launch.hardware.save_hardware", lambda hw, path: None)
    points = [{"parallel.tensor_parallel_size": 1, "parallel.data_parallel_size": 1},
              {"parallel.tensor_parallel_size": 2}, {"parallel.data_parallel_size": 2, "parallel.tensor_parallel_size": 2},
              {"parallel.data_parallel_size": 4}, {"parallel.data_parallel_size": "x"}]
    plan = runner.SweepPlan({"model": str(tmp_path), "parallel": {"data_parallel_size": 1}}, [], points,
                            Workload(("hi",), 4, "w"), tmp_path)
    assert plan.rank_counts() == (2, 4)
    plan._hardware()
    assert asked["ray_ranks"] == (2, 4)
    assert runner.SweepPlan({"parallel": {"data_parallel_size": 2}}, [], [{}], Workload(("hi",), 4, "w"),
                            tmp_path).rank_counts() == (2,)
    assert runner.SweepPlan({}, [], [{}], Workload(("hi",), 4, "w"), tmp_path).rank_counts() == ()
