"""Bad user input found before any work, as one ``error: ...`` line naming the flag, exit 2 (second
pass): empty paths, an absurd --memory, sweep --out on a file, bench overhead --transports on one
rank, submit's --working-dir / --runtime-env-json checked before the dashboard is asked, and
profile --num-groups / --hierarchical-nodes that cannot apply."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from launch import cli, submit
from launch.core.kv_sizing import parse_memory
from moe.tiny import build_tiny_config
from tests.unit.profile_dumps import skewed_counts


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


def _config_only_model(tmp_path: Path) -> Path:
    """A tiny DeepSeek-V3 checkpoint folder with only config.json (8 experts, n_group 2): enough for
    every check made before a model loads."""
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(build_tiny_config("deepseek_v3")))
    return model


# 1. empty paths ---------------------------------------------------------------------------------

def test_generate_empty_output_or_input_is_named_an_empty_path(tmp_path, capsys):
    from launch import generate

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert generate.main(["--model", str(tmp_path), "--input", str(prompts), "--output", ""]) == 2
    assert _one_line(capsys) == "error: --output: an empty path"
    assert generate.main(["--model", str(tmp_path), "--input", "", "--output", str(tmp_path / "o.jsonl")]) == 2
    assert _one_line(capsys) == "error: --input: an empty path"
    assert generate.main(["--model", str(tmp_path), "--input", str(prompts), "--output", str(prompts)]) == 2
    assert _one_line(capsys) == f"error: --output {prompts} is the input file; write the completions elsewhere"
    assert not (tmp_path / "o.jsonl").exists()


def test_bench_quantization_empty_texts_is_named_an_empty_path(tmp_path, capsys):
    from launch.bench import quantization

    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):  # never read: the --texts check comes first
        (model / name).write_text("{}")
    text = tmp_path / "t.txt"
    text.write_text("hello")
    assert quantization.main(["--model", str(model), "--texts", str(text), ""]) == 2
    assert _one_line(capsys) == "error: --texts: an empty path"


# 2. --memory beyond any finite size -------------------------------------------------------------

@pytest.mark.parametrize("value", ["1e400", "1e300", "1e308TiB", math.inf])
def test_parse_memory_refuses_a_size_that_is_not_finite(value):
    with pytest.raises(ValueError, match=r"is not a finite size"):
        parse_memory(value)


def test_parse_memory_keeps_large_real_sizes_and_its_other_messages():
    assert parse_memory("8TiB") == 8 * 2**40 and parse_memory(2**63) == 2**63
    with pytest.raises(ValueError, match="non-negative"):
        parse_memory(-1)
    with pytest.raises(ValueError, match="not a number"):
        parse_memory(math.nan)


def test_kvcalc_memory_1e400_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses it, naming the flag
        cli.main(["kvcalc", "--model", "deepseek-ai/DeepSeek-V3", "--memory=1e400"])
    assert exit_info.value.code == 2
    line = _one_line(capsys)
    assert "'1e400' is not a finite size" in line and "non-negative" not in line
    assert line.startswith("error: argument --memory: "), line


def test_kvcalc_hardware_is_checked_and_not_given_beside_memory(tmp_path, capsys):
    run = ["kvcalc", "--model", "deepseek-ai/DeepSeek-V3"]
    assert cli.main([*run, "--memory", "2GiB", "--hardware", "foo"]) == 2  # taken and ignored before
    assert _one_line(capsys) == ("error: kvcalc deepseek-ai/DeepSeek-V3: --memory 2GiB and --hardware foo both give "
                                 "the memory per rank (the hardware's is its memory_bytes): pass one")
    assert cli.main([*run, "--hardware", "foo"]) == 2
    assert "hardware 'foo' is neither a file nor one of" in _one_line(capsys)
    # a runtime config's engine.memory yields to --hardware (the flag over the file)
    config = tmp_path / "run.yaml"
    config.write_text("model: deepseek-ai/DeepSeek-V3\nengine: {memory: 200GiB}\n")
    assert cli.main(["kvcalc", "--model", str(config), "-tp", "8", "-ep", "8", "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert cli.main(["kvcalc", "--model", str(config), "-tp", "8", "-ep", "8", "--hardware", "h200", "--json"]) == 0
    from_flag = json.loads(capsys.readouterr().out)
    assert from_file["memory_bytes"] == 200 * 2**30 and from_flag["memory_bytes"] == 141_000_000_000


@pytest.mark.parametrize("value", ["1e400", "8 GiB/s", "-2GiB"])
def test_runtime_memory_flag_is_refused_at_parse_naming_it(value, capsys):
    from launch.config_args import FlagParser, add_runtime_args
    parser = FlagParser(prog="python -m launch generate")
    add_runtime_args(parser, server=False)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--model", "m", f"--memory={value}"])
    assert exit_info.value.code == 2
    line = _one_line(capsys)
    assert line.startswith("error: argument --memory: ") and repr(value) in line, line
    assert parser.parse_args(["--model", "m", "--memory", "8GiB"]).memory == "8GiB"


# 3. sweep --out on a file -----------------------------------------------------------------------

def test_sweep_out_on_an_existing_file_names_out(tmp_path, capsys, monkeypatch):
    from launch.sweep import runner
    from tests.unit.test_sweep_runner import sweep_base_args

    monkeypatch.setattr(runner, "run_point", lambda *a, **k: pytest.fail("a point ran"))
    args = [*sweep_base_args(tmp_path), "engine.max_num_seqs=[2,4]"]
    target = tmp_path / "file.jsonl"
    target.write_text("keep\n")
    args[args.index("--out") + 1] = str(target)
    assert cli.main(["sweep", *args]) == 2
    assert _one_line(capsys) == f"error: --out: {target} exists and is not a directory"
    assert target.read_text() == "keep\n"


# 4. bench overhead --transports on one rank -----------------------------------------------------

@pytest.mark.parametrize("transports", ["socket", "ray", "socket,,ray"])
def test_overhead_transports_on_one_rank_is_one_line(transports, tmp_path, capsys, monkeypatch):
    from launch.bench import overhead

    monkeypatch.setattr(overhead, "measure", lambda *a, **k: pytest.fail("measured"))
    model = _config_only_model(tmp_path)
    assert overhead.main(["--model", str(model), "--transports", transports]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: --transports {transports}: ") and "needs more than one rank" in line


def test_overhead_transports_with_several_ranks_are_kept():
    from launch.bench.overhead import parse_transports
    from launch.config import ParallelConfig, RuntimeConfig

    two = RuntimeConfig(model="m", parallel=ParallelConfig(data_parallel_size=2))
    assert parse_transports("socket", two) == ["socket"]
    assert parse_transports(None, RuntimeConfig(model="m")) == [RuntimeConfig(model="m").parallel.step_transport]


# 5. submit --------------------------------------------------------------------------------------

@pytest.fixture
def no_dashboard(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dashboard was contacted")

    monkeypatch.setattr(submit, "probe_auth", refuse)
    monkeypatch.setattr(submit, "check_token", refuse)
    monkeypatch.setattr(submit, "run_passing_output", refuse)


def test_bare_submit_is_one_error_line(no_dashboard, capsys):
    assert submit.main([]) == submit.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: nothing to submit: ") and "`--`" in captured.err


@pytest.mark.parametrize(("flags", "message"), [
    (["--working-dir", "/nonexist-dir-x"], "--working-dir /nonexist-dir-x: no such directory"),
    (["--working-dir="], "--working-dir: an empty path"),
    (["--runtime-env-json", "{bad"], "--runtime-env-json '{bad': not valid JSON ("),
    (["--runtime-env-json=[1, 2]"], "--runtime-env-json '[1, 2]': must be a JSON object"),
])
def test_submit_checks_working_dir_and_runtime_env_before_the_dashboard(flags, message, no_dashboard, capsys):
    assert submit.main(["--address", "http://127.0.0.1:1", *flags, "--", "python", "-c", "1"]) == 2
    assert _one_line(capsys).startswith(f"error: {message}")


def test_submit_working_dir_a_file_is_named(tmp_path, no_dashboard, capsys):
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    assert submit.main(["--working-dir", str(afile), "--", "python"]) == 2
    assert _one_line(capsys) == f"error: --working-dir {afile}: not a directory (nor a .zip file)"


def test_submit_good_working_dir_and_runtime_env_pass_on(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(submit, "probe_auth", lambda address, timeout_s=10.0: False)
    monkeypatch.setattr(submit, "run_passing_output", lambda cmd, env: (seen.append(cmd), (0, False))[1])
    (tmp_path / "job.zip").write_bytes(b"PK")
    for flags in (["--working-dir", str(tmp_path)], ["--working-dir", str(tmp_path / "job.zip")],
                  ["--working-dir", "s3://bucket/job.zip"], ['--runtime-env-json={"pip": ["x"]}']):
        assert submit.main(["--address", "http://127.0.0.1:1", *flags, "--", "python"]) == 0
    assert len(seen) == 4


# 6. profile --num-groups / --hierarchical-nodes that cannot apply -------------------------------

@pytest.mark.parametrize(("flags", "message"), [
    (["--num-groups", "3"], "--num-groups 3: the hierarchical what-if cannot apply: the 8 experts do not form 3 groups"),
    (["--hierarchical-nodes", "3"], "--hierarchical-nodes 3: the hierarchical what-if cannot apply: the 8 experts "
                                    "do not form 3 groups (--num-groups defaults to one group per node)"),
    (["--num-groups", "4", "--hierarchical-nodes", "8"], "--num-groups 4 --hierarchical-nodes 8: the hierarchical "
                                                         "what-if cannot apply: 4 expert groups do not split over 8 nodes"),
    (["--ep", "2", "--hierarchical-nodes", "4", "--num-groups", "4"],
     "--num-groups 4 --hierarchical-nodes 4: the hierarchical what-if cannot apply: no EP size of the what-if (2) "
     "splits over 4 nodes"),
])
def test_profile_report_explicit_hierarchical_flags_that_cannot_apply(flags, message, tmp_path, capsys):
    counts = tmp_path / "c.npy"
    np.save(counts, skewed_counts(6, 2, 8, seed=1))
    assert cli.main(["profile", "report", str(counts), "--out", str(tmp_path / "r"), "--no-progress", *flags]) == 2
    assert _one_line(capsys) == f"error: {message}"
    assert not (tmp_path / "r").exists()


def test_profile_run_explicit_hierarchical_nodes_checked_before_running(tmp_path, capsys, monkeypatch):
    import launch.profile.runner

    monkeypatch.setattr(launch.profile.runner, "run_and_report", lambda *a, **k: pytest.fail("the workload ran"))
    model = _config_only_model(tmp_path)  # 8 experts in n_group 2
    assert cli.main(["profile", "run", "--model", str(model), "--workload", "prose", "--out", str(tmp_path / "r"),
                     "--hierarchical-nodes", "3"]) == 2
    assert _one_line(capsys) == ("error: --hierarchical-nodes 3: the hierarchical what-if cannot apply: 2 expert "
                                 "groups (the model's n_group) do not split over 3 nodes")


def test_hierarchical_flags_some_ep_size_takes_or_defaults_are_no_problem():
    from argparse import Namespace

    from launch.profile.commands import hierarchical_flags_problem
    from launch.profile.study import options_from_args

    def args(groups=None, nodes=None):
        return Namespace(num_groups=groups, hierarchical_nodes=nodes, ep=None, redundant=None, recorded_ep=None,
                         no_progress=True)

    assert hierarchical_flags_problem(args(), 8, None, [2, 4, 8]) is None  # defaults: skipped quietly
    assert hierarchical_flags_problem(args(nodes=4), 8, None, [2, 4, 8]) is None  # EP 4 and 8 take 4 nodes
    assert hierarchical_flags_problem(args(groups=8), 8, None, [2, 4, 8]) is None
    assert options_from_args(args()).num_nodes == 2 and options_from_args(args(nodes=4)).num_nodes == 4
