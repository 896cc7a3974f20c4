"""``POST /v1/responses`` (OpenAI's Responses API, text only): through the official ``openai`` client and
raw HTTP against ``FakeEngine`` in a ``ServerThread``, plus one round trip on the tiny real engine."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from launch.server import build_app
from launch.server.responses_api import ResponsesRequest
from tests.unit.server_fakes import (
    CharTokenizer,
    FakeEngine,
    ServerThread,
    assert_read_timeout_aborts,
    wait_until,
)

STREAM_TYPES = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
END_TYPES = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
             "response.completed"]


def server_config(**overrides):
    base = dict(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine()
    with ServerThread(build_app(engine, server_config())) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        yield SimpleNamespace(engine=engine, url=srv.base_url, client=client)


def prompt_len(messages):
    return len(CharTokenizer().apply_chat_template(messages))


# ---------------------------------------------------------------- the request model


def test_instructions_lead_and_items_become_chat_messages():
    req = ResponsesRequest(input=[{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                               {"type": "input_text", "text": "b"}]},
                                  {"type": "message", "role": "assistant",
                                   "content": [{"type": "output_text", "text": "c"}]},
                                  {"role": "developer", "content": "d"}], instructions="sys")
    assert [(m.role, m.text()) for m in req.messages()] == [("system", "sys"), ("user", "a\nb"),
                                                            ("assistant", "c"), ("developer", "d")]
    assert [(m.role, m.text()) for m in ResponsesRequest(input="hi").messages()] == [("user", "hi")]


# ---------------------------------------------------------------- non-streaming


def test_response_object_parses_with_the_sdk(served):
    r = served.client.responses.create(model="fake-moe", input="Hello", instructions="be brief",
                                       max_output_tokens=5, temperature=0.5, metadata={"k": "v"}, user="u1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "fake-moe"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert len(r.output) == 1
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [p.type for p in msg.content] == ["output_text"] and msg.content[0].annotations == []
    assert len(r.output_text) == 5
    assert (r.instructions, r.max_output_tokens, r.metadata, r.temperature, r.user) == ("be brief", 5, {"k": "v"},
                                                                                        0.5, "u1")
    assert r.tools == [] and r.error is None
    expected_input = prompt_len([{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello"}])
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (expected_input, 5, expected_input + 5)
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cache_write_tokens == 0
    type(r).model_validate(r.model_dump(), strict=True)  # the client's own type, every required field there


def test_a_stop_ends_it_completed(served):
    full = served.client.responses.create(model="fake-moe", input="stop me", max_output_tokens=8).output_text
    stop = full[3:5]
    r = served.client.responses.create(model="fake-moe", input="stop me", max_output_tokens=8,
                                       extra_body={"stop": [stop]})
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    assert r.output_text == full[:full.index(stop)]


def test_message_items_and_store_are_accepted(served):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Yo"}]},
             {"role": "user", "content": "More"}]
    for store in (True, False):
        r = served.client.responses.create(model="fake-moe", input=items, max_output_tokens=3, store=store)
        assert r.usage.input_tokens == prompt_len([{"role": "user", "content": "Hi"},
                                                   {"role": "assistant", "content": "Yo"},
                                                   {"role": "user", "content": "More"}])


# ---------------------------------------------------------------- streaming


def test_streamed_events_match_the_response(served):
    kw = dict(model="fake-moe", input="Stream", instructions="x", max_output_tokens=6, extra_body={"seed": 3})
    full = served.client.responses.create(**kw)
    events = list(served.client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == STREAM_TYPES and types[-4:] == END_TYPES
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    done = events[-1].response
    assert done.id == events[0].response.id and done.output_text == text
    assert done.status == "incomplete" and done.usage.output_tokens == 6
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_stream_helper_gets_the_final_response(served):
    with served.client.responses.stream(model="fake-moe", input="Helper", max_output_tokens=4) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and final.usage.output_tokens == 4


def test_raw_sse_names_each_event_and_sends_no_done(served):
    body = {"input": "raw", "max_output_tokens": 2, "stream": True}
    r = httpx.post(served.url + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b]
    for block in blocks:
        event, data = block.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert "[DONE]" not in r.text


# ---------------------------------------------------------------- refusals and errors


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"n": 2}, "n"),
    ({"max_tokens": 4}, "max_tokens"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [3] * 100}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 1000}, "max_output_tokens"),
])
def test_refused_fields_are_named(served, extra, param):
    r = httpx.post(served.url + "/v1/responses", json={"input": "hi", **extra}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_too_long_input_names_input(served):
    r = httpx.post(served.url + "/v1/responses", json={"input": "x" * 100}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "maximum context length" in r.json()["error"]["message"]


def test_neutral_values_pass(served):
    r = served.client.responses.create(model="fake-moe", input="ok", max_output_tokens=2, tool_choice="none",
                                       text={"format": {"type": "text"}}, truncation="disabled", tools=[],
                                       parallel_tool_calls=True, extra_body={"reasoning": {"effort": None}})
    assert r.usage.output_tokens == 2


def test_unknown_model_is_404(served):
    with pytest.raises(openai.NotFoundError):
        served.client.responses.create(model="nope", input="hi")


# ---------------------------------------------------------------- shared with chat: key, metrics, aborts


def test_api_key_guards_responses():
    with ServerThread(build_app(FakeEngine(), server_config(api_key="sekret"))) as srv:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0).responses.create(
                model="fake-moe", input="hi")
        good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sekret", max_retries=0)
        assert good.responses.create(model="fake-moe", input="hi", max_output_tokens=2).usage.output_tokens == 2


def test_metrics_count_responses(served):
    served.client.responses.create(model="fake-moe", input="metrics", max_output_tokens=3)
    text = httpx.get(served.url + "/metrics").text
    assert 'vllm:request_success_total{finished_reason="length",model_name="fake-moe"}' in text


def test_full_queue_gets_503():
    engine = FakeEngine(max_running=1)
    with ServerThread(build_app(engine, server_config(max_queue_len=0))) as srv:
        r = httpx.post(srv.base_url + "/v1/responses", json={"input": "q", "max_output_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_disconnecting_stream_aborts_and_frees(served):
    engine = served.engine
    before = len(engine.aborted)
    body = {"input": "d", "max_output_tokens": 40, "stream": True}
    with httpx.stream("POST", served.url + "/v1/responses", json=body, timeout=10) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a discarded line iterator closes the stream when collected
        next(lines)
        assert engine.stats().num_running == 1
    assert wait_until(lambda: len(engine.aborted) > before)
    assert wait_until(lambda: engine.stats().num_running == 0)


def test_disconnecting_non_streaming_client_aborts(served):
    assert_read_timeout_aborts(served.engine, served.url + "/v1/responses", {"input": "slow", "max_output_tokens": 30})


# ---------------------------------------------------------------- the tiny real engine


def test_live_streamed_text_matches_the_response(tiny_ckpt_with_tokenizer, tmp_path):
    pytest.importorskip("launch.async_llm")
    from tests.server.test_server_live import LiveServer, runtime_config
    with LiveServer(runtime_config(tiny_ckpt_with_tokenizer, tmp_path)) as srv:
        client, name = srv.client(), srv.cfg.served_model_name
        kw = dict(model=name, input="Tell me about experts.", instructions="Be brief.", max_output_tokens=6,
                  temperature=0, extra_body={"ignore_eos": True})
        full = client.responses.create(**kw)
        assert full.status == "incomplete" and full.usage.output_tokens == 6
        with client.responses.stream(**kw) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == final.output_text == full.output_text
        assert final.usage.input_tokens == full.usage.input_tokens


def test_a_late_failure_is_an_error_event():
    from launch.server.protocol import APIError
    from launch.server.responses_api import ResponsesFormatter
    fmt = ResponsesFormatter("resp_x", "m", [[1, 2]], 1, str, None)
    started = fmt.stream_start()
    raw = fmt.encode(fmt.error_event(APIError(503, "worker lost", type="service_unavailable")))
    event, data = raw.strip().split("\n")
    body = json.loads(data.removeprefix("data: "))
    assert event == "event: error" and body["type"] == "error" and body["sequence_number"] == len(started)
    assert (body["code"], body["message"], body["param"]) == ("service_unavailable", "worker lost", None)
    assert fmt.stream_end() == ""
