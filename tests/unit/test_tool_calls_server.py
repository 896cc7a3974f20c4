"""Tool calling through the server: /v1/chat/completions with a scripted fake engine, the flags, the errors.

``ScriptedEngine`` (``server_fakes.FakeEngine`` with a scripted reply) emits the tokens of
``engine.reply`` then eos; its tokenizer has one token per character plus whole special tokens
that decoding drops, as the real engine's text does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import httpx
import openai
import pytest

from launch.config import ServerConfig
from launch.core.outputs import CompletionOutput, RequestOutput
from launch.server import build_app
from launch.server.tools.stream import MarkedText
from tests.unit.server_fakes import FakeEngine, ServerThread

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_REPLY = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptTokenizer:
    """One token per printable ASCII character and newline, then ``specials`` as whole tokens (``special``
    ones are dropped by ``decode(skip_special_tokens=True)``); ``seen``: what the chat template was given."""

    def __init__(self, specials: tuple[str, ...] = (), special: tuple[str, ...] = ()) -> None:
        self.vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>", *specials]
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.special = {"</s>", *special}
        self.eos_token_ids = (self.ids["</s>"],)
        self.seen: list[tuple[list[dict], list[dict] | None]] = []

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out, i = [], 0
        while i < len(text):
            whole = next((t for t in self.vocab[96:] if text.startswith(t, i)), None)
            out.append(self.ids[whole] if whole else self.ids.get(text[i], self.ids["?"]))
            i += len(whole) if whole else 1
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and self.vocab[i] in self.special))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        self.seen.append((messages, tools))
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class ScriptedEngine(FakeEngine):
    def __init__(self, tokenizer: ScriptTokenizer) -> None:
        super().__init__(max_model_len=512, step_s=0.0005)
        self.tokenizer = tokenizer
        self.model_config = SimpleNamespace(vocab_size=len(tokenizer.vocab), moe_layer_ids=(1, 2), num_experts=4)
        self.reply = ""

    async def _decode(self, prompt, params, request_id):
        script = self.tokenizer.encode(self.reply) + list(self.tokenizer.eos_token_ids)
        limit = min(params.max_tokens, self.max_model_len - len(prompt))
        ids: list[int] = []
        for t in script:
            await asyncio.sleep(self.step_s)
            ids.append(t)
            reason = "stop" if t in self.tokenizer.eos_token_ids else "length" if len(ids) >= limit else None
            text = self.tokenizer.decode(ids)
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(0, text, list(ids), reason, None, None)],
                                reason is not None)
            if reason is not None:
                return


def serve(tokenizer: ScriptTokenizer, **server: object):
    engine = ScriptedEngine(tokenizer)
    cfg = SimpleNamespace(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None, **server)
    return engine, ServerThread(build_app(engine, cfg))


@pytest.fixture(scope="module")
def hermes():
    engine, thread = serve(ScriptTokenizer(), enable_auto_tool_choice=True, tool_call_parser="hermes")
    with thread as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url,
                              client=openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0))


@pytest.fixture(scope="module")
def mistral():
    tok = ScriptTokenizer(specials=("[TOOL_CALLS]", "[ARGS]"), special=("[TOOL_CALLS]", "[ARGS]"))
    engine, thread = serve(tok, enable_auto_tool_choice=True, tool_call_parser="mistral")
    with thread as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url)


@pytest.fixture(scope="module")
def plain():
    engine, thread = serve(ScriptTokenizer())
    with thread as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url)


def chat(srv, reply: str, **body: object) -> httpx.Response:
    srv.engine.reply = reply
    return httpx.post(srv.url + "/v1/chat/completions", json={"messages": USER, "tools": TOOLS, **body}, timeout=30)


def chat_stream(srv, reply: str, **body: object) -> list[dict]:
    """The SSE chunks of a streamed chat reply."""
    srv.engine.reply = reply
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30,
                      json={"messages": USER, "tools": TOOLS, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def assemble(chunks: list[dict]) -> dict[int, dict]:
    """Per choice: content, calls (name, arguments, id) and finish_reason, as a client adds them up."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            acc = out.setdefault(choice["index"], {"content": "", "calls": [], "finish_reason": None})
            delta = choice["delta"]
            acc["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                if call["index"] == len(acc["calls"]):
                    assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function"
                    acc["calls"].append([call["function"]["name"], "", call["id"]])
                else:
                    assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                acc["calls"][call["index"]][1] += call["function"].get("arguments", "")
            acc["finish_reason"] = choice["finish_reason"] or acc["finish_reason"]
    return out


def message_calls(message: dict) -> list[list[str]]:
    return [[c["function"]["name"], c["function"]["arguments"], c["id"]] for c in message["tool_calls"]]


# ---------------------------------------------------------------- replies with calls


def test_a_reply_with_a_call_has_tool_calls_and_the_text_around_them(hermes) -> None:
    hermes.engine.reply = HERMES_REPLY
    r = hermes.client.chat.completions.create(model="fake-moe", messages=USER, tools=TOOLS)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools reached the template, the default tool_choice is "auto"
    assert hermes.engine.tokenizer.seen[-1][1] == TOOLS


def test_a_streamed_reply_adds_up_to_the_whole_one(hermes) -> None:
    whole = chat(hermes, HERMES_REPLY).json()["choices"][0]
    chunks = chat_stream(hermes, HERMES_REPLY)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("<" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks)  # no markup leaks
    (got,) = assemble(chunks).values()
    assert got["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert got["content"] == whole["message"]["content"]
    assert [c[:2] for c in got["calls"]] == [c[:2] for c in message_calls(whole["message"])]
    assert got["calls"][0][2].startswith("chatcmpl-tool-")
    assert sum(bool(c["choices"][0]["delta"].get("tool_calls")) for c in chunks) > 2  # argument fragments


def test_the_openai_client_reads_the_streamed_calls(hermes) -> None:
    hermes.engine.reply = HERMES_REPLY
    stream = hermes.client.chat.completions.create(model="fake-moe", messages=USER, tools=TOOLS, stream=True)
    name, args, finish = None, "", None
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            name = name or call.function.name
            args += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")


def test_several_calls_and_choices(hermes) -> None:
    reply = HERMES_REPLY + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    body = chat(hermes, reply, n=2).json()
    for choice in body["choices"]:
        assert [json.loads(a) for _, a, _ in message_calls(choice["message"])] == [{"city": "Paris"}, {"city": "Rome"}]
    ids = {i for choice in body["choices"] for *_, i in message_calls(choice["message"])}
    assert len(ids) == 4
    streamed = assemble(chat_stream(hermes, reply, n=2))
    assert [[c[:2] for c in streamed[i]["calls"]] for i in (0, 1)] == [
        [c[:2] for c in message_calls(choice["message"])] for choice in body["choices"]]


def test_a_reply_without_calls_is_content(hermes) -> None:
    choice = chat(hermes, "It is sunny <b>today</b>.").json()["choices"][0]
    message = {k: v for k, v in choice["message"].items() if v is not None}  # vLLM's null fields left out
    assert message == {"role": "assistant", "content": "It is sunny <b>today</b>.", "tool_calls": []}
    assert choice["finish_reason"] == "stop"
    (got,) = assemble(chat_stream(hermes, "It is sunny <b>today</b>.")).values()
    assert (got["content"], got["calls"], got["finish_reason"]) == ("It is sunny <b>today</b>.", [], "stop")


def test_malformed_call_json_stays_content(hermes) -> None:
    reply = "<tool_call>{not json}</tool_call>"
    choice = chat(hermes, reply).json()["choices"][0]
    assert (choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]) == (reply, [], "stop")
    (got,) = assemble(chat_stream(hermes, reply)).values()
    assert (got["content"], got["calls"]) == (reply, [])


def test_a_call_cut_by_max_tokens_ends_with_length(hermes) -> None:
    cut = len(HERMES_REPLY[: HERMES_REPLY.index("Pa") + 2])  # one token per character
    choice = chat(hermes, HERMES_REPLY, max_tokens=cut).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    ((name, args, _),) = message_calls(choice["message"])
    assert name == "get_weather" and args == '{"city": "Pa'
    (got,) = assemble(chat_stream(hermes, HERMES_REPLY, max_tokens=cut)).values()
    assert (got["finish_reason"], [c[:2] for c in got["calls"]]) == ("length", [["get_weather", '{"city": "Pa']])


def test_tool_choice_none_renders_the_tools_and_parses_nothing(hermes) -> None:
    choice = chat(hermes, HERMES_REPLY, tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == HERMES_REPLY and choice["finish_reason"] == "stop"
    assert hermes.engine.tokenizer.seen[-1][1] == TOOLS


def test_mistral_special_tokens_are_kept_for_the_parser(mistral) -> None:
    """[TOOL_CALLS] and [ARGS] are special: the engine's text drops them, the server decodes the ids again."""
    reply = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    choice = chat(mistral, reply).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    ((name, args, call_id),) = message_calls(choice["message"])
    assert (name, args) == ("get_weather", '{"city": "Paris"}') and len(call_id) == 9 and call_id.isalnum()
    (got,) = assemble(chat_stream(mistral, reply)).values()
    assert (got["content"], [c[:2] for c in got["calls"]]) == ("Sure.", [["get_weather", '{"city": "Paris"}']])


def test_marked_text_keeps_markers_and_cuts_like_the_engine() -> None:
    tok = ScriptTokenizer(specials=("<tool_call>", "<x>"), special=("<tool_call>", "<x>"))
    markers = {tok.ids["<tool_call>"]: "<tool_call>"}
    ids = tok.encode("a<x><tool_call>b") + [tok.ids["</s>"]]
    done = SimpleNamespace(token_ids=ids, finish_reason="stop", stop_reason=None)
    assert MarkedText(tok, markers, [1], False).update(done) == "a<tool_call>b"  # other specials and eos dropped
    ids = tok.encode("one STOP two")
    cut = SimpleNamespace(token_ids=ids[:8], finish_reason="stop", stop_reason="STOP")
    assert MarkedText(tok, markers, [1], False).update(cut) == "one "
    assert MarkedText(tok, markers, [1], True).update(cut) == "one STOP"


def test_marked_text_withholds_what_may_start_a_stop_string_while_the_reply_runs() -> None:
    """As the engine's text does (``Sequence.visible_text``): a streamed reply showed "ok STOPHER" of a
    stop string "STOPHERE" whose whole reply ended "ok", and sent it on as content or arguments."""
    tok = ScriptTokenizer(specials=("[TOOL_CALLS]",), special=("[TOOL_CALLS]",))
    markers = {tok.ids["[TOOL_CALLS]"]: "[TOOL_CALLS]"}
    ids = tok.encode("ok[TOOL_CALLS] STOPHERE")
    for include, stop, want in ((False, ["STOPHERE"], "ok[TOOL_CALLS] "), (False, ["X", "HERX"], "ok[TOOL_CALLS] STOP"),
                                (True, ["STOPHERE"], "ok[TOOL_CALLS] STOPHER"), (False, [], "ok[TOOL_CALLS] STOPHER")):
        marked = MarkedText(tok, markers, [1], include, stop)
        running = SimpleNamespace(token_ids=ids[:-1], finish_reason=None, stop_reason=None)  # "...STOPHER"
        assert marked.update(running) == want, (include, stop)
    done = SimpleNamespace(token_ids=ids, finish_reason="stop", stop_reason="STOPHERE")
    assert marked.update(done) == "ok[TOOL_CALLS] "


# ---------------------------------------------------------------- the conversation's past calls


def test_past_calls_reach_the_template_as_vllm_passes_them(hermes) -> None:
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "assistant", "content": "ok", "tool_calls": []}]
    hermes.engine.reply = "It is 18C."
    r = httpx.post(hermes.url + "/v1/chat/completions", json={"messages": messages, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    seen = hermes.engine.tokenizer.seen[-1][0]
    assert seen[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {}}}]}
    assert seen[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    assert seen[3] == {"role": "assistant", "content": "ok"}


# ---------------------------------------------------------------- errors


AUTO = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@pytest.mark.parametrize(("server", "body", "param", "message"), [
    ("plain", {}, "tool_choice", AUTO),  # tools without tool_choice mean "auto"
    ("plain", {"tool_choice": "auto"}, "tool_choice", AUTO),
    ("hermes", {"tool_choice": "required"}, "tool_choice", "needs guided decoding"),
    ("hermes", {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice",
     "needs guided decoding"),
    ("hermes", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ("hermes", {"tool_choice": {"type": "function"}}, "tool_choice", "Invalid value for `function`"),
    ("hermes", {"tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`: sometimes!"),
    ("hermes", {"tools": None, "tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ("hermes", {"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools",
     "tools[0].function.name must be a non-empty string"),
    ("hermes", {"tools": [TOOLS[0], {"type": "retrieval"}]}, "tools", 'tools[1].type must be "function"'),
    ("hermes", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools",
     "tools[0].function.parameters.type is not a valid JSON Schema"),
    ("hermes", {"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "x", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages", "messages.1.tool_calls.0.type"),
])
def test_tool_requests_the_server_cannot_serve_are_400(request, server, body, param, message) -> None:
    srv = request.getfixturevalue(server)
    r = chat(srv, "x", **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_required_with_no_tools_is_none(plain) -> None:
    r = chat(plain, "<tool_call>", tools=[], tool_choice="required")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "<tool_call>"


# ---------------------------------------------------------------- flags


def test_flag_checks_at_startup(tiny_ckpt_with_tokenizer, monkeypatch, capsys, caplog) -> None:
    import launch.serve as serve_module

    started = []

    async def never(cfg, **kwargs):
        started.append(cfg)

    monkeypatch.setattr(serve_module, "serve", never)
    model = ["--model", str(tiny_ckpt_with_tokenizer), "--port", "0"]
    assert serve_module.main([*model, "--enable-auto-tool-choice"]) == 2
    assert capsys.readouterr().err == "error: server: --enable-auto-tool-choice requires --tool-call-parser\n"
    assert serve_module.main([*model, "--enable-auto-tool-choice", "--tool-call-parser", "mistral"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --tool-call-parser mistral: the tokenizer has no [TOOL_CALLS] token")
    with pytest.raises(SystemExit):
        serve_module.main([*model, "--tool-call-parser", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert started == []
    assert serve_module.main([*model, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == 0
    assert (started[0].server.enable_auto_tool_choice, started[0].server.tool_call_parser) == (True, "hermes")
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)


def test_build_app_checks_the_parser_against_the_tokenizer(caplog) -> None:
    cfg = SimpleNamespace(enable_auto_tool_choice=True, tool_call_parser="deepseek_v3")
    with pytest.raises(ValueError, match="no <｜tool▁calls▁begin｜> / <｜tool▁calls▁end｜> token"):
        build_app(ScriptedEngine(ScriptTokenizer()), cfg)
    engine = ScriptedEngine(ScriptTokenizer())
    engine.tokenizer = None
    with pytest.raises(ValueError, match="needs the checkpoint's tokenizer"):
        build_app(engine, cfg)
    with caplog.at_level(logging.WARNING):
        build_app(ScriptedEngine(ScriptTokenizer()), SimpleNamespace(tool_call_parser="hermes"))
    assert "does nothing without --enable-auto-tool-choice" in caplog.text


def test_a_real_tokenizers_special_markers_are_found_and_kept(tiny_ckpt_with_tokenizer, tmp_path) -> None:
    """The trained BPE of make-tiny with Mistral's control tokens added as special tokens: the engine's
    decode drops them, ``MarkedText`` (what the server parses) keeps them and drops eos."""
    import shutil

    import tokenizers

    from launch.server.tools.registry import check_tool_parser, special_token_ids
    from launch.tokenizer import Tokenizer

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_with_tokenizer, ckpt)
    backend = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    backend.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    backend.save(str(ckpt / "tokenizer.json"))
    tok = Tokenizer.from_dir(ckpt)
    parser = check_tool_parser("mistral", tok)
    markers = special_token_ids(tok, parser)
    assert sorted(markers.values()) == ["[ARGS]", "[TOOL_CALLS]"]
    reply = 'Sure, the weather.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    ids = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    assert tok.decode(ids) == 'Sure, the weather.get_weather{"city": "Paris"}'
    done = SimpleNamespace(token_ids=ids, finish_reason="stop", stop_reason=None)
    assert MarkedText(tok, markers, tok.encode("Hi"), False).update(done) == reply
