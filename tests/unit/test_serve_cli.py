"""``python -m launch serve`` argument handling (the live server is in tests/server/test_server_live.py)."""

from __future__ import annotations

import json

from launch.serve import build_parser, config_from_args, is_loopback, main


def test_serve_flags_land_in_server_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({}))
    args = build_parser().parse_args(["--model", str(tmp_path), "--port", "0", "--api-key", "k",
                                      "--max-queue-len", "3", "--init-expert-location", "/d/x.safetensors",
                                      "--expert-distribution-dir", "/d",
                                      "--expert-distribution-recorder-buffer-size", "64"])
    cfg = config_from_args(args)
    s = cfg.server
    assert (s.host, s.port, s.api_key, s.max_queue_len) == ("127.0.0.1", 0, "k", 3)
    assert (s.init_expert_location, s.expert_distribution_dir) == ("/d/x.safetensors", "/d")
    assert s.expert_distribution_recorder_buffer_size == 64
    default = config_from_args(build_parser().parse_args(["--model", str(tmp_path)])).server
    assert default.init_expert_location is None and default.expert_distribution_recorder_buffer_size == 1000


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")


def test_bad_model_or_flags_exit_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["--model", str(tmp_path), "--max-queue-len", "0"]) == 2
    assert "max_queue_len" in capsys.readouterr().err


def test_what_the_engine_would_refuse_is_one_line_before_the_model_loads(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """Settings the engine refuses, an unusable address or dump folder: one line, exit 2, and the
    server (engine, weights, uvicorn) never starts."""
    import socket

    import launch.serve as serve_module

    async def refuse(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(serve_module, "serve", refuse)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--max-model-len", "100000"], "error: engine.max_model_len=100000 > the model's max_position_embeddings"),
            (["--memory", "1KiB"], "error: no room for the KV cache: the weights take "),
            (["--init-expert-location", str(tmp_path / "nope.safetensors")], "error: expert distribution dump "),
            (["--expert-distribution-dir", str(afile)],
             f"error: expert_distribution_dir: {afile} exists and is not a directory"),
            (["--host", "not..a..host"], "error: --host 'not..a..host' is not an address this machine can listen on"),
            (["--port", str(port)], f"error: cannot listen on 127.0.0.1:{port}: "),
        ]
        for flags, start in cases:
            assert main(["--model", str(tiny_ckpt), "--port", "0", *flags]) == 2, flags
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert line.startswith(start), (flags, line)


def test_an_empty_api_key_is_refused_not_taken_as_none(tiny_ckpt, capsys):
    assert main(["--model", str(tiny_ckpt), "--api-key", ""]) == 2
    assert capsys.readouterr().err.strip() == ("error: server: api_key is empty: give a key, or leave it out to serve "
                                               "without one")


def test_demo_checks_what_serve_checks_before_the_ranks_start(capsys, monkeypatch):
    """``make run``'s command refuses a layout the engine would refuse and a taken port in one line,
    before the Ray ranks start and the weights load."""
    import socket

    import launch.serve as serve_module
    from launch import demo

    async def refuse(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr(serve_module, "serve", refuse)
    assert demo.main(["--set", "parallel.data_parallel_size=3"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "error: num_experts=16 + num_redundant_experts=4 = 20 slots is not divisible by ep_size=3"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert demo.main(["--port", str(port)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}: ")


def test_kv_pool_smaller_than_max_model_len_is_warned_of(tiny_ckpt):
    """A pool that cannot hold a max_model_len request (vLLM refuses to start): the warning names
    the pool, the length and the flags; a pool that holds max_model_len - 1 slots (the last token is
    never fed back) is enough."""
    from launch.config import RuntimeConfig
    from launch.engine import LLMEngine
    from launch.serve import kv_pool_warning

    def engine(max_model_len: int) -> LLMEngine:
        return LLMEngine(RuntimeConfig.from_dict({
            "model": str(tiny_ckpt), "engine": {"dtype": "float32", "max_model_len": max_model_len,
                                                "num_kv_blocks": 4, "block_size": 16}}))

    warning = kv_pool_warning(engine(66))
    assert warning is not None and "64 tokens per DP rank (4 blocks of 16)" in warning
    assert "max_model_len=66" in warning and "--num-kv-blocks" in warning and "\n" not in warning
    assert kv_pool_warning(engine(65)) is None
    assert kv_pool_warning(engine(64)) is None
