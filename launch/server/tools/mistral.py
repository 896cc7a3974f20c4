"""``mistral``: Mistral's ``[TOOL_CALLS]`` format, in both of its forms (vLLM's ``mistral_tool_parser.py``).

- Tokenizers before v11 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct):
  ``content[TOOL_CALLS] [{"name": "f", "arguments": {...}}, {...}]``, one JSON list of calls.
- v11 and later (Mistral-Small-3.1+, Devstral, Magistral): ``content[TOOL_CALLS]f[ARGS]{...}``
  repeated once per call (``[ARGS]`` left out by the earliest v11 models: ``[TOOL_CALLS]f{...}``).

The form is read from the text (a ``[`` after ``[TOOL_CALLS]`` is the list form), not from the
tokenizer's version. ``[TOOL_CALLS]`` and ``[ARGS]`` are special (control) tokens: the server keeps
them in the text it parses (vLLM sets ``skip_special_tokens=False`` for the same reason). Mistral's
templates want tool-call ids of 9 letters and digits, so this parser makes such ids (as vLLM's).
"""

from __future__ import annotations

import re
import secrets
import string

from launch.server.tools.base import Section, ToolParser
from launch.server.tools.scan import (
    OPEN,
    Malformed,
    ParsedCall,
    as_call,
    scan_call_object,
    skip_ws,
    value_end,
)

_ID_ALPHABET = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    special_tokens = ("[TOOL_CALLS]", ARGS)
    required_tokens = ("[TOOL_CALLS]",)

    def new_call_id(self) -> str:
        """Nine letters and digits, as Mistral's chat templates and ``mistral_common`` require."""
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def scan_section(self, text: str, i: int, final: bool) -> Section:
        j = skip_ws(text, i)
        if j == len(text):
            return Section(end=len(text), malformed=True) if final else Section(pending=True)
        if text[j] == "[":
            return self._list_section(text, j + 1, final)
        return self._named_section(text, j, final)

    @staticmethod
    def _list_section(text: str, k: int, final: bool) -> Section:
        """``[{call}, {call}]``; text after the list is content."""
        calls: list[ParsedCall] = []
        while True:
            k = skip_ws(text, k)
            if k == len(text):
                if calls:
                    return Section(tuple(calls), end=len(text))
                return Section(end=len(text), malformed=True) if final else Section(pending=True)
            if text[k] == "]":
                return Section(tuple(calls), end=k + 1, malformed=not calls)
            obj = scan_call_object(text, k)
            if obj.name is None:
                if obj.malformed or obj.end != OPEN or final:
                    return Section(tuple(calls), end=len(text), malformed=True)
                return Section(tuple(calls), pending=True)
            calls.append(as_call(obj))
            if obj.end == OPEN:
                return Section(tuple(calls), end=len(text))
            k = skip_ws(text, obj.end)
            if k < len(text) and text[k] == ",":
                k += 1
            elif k < len(text) and text[k] != "]":
                return Section(tuple(calls), end=k)

    @staticmethod
    def _named_section(text: str, j: int, final: bool) -> Section:
        """``name[ARGS]{...}`` (or ``name{...}``): one call."""
        k = _NAME.match(text, j).end()  # type: ignore[union-attr]  # the pattern matches "" at least
        name = text[j:k]
        if text.startswith(ARGS, k):
            a = skip_ws(text, k + len(ARGS))
        elif k == len(text) or ARGS.startswith(text[k:]):  # the name (or [ARGS]) may go on
            return Section(end=len(text), malformed=True) if final else Section(pending=True)
        else:
            a = k  # the arguments follow the name directly
        if not name or (a < len(text) and text[a] != "{"):
            return Section(end=a, malformed=True)
        if a == len(text):  # a call needs its "{"
            return Section(end=len(text), malformed=True) if final else Section(pending=True)
        try:
            e = value_end(text, a)
        except Malformed:
            e = OPEN
        if e == OPEN:
            return Section((ParsedCall(name, text[a:], False),), end=len(text))
        return Section((ParsedCall(name, text[a:e], True),), end=e)
