"""vLLM request extensions the server once ignored silently (a warning in its log, nothing to the client).

vLLM honours each of them (``vllm/entrypoints/openai/protocol.py``: ``allowed_token_ids``, ``bad_words``,
``logits_processors``, ``truncate_prompt_tokens``, ``return_tokens_as_token_ids``, ``add_special_tokens``,
``prompt_embeds``, ``chat_template``, ``chat_template_kwargs``, ``documents``). Here the chat template
gets ``chat_template_kwargs`` and ``documents`` and ``add_special_tokens`` is honoured, as vLLM's; the
others are refused by name unless neutral, as docs/server.md promises for every field that would change
the output.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from launch.server import build_app
from tests.unit.server_fakes import CharTokenizer, FakeEngine, ServerThread

CHAT = [{"role": "user", "content": "hi"}]


BOS = 93


class TemplateVarsTokenizer(CharTokenizer):
    """Renders the extra template variables it is given, so a test can see them in the prompt; adds a
    bos token when asked for special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS] * add_special_tokens + super().encode(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **kwargs: object) -> str:
        text = super().apply_chat_template(messages, add_generation_prompt, tools)
        text += "".join(f"[{k}={v}]" for k, v in sorted(kwargs.items()))
        return text + "".join(f"<doc:{d.get('title')}>" for d in documents or [])


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(max_model_len=64)
    engine.tokenizer = TemplateVarsTokenizer()
    cfg = SimpleNamespace(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    with ServerThread(build_app(engine, cfg)) as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url)


def post(served, path: str, body: dict) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=10)


def prompt_tokens(served, body: dict) -> int:
    r = post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [3, -4]}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": []}, "allowed_token_ids"),  # nothing to draw
    ("/v1/chat/completions", {"messages": CHAT, "bad_words": ["a", 3]}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "logits_processors": ["pkg.Proc"]}, "logits_processors"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "return_tokens_as_token_ids": True, "logprobs": 1},
     "return_tokens_as_token_ids"),
    ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"continue_final_message": True}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
])
def test_vllm_fields_that_change_the_output_are_refused_not_ignored(served, path, body, param):
    r = post(served, path, {"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert param in r.json()["error"]["message"]


def test_neutral_values_of_the_vllm_fields_pass(served):
    body = {"max_tokens": 2, "allowed_token_ids": None, "bad_words": [], "logits_processors": None,
            "truncate_prompt_tokens": None, "return_tokens_as_token_ids": False}
    assert post(served, "/v1/completions", {"prompt": "x", "add_special_tokens": True, **body}).status_code == 200
    assert post(served, "/v1/chat/completions", {"messages": CHAT, "add_special_tokens": False,
                                                 "chat_template": None, **body}).status_code == 200


def test_chat_template_kwargs_and_documents_reach_the_template(served):
    """vLLM: ``chat_template_kwargs`` are extra template variables (Qwen3's ``enable_thinking``), and
    ``documents`` the template's ``documents``; both change the prompt."""
    plain = prompt_tokens(served, {})
    kwargs = prompt_tokens(served, {"chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs == plain + len("[enable_thinking=False]")
    docs = prompt_tokens(served, {"documents": [{"title": "t1", "text": "x"}]})
    assert docs == plain + len("<doc:t1>")
    assert prompt_tokens(served, {"chat_template_kwargs": {}, "documents": None}) == plain


def test_add_special_tokens_is_honoured(served):
    """vLLM: completions encode with special tokens unless ``add_special_tokens: false``; chat encodes the
    rendered template without them unless ``add_special_tokens: true``."""
    def completion_prompt_tokens(body: dict) -> int:
        r = post(served, "/v1/completions", {"prompt": "abc", "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert completion_prompt_tokens({}) == completion_prompt_tokens({"add_special_tokens": True}) == 4
    assert completion_prompt_tokens({"add_special_tokens": False}) == 3
    plain = prompt_tokens(served, {})
    assert prompt_tokens(served, {"add_special_tokens": False}) == plain
    assert prompt_tokens(served, {"add_special_tokens": True}) == plain + 1


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(served):
    """vLLM: the encoded prompt keeps its last k tokens (-1: max_model_len); echo shows what is kept."""
    def completion(body: dict) -> dict:
        r = post(served, "/v1/completions", {"prompt": "abcdef", "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()
    assert completion({})["usage"]["prompt_tokens"] == 7  # bos + 6
    assert completion({"truncate_prompt_tokens": 3})["usage"]["prompt_tokens"] == 3
    assert completion({"truncate_prompt_tokens": 3, "echo": True})["choices"][0]["text"].startswith("def")
    assert completion({"truncate_prompt_tokens": 50})["usage"]["prompt_tokens"] == 7
    assert completion({"truncate_prompt_tokens": -1})["usage"]["prompt_tokens"] == 7  # max_model_len 64
    long = post(served, "/v1/completions", {"prompt": "a" * 100, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"  # 64 kept: no room to generate
    assert prompt_tokens(served, {"truncate_prompt_tokens": 2}) == 2
    assert completion({"truncate_prompt_tokens": 64})["usage"]["prompt_tokens"] == 7  # max_model_len itself
    for path, body in (("/v1/completions", {"prompt": "abc"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = post(served, path, {"max_tokens": 1, "truncate_prompt_tokens": 65, **body})  # vLLM's 400 and message
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert r.json()["error"]["message"] == ("truncate_prompt_tokens value (65) is greater than max_model_len (64). "
                                                "Please, select a smaller truncation size.")


def test_continue_final_message_reaches_the_template(served):
    """vLLM: the last message is left open (the template's continue_final_message), never beside
    add_generation_prompt."""
    plain = prompt_tokens(served, {"add_generation_prompt": False})
    body = {"add_generation_prompt": False, "continue_final_message": True}
    assert prompt_tokens(served, body) == plain + len("[continue_final_message=True]")


def test_skip_special_tokens_reaches_the_sampling_params(served):
    for body, want in (({}, True), ({"skip_special_tokens": False}, False), ({"skip_special_tokens": True}, True)):
        assert post(served, "/v1/completions", {"prompt": "x", "max_tokens": 1, **body}).status_code == 200
        assert served.engine.seen_params[-1].skip_special_tokens is want
