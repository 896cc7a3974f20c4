"""``deepseek_v3`` and ``deepseek_v31``: DeepSeek's special-token tool calls (vLLM's
``deepseekv3_tool_parser.py`` and ``deepseekv31_tool_parser.py``).

deepseek_v3 (DeepSeek-V3, R1-0528)::

    content<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"arg": ...}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

deepseek_v31 (DeepSeek-V3.1): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": ...}<｜tool▁call▁end｜>``
inside the same ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``.

Whitespace between the calls is allowed; text between a call's arguments and its end marker
(the closing fence) is skipped; text after ``<｜tool▁calls▁end｜>`` is content.
"""

from __future__ import annotations

from launch.server.tools.base import Section, ToolParser
from launch.server.tools.scan import OPEN, Malformed, ParsedCall, partial_marker_len, skip_ws, value_end

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
_FENCE = "```json"
_PENDING = "pending"  # _scan_call: the call's name is not complete yet


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    start = CALLS_BEGIN
    special_tokens = _MARKERS
    required_tokens = (CALLS_BEGIN, CALLS_END)
    typed = True  # V3 writes the call's type ("function") before the separator and fences the arguments

    def scan_section(self, text: str, i: int, final: bool) -> Section:
        calls: list[ParsedCall] = []
        k = i
        while True:
            k = skip_ws(text, k)
            if text.startswith(CALLS_END, k):
                return Section(tuple(calls), end=k + len(CALLS_END), malformed=not calls)
            rest = text[k:]
            if not final and (CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest)):
                return Section(tuple(calls), end=len(text), pending=not calls)
            if not text.startswith(CALL_BEGIN, k):
                return self._stop(text, k, calls)
            call = self._scan_call(text, k + len(CALL_BEGIN), final)
            if call == _PENDING:
                return Section(tuple(calls), pending=True)
            if call is None:
                return self._stop(text, k, calls)
            parsed, k = call
            calls.append(parsed)
            if k == OPEN:
                return Section(tuple(calls), end=len(text))

    @staticmethod
    def _stop(text: str, k: int, calls: list[ParsedCall]) -> Section:
        """Text that is no call at ``k``: with calls before it, skipped to the end of the section;
        without, the section is content."""
        if not calls:
            return Section(end=len(text), malformed=True)
        end = text.find(CALLS_END, k)
        return Section(tuple(calls), end=len(text) if end < 0 else end + len(CALLS_END))

    def _scan_call(self, text: str, k: int, final: bool) -> tuple[ParsedCall, int] | str | None:
        """The call whose text starts at ``k`` (after its begin marker) and the index after its end marker
        (``OPEN`` while it has none); ``_PENDING`` while its name is incomplete; None when it is malformed."""
        sep = text.find(SEP, k)
        head = text[k:] if sep < 0 else text[k:sep]
        if any(marker in head for marker in _MARKERS) or (self.typed and "\n" in head):
            return None
        if sep < 0:
            return None if final else _PENDING
        a = sep + len(SEP)
        if self.typed:
            newline = text.find("\n", a)
            if newline < 0:
                return None if final else _PENDING
            name, a = text[a:newline].strip(), skip_ws(text, newline)
        else:
            name, a = head.strip(), skip_ws(text, a)
        if not name or any(marker in name for marker in _MARKERS):
            return None
        if self.typed:
            if text.startswith(_FENCE, a):
                a = skip_ws(text, a + len(_FENCE))
            elif not final and _FENCE.startswith(text[a:]):
                return ParsedCall(name, "", False), OPEN
            elif text.startswith("```", a):  # a fence without the language
                a = skip_ws(text, a + 3)
        if a == len(text):
            return ParsedCall(name, "", False), OPEN
        if text.startswith(CALL_END, a):
            return ParsedCall(name, "{}", True), a + len(CALL_END)
        try:
            e = value_end(text, a)
        except Malformed:
            e = OPEN
        if e == OPEN:  # cut short, or not JSON: the arguments run to the end marker as written
            stop = text.find(CALL_END, a)
            if stop < 0:
                held = 0 if final else partial_marker_len(text, (CALL_END,))
                return ParsedCall(name, text[a: len(text) - held], False), OPEN
            return ParsedCall(name, text[a:stop], True), stop + len(CALL_END)
        stop = text.find(CALL_END, e)
        return ParsedCall(name, text[a:e], True), (OPEN if stop < 0 else stop + len(CALL_END))


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"
    typed = False
