"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the server's own prompt encoding, nothing generated.

``/tokenize`` takes a completions ``prompt`` (text) or chat ``messages`` and returns the token ids the
completions or chat endpoint would run on (same tokenizer, same chat template and its variables, same
``add_special_tokens`` default: yes for a prompt, no for messages), with their ``count`` and the
server's ``max_model_len``. ``/detokenize`` turns token ids back into text, special tokens kept (as vLLM's).
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from launch.server.chat import render_chat_prompt
from launch.server.protocol import CHAT_TEMPLATE_RESERVED, APIError, ChatMessage, check_texts
from launch.server.serving import OpenAIServing
from launch.server.tools.requests import check_tools


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest`` (``messages``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool | None = None  # null: yes for a prompt, no for messages
    add_generation_prompt: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | None) -> str | None:
        return check_texts(value, "prompt")

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return value if value is None else check_tools(value)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (text) and messages (a chat)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(serving: OpenAIServing, req: TokenizeRequest) -> TokenizeResponse:
    """The ids ``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (``messages``) would run on."""
    serving.check_model(req.model)
    if req.return_token_strs:
        raise APIError(400, "return_token_strs is not supported by this server", param="return_token_strs")
    reserved = sorted(set(req.chat_template_kwargs or ()) & CHAT_TEMPLATE_RESERVED)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r}: send the request's own field "
                       "instead", param="chat_template_kwargs")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await asyncio.to_thread(serving.tokenize, req.prompt, "prompt", add_special)
    else:
        ids = await asyncio.to_thread(render_chat_prompt, serving.tokenizer("chat messages"), req.messages,
                                      add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                                      template_kwargs=req.chat_template_kwargs,
                                      add_special_tokens=bool(req.add_special_tokens),
                                      chat_template=serving.chat_template)
    return TokenizeResponse(count=len(ids), max_model_len=int(serving.engine.max_model_len), tokens=ids)


async def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> DetokenizeResponse:
    """The text of ``tokens`` (each inside the vocabulary, else a 400), special tokens kept."""
    serving.check_model(req.model)
    ids = serving.check_token_ids(list(req.tokens), "tokens")
    tok = serving.engine.tokenizer
    if tok is None:
        raise APIError(400, "This model has no tokenizer, so token ids cannot be decoded.", param="tokens")
    text = await asyncio.to_thread(lambda: tok.decode(ids, skip_special_tokens=False))
    return DetokenizeResponse(prompt=text)
