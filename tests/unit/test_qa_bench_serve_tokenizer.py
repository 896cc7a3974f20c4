"""bench serve: a --tokenizer directory that cannot give the vocabulary is a one-line error naming it
(exit 2, before the server is asked), not a traceback; --vocab-size still works beside a config.json
without vocab_size."""

from __future__ import annotations

import asyncio
import json

import pytest

from launch.bench import serve as bench_serve
from launch.bench import serve_client


@pytest.fixture
def no_server(monkeypatch):
    async def refuse(base_url, api_key):
        raise AssertionError("the server was asked")

    monkeypatch.setattr(serve_client, "fetch_models", refuse)


@pytest.mark.parametrize(("config", "problem"), [
    ({"model_type": "x", "eos_token_id": 1}, "{file} has no integer vocab_size: pass --vocab-size N"),
    ('{"vocab_size": ', "{file}: cannot be read as JSON ("),
    ({"vocab_size": 100, "eos_token_id": "two"}, "{file}: eos_token_id must be an integer or a list of integers"),
    (None, "--tokenizer {dir}: no config.json in that directory"),
])
def test_a_tokenizer_without_a_usable_vocab_size_is_named(config, problem, tmp_path, no_server, capsys) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    rc = bench_serve.main(["--port", "9", "--model", "m", "--tokenizer", str(tmp_path), "--num-prompts", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + problem.format(file=tmp_path / "config.json", dir=tmp_path))
    assert err.count("\n") == 1


def test_vocab_size_flag_works_beside_a_config_without_one(tmp_path, monkeypatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))

    async def models(base_url, api_key):
        return [{"id": "m", "object": "model"}]

    monkeypatch.setattr(serve_client, "fetch_models", models)
    args = bench_serve.build_parser().parse_args(["--model", "m", "--tokenizer", str(tmp_path), "--vocab-size", "50"])
    target, vocab, avoid = asyncio.run(serve_client.resolve_target(args))
    assert (target.model, vocab, avoid) == ("m", 50, (3, 4))
