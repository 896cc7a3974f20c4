"""One choice's tool calls: parsed from the whole reply, or streamed as OpenAI deltas.

``ToolCallStream.update`` re-scans the reply's text each time it grows and sends what grew:
new content, a new call's first delta (``index``, ``id``, ``type``, ``function.name`` and the
arguments so far), then argument fragments. ``result`` scans the finished reply. Both use the
parser's one ``scan`` (``launch.server.tools.base``), so the calls and content a stream adds up
to are those of the whole response.

The text is the engine's (special tokens left out) unless the parser's markers are special
tokens of this tokenizer: then ``MarkedText`` decodes the token ids again, keeping the markers
and leaving out the other special tokens, the stop token and the stop string as the engine does,
and, while the reply runs, withholding a tail that may be the start of a stop string as the engine
withholds it from its text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launch.core.detokenizer import IncrementalDetokenizer, stop_string_holdback
from launch.server.responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from launch.server.tools.base import ToolParser


def decode_keeping(tokenizer: Any, markers: Mapping[int, str], ids: list[int]) -> str:
    """``ids`` decoded without special tokens, except ``markers`` (id -> text), which stay in place."""
    parts, run = [], []
    for t in ids:
        if t in markers:
            parts.append(tokenizer.decode(run, skip_special_tokens=True))
            parts.append(markers[t])
            run = []
        else:
            run.append(t)
    parts.append(tokenizer.decode(run, skip_special_tokens=True))
    return "".join(parts)


class MarkedText:
    """A choice's cumulative text with the parser's special-token markers kept.

    markers: id -> text of the markers to keep. include_stop_str: the request's
    ``include_stop_str_in_output`` (the stop token or string stays in the text, as the engine keeps it).
    stop: the request's stop strings (a tail that may start one is withheld while the reply runs, as
    the engine's ``Sequence.visible_text`` withholds it; never with ``include_stop_str``).
    """

    def __init__(self, tokenizer: Any, markers: Mapping[int, str], prompt_token_ids: list[int],
                 include_stop_str: bool, stop: Sequence[str] = ()) -> None:
        self._detok = IncrementalDetokenizer(lambda ids: decode_keeping(tokenizer, markers, ids), prompt_token_ids)
        self._include_stop_str = include_stop_str
        self._stop = tuple(stop)
        self._num_fed = 0
        self._before_last = 0  # length of the text before the newest token
        self._done = False
        self.text = ""

    def update(self, completion: Any) -> str:
        """The text of ``completion`` (a cumulative ``CompletionOutput``), less a withheld tail while it runs."""
        if self._done:
            return self.text
        reason, stop = completion.finish_reason, completion.stop_reason
        upto = len(completion.token_ids)
        if reason == "stop" and not isinstance(stop, str) and not self._include_stop_str and upto:
            upto -= 1  # the stop token (eos or a stop_token_id) is not part of the text
        for t in completion.token_ids[self._num_fed:upto]:
            self._before_last = len(self.text)
            self.text += self._detok.add_token(t)
        self._num_fed = max(self._num_fed, upto)
        if reason is not None:
            self._done = True
            self.text += self._detok.flush()
            if reason == "stop" and isinstance(stop, str):
                at = self.text.find(stop, max(0, self._before_last - len(stop) + 1))
                if at >= 0:
                    self.text = self.text[: at + (len(stop) if self._include_stop_str else 0)]
            return self.text
        if self._stop and not self._include_stop_str:
            return self.text[: len(self.text) - stop_string_holdback(self.text, self._stop)]
        return self.text


@dataclass
class _SentCall:
    id: str
    num_args: int


class ToolCallStream:
    """The tool calls of one choice (a new object per choice and response)."""

    def __init__(self, parser: ToolParser, marked_text: MarkedText | None = None) -> None:
        self.parser = parser
        self._marked_text = marked_text
        self._num_content = 0
        self._sent: list[_SentCall] = []

    @property
    def called(self) -> bool:
        """At least one call has been streamed."""
        return bool(self._sent)

    def text(self, completion: Any) -> str:
        return completion.text if self._marked_text is None else self._marked_text.update(completion)

    def update(self, completion: Any) -> tuple[str, list[DeltaToolCall]]:
        """New content and call deltas since the last call, for the cumulative ``completion``."""
        content, calls = self.parser.scan(self.text(completion), completion.finish_reason is not None)
        new_content = content[self._num_content:]
        self._num_content = max(self._num_content, len(content))
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self._sent):
                self._sent.append(_SentCall(self.parser.new_call_id(), len(call.arguments)))
                deltas.append(DeltaToolCall(index=index, id=self._sent[index].id, type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            elif len(call.arguments) > self._sent[index].num_args:
                fragment = call.arguments[self._sent[index].num_args:]
                self._sent[index].num_args = len(call.arguments)
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        return new_content, deltas

    def result(self, completion: Any) -> tuple[str | None, list[ToolCall]]:
        """``(content, tool_calls)`` of the finished ``completion``; content is None when calls took all of it."""
        content, calls = self.parser.scan(self.text(completion), True)
        tool_calls = [ToolCall(id=self.parser.new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls]
        return (content or None) if tool_calls else content, tool_calls


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's ``"tool_calls"`` for a choice that stopped after calling tools; "length" (cut) stays."""
    return "tool_calls" if called and reason == "stop" else reason
