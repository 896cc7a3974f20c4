"""OpenAI wire format: request and response models for the completions and chat APIs.

Requests are validated here (types, ranges); checks that need the engine (prompt
length against ``max_model_len``, token ids against the vocabulary, the model
name) live in ``launch.server.serving``. Unknown request fields are ignored, as
OpenAI and vLLM do. Every error leaves the server as ``ErrorResponse``:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    StrictStr,
    field_validator,
    model_serializer,
    model_validator,
)

from launch.tokenizer import check_text

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


def check_texts(value: Any, name: str) -> Any:
    """``value`` unchanged when every string in it (a string or a list of them) is valid Unicode;
    else ValueError naming ``name[i]``. JSON's ``"\\ud800"`` escape decodes to an unpaired
    surrogate, which no tokenizer (and no UTF-8 response) can carry: a 400, not a 500."""
    if isinstance(value, str):
        check_text(value, name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str):
                check_text(item, f"{name}[{i}]")
    return value


def random_id(prefix: str) -> str:
    """An OpenAI-style object id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the handlers turn into ``ErrorResponse`` with ``status_code``.

    ``type`` follows OpenAI: ``invalid_request_error`` (400), ``authentication_error``
    (401), ``not_found_error`` (404), ``server_overloaded`` (503), ``internal_error`` (500).
    """

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.status_code))


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI / vLLM sampling fields this server does not implement: typed here so that a value
    # that would change the output is refused (``unsupported``) instead of silently ignored
    best_of: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = None  # vLLM's; special tokens are always left out of the text

    @field_validator("model", "user")
    @classmethod
    def _check_unicode(cls, value: str | None, info: Any) -> str | None:
        return check_texts(value, info.field_name)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        check_texts(value, "stop")
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, message)`` for the first field set to a value this server cannot honour (its
        no-op values pass: penalties 0 / 1, ``best_of`` up to ``n`` (no extra candidates to choose
        from; some SDKs send ``best_of=1`` by default), an empty ``logit_bias``)."""
        if self.best_of is not None and self.best_of > self.n:
            return "best_of", (f"best_of={self.best_of} is not supported: this server returns the n={self.n} "
                               "samples it draws (best_of <= n)")
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                return name, f"{name}={value} is not supported (only {neutral})"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.min_tokens:
            return "min_tokens", f"min_tokens={self.min_tokens} is not supported (only 0)"
        if self.skip_special_tokens is False:
            return "skip_special_tokens", ("skip_special_tokens=false is not supported: special tokens are always "
                                           "left out of the text")
        return None


class CompletionRequest(SamplingRequest):
    """``/v1/completions``: ``prompt`` is a string, strings, token ids, or lists of token ids."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(isinstance(p, str) and not p for p in value):
            raise ValueError("prompt strings must not be empty")
        return check_texts(value, "prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _check_unicode(cls, value: str) -> str:
        return check_text(value, "text")


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part of another type (image_url, input_audio, ...) gets one message saying so, not
        pydantic's errors for every branch of the union."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content part {i} has type {kind!r}: this server takes text parts only")
        return value

    @field_validator("content", "name")
    @classmethod
    def _check_unicode(cls, value: Any, info: Any) -> Any:
        return check_texts(value, info.field_name)

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM joins them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``/v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # OpenAI tools: rendered into the prompt by the chat template (as transformers and vLLM pass
    # them); tool calls are not parsed out of the reply, so only tool_choice "none" is accepted
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        problem = super().unsupported()
        if problem is not None:
            return problem
        if self.tools and self.tool_choice != "none":
            return "tool_choice", ("tool calls are not parsed by this server: with tools, send tool_choice \"none\" "
                                   "(the chat template then renders the tools into the prompt)")
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", f"tool_choice={self.tool_choice!r} is not supported (only \"none\")"
        return None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """How many top alternatives to return per token; None when logprobs are off."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


# ---------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    """A chat chunk's delta: only the keys it carries (``{"content": "..."}``; ``{}`` in a last chunk
    with no new text), as OpenAI and vLLM send them, never ``"role": null``."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended the choice


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "moe-serve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
