"""launch/server/tools: each ``--tool-call-parser`` format, whole and streamed.

The property every case checks: streaming the reply (one character at a time, or in random
chunks as the server's coalesced outputs arrive) adds up to the same content and calls as
parsing the whole reply. The example replies follow vLLM's parser docstrings and tests.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.server.tools import deepseek as ds
from launch.server.tools.registry import TOOL_PARSERS, get_tool_parser
from launch.server.tools.scan import OPEN, Malformed, partial_marker_len, scan_call_object, value_end
from launch.server.tools.stream import ToolCallStream, tool_finish_reason

Calls = list[tuple[str, str]]


def whole(parser: str, text: str, reason: str = "stop") -> tuple[str | None, Calls]:
    content, calls = ToolCallStream(get_tool_parser(parser)()).result(SimpleNamespace(text=text, finish_reason=reason))
    return content, [(c.function.name, c.function.arguments) for c in calls]


def streamed(parser: str, text: str, cuts: list[int] | None = None, reason: str = "stop") -> tuple[str | None, Calls]:
    """The reply as a client assembles it from the deltas; ``cuts``: where the chunks end (default: every char)."""
    stream = ToolCallStream(get_tool_parser(parser)())
    content, calls, ids = "", {}, {}
    ends = sorted(set(cuts or range(1, len(text) + 1)) | {len(text)})
    for end in ends:
        new, deltas = stream.update(SimpleNamespace(text=text[:end], finish_reason=reason if end == len(text) else None))
        content += new
        for d in deltas:
            if d.index not in calls:  # a call's first delta says everything about it but the rest of its arguments
                assert d.index == len(calls) and d.id and d.type == "function" and d.function.name
                calls[d.index], ids[d.index] = [d.function.name, ""], d.id
            else:
                assert d.id is None and d.type is None and d.function.name is None
            calls[d.index][1] += d.function.arguments or ""
    if parser == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids.values())
    return (content or None) if calls else content, [tuple(c) for c in calls.values()]


def check(parser: str, text: str, content: str | None, calls: list[tuple[str, dict | str]]) -> None:
    got = whole(parser, text)
    assert got[0] == content
    assert [(n, json.loads(a) if isinstance(want, dict) else a) for (n, a), (_, want) in zip(got[1], calls)] == calls
    assert len(got[1]) == len(calls)
    assert streamed(parser, text) == got


WEATHER = '{"location": "Paris", "unit": "celsius"}'
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + '}\n</tool_call>', None,
         [("get_weather", json.loads(WEATHER))]),
        ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "}</tool_call>"}]}}\n</tool_call>\n'
         '<tool_call>\n{"arguments": {}, "name": "b"}\n</tool_call>\nDone.', "Let me check.\nDone.",
         [("a", {"x": [1, {"y": "}</tool_call>"}]}), ("b", {})]),
        ("no tools here, but <b>markup</b> and a lone <tool", "no tools here, but <b>markup</b> and a lone <tool", []),
        ('<tool_call>{"name": "f", "arguments": {"q": "\\"quoted\\" \\u00e9"}}', None, [("f", {"q": '"quoted" é'})]),
        ('<tool_call>{"name": "f"}</tool_call>', None, [("f", {})]),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "mul", "arguments": {"a": 2}}]',
         None, [("add", {"a": 3.5, "b": 4}), ("mul", {"a": 2})]),
        ('Sure.[TOOL_CALLS][{"name": "f", "arguments": {}}] trailing', "Sure. trailing", [("f", {})]),
        ('[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]mul[ARGS]{"a": [1, 2]}', None,
         [("add", {"a": 3.5, "b": 4}), ("mul", {"a": [1, 2]})]),
        ('text first [TOOL_CALLS]get_weather{"city": "Paris"}', "text first", [("get_weather", {"city": "Paris"})]),
    ],
    "deepseek_v3": [
        (f'Sure.{ds.CALLS_BEGIN}{ds.CALL_BEGIN}function{ds.SEP}get_current_weather\n```json\n{{"location": "Beijing"}}\n```'
         f'{ds.CALL_END}\n{ds.CALL_BEGIN}function{ds.SEP}get_time\n```json\n{{}}\n```{ds.CALL_END}{ds.CALLS_END}',
         "Sure.", [("get_current_weather", {"location": "Beijing"}), ("get_time", {})]),
        ("Just text, 中文 too.", "Just text, 中文 too.", []),
    ],
    "deepseek_v31": [
        (f'{ds.CALLS_BEGIN}{ds.CALL_BEGIN}get_weather{ds.SEP}{{"location": "杭州"}}{ds.CALL_END}'
         f'{ds.CALL_BEGIN}f{ds.SEP}{{}}{ds.CALL_END}{ds.CALLS_END}', None, [("get_weather", {"location": "杭州"}), ("f", {})]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": ' + WEATHER + "}", None, [("get_weather", json.loads(WEATHER))]),
        ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}', None,
         [("a", {"x": 1}), ("b", {})]),
        ('{"result": 42}', '{"result": 42}', []),
        ('The JSON is {"name": "x", "parameters": {}}', 'The JSON is {"name": "x", "parameters": {}}', []),
    ],
}
ALL_CASES = [(parser, *case) for parser, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL_CASES)
def test_whole_and_streamed_replies_give_the_same_calls(parser, text, content, calls) -> None:
    check(parser, text, content, calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(ALL_CASES), data=st.data())
def test_any_chunking_gives_the_same_calls(case, data) -> None:
    parser, text = case[0], case[1]
    cuts = data.draw(st.lists(st.integers(1, len(text)), max_size=12))
    assert streamed(parser, text, cuts) == whole(parser, text)


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "hi <tool_call>not json</tool_call> bye"),
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": 7, "arguments": {}}</tool_call>'),
    ("hermes", "<tool_call></tool_call>"),
    ("mistral", "[TOOL_CALLS] not a call"),
    ("mistral", "[TOOL_CALLS][]"),
    ("deepseek_v3", f"{ds.CALLS_BEGIN}garbage{ds.CALLS_END}"),
    ("llama3_json", '{"name": 1, "parameters": {}}'),
    # a JSON answer with a "name" and no arguments or parameters is no call (vLLM's parser fails on it)
    ("llama3_json", '{"name": "John Smith", "age": 30}'),
])
def test_malformed_calls_stay_in_the_content_as_written(parser, text) -> None:
    assert whole(parser, text) == (text, []) == streamed(parser, text)


def test_a_call_whose_name_has_streamed_stays_a_call() -> None:
    """OpenAI's arguments may be invalid JSON (clients validate them): after the name they are kept as
    written, and a call cut short (max_tokens) keeps what was written, whole and streamed alike."""
    bad_args = "<tool_call>{\"name\": \"f\", \"arguments\": {'a': 1}}</tool_call>"
    assert whole("hermes", bad_args) == (None, [("f", "{'a': 1}")]) == streamed("hermes", bad_args)
    cut = '<tool_call>{"name": "f", "arguments": {"city": "Pa'
    assert whole("hermes", cut, "length") == (None, [("f", '{"city": "Pa')]) == streamed("hermes", cut, reason="length")
    assert tool_finish_reason("length", True) == "length" and tool_finish_reason("stop", True) == "tool_calls"
    assert tool_finish_reason("stop", False) == "stop"


def test_a_later_llama_object_without_arguments_ends_the_calls() -> None:
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "John"}'
    assert whole("llama3_json", text) == ('{"name": "John"}', [("f", '{"a": 1}')]) == streamed("llama3_json", text)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2}}\n</tool_call>',  # a bracket that breaks the JSON
    '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call> after',
    '<tool_call>{"name": "f", "arguments": {"a": 1}   \n</tool_call>',
])
def test_arguments_that_break_json_stream_no_part_of_the_end_tag(text) -> None:
    """Arguments kept as written run to the end of the call's text: while streaming, a tail that may
    become </tool_call> is not the call's, and trailing whitespace a finished call drops is never sent
    (the stream sent '{"a": [1, 2}}\n</tool_call' where the whole reply has '{"a": [1, 2}}')."""
    assert whole("hermes", text) == streamed("hermes", text)


def test_partial_markup_never_reaches_the_content_while_streaming() -> None:
    text = 'Checking <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    stream = ToolCallStream(get_tool_parser("hermes")())
    sent = ""
    for end in range(1, len(text)):
        sent += stream.update(SimpleNamespace(text=text[:end], finish_reason=None))[0]
        assert "<" not in sent and not sent.endswith(" ")
    assert sent == "Checking"


# ---------------------------------------------------------------- any text: the stream never disagrees

PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "{", "}", '"name"', ":", '"f"', ",", '"arguments"', "[", "]",
               " ", "\n", "x", '"', "\\", "1", "true"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[", "]", "{", "}", '"name"', ":", '"f"', ",", '"arguments"', " ", "x", "add",
                '"', "1"],
    "deepseek_v3": [ds.CALLS_BEGIN, ds.CALLS_END, ds.CALL_BEGIN, ds.CALL_END, ds.SEP, "function", "\n", "```json", "```",
                    "{", "}", '"a"', ":", "1", " ", "x", '"'],
    "deepseek_v31": [ds.CALLS_BEGIN, ds.CALLS_END, ds.CALL_BEGIN, ds.CALL_END, ds.SEP, "f", "\n", "{", "}", '"a"', ":",
                     "1", " ", "x"],
    "llama3_json": ["<|python_tag|>", "{", "}", '"name"', ":", '"f"', ",", '"parameters"', ";", " ", "x", '"', "1"],
}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), parser=st.sampled_from(sorted(PIECES)))
def test_streams_of_arbitrary_text_add_up_to_the_whole_reply(data, parser) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES[parser]), max_size=30)))
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text))), max_size=20)) if text else []
    assert streamed(parser, text, cuts) == whole(parser, text)


# ---------------------------------------------------------------- the scanning helpers


def test_value_end_delimits_json_values() -> None:
    assert value_end('{"a": "}"} tail', 0) == 10
    assert value_end('[1, {"b": [2]}],', 0) == 15
    assert value_end('"x\\"y" z', 0) == 6
    assert value_end("12, 3", 0) == 2 and value_end("12", 0) == OPEN and value_end('{"a": [1', 0) == OPEN
    for bad in ("{]", "nope,", "@"):
        with pytest.raises(Malformed):
            value_end(bad, 0)


def test_scan_call_object_reads_keys_in_any_order() -> None:
    obj = scan_call_object(' {"id": 3, "parameters": {"x": 1}, "name": "f"} rest', 0)
    assert (obj.name, obj.arguments, obj.end) == ("f", '{"x": 1}', 47)
    assert scan_call_object('{"name": "f", "argu', 0).name == "f"
    assert scan_call_object('{"name": "f', 0).name is None
    assert scan_call_object('{"x": 1}', 0).malformed and scan_call_object("[1]", 0).malformed


def test_partial_marker_len() -> None:
    assert partial_marker_len("abc <tool_ca", ("<tool_call>",)) == 8
    assert partial_marker_len("abc <tool_call>", ("<tool_call>",)) == 0  # a whole marker is not partial
    assert partial_marker_len("x[", ("[TOOL_CALLS]",)) == 1


def test_the_registry_has_vllms_names() -> None:
    assert {"hermes", "mistral", "deepseek_v3", "deepseek_v31", "llama3_json", "llama4_json"} == set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="invalid tool call parser: nope"):
        get_tool_parser("nope")
