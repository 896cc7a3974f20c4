"""Paths a user gives: outputs checked before the work that fills them (``launch.paths``), and the
CLI's last-resort one-line error for a path no command checked itself."""

from __future__ import annotations

import os

import numpy as np
import pytest

from launch import cli
from launch.paths import output_dir_problem, output_file_problem


def test_output_file_problems_name_the_path(tmp_path) -> None:
    (tmp_path / "afile").write_text("x")
    assert output_file_problem(tmp_path / "out.json") is None
    assert output_file_problem(tmp_path / "new" / "deeper" / "out.json") is None  # parents are made
    assert output_file_problem(tmp_path / "afile") is None  # overwritten
    assert output_file_problem(tmp_path) == f"{tmp_path} is a directory"
    assert output_file_problem(tmp_path / "afile" / "out.json") == f"{tmp_path / 'afile'} is not a directory"
    assert output_file_problem("") == "an empty path"
    assert output_dir_problem(tmp_path / "report") is None
    assert output_dir_problem(tmp_path) is None
    assert output_dir_problem(tmp_path / "afile") == f"{tmp_path / 'afile'} exists and is not a directory"
    assert output_dir_problem(tmp_path / "afile" / "report") == f"{tmp_path / 'afile'} is not a directory"
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        assert output_file_problem(tmp_path / "locked" / "x.json") == f"{tmp_path / 'locked'} is not writable"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_no_file_can_be_made_in_is_refused_even_for_root(tmp_path) -> None:
    # os.access says yes to root for /proc; nothing can be created there
    # the reason says what failed, without calling the folder "not writable" next to "no such file"
    assert output_file_problem("/proc/x.json").startswith("no file can be made in /proc (making one failed: ")
    assert output_dir_problem("/proc/out").startswith("no file can be made in /proc (making one failed: ")
    assert output_file_problem(tmp_path / "a" / "x.json") is None and output_dir_problem(tmp_path / "d") is None
    assert list(tmp_path.iterdir()) == []  # the probe file is gone again


def test_a_path_error_no_command_checked_is_one_line(monkeypatch, capsys) -> None:
    def fails(argv: list[str]) -> int:
        open("/nonexistent-dir/x.json", "w")  # noqa: SIM115 - raises
        return 0

    monkeypatch.setattr(cli, "load", lambda cmd: fails)
    assert cli.main(["simulate", "--json", "/nonexistent-dir/x.json"]) == cli.EXIT_USAGE
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "error: simulate: /nonexistent-dir/x.json: no such file or directory"
    monkeypatch.setenv("MOE_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError):
        cli.main(["simulate"])


def test_a_checkpoint_that_cannot_load_is_one_line_for_any_command(tiny_ckpt, tmp_path, monkeypatch, capsys) -> None:
    """serve and bench decode do not catch the loader's errors themselves: the CLI prints them as one
    line (exit 2); MOE_TRACEBACK=1 shows the traceback."""
    import shutil

    from moe.loading.errors import CheckpointNotFoundError

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_ckpt / "config.json", bare / "config.json")  # a config without its weights
    for argv in (["serve", "--model", str(bare), "--port", "0"],
                 ["bench", "decode", "--model", str(bare), "--batch-sizes", "1", "--steps", "1"]):
        assert cli.main(argv) == cli.EXIT_USAGE
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {' '.join(argv[:2]) if argv[0] == 'bench' else 'serve'}: {bare}: "
                               "no safetensors weights found"), line
    monkeypatch.setenv("MOE_TRACEBACK", "1")
    with pytest.raises(CheckpointNotFoundError):
        cli.main(["serve", "--model", str(bare), "--port", "0"])


def test_benchmarks_refuse_an_unwritable_json_before_running(tmp_path, capsys) -> None:
    from launch.bench import eplb, moe_layer

    with pytest.raises(SystemExit) as exit_:
        eplb.main(["--json", str(tmp_path), "--scenario", "mixtral-ep8"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, no usage block
    assert line.startswith(f"error: --json: {tmp_path} is a directory ")
    assert moe_layer.main(["--json", str(tmp_path), "--tokens", "1"]) == 2
    out = capsys.readouterr()
    assert out.err.strip() == f"error: --json: {tmp_path} is a directory" and out.out == ""


@pytest.mark.parametrize("source, problem", [
    ("x = 1\n", "defines no rebalance_experts()"),
    ("def f(:\n", "importing {file} failed: SyntaxError"),
])
def test_bench_eplb_reference_files_that_cannot_serve(tmp_path, capsys, source: str, problem: str) -> None:
    from launch.bench import eplb

    file = tmp_path / "eplb.py"
    file.write_text(source)
    with pytest.raises(SystemExit) as exit_:
        eplb.main(["--reference", str(tmp_path), "--scenario", "mixtral-ep8"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, no usage block
    assert f"error: --reference {tmp_path}: " in line and problem.format(file=file) in line


def test_profile_report_refuses_a_file_as_its_folder_and_unreadable_dumps(tmp_path, capsys) -> None:
    from launch.profile.commands import report_main

    np.save(tmp_path / "ok.npy", np.ones((3, 2, 4)))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        report_main([str(tmp_path / "ok.npy"), "--out", str(tmp_path / "afile")])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, no usage block
    assert line.startswith(f"error: --out: {tmp_path / 'afile'} exists and is not a directory ")
    (tmp_path / "empty.npy").write_bytes(b"")
    assert report_main([str(tmp_path / "empty.npy"), "--out", str(tmp_path / "r")]) != 0
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'empty.npy'}: not a readable .npy file "
                                               "(No data left in file)")
    assert report_main([str(tmp_path), "--out", str(tmp_path / "r")]) != 0
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: is a directory, not a dump file"


def test_profile_run_refuses_what_the_engine_would_before_loading(tiny_ckpt_with_tokenizer, tmp_path, capsys,
                                                                  monkeypatch) -> None:
    from launch.llm import LLM
    from launch.profile.commands import run_main

    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    base = ["--model", str(tiny_ckpt_with_tokenizer), "--workload", "prose", "--steps", "4",
            "--out", str(tmp_path / "report")]
    assert run_main([*base, "--max-model-len", "100000"]) == 2
    assert capsys.readouterr().err.strip() == ("error: engine.max_model_len=100000 > the model's "
                                               "max_position_embeddings 2048")
    assert run_main([*base, "--memory", "1KiB"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: no room for the KV cache: the weights take ")
