"""vLLM's CORS flags and middleware, a SIGTERM while the engine is still being built, and the chat
response fields vLLM always sends: in process, on ``build_app`` around the fake engine (and
``launch.serve.main`` with the engine build patched, as test_serve_interrupt.py does).
"""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

import launch.async_llm
import launch.serve
from launch.config import ServerConfig
from launch.config_args import runtime_config_from_args
from launch.server import build_app
from tests.server.test_serve_interrupt import serve_with_signal
from tests.unit.server_fakes import FakeEngine

KEY = "sekret"
ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def server_config(**overrides):
    return SimpleNamespace(**{"api_key": None, "served_model_name": None, "max_queue_len": 8,
                              "expert_distribution_dir": None, **overrides})


# --- CORS -----------------------------------------------------------------------------------------


def test_a_preflight_gets_vllms_default_cors_answer() -> None:
    client = TestClient(build_app(FakeEngine(), server_config(api_key=KEY)))
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization,content-type"
    assert "access-control-allow-credentials" not in r.headers
    ok = client.get("/health", headers={"Origin": ORIGIN})
    assert ok.headers["access-control-allow-origin"] == "*"


def test_a_401_carries_the_cors_headers() -> None:
    client = TestClient(build_app(FakeEngine(), server_config(api_key=KEY)))
    r = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == "*"  # else a browser cannot read why


def test_the_cors_flags_reach_the_middleware() -> None:
    argv = ["--model", "m", "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "POST"]',
            "--allowed-headers", '["Authorization"]', "--allow-credentials"]
    cfg = runtime_config_from_args(launch.serve.build_parser().parse_args(argv))
    assert (cfg.server.allowed_origins, cfg.server.allowed_methods, cfg.server.allowed_headers,
            cfg.server.allow_credentials) == ([ORIGIN], ["GET", "POST"], ["Authorization"], True)
    client = TestClient(build_app(FakeEngine(), cfg.server))
    r = client.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST"
    refused = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


def test_the_defaults_are_vllms() -> None:
    server = ServerConfig()
    assert (server.allowed_origins, server.allowed_methods, server.allowed_headers, server.allow_credentials) == (
        ["*"], ["*"], ["*"], False)


@pytest.mark.parametrize("value", ["https://app.example", '"*"', '[1]', "[*]"])
def test_a_bad_cors_flag_is_one_line_naming_it(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        launch.serve.build_parser().parse_args(["--model", "m", "--allowed-origins", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: argument --allowed-origins: "), err


def test_cors_keys_in_a_vllm_config_file(tmp_path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(f'model: m\nallowed-origins: ["{ORIGIN}"]\nallow_credentials: true\n')
    cfg = runtime_config_from_args(launch.serve.build_parser().parse_args(["--config", str(path)]))
    assert (cfg.server.allowed_origins, cfg.server.allow_credentials) == ([ORIGIN], True)
    path.write_text("model: m\nallowed-origins: https://a.example\n")
    with pytest.raises(ValueError, match="allowed_origins must be a list of strings"):
        runtime_config_from_args(launch.serve.build_parser().parse_args(["--config", str(path)]))


# --- SIGTERM --------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["building the engine", "serving"])
def test_sigterm_exits_quietly(when: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    before = signal.getsignal(signal.SIGTERM)
    engines, output = serve_with_signal(when, signal.SIGTERM, monkeypatch, capfd)  # mid-build: the build ends
    assert "Traceback" not in output and "SystemExit" not in output, output
    assert [e.shutdowns for e in engines] == [1]
    assert signal.getsignal(signal.SIGTERM) is before
    if when == "building the engine":
        assert "Uvicorn running" not in output  # nothing was served


# --- chat response fields -------------------------------------------------------------------------


def test_chat_message_choice_and_usage_carry_vllms_fields() -> None:
    client = TestClient(build_app(FakeEngine(), server_config()))
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 3}).json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": message["content"], "refusal": None, "annotations": None,
                       "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None,
                       "reasoning": None}
    choice = body["choices"][0]
    assert {"logprobs": None, "finish_reason": "length", "stop_reason": None}.items() <= choice.items()
    assert body["usage"]["prompt_tokens_details"] is None
    assert body["system_fingerprint"] is None and body["service_tier"] is None
    completion = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    assert completion["usage"]["prompt_tokens_details"] is None


def test_streamed_deltas_stay_sparse_and_usage_has_the_details_key() -> None:
    client = TestClient(build_app(FakeEngine(), server_config()))
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
                             "stream_options": {"include_usage": True}}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(c["choices"][0]["delta"]) <= {"content"} for c in chunks[1:-1])  # no null keys in a delta
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] is None
