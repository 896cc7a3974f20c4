"""OpenAI wire format: the response bodies and SSE chunks of the completions and chat APIs
(requests and errors are in ``launch.server.protocol``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


class UsageInfo(BaseModel):
    """vLLM's: ``prompt_tokens_details`` is always there, null (vLLM fills in ``cached_tokens`` only
    under ``--enable-prompt-tokens-details``, a flag this server does not have)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` in ``prompt_logprobs``: ``rank`` is the token's place among the top
    logprobs asked for (1: most likely); the prompt token's, when it is not among them, is its rank
    over the whole vocabulary (how many tokens have a logprob >= its own)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: per prompt token, null for the first, else {token id: PromptLogprob}
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with ``prompt_logprobs``


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


class FunctionCall(BaseModel):
    """A parsed call: ``arguments`` is the JSON text the model wrote (OpenAI: validate before use)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """vLLM's ``ChatMessage``, every key always there: ``tool_calls`` (``[]`` without calls); OpenAI's
    ``refusal``, ``annotations``, ``audio`` and ``function_call`` and vLLM's reasoning text
    (``reasoning_content``, named ``reasoning`` since vLLM 0.11) are null: this server has no
    refusals, audio, legacy function calls or reasoning parser."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None
    reasoning: str | None = None


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
    service_tier: str | None = None  # OpenAI's; null, as vLLM sends it
    system_fingerprint: str | None = None  # OpenAI's; null, as vLLM sends it
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, with ``prompt_logprobs``


class _WithoutNulls(BaseModel):
    """Serialized with only the keys that are set (a delta never says ``"role": null``)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """A streamed call: the first delta of call ``index`` carries ``id``, ``type`` and ``function.name``
    (and the arguments so far), the next ones argument fragments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_WithoutNulls):
    """A chat chunk's delta: only the keys it carries (``{"content": "..."}``; ``{}`` in a last chunk
    with no new text), as OpenAI and vLLM send them, never ``"role": null``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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


class ModelPermission(BaseModel):
    """vLLM's ``ModelPermission``: fixed values that OpenAI's old model object carried."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """vLLM's ``ModelCard``: ``root`` is the checkpoint, ``permission`` one ``ModelPermission``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "moe-serve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
