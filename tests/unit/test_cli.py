"""`python -m launch`: the command registry, make-tiny, kvcalc, config, and error paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch import cli
from tests.unit.hf_reference_configs import DEEPSEEK_V3, MIXTRAL_8X7B

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "launch", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_help_lists_every_command():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for name in cli.COMMANDS:
        assert f"  {name} " in r.stdout
        assert cli.is_available(cli.COMMANDS[name]), name
    assert _run().returncode == cli.EXIT_USAGE


def test_readme_command_table_has_a_row_per_command():
    """README's command table is where users look: every registered command has its own row."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first_cells = [line.split("|")[1].strip().strip("`") for line in readme.splitlines() if line.startswith("| `")]
    missing = [name for name in cli.COMMANDS
               if not any(cell == name or cell.startswith(name + " ") for cell in first_cells)]
    assert missing == []


@pytest.mark.slow
def test_make_tiny_writes_a_loadable_checkpoint_without_importing_ray(tmp_path):
    code = ("import sys; from launch.cli import main; rc = main(sys.argv[1:]); "
            "assert 'ray' not in sys.modules, 'make-tiny imported ray'; "
            "assert 'launch.serve' not in sys.modules; sys.exit(rc)")
    out = tmp_path / "v3"
    r = _run("make-tiny", "--arch", "deepseek_v3", "--out", str(out), "--seed", "1", code=code)
    assert r.returncode == 0, r.stderr
    # one line: what was written, where (the weights' writer's own line is not printed beside it)
    assert r.stdout == f"wrote deepseek_v3 tiny checkpoint to {out}: 257,728 parameters, vocab 512, 1 weight file(s)\n"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    from launch.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(out)
    cfg = json.loads((out / "config.json").read_text())
    assert tok.vocab_size == cfg["vocab_size"] and tok.eos_token_id == cfg["eos_token_id"]


def test_make_tiny_other_arch_and_its_errors(tmp_path, capsys):
    assert cli.main(["make-tiny", "--arch", "mixtral", "--out", str(tmp_path / "mx")]) == 0
    assert json.loads((tmp_path / "mx" / "config.json").read_text())["model_type"] == "mixtral"
    assert "mixtral tiny" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["make-tiny", "--arch", "llama", "--out", str(tmp_path / "x")])
    assert e.value.code == 2 and "invalid choice: 'llama'" in capsys.readouterr().err
    for seed in ("-1", str(2**32), "99999999999999999999"):  # a torch generator overflow, named before: one line
        with pytest.raises(SystemExit) as e:
            cli.main(["make-tiny", "--arch", "mixtral", "--out", str(tmp_path / "s"), "--seed", seed])
        assert e.value.code == 2
        assert capsys.readouterr().err.startswith(f"error: --seed must be in [0, 2**32 - 1], got {seed} ")
    assert not (tmp_path / "s").exists()


def _write_config(tmp_path: Path, cfg: dict) -> Path:
    d = tmp_path / cfg["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.slow
def test_kvcalc_deepseek_v3_mla_bytes_per_token(tmp_path, capsys):
    d = _write_config(tmp_path, DEEPSEEK_V3)
    r = _run("kvcalc", "--model", str(d), "--memory", "141GiB", "-tp", "16", "-ep", "16", "--max-model-len", "32768")
    assert r.returncode == 0, r.stderr
    assert "KV bytes per token (all layers): 70,272 B" in r.stdout  # 61 x 576 x 2
    assert "MLA latent: 512 + 64 rope = 576" in r.stdout
    assert "concurrent sequences at max_model_len 32,768" in r.stdout
    rc = cli.main(["kvcalc", "--model", str(d / "config.json"), "--kv-cache-dtype", "fp8", "--weight-dtype", "fp8",
                   "--memory", "141GiB", "-tp", "8", "-ep", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 35136 and out["attention"] == "mla"
    # TP8 x EP8 as this runtime shards it, counted by hand: 32 of the 256 routed experts and the shared
    # expert at 1 B; attention heads and the 3 dense MLPs over 8 at 1 B (MLA's latent projections and
    # their norms whole); embeddings, lm_head and the other norms whole in bf16; routers in fp32
    routed, shared = 58 * 32 * 3 * 7168 * 2048, 58 * 3 * 7168 * 2048
    attention = 61 * (7168 * 1536 + 1536 + 1536 * 16 * 192 + 7168 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 7168)
    dense = 3 * 3 * 7168 * 18432 // 8
    bf16 = (2 * 129280 * 7168 + 7168 + 61 * 2 * 7168) * 2
    routers = 58 * (7168 * 256 + 256) * 4
    assert out["weight_bytes_per_rank"] == routed + shared + attention + dense + bf16 + routers
    assert out["max_num_tokens"] == out["kv_budget_bytes"] // 35136
    assert out["num_blocks"] == out["max_num_tokens"] // 16


def test_kvcalc_mixtral_gqa_and_errors(tmp_path, capsys):
    d = _write_config(tmp_path, MIXTRAL_8X7B)
    assert cli.main(["kvcalc", "--model", str(d), "--json", "--memory", "141GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 131072 and out["attention"] == "gqa"
    assert out["max_model_len"] == 32768
    assert cli.main(["kvcalc", "--model", str(d), "--memory", "8GiB"]) == 2  # 93 GB of weights do not fit
    err = capsys.readouterr().err
    assert "error: kvcalc" in err and "no room for the KV cache" in err
    assert cli.main(["kvcalc", "--model", str(tmp_path / "missing")]) == 2
    assert "error: kvcalc" in capsys.readouterr().err


def test_config_command_prints_resolved_yaml(capsys):
    argv = ["config", "--config", "configs/demo.yaml", "-dp", "2", "--set", "balancer.num_redundant_experts=2"]
    assert cli.main(argv) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["parallel"]["data_parallel_size"] == 2
    assert resolved["balancer"]["num_redundant_experts"] == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--set", "engine.max_num_seq=3"],
         "unknown config key 'engine.max_num_seq' (did you mean 'engine.max_num_seqs'?)"),
        (["--eplb-config", '{"window_sise": 10}'], "unknown --eplb-config key 'window_sise'"),
        (["--max-num-seqs", "4", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    ],
    ids=["unknown-config-key", "bad-eplb-key", "unknown-flag"],
)
@pytest.mark.slow
def test_config_errors_exit_2_without_traceback(argv, message):
    r = _run("config", "--config", "configs/demo.yaml", *argv)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_unknown_and_unavailable_commands(monkeypatch, capsys):
    assert cli.main(["mak-tiny"]) == cli.EXIT_USAGE
    assert "did you mean 'make-tiny'" in capsys.readouterr().err
    assert cli.main(["bench"]) == cli.EXIT_USAGE
    assert "bench eplb" in capsys.readouterr().err
    assert cli.main(["bench", "nope"]) == cli.EXIT_USAGE
    monkeypatch.setitem(cli.COMMANDS, "ghost", cli.Command("ghost", "launch.no_such_module:main", "x"))
    assert cli.main(["ghost", "--x"]) == cli.EXIT_UNAVAILABLE
    assert "module launch.no_such_module does not exist" in capsys.readouterr().err
    monkeypatch.setitem(cli.COMMANDS, "nofn", cli.Command("nofn", "launch.cli:no_such_function", "x"))
    assert cli.main(["nofn"]) == cli.EXIT_UNAVAILABLE
    assert "has no function no_such_function()" in capsys.readouterr().err


def test_a_command_groups_help_lists_its_commands(capsys):
    for flag in ("--help", "-h", "help"):
        assert cli.main(["bench", flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: python -m launch bench <command>")
        assert "bench decode" in out and "bench moe-layer" in out and "make-tiny" not in out


def test_resolution_prefers_two_word_commands_and_passes_the_rest(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "load", lambda cmd: lambda argv: seen.append((cmd.name, argv)) or 3)
    assert cli.main(["bench", "eplb", "--steps", "5"]) == 3
    assert cli.main(["kvcalc", "--model", "x"]) == 3
    assert seen == [("bench eplb", ["--steps", "5"]), ("kvcalc", ["--model", "x"])]


def test_register_validates():
    with pytest.raises(ValueError, match="already registered"):
        cli.register("serve", "launch.serve:main", "x")
    with pytest.raises(ValueError, match="module:function"):
        cli.register("zzz", "launch.serve", "x")
    with pytest.raises(ValueError, match="one or two words"):
        cli.register("a b c", "m:f", "x")
    assert "zzz" not in cli.COMMANDS
