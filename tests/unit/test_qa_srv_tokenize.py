"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (``vllm/entrypoints/openai/protocol.py``:
``TokenizeCompletionRequest`` / ``TokenizeChatRequest`` -> ``{"count", "max_model_len", "tokens",
"token_strs"}``, ``DetokenizeRequest`` -> ``{"prompt"}``), which the server once answered with 404.
The ids must be the ones the completions and chat endpoints run on.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from launch.server import build_app
from tests.unit.server_fakes import EOS, CharTokenizer, FakeEngine, ServerThread

MAX_MODEL_LEN = 64
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    cfg = SimpleNamespace(api_key="k", served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    with ServerThread(build_app(engine, cfg)) as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url)


def post(served, path: str, body: dict, key: str = "k") -> httpx.Response:
    return httpx.post(served.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)


def test_tokenize_a_prompt_gives_the_ids_completions_run_on(served):
    r = post(served, "/tokenize", {"prompt": "hello", "model": "fake-moe"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {"count": 5, "max_model_len": MAX_MODEL_LEN, "tokens": CharTokenizer().encode("hello"),
                    "token_strs": None}
    usage = post(served, "/v1/completions", {"prompt": "hello", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]


def test_tokenize_messages_gives_the_ids_chat_runs_on(served):
    r = post(served, "/tokenize", {"messages": CHAT})
    assert r.status_code == 200, r.text
    usage = post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert r.json()["count"] == usage["prompt_tokens"] == len(r.json()["tokens"])
    no_header = post(served, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_header["count"] == r.json()["count"] - len("<assistant>")


def test_detokenize_keeps_special_tokens(served):
    ids = CharTokenizer().encode("abc") + [EOS]
    r = post(served, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": CharTokenizer().decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, None),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, 400, "return_token_strs"),
    ("/detokenize", {"tokens": [10_000]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
])
def test_bad_requests_get_the_error_shape(served, path, body, status, param):
    r = post(served, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_the_routes_are_outside_the_api_key_as_in_vllm(served):
    # vLLM's key guards only /v1/*: /tokenize and /detokenize answer whatever the header says
    assert post(served, "/tokenize", {"prompt": "a"}, key="wrong").status_code == 200
    assert post(served, "/detokenize", {"tokens": [1]}, key="wrong").status_code == 200
