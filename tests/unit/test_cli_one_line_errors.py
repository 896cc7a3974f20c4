"""Bad flags of the launch commands are one ``error:`` line on stderr naming the flag, exit status 2,
no argparse usage block (``launch.config_args.FlagParser``), and the value checks that come with them:
``sweep``'s repeated ``--grid`` and its ``--hardware`` on a resumed sweep, ``kvcalc --max-model-len``
against the model's context length, ``--json ""``. Every case fails before a model loads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from launch import build_kernels, kvcalc, simulate
from launch.bench import decode, eplb, moe_layer, throughput
from launch.profile.commands import report_main, run_main
from launch.sweep import runner
from launch.sweep.measure import PointRun, StepRecord
from moe.tiny import build_tiny_config


def _run(main: Callable[[list[str]], int | None], argv: list[str], capsys) -> tuple[int | None, str]:
    """(exit status, stderr) of ``main(argv)``: its return value, or the code a parser exited with."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _assert_one_line(rc: int | None, err: str, *needles: str) -> str:
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    (line,) = lines
    assert line.startswith("error: "), line
    assert "usage:" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in line, line
    return line


@pytest.mark.parametrize("main,argv,flag", [
    (kvcalc.main, ["--model", "deepseek-ai/DeepSeek-V3", "--block-size", "sixteen"], "--block-size"),
    (kvcalc.main, ["--model", "deepseek-ai/DeepSeek-V3", "--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
    (simulate.main, ["--search", "--top", "many"], "--top"),
    (moe_layer.main, ["--tokens", "1", "lots"], "--tokens"),
    (moe_layer.main, ["--device", "tpu"], "--device"),
    (decode.main, ["--model", "m", "--steps", "x"], "--steps"),
    (decode.main, ["--model", "m", "--batch-sizes"], "--batch-sizes"),
    (throughput.main, ["--model", "m", "--hf-dtype", "int8"], "--hf-dtype"),
    (throughput.main, ["--model", "m", "--input-len-range", "3"], "--input-len-range"),
    (eplb.main, ["--repeats", "twice"], "--repeats"),
    (eplb.main, ["--series", "--num-gpus", "x"], "--num-gpus"),
    (report_main, ["dump.npy", "--out", "r", "--ep", "0"], "--ep"),
    (run_main, ["--workload", "prose", "--out", "r", "--steps", "-1"], "--steps"),
    (runner.main, ["--config", "c.yaml", "--workload", "w", "--out", "o", "--baseline", "sometimes"], "--baseline"),
    (build_kernels.main, ["--verbose=yes"], "--verbose"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(main, argv, flag, capsys):
    rc, err = _run(main, argv, capsys)
    line = _assert_one_line(rc, err, flag)
    assert line.endswith("--help` lists the flags)"), line


@pytest.mark.parametrize("main,argv,message", [
    (eplb.main, ["--drift", "-1"], "--drift must be >= 0, got -1.0"),  # the command's own parser.error
    (eplb.main, ["--series", "--check-interval", "0"], "--check-interval must be positive, got 0"),
    (report_main, ["dump.npy", "--out", ""], "--out: an empty path"),
])
def test_a_commands_own_value_check_through_its_parser_is_one_line(main, argv, message, capsys):
    _assert_one_line(*_run(main, argv, capsys), message)


@pytest.mark.parametrize("main,argv", [
    (simulate.main, ["--config", "c.yaml", "--hardware", "h100", "--json", ""]),
    (moe_layer.main, ["--tokens", "1", "--json", ""]),
    (eplb.main, ["--scenario", "mixtral-ep8", "--json", ""]),
])
def test_an_empty_json_path_is_one_line(main, argv, capsys):
    _assert_one_line(*_run(main, argv, capsys), "--json: an empty path")


def test_kvcalc_refuses_a_max_model_len_beyond_the_model_as_config_does(capsys):
    from launch.config_args import main as config_main

    argv = ["--model", "deepseek-ai/DeepSeek-V3", "--max-model-len", "1000000"]
    line = _assert_one_line(*_run(kvcalc.main, [*argv, "--memory", "2000GiB"], capsys), "max_model_len=1000000")
    rc, err = _run(config_main, argv, capsys)
    assert rc == 2 and err.strip().removeprefix("error: ") in line  # the same words as `launch config`
    assert "max_position_embeddings 163840" in line
    assert kvcalc.main([*argv[:2], "--max-model-len", "163840", "--memory", "2000GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_model_len"] == 163840


def _sweep_args(tmp_path: Path) -> list[str]:
    """A sweep's flags up to its --grid flags: a config.json-only checkpoint (the fake run never loads
    weights) and a two-prompt token-id workload."""
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_tiny_config("deepseek_v3")))
    base = tmp_path / "base.yaml"
    base.write_text(f"model: {model}\nengine: {{max_num_seqs: 4}}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [4, 5]}\n')
    return ["--config", str(base), "--workload", str(prompts), "--max-tokens", "2", "--out", str(tmp_path / "out"),
            "--no-progress", "--baseline", "never"]


def _fake_run(config, workload, **_kw) -> PointRun:
    seqs = config.engine.max_num_seqs
    return PointRun(steps=[StepRecord(0.01 * seqs, 0.01 * seqs, seqs, True)] * 4,
                    outputs=[[7] * workload.max_tokens for _ in workload.prompts], ttft_s=[0.1, 0.2],
                    tpot_s=[0.01, 0.02], elapsed_s=1.0, tokens_dropped=0, balancedness=1.0, kv_tokens=1024,
                    ep_size=1, num_moe_layers=2, top_k=2)


def test_sweep_counts_every_grid_flag():
    args = runner.build_parser().parse_args(["--config", "c", "--workload", "w", "--out", "o",
                                             "--grid", "a=[1,2]", "b=[3]", "--grid", "c=[4]"])
    assert args.grid == ["a=[1,2]", "b=[3]", "c=[4]"]


def test_sweep_runs_the_points_of_every_grid_flag(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: seen.append(
        (c.engine.max_num_seqs, c.engine.block_size)) or _fake_run(c, w))
    argv = [*_sweep_args(tmp_path), "--hardware", "none", "--grid", "engine.max_num_seqs=[2,4]",
            "--grid", "engine.block_size=[8,16]"]
    assert runner.main(argv) == 0
    assert sorted(seen) == [(2, 8), (2, 16), (4, 8), (4, 16)]


def test_a_resumed_sweep_still_checks_hardware_up_front(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "run_point", lambda c, w, **kw: _fake_run(c, w))
    argv = [*_sweep_args(tmp_path), "--grid", "engine.max_num_seqs=[2]"]
    assert runner.main([*argv, "--hardware", "none"]) == 0  # every run recorded: a rerun has nothing to do
    results = (tmp_path / "out" / "results.jsonl").read_text()
    capsys.readouterr()
    line = _assert_one_line(*_run(runner.main, [*argv, "--hardware", "foo"], capsys), "--hardware foo")
    assert "neither a file nor one of" in line
    assert (tmp_path / "out" / "results.jsonl").read_text() == results
    assert runner.main([*argv, "--hardware", "none"]) == 0
    assert "resuming: 1 of 1 runs already recorded" in capsys.readouterr().out
