"""The formats whose calls are JSON objects ``{"name": ..., "arguments": {...}}``: ``hermes`` and ``llama3_json``.

hermes (Hermes 2 Pro, Qwen2.5, Qwen3; vLLM's ``hermes_tool_parser.py``): each call is
``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number of them, with text
before, between and after. A call whose ``</tool_call>`` never comes ends at the next
``<tool_call>`` or at the end of the reply (vLLM's ``<tool_call>(.*)``); a marker inside a JSON
string is text. Text inside the tags after the object is ignored.

llama3_json (Llama 3.1 / 3.2 / 4 JSON tool calls; vLLM's ``llama_tool_parser.py``): the reply
(after leading whitespace) starts with ``<|python_tag|>`` or ``{`` and holds objects with
``"parameters"`` (or ``"arguments"``) separated by ``;``. A reply that starts otherwise, or whose
first object has no name or neither key, is content (vLLM's parser fails on it: a JSON answer such
as ``{"name": "John", "age": 30}`` is no call); a later such object ends the calls, as text (the
calls before it may have streamed). While streaming, a call is held back until its arguments start.
"""

from __future__ import annotations

from launch.server.tools.base import Section, ToolParser
from launch.server.tools.scan import (
    OPEN,
    ParsedCall,
    as_call,
    find_unquoted,
    partial_marker_len,
    scan_call_object,
    skip_ws,
)


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>``; the tags may be plain text or (Hermes 2 Pro) special tokens."""

    name = "hermes"
    start = "<tool_call>"
    end_marker = "</tool_call>"
    special_tokens = ("<tool_call>", "</tool_call>")

    def scan_section(self, text: str, i: int, final: bool) -> Section:
        stop = find_unquoted(text, i, (self.end_marker, self.start))
        if stop < 0:  # while the reply runs, a tail that may become a marker is not the call's yet
            held = 0 if final else partial_marker_len(text, (self.end_marker, self.start))
            region_end, end, closed = len(text) - held, len(text), final
        else:  # </tool_call>, or the next <tool_call> when it never came
            ends = text.startswith(self.end_marker, stop)
            region_end, end, closed = stop, stop + (len(self.end_marker) if ends else 0), True
        obj = scan_call_object(text[:region_end], i)
        if obj.name is None:
            if obj.malformed or obj.end != OPEN or closed:
                return Section(end=end, malformed=True)
            return Section(pending=True)
        return Section((as_call(obj),), end=end)


class Llama3JsonToolParser(ToolParser):
    """JSON objects separated by ``;`` at the start of the reply, after an optional ``<|python_tag|>``."""

    name = "llama3_json"
    start = "<|python_tag|>"
    special_tokens = ("<|python_tag|>",)

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        j = skip_ws(text, 0)
        if j == len(text):
            return (text if final else ""), []
        if text.startswith(self.start, j):
            i = j + len(self.start)
        elif text[j] == "{":
            i = j
        elif not final and self.start.startswith(text[j:]):
            return "", []
        else:
            return text, []
        calls: list[ParsedCall] = []
        while True:
            obj = scan_call_object(text, i)
            if obj.name is None:
                if not (obj.malformed or obj.end != OPEN or final):
                    return "", calls  # the name may still come
                return (text, []) if not calls else (self.tail(text[i:], True, final), calls)
            if obj.arguments is None:
                if not (obj.malformed or obj.end != OPEN or final):
                    return "", calls  # "parameters" may still come
                return (text, []) if not calls else (self.tail(text[i:], True, final), calls)  # not a call
            calls.append(as_call(obj))
            if obj.end == OPEN:
                return "", calls
            k = skip_ws(text, obj.end)
            if k < len(text) and text[k] == ";":
                i = k + 1
                continue
            return self.tail(text[obj.end:], True, final), calls


class Llama4JsonToolParser(Llama3JsonToolParser):
    """vLLM's ``llama4_json``: the same parser under Llama 4's name."""

    name = "llama4_json"
