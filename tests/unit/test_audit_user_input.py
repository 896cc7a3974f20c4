"""Bad user input is one line naming the problem: config's config.json and generation config,
make-tiny / train-tiny --out (and a checkpoint written over another), generate's chat messages,
workload files, and a config.json whose model_type contradicts its architectures."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from launch import config_args
from launch.tiny_checkpoint import main as make_tiny_main
from launch.tiny_checkpoint import make_tiny_checkpoint, remove_stale_weights
from launch.tokenizer import CHAT_ROLES, check_prompt
from launch.training.train import TrainArgs, train
from launch.training.train import main as train_main
from launch.workloads import WorkloadError, load_workload
from moe.config import ModelConfig
from moe.loading.checkpoint import Checkpoint, resolve_checkpoint_files
from moe.tiny import write_tiny_checkpoint

MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.strip()


# ---- config: config.json read as the loader reads it ------------------------------------------


@pytest.mark.parametrize(("content", "message"), [
    (b"[1, 2]", "expected a JSON object, got a list"),
    (b"{bad", "is not a model config.json (JSON: Expecting property name"),
    (b'{"model_type": "\xff"}', "not UTF-8 text"),
])
def test_config_names_a_config_json_that_is_not_an_object(tmp_path: Path, capsys, content: bytes,
                                                          message: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    assert config_args.main(["--model", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert str(tmp_path / "config.json") in line and message in line, line


# ---- config: the generation config checks generate makes ---------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    (["--generation-config", "/nonexist"], "generation_config '/nonexist' is not 'auto', 'vllm' or a directory"),
    (["--override-generation-config", '{"temperature": "hot"}'], "temperature must be a number"),
    (["--override-generation-config", '{"temperature": -1}'], "override_generation_config: temperature must be"),
])
def test_config_refuses_the_generation_configs_generate_refuses(tiny_ckpt: Path, capsys, flags, message) -> None:
    try:
        rc = config_args.main(["--model", str(tiny_ckpt), *flags])
    except SystemExit as exit_info:  # a value of the wrong type: argparse refuses it, naming the flag
        rc = exit_info.code
    assert rc == 2
    assert message in _one_error_line(capsys)


def test_config_takes_a_generation_config_directory(tiny_ckpt: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    argv = ["--model", str(tiny_ckpt), "--generation-config", str(tmp_path),
            "--override-generation-config", '{"top_p": 0.9}']
    assert config_args.main(argv) == 0
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    assert config_args.main(argv[:4]) == 2
    assert "generation_config.json: top_p" in _one_error_line(capsys)


# ---- make-tiny / train-tiny --out --------------------------------------------------------------


def test_train_tiny_refuses_an_empty_out_before_training(tmp_path: Path, capsys, monkeypatch) -> None:
    import launch.training.train as train_module

    def no_step(*args):
        raise AssertionError("trained")

    monkeypatch.setattr(train_module, "_step", no_step)
    monkeypatch.chdir(tmp_path)
    assert train_main(["--arch", "mixtral", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--out", ""]) == 2
    assert _one_error_line(capsys) == "error: --out '': an empty path"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("main", [train_main, make_tiny_main])
def test_tiny_commands_bad_flag_values_are_one_line(main, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--arch", "mixtral", "--out", "x", "--seed", "many"])
    assert e.value.code == 2
    line = _one_error_line(capsys)
    assert "argument --seed: invalid int value: 'many'" in line and "usage:" not in line


def _write_sharded(out: Path) -> list[str]:
    """A mixtral checkpoint in several shards with an index; returns its weight file names."""
    write_tiny_checkpoint("mixtral", out, shard_bytes=20_000)
    names = sorted(p.name for p in out.glob("*.safetensors*"))
    assert "model.safetensors.index.json" in names and len(names) > 2
    return names


def test_make_tiny_over_a_sharded_checkpoint_leaves_only_the_new_one(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    _write_sharded(out)
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "keep.safetensors").write_text("not ours to remove")
    make_tiny_checkpoint("deepseek_v3", out)
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine" and (out / "sub" / "keep.safetensors").exists()
    assert resolve_checkpoint_files(out).files == [out / "model.safetensors"]
    with Checkpoint(out) as ckpt:
        assert ckpt.config["model_type"] == "deepseek_v3"
    make_tiny_checkpoint("mixtral", out)  # the usual workflow: the same --out again
    assert ModelConfig.from_hf(out).architecture == "mixtral"


def test_train_tiny_over_a_sharded_checkpoint_leaves_only_the_new_one(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    _write_sharded(out)
    (out / "notes.txt").write_text("mine")
    train(TrainArgs(arch="mixtral", out=str(out), steps=1, batch_size=1, seq_len=8, threads=1),
          progress=False, report_prompts=1)
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine"
    assert resolve_checkpoint_files(out).files == [out / "model.safetensors"]


def test_remove_stale_weights_touches_weight_files_only(tmp_path: Path) -> None:
    for name in ("model.safetensors", "consolidated.safetensors", "model.safetensors.index.json", "config.json",
                 "tokenizer.json", "model.safetensors.bak"):
        (tmp_path / name).write_text("x")
    (tmp_path / "dir.safetensors").mkdir()
    removed = remove_stale_weights(tmp_path)
    assert sorted(p.name for p in removed) == ["consolidated.safetensors", "model.safetensors",
                                               "model.safetensors.index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "dir.safetensors",
                                                          "model.safetensors.bak", "tokenizer.json"]
    assert remove_stale_weights(tmp_path / "missing") == []


# ---- generate's chat messages ------------------------------------------------------------------


@pytest.mark.parametrize(("messages", "message"), [
    ([{"role": "user"}], "in.jsonl:3: messages[0] has no 'content'"),
    ([{"role": "user", "content": None}], "in.jsonl:3: messages[0] has no 'content'"),
    ([{"role": "system", "content": "s"}, {"role": "bogus", "content": "x"}],
     "in.jsonl:3: messages[1]: unknown role 'bogus'"),
    ([{"role": "assistant"}], "in.jsonl:3: messages[0] has no 'content'"),
])
def test_a_chat_message_needs_a_known_role_and_content(messages, message) -> None:
    with pytest.raises(ValueError) as e:
        check_prompt({"messages": messages}, "in.jsonl:3")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_every_role_the_server_takes_is_taken() -> None:
    from launch.server.protocol import ChatMessage

    assert set(CHAT_ROLES) == set(ChatMessage.model_fields["role"].annotation.__args__)
    check_prompt({"messages": [{"role": r, "content": "x"} for r in CHAT_ROLES]}, "w")
    check_prompt({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                               {"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "w")


# ---- workload files ----------------------------------------------------------------------------


@pytest.mark.parametrize(("line", "message"), [
    ({"prompt": "hi", "max_tokens": -1}, "w.jsonl:2: sampling field(s) ['max_tokens'] in a workload line"),
    ({"prompt": "hi", "temperature": 0.5, "top_p": 0.9}, "w.jsonl:2: sampling field(s) ['temperature', 'top_p']"),
    ({"prompt": ""}, "w.jsonl:2: 'prompt' must be a non-empty string"),
    ({"text": "hi"}, "w.jsonl:2: expected an object with a string \"prompt\""),
])
def test_a_workload_line_sets_a_prompt_and_no_sampling(tmp_path: Path, line, message) -> None:
    """A line's sampling fields would silently not apply (the run's flags set sampling): refused,
    naming the line; other keys (an id, a dataset's metadata) are ignored as before."""
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "id": 1, "source": "x"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(WorkloadError) as e:
        load_workload(str(path))
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    path.write_text(json.dumps({"prompt": "fine", "id": 1, "category": "essay"}) + "\n")
    assert load_workload(str(path)) == ["fine"]


# ---- config.json: model_type against architectures ---------------------------------------------


def test_a_model_type_contradicting_the_architecture_is_refused() -> None:
    raw = json.loads((MODEL_CONFIGS / "deepseek-v3.json").read_text())
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(dict(raw, model_type="llama"))
    assert "'llama'" in str(e.value) and "'DeepseekV3ForCausalLM'" in str(e.value)
    with pytest.raises(ValueError, match="model_type 'mixtral'"):
        ModelConfig.from_hf(dict(raw, model_type="mixtral"), strict=False)
    assert ModelConfig.from_hf(dict(raw, model_type="kimi_k2")).architecture == "deepseek_v3"  # Kimi K2's
    assert ModelConfig.from_hf({k: v for k, v in raw.items() if k != "model_type"}).architecture == "deepseek_v3"


def test_every_shipped_model_config_still_loads() -> None:
    paths = sorted(glob.glob(str(MODEL_CONFIGS / "*.json")))
    assert paths
    for path in paths:
        ModelConfig.from_hf(path, strict=False)
