"""OpenAI's Responses API as vLLM serves it, text only: ``POST /v1/responses``.

The request becomes chat messages (``instructions`` as a leading system message, then ``input``:
a string as one user message, or message items), rendered by the chat template and run through the
chat endpoint's path (``OpenAIServing``: model, queue and length checks, fan-out, disconnect aborts,
metrics). Only the wire format differs: a ``response`` object instead of a chat completion, and
named SSE events (``event: TYPE`` / ``data: {json}``, each with a ``sequence_number``, no
``[DONE]``) instead of chunks.

Nothing is stored: ``store`` (true by default, as OpenAI's) is accepted and ignored, as vLLM
does unless ``VLLM_ENABLE_RESPONSES_API_STORE`` is set, so ``previous_response_id`` and
``background`` (which need stored responses) are refused; so are tools, reasoning, non-text
``text.format`` and the other fields that would change the output, by name.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator
from starlette.requests import Request
from starlette.responses import Response

from launch.server.chat import render_chat_prompt
from launch.server.formatting import _Formatter
from launch.server.protocol import (
    APIError,
    ChatMessage,
    SamplingRequest,
    TextPart,
    check_texts,
    only_item_types,
)
from launch.server.serving import OpenAIServing

TEXT_PART_TYPES = ("input_text", "output_text")  # an assistant turn in the history carries output_text


# ---------------------------------------------------------------- request


class InputTextPart(TextPart):
    """A text part of a message item (chat's ``TextPart``, its Unicode check included, under the
    Responses API's type names)."""

    type: Literal["input_text", "output_text"]  # type: ignore[assignment]
    text: StrictStr


class InputMessage(BaseModel):
    """One message item of ``input`` (OpenAI's EasyInputMessage / message item)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputTextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        return only_item_types(value, TEXT_PART_TYPES, "content part {i}", "input_text parts only")

    @field_validator("content")
    @classmethod
    def _check_unicode(cls, value: Any) -> Any:
        return check_texts(value, "content")

    def text(self) -> str:
        """The content as one string (parts joined by newlines, as chat joins them)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ResponsesRequest(SamplingRequest):
    """``/v1/responses``. Of ``SamplingRequest``'s fields, OpenAI's ``temperature``, ``top_p``,
    ``stream``, ``user`` and vLLM's sampling extensions (``top_k``, ``seed``, ...) apply; ``n`` and
    ``max_tokens`` are refused (one output; ``max_output_tokens`` is the limit)."""

    input: StrictStr | list[InputMessage]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = True  # accepted, nothing stored (vLLM's default)
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: StrictInt | None = None
    service_tier: StrictStr | None = None
    # refused unless neutral (``unsupported``)
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: StrictBool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    truncation: StrictStr | None = None
    prompt: Any = None  # OpenAI's stored prompt templates

    ADDS_SPECIAL_TOKENS: ClassVar[bool] = False  # the chat template writes them

    @field_validator("input", mode="before")
    @classmethod
    def _message_items_only(cls, value: Any) -> Any:
        """An item of another type (function_call, reasoning, item_reference, ...) gets one message."""
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        return only_item_types(value, ("message",), "input[{i}]", "message items with text only", default="message")

    @field_validator("input", "instructions")
    @classmethod
    def _check_unicode(cls, value: Any, info: Any) -> Any:
        return check_texts(value, info.field_name)

    @property
    def include_usage(self) -> bool:  # usage rides on response.completed, never in a chunk of its own
        return False

    @property
    def continuous_usage(self) -> bool:
        return False

    def unsupported(self) -> tuple[str, str] | None:
        problem = super().unsupported()
        if problem is not None:
            return problem
        if self.n != 1:
            return "n", "n is not a Responses API field: a response has one output"
        if self.max_tokens is not None:
            return "max_tokens", "max_tokens is not a Responses API field: send max_output_tokens"
        if self.previous_response_id is not None:
            return "previous_response_id", ("previous_response_id is not supported: this server stores no "
                                            "responses (store is accepted and ignored, as vLLM's default)")
        if self.conversation is not None:
            return "conversation", "conversation is not supported: this server stores no conversations"
        if self.background:
            return "background", "background=true is not supported: it needs stored responses, and none are stored"
        if self.tools:
            return "tools", "tools are not supported on /v1/responses (use /v1/chat/completions)"
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice", "tool_choice is not supported on /v1/responses (no tools)"
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            return "reasoning", "reasoning is not supported by this server"
        fmt = (self.text or {}).get("format") or {}
        if fmt.get("type", "text") != "text":
            return "text", (f"text.format type {fmt.get('type')!r} is not supported: this server has no "
                            "constrained decoding (only \"text\")")
        if self.include:
            return "include", f"include {self.include[0]!r} is not supported"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not supported on /v1/responses"
        if self.truncation not in (None, "disabled"):
            return "truncation", f"truncation {self.truncation!r} is not supported (only \"disabled\")"
        if self.prompt is not None:
            return "prompt", "prompt (a stored prompt template) is not supported: send input"
        return None

    def messages(self) -> list[ChatMessage]:
        """The conversation the chat template renders: ``instructions`` first, as a system message."""
        out = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        if isinstance(self.input, str):
            return [*out, ChatMessage(role="user", content=self.input)]
        return [*out, *(ChatMessage(role=item.role, content=item.text()) for item in self.input)]

    def echoed(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The settings a response object echoes (sampling values: the request's, else the model's
        defaults, else 1.0)."""
        temperature = self.temperature if self.temperature is not None else defaults.get("temperature", 1.0)
        top_p = self.top_p if self.top_p is not None else defaults.get("top_p", 1.0)
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata, "temperature": float(temperature), "top_p": float(top_p),
                "user": self.user, "tool_choice": self.tool_choice if isinstance(self.tool_choice, str) else "auto",
                "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
                "service_tier": self.service_tier or "auto"}


# ---------------------------------------------------------------- response objects


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ResponseUsage(BaseModel):
    """``cached_tokens`` and ``cache_write_tokens`` are 0: the engine does not report prefix-cache hits
    per request (the openai client's ``InputTokensDetails`` requires both)."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0, "cache_write_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseObject(BaseModel):
    """OpenAI's ``Response`` (vLLM's ``ResponsesResponse``), with the request's settings echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: None = None
    service_tier: str = "auto"
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None
    user: str | None = None


class StreamEvent(BaseModel):
    """One streamed event: ``type``, ``sequence_number`` and the type's own fields (OpenAI's)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


# ---------------------------------------------------------------- formatting


@dataclass
class ResponsesFormatter(_Formatter):
    """Response objects and the event stream of one response (one prompt, one output: ``n`` is 1).

    The stream: response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta per new text, then when the output ends
    response.output_text.done, response.content_part.done, response.output_item.done and
    response.completed (as vLLM: its response's ``status`` says "incomplete" when the length ended it).
    """

    settings: dict[str, Any] = field(default_factory=dict)  # ResponsesRequest.echoed
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    num_events: int = field(default=0, init=False)

    def message(self, status: str, text: str | None) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=[] if text is None else [OutputText(text=text)])

    def body(self, completion: Any | None) -> ResponseObject:
        """The response object: in progress (``completion`` None) or ended with ``completion``."""
        if completion is None:
            return ResponseObject(id=self.request_id, created_at=self.created, model=self.model, status="in_progress",
                                  output=[], **self.settings)
        incomplete = completion.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        input_tokens, output_tokens = len(self.prompts[0]), len(completion.token_ids)
        return ResponseObject(
            id=self.request_id, created_at=self.created, model=self.model, status=status,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            output=[self.message(status, completion.text)],
            usage=ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                                total_tokens=input_tokens + output_tokens), **self.settings)

    def response(self, finals: list[Any]) -> ResponseObject:
        return self.body(finals[0].outputs[0])

    def event(self, type: str, **fields: Any) -> StreamEvent:
        self.num_events += 1
        return StreamEvent(type=type, sequence_number=self.num_events - 1,
                           **{k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()})

    def stream_start(self) -> list[BaseModel]:
        started = self.body(None)
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=started),
                self.event("response.in_progress", response=started),
                self.event("response.output_item.added", output_index=0, item=self.message("in_progress", None)),
                self.event("response.content_part.added", **where, part=OutputText(text=""))]

    def stream_chunks(self, index: int, out: Any) -> list[BaseModel]:
        piece = self.next_piece(index, out)
        if piece is None:
            return []
        cursor, c, text, _, _ = piece
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        events = [self.event("response.output_text.delta", **where, delta=text, logprobs=[])] if text else []
        if cursor.finished:
            final = self.body(c)
            item = final.output[0]
            events += [self.event("response.output_text.done", **where, text=item.content[0].text, logprobs=[]),
                       self.event("response.content_part.done", **where, part=item.content[0]),
                       self.event("response.output_item.done", output_index=0, item=item),
                       self.event("response.completed", response=final)]
        return events

    def encode(self, payload: BaseModel) -> str:
        return f"event: {payload.type}\ndata: {payload.model_dump_json()}\n\n"

    def error_event(self, err: APIError) -> BaseModel:
        return self.event("error", code=err.type, message=err.message, param=err.param)

    def stream_end(self) -> str:
        return ""  # no [DONE]: response.completed (or error) is the last event


# ---------------------------------------------------------------- the endpoint


async def create_response(serving: OpenAIServing, req: ResponsesRequest, raw: Request) -> Response:
    """``POST /v1/responses``: the chat endpoint's checks and engine path, the Responses wire format."""
    serving.check_model(req.model)
    serving.check_supported(req)
    if serving.engine.tokenizer is None:
        raise APIError(400, "This model has no tokenizer, so /v1/responses cannot be used.", param="input")
    try:  # off the event loop, as chat's: a long conversation takes a while to render and encode
        ids = await asyncio.to_thread(render_chat_prompt, serving.engine.tokenizer, req.messages(),
                                      add_special_tokens=req.encode_special_tokens, chat_template=serving.chat_template)
    except APIError as err:
        raise APIError(err.status_code, err.message, param="input" if err.param == "messages" else err.param) from err
    prompts = [serving.check_token_ids(serving.truncate(ids, req), "input")]
    serving.check_queue()
    response_id = f"resp_{uuid.uuid4().hex}"
    subs = serving.build_subrequests(response_id, prompts, req, req.max_output_tokens, None, "input",
                                     "max_output_tokens")
    formatter = ResponsesFormatter(response_id, serving.reply_model_name(req.model), prompts, 1,
                                   serving.token_text, None, created=int(time.time()),
                                   settings=req.echoed(serving.default_sampling))
    return await serving.respond(subs, formatter, req, raw)
