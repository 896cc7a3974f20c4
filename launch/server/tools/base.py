"""The tool-call parser contract, and the scan shared by the formats that open calls with a marker.

A parser is a pure function of the reply's text: ``scan(text, final)`` returns the content
(the text outside the calls) and the calls found so far. Streaming calls it on every longer
prefix of the reply and sends what grew; the whole reply is ``scan(text, final=True)``. So that
the two agree, a scan of a prefix must be a prefix of the scan of the whole text: the content
only grows at its end, calls are only appended, a call's name never changes once given and its
arguments only grow. Hence, while not ``final``, text that may still turn out to be markup (a
partial start marker, a call whose name has not ended) and the whitespace before it are held
back rather than sent as content.

Content seams: the whitespace before a call is dropped, and so is the whitespace after a call at
the start or the end of the content (a reply of only calls has null content; ``a <call> b`` has
``a b``); a section that is not a valid call (no name, not JSON) stays in the content as written,
markers included.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import ClassVar

from launch.server.tools.scan import OPEN, ParsedCall, partial_marker_len


@dataclass(frozen=True)
class Section:
    """What a parser found after one start marker.

    calls: the calls of the section so far. end: index of the first character after the section
    (the content resumes there). pending: the text ends before the section says what it is (hold
    it back). malformed: no call could be read from the section; without ``calls`` its text is content.
    """

    calls: tuple[ParsedCall, ...] = ()
    end: int = OPEN
    pending: bool = False
    malformed: bool = False


class ToolParser:
    """Base of the ``--tool-call-parser`` formats (vLLM's names).

    start: the text that opens a tool-call section. special_tokens: the format's markers; the
    server keeps them in the text it parses when the tokenizer marks them special (they would be
    dropped from the reply's text otherwise). required_tokens: the tokenizer must hold each as one
    token, else the server refuses the parser at startup (vLLM's parser raises for these).
    """

    name: ClassVar[str]
    start: ClassVar[str]
    special_tokens: ClassVar[tuple[str, ...]] = ()
    required_tokens: ClassVar[tuple[str, ...]] = ()

    def new_call_id(self) -> str:
        """A fresh ``tool_calls[].id`` (vLLM's form)."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """``(content, calls)`` of the reply so far; ``final``: ``text`` is the whole reply."""
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos, after_call = 0, False
        while True:
            begin = text.find(self.start, pos)
            if begin < 0:
                content.append(self.tail(text[pos:], after_call, final, not any(content)))
                return "".join(content), calls
            before = text[pos:begin].lstrip() if after_call and not any(content) else text[pos:begin]
            section = self.scan_section(text, begin + len(self.start), final)
            if section.malformed and not section.calls:
                content.append(before + text[begin:section.end])
                after_call = False
            else:
                content.append(before.rstrip())
                calls.extend(section.calls)
                after_call = after_call or bool(section.calls)
            if section.pending:
                return "".join(content), calls
            pos = section.end

    def tail(self, text: str, after_call: bool, final: bool, first: bool = True) -> str:
        """The content after the last section. After a call: without trailing whitespace, and without
        leading whitespace when it is the ``first`` content. While streaming: without what may still
        open a section (a partial marker, whitespace before it)."""
        text = text.lstrip() if after_call and first else text
        if not final:
            text = text[: len(text) - partial_marker_len(text, (self.start,))]
        return text.rstrip() if after_call or not final else text

    def scan_section(self, text: str, i: int, final: bool) -> Section:
        """The section whose body starts at ``text[i]`` (just after ``start``)."""
        raise NotImplementedError
