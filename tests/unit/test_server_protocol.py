"""The OpenAI server against a deterministic fake engine: wire format, errors, streaming, metrics.

The real engine is exercised in tests/server/test_server_live.py; here the engine is
``server_fakes.FakeEngine`` so every behaviour of the HTTP layer is checked in
about a second, through the official ``openai`` client and raw HTTP.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
from pydantic import ValidationError
from safetensors.torch import load_file

from launch.server import build_app
from launch.server.protocol import ChatCompletionRequest, CompletionRequest
from launch.server.serving import OpenAIServing
from tests.unit.server_fakes import (
    CharTokenizer,
    FakeEngine,
    ServerThread,
    assert_read_timeout_aborts,
    wait_until,
)


def server_config(**overrides):
    base = dict(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = FakeEngine()
    cfg = server_config(expert_distribution_dir=str(tmp_path_factory.mktemp("dist")))
    with ServerThread(build_app(engine, cfg)) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        yield SimpleNamespace(engine=engine, url=srv.base_url, client=client)


# ---------------------------------------------------------------- request models


def test_completion_prompt_forms():
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for bad in ([], "", [1, "a"], [1.5], [[1], []], [-1], [True], {"x": 1}):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt=bad)


def test_sampling_fields_validated():
    for bad in ({"max_tokens": -3}, {"n": 0}, {"top_p": 0}, {"temperature": -1},
                {"logprobs": -1}, {"stop": [""]}, {"stop": ["x"] * 17}, {"top_k": -2}):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt="x", **bad)
    assert CompletionRequest(prompt="x", stop="END").stop == ["END"]
    with pytest.raises(ValidationError, match="stream_options"):
        CompletionRequest(prompt="x", stream_options={"include_usage": True})
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}],
                                 max_tokens=3, max_completion_tokens=5)
    assert chat.messages[0].text() == "a\nb" and chat.max_new_tokens == 5  # vLLM joins text parts with newlines
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])


# ---------------------------------------------------------------- happy paths via the openai client


def test_completion_text_and_usage(served):
    a = served.client.completions.create(model="fake-moe", prompt="Hello", max_tokens=7, temperature=0)
    b = served.client.completions.create(model="fake-moe", prompt="Hello", max_tokens=7, temperature=0)
    assert a.object == "text_completion" and len(a.choices) == 1
    assert len(a.choices[0].text) == 7 and a.choices[0].finish_reason == "length"
    assert a.choices[0].text == b.choices[0].text  # greedy is repeatable
    assert (a.usage.prompt_tokens, a.usage.completion_tokens, a.usage.total_tokens) == (5, 7, 12)


def test_completion_token_ids_batch_and_n(served):
    out = served.client.completions.create(model="fake-moe", prompt=[[5, 6], [7, 8, 9]], max_tokens=3,
                                           n=2, seed=100)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 12
    seeds = sorted(p.seed for p in served.engine.seen_params[-4:])
    assert seeds == [100, 100, 101, 101]  # seed + index within each prompt's n choices
    assert out.choices[0].text != out.choices[1].text
    single = served.client.completions.create(model="fake-moe", prompt=[5, 6], max_tokens=3, seed=100)
    assert single.choices[0].text == out.choices[0].text


def test_stop_string_and_logprobs(served):
    full = served.client.completions.create(model="fake-moe", prompt="abc", max_tokens=10, temperature=0)
    stop = full.choices[0].text[4:6]
    cut = served.client.completions.create(model="fake-moe", prompt="abc", max_tokens=10, temperature=0,
                                           stop=[stop], logprobs=2)
    choice = cut.choices[0]
    assert choice.text == full.choices[0].text[: full.choices[0].text.index(stop)]
    assert choice.finish_reason == "stop"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] == -0.5 and len(lp.top_logprobs[0]) == 2
    assert lp.text_offset[:3] == [0, 1, 2]


def test_chat_and_streamed_chat_with_usage(served):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = served.client.chat.completions.create(model="fake-moe", messages=msgs, max_completion_tokens=6,
                                                 temperature=0, logprobs=True, top_logprobs=1)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert len(full.choices[0].logprobs.content) == 6
    assert len(full.choices[0].logprobs.content[0].top_logprobs) == 1
    prompt_len = len("<system>be brief<user>hi<assistant>")
    assert full.usage.prompt_tokens == prompt_len and full.usage.completion_tokens == 6
    chunks = list(served.client.chat.completions.create(
        model="fake-moe", messages=msgs, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == prompt_len + 6
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_raw_sse(served):
    body = {"prompt": [3, 4], "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == \
        served.client.completions.create(model="fake-moe", prompt=[3, 4], max_tokens=5, temperature=0
                                         ).choices[0].text
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_models_health_metrics(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == ["fake-moe"]
    assert httpx.get(served.url + "/health").status_code == 200
    served.client.completions.create(model="fake-moe", prompt="m", max_tokens=4)
    text = httpx.get(served.url + "/metrics").text
    for needle in ('vllm:num_requests_running{model_name="fake-moe"}',
                   'vllm:num_requests_waiting{model_name="fake-moe"}',
                   'vllm:kv_cache_usage_perc{model_name="fake-moe"}',
                   'vllm:generation_tokens_total{model_name="fake-moe"}',
                   'vllm:prompt_tokens_total{model_name="fake-moe"}',
                   'vllm:prefix_cache_hits_total{model_name="fake-moe"}',
                   'moe:layer_balancedness{layer="2",model_name="fake-moe"} 0.75',
                   'moe:tokens_dropped_total{model_name="fake-moe"} 3.0',
                   'moe:expert_copies_moved_total{model_name="fake-moe"} 4.0',
                   'moe:rebalance_seconds_total{model_name="fake-moe"} 0.25',
                   'vllm:request_success_total{finished_reason="length",model_name="fake-moe"}'):
        assert needle in text, needle
    assert "_created" not in text
    count = next(ln for ln in text.splitlines() if ln.startswith("vllm:time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1
    assert "vllm:inter_token_latency_seconds_bucket" in text and "vllm:e2e_request_latency_seconds_sum" in text


# ---------------------------------------------------------------- errors


def post(url, body, **kw):
    return httpx.post(url, content=body if isinstance(body, bytes) else json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=10, **kw)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 95]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "y" * 64}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    # chat errors name the chat request's own fields
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 64}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 60}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 60}, 400, "max_tokens"),
    # sampling fields the server does not implement are refused, not silently ignored
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 100}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 4, "max_tokens": 2}, 400,
     "min_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    # tools are rendered into the prompt, but tool calls are not parsed out: only tool_choice "none"
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": "high"}, 400, "frequency_penalty"),
])
def test_bad_requests_get_openai_errors(served, path, body, status, param):
    r = post(served.url + path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    assert err["param"] == param
    ok = served.client.completions.create(model="fake-moe", prompt="still fine", max_tokens=2)
    assert len(ok.choices[0].text) == 2


def test_neutral_values_of_unimplemented_sampling_fields_pass_and_stop_str_can_be_kept(served):
    """What SDKs send by default (penalties 0 / 1, best_of 1, logit_bias {}) still works, and
    vLLM's include_stop_str_in_output reaches the engine's SamplingParams."""
    body = {"prompt": "abc", "max_tokens": 2, "n": 2, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
            "repetition_penalty": 1.0, "logit_bias": {}, "min_tokens": 0, "skip_special_tokens": True}
    r = post(served.url + "/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    params = OpenAIServing.sampling_params(CompletionRequest(prompt="x", stop="y", include_stop_str_in_output=True), 4, None)
    assert params.include_stop_str_in_output and params.stop == ("y",)


def test_tools_with_tool_choice_none_are_served(served):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    r = post(served.url + "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    without = post(served.url + "/v1/chat/completions", {**body, "tools": None, "tool_choice": None})
    # the template rendered the tool into the prompt: "<tool:f>" is 8 more prompt tokens (one per character)
    assert r.json()["usage"]["prompt_tokens"] == without.json()["usage"]["prompt_tokens"] + len("<tool:f>")


def test_a_non_text_content_part_is_named(served):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                      {"type": "image_url", "image_url": {"url": "http://x"}}]}]}
    r = post(served.url + "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["message"] == ("messages.0.content: content part 1 has type 'image_url': this server "
                                            "takes text parts only")


@pytest.mark.parametrize("content_type, body, status, message", [
    ("application/x-www-form-urlencoded", b'{"prompt": "hi", "max_tokens": 2}', 415,
     "Unsupported Media Type: application/x-www-form-urlencoded; only 'application/json' is allowed."),
    ("text/plain", b'{"prompt": "hi"}', 415, "Unsupported Media Type: text/plain; only 'application/json' is allowed."),
    ("application/json", b"", 400, "Missing request body: expected a JSON object."),
    # FastAPI's strict Content-Type check leaves a body without the header unread: the header is named
    (None, b'{"prompt": "hi", "max_tokens": 2}', 415, "Unsupported Media Type: the request has a body but no "
     "Content-Type header; send it with 'Content-Type: application/json'."),
])
def test_a_body_that_is_not_json_says_so(served, content_type, body, status, message):
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(served.url + "/v1/completions", content=body, headers=headers, timeout=10)
    assert content_type is not None or "content-type" not in r.request.headers
    assert r.status_code == status and r.json()["error"]["message"] == message, r.text
    ok = post(served.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})  # what curl -H ... sends
    assert ok.status_code == 200


def test_unknown_route_and_method(served):
    r = httpx.get(served.url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(served.url + "/v1/completions").status_code == 405


def test_openai_client_raises_typed_errors(served):
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        served.client.completions.create(model="fake-moe", prompt="x", max_tokens=1000)


def test_oversized_bodies_get_413():
    with ServerThread(build_app(FakeEngine(), server_config(), max_body_bytes=1000)) as srv:
        big = {"prompt": "x" * 2000}
        r = post(srv.base_url + "/v1/completions", big)
        assert r.status_code == 413 and "too large" in r.json()["error"]["message"]

        def chunks():  # no content-length: the limit applies while streaming the body in
            yield json.dumps(big).encode()
        r = httpx.post(srv.base_url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert post(srv.base_url + "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
        # both 413s counted once: the declared one in the middleware, the streamed one by the handler
        assert 'moe:requests_rejected_total{model_name="fake-moe",status="413"} 2.0' in \
            httpx.get(srv.base_url + "/metrics").text


def test_unknown_routes_and_methods_are_counted_as_rejected():
    with ServerThread(build_app(FakeEngine(), server_config())) as srv:
        assert httpx.get(srv.base_url + "/nope").status_code == 404
        assert httpx.get(srv.base_url + "/v1/completions").status_code == 405
        text = httpx.get(srv.base_url + "/metrics").text
        assert 'moe:requests_rejected_total{model_name="fake-moe",status="404"} 1.0' in text
        assert 'moe:requests_rejected_total{model_name="fake-moe",status="405"} 1.0' in text


def test_api_key_guards_the_v1_routes():
    engine = FakeEngine()
    with ServerThread(build_app(engine, server_config(api_key="sekret"))) as srv:
        for path in ("/health", "/metrics"):  # outside /v1: open, as in vLLM
            assert httpx.get(srv.base_url + path).status_code == 200
        r = httpx.get(srv.base_url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = post(srv.base_url + "/v1/completions", {"prompt": "x"}, )
        assert r.status_code == 401
        assert httpx.get(srv.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        for header, status in (("bearer sekret", 200), ("BEARER sekret", 200), ("Basic sekret", 401),
                               ("Bearersekret", 401), ("sekret", 401), ("Bearer sekret2", 401)):
            # the scheme is case-insensitive, the key exact
            assert httpx.get(srv.base_url + "/v1/models", headers={"Authorization": header}).status_code == status
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model="fake-moe", prompt="k", max_tokens=2).usage.completion_tokens == 2
        metrics = httpx.get(srv.base_url + "/metrics", headers={"Authorization": "Bearer sekret"}).text
        assert 'moe:requests_rejected_total{model_name="fake-moe",status="401"} 8.0' in metrics


# ---------------------------------------------------------------- load shedding and cancellation


def test_full_queue_gets_503_and_recovers():
    # The first stream must outlast the next two posts even on a loaded machine: it is long
    # (up to 20 s) and ends early when the `with` closes its connection.
    engine = FakeEngine(max_running=1, max_queue_len=1, step_s=0.02, max_model_len=1024)
    with ServerThread(build_app(engine, server_config(max_queue_len=1))) as srv, ThreadPoolExecutor(1) as pool:
        body = {"prompt": "q", "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=10) as first:
            lines = first.iter_lines()  # (a dropped iterator would close the connection)
            next(lines)  # running; the next request has to wait
            second = pool.submit(post, srv.base_url + "/v1/completions", {"prompt": "q", "max_tokens": 2})
            assert wait_until(lambda: engine.stats().num_waiting == 1)
            third = post(srv.base_url + "/v1/completions", {"prompt": "q", "max_tokens": 2})
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["type"] == "server_overloaded"
        assert second.result().status_code == 200
        assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().num_waiting == 0)
        assert post(srv.base_url + "/v1/completions", {"prompt": "q", "max_tokens": 2}).status_code == 200
        assert 'moe:requests_rejected_total{model_name="fake-moe",status="503"} 1.0' in \
            httpx.get(srv.base_url + "/metrics").text


class SlowTokenizer(CharTokenizer):
    """Takes ``delay`` seconds to encode a text that starts with "slow" (a megabyte-long prompt)."""

    delay = 2.0

    def encode(self, text, add_special_tokens=True):
        if "slow" in text:
            time.sleep(self.delay)
        return super().encode(text, add_special_tokens)


def test_tokenizing_a_long_prompt_does_not_stall_other_clients():
    """Text prompts and chat messages are encoded off the event loop: while one request's prompt
    takes seconds to encode, /health and other requests are answered at once."""
    engine = FakeEngine()
    engine.tokenizer = SlowTokenizer()
    with ServerThread(build_app(engine, server_config())) as srv, ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(post, srv.base_url + "/v1/completions", {"prompt": "slow", "max_tokens": 2}),
                pool.submit(post, srv.base_url + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "slow"}], "max_tokens": 2})]
        time.sleep(0.3)  # both are encoding now
        start = time.monotonic()
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
        fast = post(srv.base_url + "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert fast.status_code == 200
        assert time.monotonic() - start < SlowTokenizer.delay / 2
        assert not any(f.done() for f in slow)
        assert [f.result().status_code for f in slow] == [200, 200]


def test_engine_queue_full_maps_to_503():
    engine = FakeEngine(max_queue_len=0)
    with ServerThread(build_app(engine, server_config(max_queue_len=None))) as srv:
        r = post(srv.base_url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "stream": True})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503


def test_disconnecting_stream_aborts_and_frees(served):
    engine = served.engine
    before = len(engine.aborted)
    body = {"prompt": "d", "max_tokens": 60, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=10) as r:
        it = r.iter_lines()
        next(it)
        assert engine.stats().num_running == 1
    assert wait_until(lambda: len(engine.aborted) > before)
    assert wait_until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0)


def test_disconnecting_non_streaming_client_aborts(served):
    body = {"messages": [{"role": "user", "content": "slow"}], "max_tokens": 30, "n": 2}
    assert_read_timeout_aborts(served.engine, served.url + "/v1/chat/completions", body, aborts=2)


# ---------------------------------------------------------------- expert distribution routes


def test_expert_distribution_record_and_dump(served):
    url = served.url
    assert post(url + "/start_expert_distribution_record", {}).status_code == 200
    served.client.completions.create(model="fake-moe", prompt="e", max_tokens=3)
    assert post(url + "/stop_expert_distribution_record", {}).status_code == 200
    r = post(url + "/dump_expert_distribution_record", {})
    assert r.status_code == 200
    tensors = load_file(r.json()["path"])
    assert tensors["logical_count"].shape == (3, 2, 4)
    assert tensors["phy2log"].shape == (2, 5)


def test_stats_collector_averages_per_rank_sequences():
    from launch.server.metrics import ServerMetrics
    stats = SimpleNamespace(num_running=2, num_waiting=0, kv_cache_usage=(0.25, 0.75), prompt_tokens_total=7,
                            balancedness_per_layer=[0.9, 0.8, 0.7])
    text = ServerMetrics("m", stats=lambda: stats, moe_layer_ids=(1, 2)).exposition().decode()
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.5' in text
    assert 'vllm:prompt_tokens_total{model_name="m"} 7.0' in text
    assert 'moe:layer_balancedness{layer="2",model_name="m"} 0.7' in text  # ids do not match: positions
    assert "vllm:generation_tokens_total" not in text and "moe:tokens_dropped" not in text  # unreported


def test_model_without_tokenizer_takes_token_ids_only():
    engine = FakeEngine()
    engine.tokenizer = None
    with ServerThread(build_app(engine, server_config())) as srv:
        r = post(srv.base_url + "/v1/completions", {"prompt": "text"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = post(srv.base_url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = post(srv.base_url + "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_health_reflects_a_dead_engine():
    engine = FakeEngine()
    with ServerThread(build_app(engine, server_config())) as srv:
        assert httpx.get(srv.base_url + "/health").status_code == 200
        engine.errored = True
        r = httpx.get(srv.base_url + "/health")
        assert r.status_code == 503 and "stopped" in r.json()["error"]["message"]
