"""OpenAI / vLLM semantics the server once got wrong, against the deterministic fake engine.

Each test names what OpenAI's API and vLLM's server do; every one of them failed on the code
before the fix (defaults, nullable and strictly typed fields, refused fields, echo, usage per
chunk, logprob maps, error messages).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from types import SimpleNamespace

import httpx
import pytest

from launch.server import build_app
from launch.server.formatting import ChatFormatter, CompletionFormatter
from tests.unit.server_fakes import CharTokenizer, FakeEngine, ServerThread

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN)
    cfg = SimpleNamespace(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    with ServerThread(build_app(engine, cfg)) as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url)


def post(served, path: str, body: object) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=10)


def events(r: httpx.Response) -> list[dict]:
    lines = [ln for ln in r.text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]", r.text
    return [json.loads(ln[len("data: "):]) for ln in lines[:-1]]


def assert_error(r: httpx.Response, status: int, param: str | None, *needles: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], err["message"]
    assert "more problem" not in err["message"], err["message"]  # one clear message, not pydantic's list


CHAT = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- max_tokens


def test_completions_default_to_16_tokens_and_null_asks_for_the_rest_of_the_context(served):
    """OpenAI's and vLLM's /v1/completions default max_tokens is 16; vLLM's explicit null means
    max_model_len - prompt; a default the prompt leaves no room for is cut, not a 400."""
    r = post(served, "/v1/completions", {"prompt": "abc", "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
    r = post(served, "/v1/completions", {"prompt": "abc", "max_tokens": None})
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 3
    r = post(served, "/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN - 4)})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert post(served, "/v1/completions", {"prompt": "x" * (MAX_MODEL_LEN - 4), "max_tokens": 16}).status_code == 400
    r = post(served, "/v1/chat/completions", {"messages": CHAT})  # chat: no default cap (OpenAI, vLLM)
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt_tokens


# ---------------------------------------------------------------- nullable and strict fields


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "n": None, "stream": None, "echo": None,
                         "ignore_eos": None, "include_stop_str_in_output": None, "logprobs": None}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "n": None, "stream": None, "logprobs": None,
                              "top_logprobs": None, "add_generation_prompt": None, "stream_options": None}),
])
def test_null_means_the_default(served, path, body):
    """OpenAI's request fields are nullable (clients that send every field send nulls); vLLM's too."""
    r = post(served, path, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),  # chat's logprobs sent to completions
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": "2", "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": "3"}, "max_completion_tokens"),
])
def test_wrong_types_are_a_400_not_coerced(served, path, body, param):
    """OpenAI: "Invalid type for 'n': expected an integer, but got a string instead." pydantic's lax
    mode had turned "5" into 5, "yes" into true and true into logprobs=1."""
    assert_error(post(served, path, body), 400, param, param)


def test_negative_seeds_are_int64_seeds(served):
    """vLLM takes any int64 seed (as launch.core.sampling_params does); OpenAI any integer."""
    r = post(served, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "seed": -1})
    assert r.status_code == 200, r.text
    assert served.engine.seen_params[-1].seed == -1
    assert_error(post(served, "/v1/completions", {"prompt": "ab", "seed": -(2**63) - 1}), 400, "seed")


# ---------------------------------------------------------------- fields that would change the output


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),  # vLLM: "suffix is not currently supported"
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"messages": CHAT, "guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True},  # beside add_generation_prompt
     "continue_final_message"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "echo"),  # as vLLM
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # only with echo
])
def test_fields_that_would_change_the_output_are_refused_not_ignored(served, path, body, param):
    assert_error(post(served, path, body), 400, param, param)


def test_neutral_values_of_refused_fields_pass(served):
    body = {"prompt": "ab", "max_tokens": 2, "suffix": None, "response_format": {"type": "text"},
            "use_beam_search": False, "prompt_logprobs": None}
    assert post(served, "/v1/completions", body).status_code == 200


def test_unknown_fields_are_ignored_with_a_warning(served, caplog):
    """vLLM: 'The following fields were present in the request but ignored: {...}'."""
    with caplog.at_level(logging.WARNING, logger="launch.server.protocol"):
        r = post(served, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200
    assert any("frobnicate" in rec.getMessage() and "ignored" in rec.getMessage() for rec in caplog.records)


# ---------------------------------------------------------------- echo


def test_echo_puts_each_prompts_text_before_its_choices(served):
    """OpenAI / vLLM: echo=true returns the prompt followed by the completion, in each choice (token-id
    prompts decoded); streamed, the prompt's text opens each choice's first chunk."""
    plain = post(served, "/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "seed": 5}).json()
    echoed = post(served, "/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "seed": 5,
                                              "echo": True}).json()
    assert [c["text"] for c in echoed["choices"]] == \
        [p + c["text"] for p, c in zip(["ab", "ab", "cd", "cd"], plain["choices"])]
    assert echoed["usage"] == plain["usage"]  # the prompt is not counted as completion tokens
    ids = CharTokenizer().encode("xy")
    r = post(served, "/v1/completions", {"prompt": ids, "max_tokens": 3, "echo": True, "stream": True})
    chunks = events(r)
    assert chunks[0]["choices"][0]["text"].startswith("xy")
    whole = post(served, "/v1/completions", {"prompt": ids, "max_tokens": 3, "echo": True}).json()
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole["choices"][0]["text"]


# ---------------------------------------------------------------- streaming usage, created, logprobs


def test_continuous_usage_stats_puts_each_choices_usage_in_every_chunk(served):
    """vLLM's stream_options.continuous_usage_stats: usage (that choice's tokens so far) on every chunk,
    then the whole request's usage in a last chunk."""
    body = {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 4, "n": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(post(served, "/v1/completions", body))
    last = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == (2 if choice["index"] < 2 else 3)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= last.get(choice["index"], 1)
        last[choice["index"]] = usage["completion_tokens"]
    assert last == {0: 4, 1: 4, 2: 4, 3: 4}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    chat = events(post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True,
                                                        "stream_options": {"continuous_usage_stats": True}}))
    assert all(c["usage"] is not None for c in chat)
    assert chat[0]["usage"]["completion_tokens"] == 0 and chat[-2]["usage"]["completion_tokens"] == 3


def test_every_chunk_of_a_response_has_its_created(monkeypatch):
    """OpenAI / vLLM: all chunks of one response share id and created (here the clock ticks a second
    per call, as a long stream crosses seconds)."""
    clock = itertools.count(1_700_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    for cls in (CompletionFormatter, ChatFormatter):
        fmt = cls("r", "m", [[5]], 1, lambda t: "a", None)
        chunks = list(fmt.stream_start())
        for step in range(1, 4):
            out = SimpleNamespace(outputs=[SimpleNamespace(text="a" * step, token_ids=[1] * step, logprobs=None,
                                                           finish_reason="length" if step == 3 else None,
                                                           stop_reason=None)])
            chunks += fmt.stream_chunks(0, out)
        chunks.append(fmt.usage_chunk())
        assert len({c.created for c in chunks}) == 1, [c.created for c in chunks]


def test_completion_logprobs_keep_the_likelier_of_two_tokens_with_one_text():
    """Two byte tokens of one UTF-8 character both read U+FFFD: the map kept whichever came last (the
    less likely), so the greedy token's entry in top_logprobs disagreed with token_logprobs."""
    texts = {1: "a", 2: "\ufffd", 3: "\ufffd"}
    fmt = CompletionFormatter("r", "m", [[5]], 1, texts.__getitem__, 2)
    lp = fmt.logprobs([2], [{2: -0.5, 3: -1.0, 1: -3.0}], 0)
    assert lp.token_logprobs == [-0.5] and lp.top_logprobs == [{"\ufffd": -0.5}]


def test_logprobs_zero_still_carries_the_sampled_token(served):
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements"; vLLM returns {sampled: logprob} for logprobs=0, not null."""
    r = post(served, "/v1/completions", {"prompt": "ab", "max_tokens": 3, "logprobs": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert [list(d.values()) for d in lp["top_logprobs"]] == [[v] for v in lp["token_logprobs"]]
    assert [list(d) for d in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_an_infinite_logprob_is_sent_as_minus_9999():
    """JSON has no -inf: OpenAI and vLLM send -9999.0 (a non-streamed body with -inf was a 500)."""
    texts = {1: "a", 2: "b"}
    lp = CompletionFormatter("r", "m", [[5]], 1, texts.__getitem__, 1).logprobs(
        [1], [{1: -math.inf, 2: -0.1}], 0)
    assert lp.token_logprobs == [-9999.0] and lp.top_logprobs == [{"b": -0.1, "a": -9999.0}]
    chat = ChatFormatter("r", "m", [[5]], 1, texts.__getitem__, 1).logprobs([1], [{1: -math.inf, 2: -0.1}])
    json.dumps(chat.model_dump(), allow_nan=False)


# ---------------------------------------------------------------- one clear message per bad input


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": [[1, 2], []]}, "prompt", "prompt[1] must not be an empty list of token ids"),
    ({"prompt": [[1, 2], [3, -4]]}, "prompt", "prompt[1][1] must be a token id (an integer >= 0), got -4"),
    ({"prompt": ["a", 3]}, "prompt", "prompt[1] must be a string"),
    ({"prompt": None}, "prompt", "prompt must be a string, a list of strings, a list of token ids"),
    ({"prompt": "x", "stop": 5}, "stop", "stop must be a string or a list of strings, got 5"),
    ({"prompt": "x", "stop": ["a", None]}, "stop", "stop[1] must be a string, got null"),
    ({"prompt": "x", "stop_token_ids": [3, 95]}, "stop_token_ids", "Token id 95 is out of vocabulary"),
    ([1, 2], None, "The request body must be a JSON object, got an array"),
])
def test_bad_inputs_get_one_message_naming_the_problem(served, body, param, message):
    assert_error(post(served, "/v1/completions", body), 400, param, message)
    assert post(served, "/v1/completions", {"prompt": "ok", "max_tokens": 2}).status_code == 200
