"""The server's logprobs cap is the engine's ``max_logprobs`` (vLLM's ``--max-logprobs``), not a
constant: over it, a 400 with vLLM's message naming the request's field; at it, served. And, as
vLLM's ``check_logprobs`` (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py),
``prompt_logprobs`` with ``stream: true`` is refused for values > 0 and -1 only: 0 streams."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from launch.server import build_app
from tests.unit.server_fakes import VOCAB, FakeEngine, ServerThread

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def server_config(**overrides):
    return SimpleNamespace(**{"api_key": None, "served_model_name": None, "max_queue_len": 8,
                              "expert_distribution_dir": None, **overrides})


@pytest.fixture(scope="module", params=[25, 3, -1], ids=["cap25", "cap3", "cap-vocab"])
def served(request):
    engine = FakeEngine(max_logprobs=request.param)
    with ServerThread(build_app(engine, server_config())) as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url, cap=VOCAB if request.param == -1 else request.param)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "fake-moe", "max_tokens": 2, **body}, timeout=10)


def _requests(n: int) -> list[tuple[str, dict, str, str, int]]:
    """(path, body, param, kind, logprobs asked for) asking for ``n`` logprobs in every field that takes them."""
    return [
        ("/v1/completions", {**COMPLETION, "logprobs": n}, "logprobs", "sample", n),
        ("/v1/completions", {**COMPLETION, "prompt_logprobs": n}, "prompt_logprobs", "prompt", n),
        ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": n}, "logprobs", "sample", n),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": n}, "top_logprobs", "sample", n),
        ("/v1/chat/completions", {**CHAT, "prompt_logprobs": n}, "prompt_logprobs", "prompt", n),
    ]


def test_over_the_configured_cap_is_a_400_naming_the_field(served):
    for path, body, param, kind, n in _requests(served.cap + 1):
        r = post(served.url, path, body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (body, error)
        assert error["message"] == (f"Requested {kind} logprobs of {n}, which is greater than max allowed: "
                                    f"{served.cap}"), (body, error)


def test_at_the_configured_cap_is_served(served):
    seen = len(served.engine.seen_params)
    for path, body, _param, _kind, _n in _requests(served.cap):
        r = post(served.url, path, body)
        assert r.status_code == 200, (body, r.text)
    assert any(p.logprobs == served.cap or p.prompt_logprobs == served.cap for p in served.engine.seen_params[seen:])


def test_minus_one_counts_as_the_vocabulary(served):
    for path, body in [("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}),
                       ("/v1/completions", {**COMPLETION, "prompt_logprobs": -1})]:
        r = post(served.url, path, body)
        if served.cap >= VOCAB:
            assert r.status_code == 200, (body, r.text)
        else:
            assert r.status_code == 400, (body, r.text)
            assert f"logprobs of {VOCAB}, which is greater than max allowed: {served.cap}" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_prompt_logprobs_with_stream_as_vllm(path, base):
    """vLLM: "`prompt_logprobs` are not available when `stream=True`" for > 0 and -1; 0 is taken."""
    engine = FakeEngine()
    with ServerThread(build_app(engine, server_config())) as srv:
        for value in (1, -1):
            r = post(srv.base_url, path, {**base, "stream": True, "prompt_logprobs": value})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        r = post(srv.base_url, path, {**base, "stream": True, "prompt_logprobs": 0})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        assert engine.seen_params[-1].prompt_logprobs == 0
