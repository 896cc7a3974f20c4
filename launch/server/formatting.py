"""Turning cumulative ``RequestOutput``s into OpenAI responses and SSE chunks.

The engine's outputs are cumulative (full text and token ids so far); a
``ChoiceCursor`` remembers how much of each choice was already sent so streaming
emits deltas only. ``CompletionOutput.logprobs`` is one ``{token_id: logprob}``
dict per generated token (the sampled token plus the top-n). Every chunk of one
response carries the response's ``id`` and ``created`` (OpenAI's and vLLM's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from launch.core.outputs import top_n
from launch.server.protocol import APIError
from launch.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    UsageInfo,
)
from launch.server.tools.stream import ToolCallStream, tool_finish_reason

TokenText = Callable[[int], str]

# What a logprob of -inf is sent as: JSON has no infinity (OpenAI and vLLM send -9999.0).
MIN_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """``logprob`` as JSON can carry it (-inf -> ``MIN_LOGPROB``)."""
    return max(float(logprob), MIN_LOGPROB)


def sse(payload: BaseModel) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


@dataclass
class ChoiceCursor:
    """What has been streamed of one choice so far."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False
    text_offset: int = 0  # logprobs' text_offset of the next token: the streamed tokens' texts so far
    echoed: bool = False  # the prompt's text (echo) has been sent

    def advance(self, completion: Any) -> tuple[str, list[int], list[dict[int, float]] | None]:
        """New text, token ids and logprob entries since the last call."""
        text = completion.text[self.num_chars:] if len(completion.text) > self.num_chars else ""
        token_ids = list(completion.token_ids[self.num_tokens:])
        logprobs = None
        if completion.logprobs is not None:
            logprobs = list(completion.logprobs[self.num_tokens:])
        self.num_chars = max(self.num_chars, len(completion.text))
        self.num_tokens = len(completion.token_ids)
        return text, token_ids, logprobs


@dataclass
class _Formatter:
    """``continuous_usage``: vLLM's ``stream_options.continuous_usage_stats``: every streamed chunk of a
    choice carries that choice's usage so far (its prompt's tokens, its own generated tokens)."""

    request_id: str
    model: str
    prompts: list[list[int]]
    n: int
    token_text: TokenText
    num_logprobs: int | None
    continuous_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    cursors: dict[int, ChoiceCursor] = field(default_factory=dict)

    def cursor(self, index: int) -> ChoiceCursor:
        return self.cursors.setdefault(index, ChoiceCursor())

    def next_piece(self, index: int, out: Any) -> tuple[ChoiceCursor, Any, str, list[int], Any] | None:
        """Choice ``index``'s cursor, completion (``out.outputs[0]``) and what it added since the
        last call (``ChoiceCursor.advance``), the cursor marked finished with the completion; None
        once the choice has finished (nothing more is streamed for it)."""
        cursor = self.cursor(index)
        if cursor.finished:
            return None
        c = out.outputs[0]
        text, token_ids, entries = cursor.advance(c)
        cursor.finished = c.finish_reason is not None
        return cursor, c, text, token_ids, entries

    def usage(self, completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    def choice_usage(self, index: int) -> UsageInfo | None:
        """Choice ``index``'s usage so far, for a streamed chunk (None unless ``continuous_usage``)."""
        if not self.continuous_usage:
            return None
        prompt_tokens = len(self.prompts[index // self.n])
        completion_tokens = self.cursor(index).num_tokens
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    def stream_start(self) -> list[BaseModel]:
        return []

    def encode(self, payload: BaseModel) -> str:
        """One SSE event of this API's stream (completions and chat: ``data: {json}``)."""
        return sse(payload)

    def error_event(self, err: APIError) -> BaseModel:
        """What a failure after the first event is sent as (completions and chat: ``{"error": ...}``)."""
        return err.to_response()

    def stream_end(self) -> str:
        """What closes the stream (completions and chat: ``data: [DONE]``)."""
        return "data: [DONE]\n\n"

    def streamed_usage(self) -> UsageInfo:
        return self.usage(sum(c.num_tokens for c in self.cursors.values()))

    def prompt_logprobs_of(self, out: Any, num: int | None) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` of one engine output (None unless asked for with ``num``, -1:
        the whole vocabulary): null for the first prompt token, then {token id: logprob, rank,
        decoded text}, the prompt token first, then the top ``num``. As vLLM, the top ``num`` are
        ranked by their place (1: most likely) and the prompt token, wherever it is, by its rank over
        the whole vocabulary (``RequestOutput.prompt_logprob_ranks``)."""
        if num is None or out.prompt_logprobs is None:
            return None
        vocab_ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs)
        scored: PromptLogprobs = []
        for token_id, entry, vocab_rank in zip(out.prompt_token_ids, out.prompt_logprobs, vocab_ranks):
            if entry is None:
                scored.append(None)
                continue
            ranks = {t: r for r, (t, _) in enumerate(top_n(entry, num), 1)}
            rank = ranks.get(token_id, vocab_rank)
            row = {token_id: PromptLogprob(logprob=json_logprob(entry[token_id]), rank=rank,
                                           decoded_token=self.token_text(token_id))}
            for t, rank in ranks.items():
                row.setdefault(t, PromptLogprob(logprob=json_logprob(entry[t]), rank=rank,
                                                decoded_token=self.token_text(t)))
            scored.append(row)
        return scored


@dataclass
class CompletionFormatter(_Formatter):
    """``/v1/completions`` bodies and chunks. ``echo_texts``: with ``echo``, each prompt's text, put
    before the text of each of its choices (in the first streamed chunk of each choice); with logprobs
    the prompt's tokens then lead the logprobs (the first with null logprobs, as vLLM). ``echo_only``
    (echo with max_tokens 0): the prompt alone, the one token sampled for it dropped.
    ``prompt_logprobs``: the request's, for each choice's vLLM ``prompt_logprobs``."""

    echo_texts: list[str] | None = None
    echo_only: bool = False
    prompt_logprobs: int | None = None

    def echo_text(self, index: int) -> str:
        return "" if self.echo_texts is None else self.echo_texts[index // self.n]

    def top_logprobs(self, token_id: int, entry: dict[int, float]) -> dict[str, float]:
        """The position's ``num_logprobs`` most likely tokens, and the sampled one when it is not among
        them (OpenAI's completions: "there may be up to logprobs+1 elements"; vLLM's too). Tokens whose
        texts are equal (byte tokens of one UTF-8 character all read U+FFFD) keep the likelier value."""
        pairs = top_n(entry, self.num_logprobs or 0)
        if token_id in entry and all(t != token_id for t, _ in pairs):
            pairs.append((token_id, entry[token_id]))
        out: dict[str, float] = {}
        for t, lp in pairs:
            out.setdefault(self.token_text(t), json_logprob(lp))
        return out

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float] | None] | None,
                 offset: int) -> CompletionLogprobs | None:
        """Logprobs of ``token_ids`` (a None entry: a token with no logprob, the prompt's first)."""
        if self.num_logprobs is None or entries is None:
            return None
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = self.token_text(token_id)
            out.tokens.append(text)
            logprob = None if entry is None else entry.get(token_id)
            out.token_logprobs.append(None if logprob is None else json_logprob(logprob))
            # logprobs=0 still carries the sampled token ("up to logprobs+1 elements"), as OpenAI and vLLM
            out.top_logprobs.append(None if entry is None else self.top_logprobs(token_id, entry))
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def generated(self, c: Any) -> tuple[str, list[int], list[dict[int, float]] | None]:
        """A completion's text, token ids and logprob entries as the response shows them (none of
        them with ``echo_only``)."""
        if self.echo_only:
            return "", [], None if c.logprobs is None else []
        return c.text, list(c.token_ids), None if c.logprobs is None else list(c.logprobs)

    def response(self, finals: list[Any]) -> CompletionResponse:
        choices = []
        for index, out in enumerate(finals):
            c = out.outputs[0]
            text, token_ids, entries = self.generated(c)
            if self.echo_texts is not None and entries is not None and out.prompt_logprobs is not None:
                token_ids, entries = list(out.prompt_token_ids) + token_ids, list(out.prompt_logprobs) + entries
            choices.append(CompletionChoice(
                index=index, text=self.echo_text(index) + text, finish_reason="length" if self.echo_only else
                c.finish_reason, stop_reason=None if self.echo_only else c.stop_reason,
                logprobs=self.logprobs(token_ids, entries, 0),
                prompt_logprobs=self.prompt_logprobs_of(out, self.prompt_logprobs)))
        completion_tokens = sum(len(self.generated(out.outputs[0])[1]) for out in finals)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage(completion_tokens))

    def stream_chunks(self, index: int, out: Any) -> list[BaseModel]:
        piece = self.next_piece(index, out)
        if piece is None:
            return []
        cursor, c, text, token_ids, entries = piece
        if self.echo_only:  # the sampled token is dropped: its text, ids and count
            text, token_ids, entries = "", [], None if entries is None else []
            cursor.num_tokens = 0
        if not cursor.echoed:
            cursor.echoed = True
            text = self.echo_text(index) + text
        if not text and not cursor.finished and not (token_ids and self.num_logprobs is not None):
            return []
        # offsets count each token's own text, as the whole response's do (a token that is part of
        # a UTF-8 character is its own text before the characters it completes reach `text`)
        logprobs = self.logprobs(token_ids, entries, cursor.text_offset)
        if logprobs is not None and logprobs.tokens:
            cursor.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        finish_reason, stop_reason = c.finish_reason, c.stop_reason
        if self.echo_only and finish_reason is not None:
            finish_reason, stop_reason = "length", None
        choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                  stop_reason=stop_reason, logprobs=logprobs)
        return [CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                   usage=self.choice_usage(index))]

    def usage_chunk(self) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[],
                                  usage=self.streamed_usage())


@dataclass
class ChatFormatter(_Formatter):
    """``/v1/chat/completions`` bodies and chunks. ``tool_streams``: with tool calls parsed (tool_choice
    "auto"), a factory of one ``ToolCallStream`` per choice; the message then carries ``tool_calls``, its
    content is the text outside them, and a choice that stopped after calling tools ends with "tool_calls"."""

    tool_streams: Callable[[], ToolCallStream] | None = None
    prompt_logprobs: int | None = None  # the request's: the response's vLLM ``prompt_logprobs``
    _choice_tools: dict[int, ToolCallStream] = field(default_factory=dict, init=False, repr=False)

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> ChatLogprobs | None:
        if self.num_logprobs is None or entries is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, entries):
            text = self.token_text(token_id)
            tops = [TopLogprob(token=self.token_text(t), logprob=json_logprob(lp),
                               bytes=list(self.token_text(t).encode()))
                    for t, lp in top_n(entry, self.num_logprobs)]
            content.append(ChatTokenLogprob(token=text, logprob=json_logprob(entry.get(token_id, MIN_LOGPROB)),
                                            bytes=list(text.encode()), top_logprobs=tops))
        return ChatLogprobs(content=content)

    def response(self, finals: list[Any]) -> ChatCompletionResponse:
        choices = []
        for index, out in enumerate(finals):
            c = out.outputs[0]
            message, finish_reason = ChatResponseMessage(content=c.text), c.finish_reason
            if self.tool_streams is not None:
                content, calls = self.tool_streams().result(c)
                message = ChatResponseMessage(content=content, tool_calls=calls)
                finish_reason = tool_finish_reason(finish_reason, bool(calls))
            choices.append(ChatChoice(index=index, message=message, finish_reason=finish_reason,
                                      stop_reason=c.stop_reason, logprobs=self.logprobs(c.token_ids, c.logprobs)))
        completion_tokens = sum(len(out.outputs[0].token_ids) for out in finals)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(completion_tokens),
                                      prompt_logprobs=self.prompt_logprobs_of(finals[0], self.prompt_logprobs))

    def stream_start(self) -> list[BaseModel]:
        """The first chunk of every choice: the assistant role, empty content."""
        num_choices = len(self.prompts) * self.n
        return [ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))], usage=self.choice_usage(i))
            for i in range(num_choices)]

    def stream_chunks(self, index: int, out: Any) -> list[BaseModel]:
        piece = self.next_piece(index, out)
        if piece is None:
            return []
        cursor, c, text, token_ids, entries = piece
        delta, finish_reason = DeltaMessage(content=text or None), c.finish_reason
        if self.tool_streams is not None:
            tools = self._choice_tools.setdefault(index, self.tool_streams())
            text, calls = tools.update(c)
            delta = DeltaMessage(content=text or None, tool_calls=calls or None)
            finish_reason = tool_finish_reason(finish_reason, tools.called)
        if not (delta.content or delta.tool_calls) and not cursor.finished and not (
                token_ids and self.num_logprobs is not None):
            return []
        choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, stop_reason=c.stop_reason,
                                 logprobs=self.logprobs(token_ids, entries))
        return [ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                    usage=self.choice_usage(index))]

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                   usage=self.streamed_usage())
