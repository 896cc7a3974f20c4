"""OpenAI wire format: the request models of the completions and chat APIs, and the error body
(responses are in ``launch.server.responses``).

Requests are validated here (types, ranges); checks that need the engine (prompt
length against ``max_model_len``, token ids against the vocabulary, the model
name) live in ``launch.server.serving``. Types are strict, as OpenAI's are: ``"n": "2"``,
``"max_tokens": 2.5`` or ``"stream": "yes"`` are 400s, not coerced; ``null`` for a field
that has a default means that default (OpenAI's fields are nullable). Unknown request
fields are ignored with a logged warning, as vLLM does. Every error leaves the server as
``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
import types
import typing
import uuid
from collections.abc import Container
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from launch.server.tools.requests import ToolCallParam, check_tool_choice, check_tools
from launch.tokenizer import CHAT_ROLES, check_text

logger = logging.getLogger(__name__)

MAX_N = 16
# How many top logprobs a request may ask for per token is the engine's ``max_logprobs`` (vLLM's
# ``--max-logprobs``), checked by ``OpenAIServing`` (-1 counting as vocab_size), not here.
MAX_STOP_SEQUENCES = 16
# What chat_template_kwargs may not set: the request's own fields (messages, tools, ...) fill them
CHAT_TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools",
                                    "documents", "tokenize"})
# /v1/completions without max_tokens generates this many tokens at most (OpenAI's and vLLM's default);
# an explicit null means "until max_model_len" (vLLM); chat has no default cap (both of them)
DEFAULT_COMPLETION_MAX_TOKENS = 16
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM and launch.core.sampling_params take seeds

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def only_item_types(value: Any, accepted: Container[str], where: str, takes: str, default: str | None = None) -> Any:
    """``value`` unchanged unless it is a list holding a mapping whose ``"type"`` (``default`` when
    absent) is a string not in ``accepted``: then ValueError "<where> has type '...': this server
    takes <takes>", ``where`` formatted with the item's index ``i``. One message for an item of
    another type (image_url, function_call, ...), not pydantic's errors for every branch of a union."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            kind = item.get("type", default) if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in accepted:
                raise ValueError(f"{where.format(i=i)} has type {kind!r}: this server takes {takes}")
    return value


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


def check_num_logprobs(value: int | None, name: str) -> int | None:
    """``value`` of a field that takes -1 for the whole vocabulary, as vLLM's ``prompt_logprobs`` and
    chat ``top_logprobs`` do: None, -1 or an integer >= 0; else ValueError naming ``name``."""
    if value is not None and value < -1:
        raise ValueError(f"{name} must be an integer >= 0, or -1 for the whole vocabulary, got {value}")
    return value


def random_id(prefix: str) -> str:
    """An OpenAI-style object id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _short(value: Any, limit: int = 40) -> str:
    """``value`` as JSON, cut to ``limit`` characters, for error messages that quote the request."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad_token_id(ids: list[Any], where: str) -> str | None:
    """The message for the first entry of ``ids`` that is not a token id, or None."""
    j = next((j for j, t in enumerate(ids) if not _is_token_id(t)), None)
    if j is None:
        return None
    return f"{where}[{j}] must be a token id (an integer >= 0), got {_short(ids[j])}"


def check_prompt_shape(value: Any) -> Any:
    """``value`` unchanged when it is one of the four prompt forms; else ValueError naming the first
    entry that breaks the form (``prompt[1][0] must be a token id ...``), one message instead of
    pydantic's one per branch of the union."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"prompt must be {PROMPT_FORMS}, got {_short(value)}")
    if not value:
        raise ValueError("prompt must not be an empty list")
    first = value[0]
    if isinstance(first, str):
        j = next((j for j, p in enumerate(value) if not isinstance(p, str)), None)
        if j is not None:
            raise ValueError(f"prompt[{j}] must be a string, as prompt[0] is, got {_short(value[j])}")
        return value
    if isinstance(first, list):
        for i, ids in enumerate(value):
            if not isinstance(ids, list):
                raise ValueError(f"prompt[{i}] must be a list of token ids, as prompt[0] is, got {_short(ids)}")
            if not ids:
                raise ValueError(f"prompt[{i}] must not be an empty list of token ids")
            problem = _bad_token_id(ids, f"prompt[{i}]")
            if problem is not None:
                raise ValueError(problem)
        return value
    problem = _bad_token_id(value, "prompt")
    if problem is not None:
        raise ValueError(problem if _is_token_id(first) else f"prompt must be {PROMPT_FORMS}; {problem}")
    return value


def _accepts_none(annotation: Any) -> bool:
    return annotation is None or annotation is type(None) or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation))


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
    """``include_usage``: a last chunk with the whole usage. vLLM's ``continuous_usage_stats``: every
    chunk also carries its choice's usage so far (and, as in vLLM, implies ``include_usage`` unless
    that is set to false). Either may be sent as null (its default), as vLLM types them."""

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None

    @property
    def final_usage(self) -> bool:
        return bool(self.include_usage) or (self.include_usage is None and bool(self.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.continuous_usage_stats) and self.include_usage is not False


class SamplingRequest(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=100.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's penalties and vLLM's repetition_penalty / min_tokens / prompt_logprobs (SamplingParams)
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, le=100.0)
    min_tokens: StrictInt | None = Field(None, ge=0)
    prompt_logprobs: StrictInt | None = None  # -1: the whole vocabulary (vLLM)
    # OpenAI / vLLM sampling fields this server does not implement: typed here so that a value
    # that would change the output is refused (``unsupported``) instead of silently ignored
    best_of: StrictInt | None = Field(None, ge=1)
    # OpenAI's {"token id": bias}; each bias clamped to [-100, 100] as OpenAI and vLLM do
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: StrictBool | None = None  # vLLM's (default true): false keeps them in the text
    response_format: dict[str, Any] | None = None  # OpenAI's; only {"type": "text"} (no constrained decoding)
    # vLLM's extensions that change the output, refused unless neutral (no constrained decoding, no
    # beam search here)
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    use_beam_search: StrictBool | None = None
    # vLLM's: only these token ids can be drawn; these words are never generated (SamplingParams)
    allowed_token_ids: Any = None
    bad_words: Any = None
    # vLLM's engine-side extensions (SamplingParams, prompt handling): refused unless neutral
    logits_processors: Any = None
    # vLLM's: keep the prompt's last k tokens (-1: max_model_len), after encoding
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    return_tokens_as_token_ids: StrictBool | None = None
    # vLLM's: whether the prompt is encoded with the tokenizer's special tokens (bos, ...); null: the
    # endpoint's default, ``ADDS_SPECIAL_TOKENS`` (completions yes; chat no, the template writes them)
    add_special_tokens: StrictBool | None = None

    ADDS_SPECIAL_TOKENS: ClassVar[bool] = True

    @property
    def encode_special_tokens(self) -> bool:
        return self.ADDS_SPECIAL_TOKENS if self.add_special_tokens is None else self.add_special_tokens

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``"n": null``, ``"stream": null`` (as some clients send every field): the default, as OpenAI
        and vLLM take them. Fields whose own default is null (``max_tokens``, ``seed``, ...) keep it."""
        if not isinstance(data, dict):
            return data
        defaulted = {name for name, f in cls.model_fields.items()
                     if not f.is_required() and not _accepts_none(f.annotation)}
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}

    @model_validator(mode="wrap")
    @classmethod
    def _warn_ignored_fields(cls, data: Any, handler: Any) -> Any:
        """Log the request fields this server does not know (ignored, as vLLM logs them)."""
        result = handler(data)
        if isinstance(data, dict):
            ignored = sorted(k for k in data if k not in cls.model_fields)
            if ignored:
                logger.warning("The following fields were present in the request but ignored: %s", ignored)
        return result

    @field_validator("model", "user")
    @classmethod
    def _check_unicode(cls, value: str | None, info: Any) -> str | None:
        return check_texts(value, info.field_name)

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, value: int | None, info: Any) -> int | None:
        return check_num_logprobs(value, info.field_name)

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop_shape(cls, value: Any) -> Any:
        """One message naming the entry that is not a string (not one per branch of the union)."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"stop must be a string or a list of strings, got {_short(value)}")
        j = next((j for j, s in enumerate(value) if not isinstance(s, str)), None)
        if j is not None:
            raise ValueError(f"stop[{j}] must be a string, got {_short(value[j])}")
        return value

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

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: StreamOptions | None, info: Any) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        """A last chunk with the usage of the whole request."""
        return self.stream_options is not None and self.stream_options.final_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: every chunk carries its choice's usage so far."""
        return self.stream_options is not None and self.stream_options.continuous_usage

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, message)`` for the first field set to a value this server cannot honour (its
        no-op values pass: ``best_of`` up to ``n`` (no extra candidates to choose from; some SDKs send
        ``best_of=1`` by default), an empty ``logits_processors``)."""
        if self.best_of is not None and self.best_of > self.n:
            return "best_of", (f"best_of={self.best_of} is not supported: this server returns the n={self.n} "
                               "samples it draws (best_of <= n)")
        if self.stream and self.prompt_logprobs not in (None, 0):  # vLLM refuses > 0 and -1, takes 0
            return "prompt_logprobs", "prompt_logprobs is not supported with stream=true (as vLLM)"
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format", (f"response_format type {_short(self.response_format.get('type'))} is not "
                                       "supported: this server has no constrained decoding (only \"text\")")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name, f"{name} is not supported: this server has no constrained decoding"
        if self.use_beam_search:
            return "use_beam_search", "use_beam_search=true is not supported (sampling only)"
        if self.truncate_prompt_tokens == 0:
            return "truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (max_model_len) or at least 1, got 0"
        for name in ("logits_processors",):
            value = getattr(self, name)
            if value is not None and value != []:
                return name, f"{name} is not supported by this server"
        if self.return_tokens_as_token_ids:
            return "return_tokens_as_token_ids", "return_tokens_as_token_ids=true is not supported"
        return None


class CompletionRequest(SamplingRequest):
    """``/v1/completions``: ``prompt`` is a string, strings, token ids, or lists of token ids.

    ``max_tokens`` defaults to 16 (OpenAI's and vLLM's default); ``null`` asks for as many as
    ``max_model_len`` leaves. ``echo`` puts the prompt's text before each choice's text; with
    ``logprobs`` the prompt's tokens lead the logprobs too (vLLM: ``prompt_logprobs`` defaults to
    ``logprobs`` then), and ``max_tokens: 0`` with ``echo`` returns the prompt alone (scoring).
    """

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=0)
    logprobs: StrictInt | None = Field(None, ge=0)
    echo: StrictBool = False
    suffix: str | None = None  # OpenAI's insertion mode: refused (``unsupported``), as vLLM refuses it
    prompt_embeds: Any = None  # vLLM's; refused when set (token prompts only)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Any:
        return check_prompt_shape(value)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(isinstance(p, str) and not p for p in value):
            raise ValueError("prompt strings must not be empty")
        return check_texts(value, "prompt")

    def unsupported(self) -> tuple[str, str] | None:
        problem = super().unsupported()
        if problem is not None:
            return problem
        if self.suffix:
            return "suffix", "suffix is not supported (this server has no insertion mode)"
        if self.prompt_embeds is not None:
            return "prompt_embeds", "prompt_embeds is not supported: send text or token ids"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens=0 needs echo=true (the prompt alone, for scoring)"
        if self.echo and self.logprobs is not None and self.stream:
            return "echo", "echo with logprobs scores the prompt, which is not supported with stream=true (as vLLM)"
        return None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt alone (vLLM samples one token and drops it)."""
        return self.echo and self.max_tokens == 0

    @property
    def prompt_scores(self) -> int | None:
        """How many top logprobs to score each prompt token with: ``prompt_logprobs``, or with
        ``echo`` the request's ``logprobs`` (vLLM's rule), else None (the prompt is not scored)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

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
    """``tool_calls``: an assistant turn's calls; ``tool_call_id``: the call a ``tool`` message answers."""

    role: Literal[CHAT_ROLES]  # the roles generate's chat lines take too (launch.tokenizer)
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part of another type (image_url, input_audio, ...) gets one message saying so."""
        return only_item_types(value, ("text",), "content part {i}", "text parts only")

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
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None  # -1: the whole vocabulary (vLLM)
    add_generation_prompt: StrictBool = True
    # vLLM's chat extensions that change the prompt: echo is refused when set (``unsupported``);
    # continue_final_message renders the last (assistant) message open, for the reply to continue it
    echo: StrictBool = False
    continue_final_message: StrictBool = False
    # OpenAI tools, rendered into the prompt by the chat template (as transformers and vLLM pass them,
    # with "none" too); with "auto" the reply's calls are parsed (launch.server.tools.calling)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None  # accepted and not enforced, as vLLM
    # vLLM's: extra template variables (e.g. Qwen3's enable_thinking) and RAG documents, handed to the
    # chat template; a per-request template is refused (vLLM: only with --trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: Any = None

    ADDS_SPECIAL_TOKENS: ClassVar[bool] = False

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: Any) -> int | None:
        return check_num_logprobs(value, info.field_name)

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return value if value is None else check_tools(value)

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: Any, info: Any) -> Any:
        return check_tool_choice(value, info.data.get("tools"))

    @property
    def effective_tool_choice(self) -> str | dict[str, Any] | None:
        """``tool_choice``, "auto" when tools are given without one (OpenAI's and vLLM's default)."""
        return "auto" if self.tool_choice is None and self.tools else self.tool_choice

    def unsupported(self) -> tuple[str, str] | None:
        problem = super().unsupported()
        if problem is not None:
            return problem
        if self.effective_tool_choice == "required" or isinstance(self.tool_choice, dict):
            return "tool_choice", (f"tool_choice {_short(self.tool_choice)} is not supported: forcing a tool call needs "
                                   "guided decoding, which this server lacks; send \"auto\" (the model may call a "
                                   "tool) or \"none\"")
        if self.echo:
            return "echo", "echo=true is not supported for chat (the reply is never prefixed with the last message)"
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", ("continue_final_message=true needs add_generation_prompt=false "
                                              "(as vLLM: it continues the last message instead of starting a reply)")
        if self.chat_template is not None:
            return "chat_template", "chat_template is not supported: the checkpoint's chat template is used"
        reserved = sorted(set(self.chat_template_kwargs or ()) & CHAT_TEMPLATE_RESERVED)
        if reserved:
            return "chat_template_kwargs", (f"chat_template_kwargs may not set {reserved[0]!r}: send the request's "
                                            "own field instead")
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
