"""``python -m launch sweep`` off the happy path (second QA pass): a point that fails or a Ctrl-C
keeps what finished and says how to resume, with no traceback on the console; bad output
folders and missing checkpoints on a grid axis are one line, exit 2, before anything runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from launch.sweep import runner
from launch.sweep.report import read_rows
from tests.unit.test_sweep_runner import fake_run, sweep_base_args


@pytest.fixture
def sweep_args(tmp_path: Path, monkeypatch) -> list[str]:
    """A base config on a config.json-only checkpoint and a token-id workload (the runs are fake)."""
    monkeypatch.setattr(runner.SweepPlan, "_hardware", lambda self: None)
    return [*sweep_base_args(tmp_path), "engine.max_num_seqs=[2,4]"]


def _grid(args: list[str], *items: str) -> list[str]:
    return args[: args.index("--grid") + 1] + list(items)


def test_a_point_that_fails_is_one_line_with_its_traceback_in_a_log(sweep_args, tmp_path, capsys,
                                                                    monkeypatch):
    def third_fails(config, workload, **_kw):
        if config.engine.max_num_seqs == 3:
            raise RuntimeError("rank 1 died\nworker log follows")
        return fake_run(config, workload)

    monkeypatch.setattr(runner, "run_point", third_fails)
    args = _grid(sweep_args, "engine.max_num_seqs=[1,2,3,4,5]")
    assert runner.main(args) == 1
    err = capsys.readouterr().err
    out = tmp_path / "out"
    assert "Traceback" not in err
    assert f"error seqs=3: RuntimeError: rank 1 died (traceback in {out / 'errors.log'})" in err
    assert "run the same command again to retry them" in err
    assert "Traceback" in (out / "errors.log").read_text()
    rows = read_rows(out / "results.jsonl")
    assert [r["status"] for r in rows] == ["ok", "ok", "error", "ok", "ok"]  # the rest still ran
    with (out / "results.csv").open() as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok", "ok", "error", "ok", "ok"]


def test_ctrl_c_keeps_finished_points_writes_outputs_and_says_how_to_resume(sweep_args, tmp_path, capsys,
                                                                             monkeypatch):
    def interrupted_on_third(config, workload, **_kw):
        if config.engine.max_num_seqs == 3:
            raise KeyboardInterrupt
        return fake_run(config, workload)

    monkeypatch.setattr(runner, "run_point", interrupted_on_third)
    args = _grid(sweep_args, "engine.max_num_seqs=[1,2,3,4,5]")
    assert runner.main(args) == 130
    out = tmp_path / "out"
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"interrupted: 2 of 5 runs recorded in {out / 'results.jsonl'}; run the same command "
                       "again to resume")
    assert [r["settings"]["engine.max_num_seqs"] for r in read_rows(out / "results.jsonl")] == [1, 2]
    with (out / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2
    assert (out / "throughput.png").is_file()  # the partial result is usable as it stands

    seen = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: seen.append(c.engine.max_num_seqs) or fake_run(c, w))
    assert runner.main(args) == 0
    assert seen == [3, 4, 5]
    assert len(read_rows(out / "results.jsonl")) == 5


def test_a_missing_checkpoint_on_the_grid_is_refused_before_anything_runs(sweep_args, tmp_path, capsys,
                                                                         monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: calls.append(c) or fake_run(c, w))
    args = _grid(sweep_args, f"model=[{tmp_path / 'ckpt'},{tmp_path / 'missing'}]")
    assert runner.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --grid model: ") and "missing" in err[0]
    assert calls == [] and not (tmp_path / "out").exists()


def test_a_corrupt_sweep_json_is_one_line_naming_it(sweep_args, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.json").write_text("{broken")
    assert runner.main(sweep_args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out / 'sweep.json'} is not a sweep's JSON" in err[0]


def test_a_folder_with_results_of_unknown_origin_is_refused_untouched(sweep_args, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text('{"someone": "else"}\n')
    assert runner.main(sweep_args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds results.jsonl but no sweep.json" in err[0]
    assert (out / "results.jsonl").read_text() == '{"someone": "else"}\n'
    assert not (out / "sweep.json").exists()


def test_rows_match_a_hand_run_of_the_same_point(sweep_args, tmp_path, monkeypatch):
    """Each row's figures are summarize_run of that point's own run (the hand computation)."""
    from launch.sweep.grid import point_config
    from launch.sweep.measure import Workload, summarize_run

    monkeypatch.setattr(runner, "run_point", fake_run)
    assert runner.main(_grid(sweep_args, "engine.max_num_seqs=[2,4]")) == 0
    rows = {r["settings"]["engine.max_num_seqs"]: r for r in read_rows(tmp_path / "out" / "results.jsonl")}
    base = json.loads((tmp_path / "out" / "sweep.json").read_text())["base"]
    for seqs in (2, 4):
        config = point_config(base, {"engine.max_num_seqs": seqs})
        by_hand = summarize_run(fake_run(config, Workload(((1, 2, 3), (4, 5)), 3)), None)
        for col in ("output_tokens_per_s", "measured_step_ms", "tpot_ms_p50", "num_output_tokens"):
            assert rows[seqs][col] == pytest.approx(by_hand[col])


def test_sweep_folder_under_a_file_is_one_line(sweep_args, tmp_path):
    (tmp_path / "afile").write_text("")
    args = list(sweep_args)
    args[args.index("--out") + 1] = str(tmp_path / "afile" / "sub")
    from launch.cli import main as cli_main

    assert cli_main(["sweep", *args]) == 2


def test_a_ctrl_c_while_ray_starts_is_held_from_its_processes_and_raised_after():
    """launch.cluster.sigint_held_for_children: children started in the block inherit SIGINT
    blocked (a terminal's Ctrl-C cannot kill a raylet mid-start and orphan its agents); a press
    in the block is raised as KeyboardInterrupt once the block ends, not in the middle of it."""
    import os
    import signal
    import subprocess

    from launch.cluster import sigint_held_for_children

    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with sigint_held_for_children():
            child = subprocess.Popen(["sleep", "5"])
            os.kill(os.getpid(), signal.SIGINT)
            reached_end = True
    try:
        status = Path(f"/proc/{child.pid}/status").read_text()
        blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        assert blocked & (1 << (signal.SIGINT - 1))
    finally:
        child.kill()
        child.wait()
    assert reached_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    with sigint_held_for_children():  # no press: nothing raised
        pass


def test_a_baseline_the_base_cannot_run_is_one_line_and_the_points_still_run(sweep_args, tmp_path, capsys,
                                                                             monkeypatch):
    def base_refused(config, workload, **kw):
        if kw.get("warmup_prompts") == 0:  # the baseline's call
            raise ValueError("request 'req-0': needs KV for 55 tokens\nmore")
        return fake_run(config, workload)

    monkeypatch.setattr(runner, "run_point", base_refused)
    assert runner.main(_grid(sweep_args, "moe.capacity_factor=[0,1.5]")) == 0
    err = capsys.readouterr().err
    assert "no greedy-agreement baseline: request 'req-0': needs KV for 55 tokens\n" in err and "Traceback" not in err
    rows = read_rows(tmp_path / "out" / "results.jsonl")
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["greedy_agreement"] is None for r in rows)
    assert not (tmp_path / "out" / "baseline.json").exists()


def test_no_plots_are_claimed_when_no_point_was_measured(sweep_args, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "run_point", fake_run)
    assert runner.main(_grid(sweep_args, "balancer.num_redundant_experts=[2]")) == 1
    out = capsys.readouterr().out
    assert "(no plots: no point was measured)" in out and not (tmp_path / "out" / "throughput.png").exists()


def test_lines_of_results_jsonl_that_are_no_row_are_skipped_on_resume(sweep_args, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_point", fake_run)
    assert runner.main(sweep_args) == 0
    results = tmp_path / "out" / "results.jsonl"
    with results.open("a") as f:
        f.write('{"note": "added by hand"}\n[1, 2]\n{"key": 3}\n')
    assert runner.main(sweep_args) == 0  # resumes: every point recorded, nothing runs again
    assert len(read_rows(results)) == 2


def test_an_output_folder_without_permission_is_one_line(sweep_args, tmp_path, monkeypatch, capsys):
    from launch.cli import main as cli_main

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    assert cli_main(["sweep", *sweep_args]) == 2
    assert capsys.readouterr().err == f"error: sweep: {tmp_path / 'out'}: permission denied\n"


def test_a_resume_after_a_torn_last_line_records_the_rerun_point(sweep_args, tmp_path, monkeypatch):
    """A run killed mid-write leaves results.jsonl ending in part of a row: the resumed sweep reruns that
    point and its row goes on a line of its own, into the CSV (appended to the torn line it was unreadable)."""
    monkeypatch.setattr(runner, "run_point", fake_run)
    assert runner.main(sweep_args) == 0
    results = tmp_path / "out" / "results.jsonl"
    text = results.read_text()
    results.write_text(text[:-50])  # the second row torn
    assert [r["settings"]["engine.max_num_seqs"] for r in read_rows(results)] == [2]
    assert runner.main(sweep_args) == 0
    assert [r["settings"]["engine.max_num_seqs"] for r in read_rows(results)] == [2, 4]
    with (tmp_path / "out" / "results.csv").open() as f:
        assert [r["settings.engine.max_num_seqs"] for r in csv.DictReader(f)] == ["2", "4"]
