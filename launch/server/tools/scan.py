"""Scanning the JSON of a tool call in text that may still be growing.

A streamed reply is parsed again from its start each time it grows, so these helpers
take a prefix of the final text and say how far they got: ``OPEN`` when the text ends
before the value does (more may come), an index when the value is complete, and
``Malformed`` when no continuation can make it the expected JSON. Values are delimited,
not validated: ``value_end`` matches brackets and strings; a call's arguments are passed
on as the model wrote them (OpenAI's ``arguments`` may be invalid JSON too).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from launch.core.detokenizer import stop_string_holdback

OPEN = -1  # the text ends inside the value: it may continue
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters", the others "arguments"
_LITERAL = re.compile(r"[-+0-9.eEa-zA-Z]+")
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)  # possessive: linear on an unterminated string
_STRUCTURE = re.compile(r'["{}\[\]]')


class Malformed(ValueError):
    """Text that no continuation can turn into the JSON the format expects."""


@dataclass(frozen=True)
class ParsedCall:
    """One tool call as parsed so far. ``arguments``: the raw JSON text of the arguments as
    written so far ("" before they start; "{}" for a finished call without any);
    ``complete``: the call's text has ended (later text cannot change it)."""

    name: str
    arguments: str
    complete: bool


@dataclass(frozen=True)
class CallObject:
    """What ``scan_call_object`` found: ``name`` once its string is complete, ``arguments`` the raw
    text of the arguments value so far (None before the key), ``end`` the index just past the
    closing brace (``OPEN`` while the object is open), ``malformed`` when the text broke the
    shape (with a name, the call still stands: see ``scan_call_object``)."""

    name: str | None = None
    arguments: str | None = None
    end: int = OPEN
    malformed: bool = False


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after ``i`` (``len(text)`` if none)."""
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def string_end(text: str, i: int) -> int:
    """Index just past the JSON string starting at ``text[i] == '"'``; ``OPEN`` if it is unterminated."""
    match = _STRING.match(text, i)
    return OPEN if match is None else match.end()


def value_end(text: str, i: int) -> int:
    """Index just past the JSON value starting at ``text[i]``; ``OPEN`` if the text ends first.
    Raises ``Malformed`` for a mismatched bracket or a token that is no JSON literal."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        closers: list[str] = []
        j = i
        while (match := _STRUCTURE.search(text, j)) is not None:
            j, c = match.start(), match.group()
            if c == '"':
                j = string_end(text, j)
                if j == OPEN:
                    return OPEN
                continue
            if c in "{[":
                closers.append("}" if c == "{" else "]")
            elif not closers or closers.pop() != c:
                raise Malformed(f"unexpected {c!r} at {j}")
            elif not closers:
                return j + 1
            j += 1
        return OPEN
    match = _LITERAL.match(text, i)
    if match is None:
        raise Malformed(f"no JSON value at {i}")
    if match.end() == len(text):
        return OPEN  # a number or literal may go on
    try:
        json.loads(match.group())
    except json.JSONDecodeError as exc:
        raise Malformed(f"{match.group()!r} is not a JSON value") from exc
    return match.end()


def read_string(text: str, i: int) -> tuple[str, int] | None:
    """The JSON string at ``text[i]`` and the index past it; None if it is unterminated.
    Raises ``Malformed`` when ``text[i]`` starts no string or the string is invalid."""
    if text[i] != '"':
        raise Malformed(f"expected a string at {i}")
    end = string_end(text, i)
    if end == OPEN:
        return None
    try:
        return json.loads(text[i:end], strict=False), end
    except json.JSONDecodeError as exc:
        raise Malformed(str(exc)) from exc


def scan_call_object(text: str, i: int, arg_keys: tuple[str, ...] = ARGUMENT_KEYS) -> CallObject:
    """Scan ``{"name": ..., "arguments": {...}}`` (keys in any order, others skipped) from ``text[i]``
    (leading whitespace allowed).

    Once the name is known the call stands whatever follows: text that breaks the shape after it
    ends the object at the end of ``text`` (callers pass the call's own region), and when it breaks
    inside the arguments, the arguments run to the end of ``text`` as written."""
    name: str | None = None
    arguments: str | None = None
    args_start = OPEN  # where the arguments value starts, while it is being scanned
    try:
        i = skip_ws(text, i)
        if i == len(text):
            return CallObject()
        if text[i] != "{":
            raise Malformed(f"expected '{{' at {i}")
        i = skip_ws(text, i + 1)
        if i < len(text) and text[i] == "}":
            raise Malformed("empty object")
        while True:
            if i == len(text):
                return CallObject(name, arguments)
            key = read_string(text, i)
            if key is None:
                return CallObject(name, arguments)
            i = skip_ws(text, key[1])
            if i == len(text):
                return CallObject(name, arguments)
            if text[i] != ":":
                raise Malformed(f"expected ':' at {i}")
            i = skip_ws(text, i + 1)
            if i == len(text):
                return CallObject(name, arguments)
            if key[0] == "name" and name is None:
                value = read_string(text, i)
                if value is None:
                    return CallObject(None, arguments)
                if not value[0].strip():
                    raise Malformed("empty name")
                name, end = value[0].strip(), value[1]
            else:
                if key[0] in arg_keys and arguments is None:
                    args_start = i
                end = value_end(text, i)
                if args_start != OPEN:
                    arguments, args_start = (text[i:] if end == OPEN else text[i:end]), OPEN
                if end == OPEN:
                    return CallObject(name, arguments)
            i = skip_ws(text, end)
            if i == len(text):
                return CallObject(name, arguments)
            if text[i] == "}":
                if name is None:
                    raise Malformed("a tool call without a name")
                return CallObject(name, arguments, i + 1)
            if text[i] != ",":
                raise Malformed(f"expected ',' or '}}' at {i}")
            i = skip_ws(text, i + 1)
    except Malformed:
        if name is None:
            return CallObject(malformed=True)
        if args_start != OPEN:
            arguments = text[args_start:]  # broke inside the arguments: keep them as written
        return CallObject(name, arguments, len(text), malformed=True)


def as_call(obj: CallObject) -> ParsedCall:
    """A ``CallObject`` whose name is known as a ``ParsedCall``; its arguments without trailing whitespace,
    complete or not (what a finished call drops is never streamed first)."""
    assert obj.name is not None
    complete = obj.end != OPEN
    arguments = obj.arguments if obj.arguments is not None else ("{}" if complete else "")
    return ParsedCall(obj.name, arguments.rstrip(), complete)


def find_unquoted(text: str, i: int, markers: tuple[str, ...]) -> int:
    """Index of the first of ``markers`` at or after ``i`` that is outside a JSON string (a marker
    quoted inside the arguments does not end the call), else -1."""
    interesting = _quote_or(markers)
    j = i
    while (match := interesting.search(text, j)) is not None:
        if match.group() != '"':
            return match.start()
        j = string_end(text, match.start())
        if j == OPEN:
            return -1
    return -1


@functools.lru_cache(maxsize=32)
def _quote_or(markers: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(['"', *(re.escape(m) for m in markers)]))


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``markers``
    (held back while streaming: it may become a marker); the engine's stop-string rule."""
    return stop_string_holdback(text, markers)
