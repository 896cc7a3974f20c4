"""The completions and chat handlers: validate, fan out to the engine, format the reply.

Checks that need the engine happen here, before anything is queued: the model
name (404 unless absent or one of the served names), prompt token ids inside the
vocabulary, prompt plus ``max_tokens`` within ``max_model_len`` (400), and the waiting
queue under ``max_queue_len`` (503).
Streaming replies are held until the first output arrives so that an error the
engine raises on admission still reaches the client as an HTTP status; errors
after that arrive as an SSE ``data: {"error": ...}`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from launch.core.sampling_params import (
    DEFAULT_MAX_LOGPROBS,
    SamplingParams,
    max_logprobs_problem,
    token_id_of_key,
    truncate_prompt,
)
from launch.server.chat import render_chat_prompt
from launch.server.formatting import ChatFormatter, CompletionFormatter
from launch.server.generation import (
    ClientDisconnected,
    EngineClient,
    SubRequest,
    first_item,
    merge_streams,
    race_disconnect,
)
from launch.server.metrics import ServerMetrics
from launch.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    random_id,
)
from launch.server.tools.calling import ToolCalling

logger = logging.getLogger(__name__)

# Status reported (in logs and metrics only) for a client that went away; nginx's convention.
CLIENT_CLOSED = 499


class OpenAIServing:
    """Serves ``/v1/completions`` and ``/v1/chat/completions`` on one engine.

    served_model_names: the names requests may use (one name or several, as vLLM's
    ``--served-model-name``); the first is the primary one. The logprobs cap is the engine's
    ``max_logprobs`` (vLLM's ``--max-logprobs``; an engine without one: vLLM's default, 20).
    """

    def __init__(self, engine: EngineClient, served_model_names: str | Sequence[str], metrics: ServerMetrics,
                 max_queue_len: int | None = None, tool_calling: ToolCalling | None = None,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.chat_template = chat_template  # --chat-template's text, rendering every chat request (None: the checkpoint's)
        self.tool_calling = tool_calling or ToolCalling()  # default: tools rendered, "auto" refused
        names = (served_model_names,) if isinstance(served_model_names, str) else tuple(served_model_names)
        if not names:
            raise ValueError("OpenAIServing needs at least one served model name")
        self.served_model_names = names
        self.model_name = names[0]
        self.metrics = metrics
        self.max_queue_len = max_queue_len
        self.vocab_size = int(engine.model_config.vocab_size)
        self.max_logprobs = int(getattr(engine, "max_logprobs", DEFAULT_MAX_LOGPROBS))

    # ------------------------------------------------------------ validation

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is absent (None or empty, as vLLM) or one of the served names."""
        if model and model not in self.served_model_names:
            served = ", ".join(f"`{name}`" for name in self.served_model_names)
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                           type="not_found_error", param="model")

    def reply_model_name(self, model: str | None) -> str:
        """The ``model`` a reply carries: the request's (a served name once ``check_model`` passed),
        else the primary served name, as vLLM's ``_get_model_name``."""
        return model or self.model_name

    @staticmethod
    def check_supported(req: SamplingRequest) -> None:
        """400 for a sampling field this server would otherwise ignore (a penalty, best_of, ...)."""
        problem = req.unsupported()
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0])

    def check_queue(self) -> None:
        """503 with Retry-After when the engine already has ``max_queue_len`` requests waiting."""
        if self.max_queue_len is None:
            return
        waiting = int(getattr(self.engine.stats(), "num_waiting", 0))
        if waiting >= self.max_queue_len:
            raise APIError(503, f"The server is overloaded: {waiting} requests are waiting "
                           f"(max_queue_len={self.max_queue_len}). Retry later.",
                           type="server_overloaded", headers={"Retry-After": "1"})

    def check_token_ids(self, ids: list[int], param: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of vocabulary (vocab_size={self.vocab_size}).",
                           param=param)
        return ids

    def truncate(self, ids: list[int], req: SamplingRequest) -> list[int]:
        """The prompt's last ``req.truncate_prompt_tokens`` ids (-1: ``max_model_len``; None: all), as
        vLLM truncates (from the left, after encoding); 400 for more than ``max_model_len`` (vLLM's
        message: no prompt that long could run)."""
        max_model_len = int(self.engine.max_model_len)
        keep = req.truncate_prompt_tokens
        if keep is not None and keep > max_model_len:
            raise APIError(400, f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                                f"({max_model_len}). Please, select a smaller truncation size.",
                           param="truncate_prompt_tokens")
        return truncate_prompt(ids, keep, max_model_len)

    def check_num_logprobs(self, num: int | None, kind: str, param: str) -> None:
        """400 naming ``param`` when ``num`` ``kind`` ("sample" / "prompt") top logprobs (-1: the whole
        vocabulary, counted as vocab_size, as vLLM counts it) are more than the engine's
        ``max_logprobs``; vLLM's message."""
        problem = max_logprobs_problem(num, kind, self.max_logprobs, self.vocab_size)
        if problem is not None:
            raise APIError(400, problem, param=param)

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, prompt_param: str = "prompt",
                           max_tokens_param: str = "max_tokens", is_default: bool = False) -> int:
        """``max_tokens`` for a prompt: the request's, or what is left of ``max_model_len``; errors name
        the request's own fields (chat: ``messages``, ``max_completion_tokens`` where it was given).
        A value the client did not send (``is_default``: completions' 16) is cut to what is left."""
        limit = int(self.engine.max_model_len)
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                           f"prompt has {prompt_len} tokens, leaving no room for a completion.",
                           param=prompt_param)
        if requested is None:
            tokens = limit - prompt_len
        elif is_default:
            tokens = min(requested, limit - prompt_len)
        elif prompt_len + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                           f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                           f"{requested} in the completion). Reduce the prompt or {max_tokens_param}.",
                           param=max_tokens_param)
        else:
            tokens = requested
        cap = self.default_sampling.get("max_tokens")  # the generation config's max_new_tokens (vLLM's rule)
        return tokens if cap is None else min(tokens, cap)

    def tokenizer(self, what: str) -> Any:
        """The engine's tokenizer; 400 when the checkpoint has none (token-id prompts still work)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, f"This model has no tokenizer, so {what} cannot be used: send token ids.",
                           param="messages" if what == "chat messages" else "prompt")
        return tok

    def tokenize(self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer("text prompts").encode(prompt, add_special_tokens=add_special_tokens)
            except ValueError as exc:  # e.g. InvalidTextError: text the tokenizer cannot take
                raise APIError(400, str(exc), param=param) from exc
            return self.check_token_ids(list(ids), param)
        return self.check_token_ids(list(prompt), param)

    async def tokenize_all(self, prompts: list[str | list[int]], param: str = "prompt",
                           add_special_tokens: bool = True) -> list[list[int]]:
        """``tokenize`` of every prompt; text is encoded in a worker thread, so that a long prompt (seconds
        for megabytes of text) does not stall the event loop and with it every other client's stream."""
        if not any(isinstance(p, str) for p in prompts):
            return [self.tokenize(p, param) for p in prompts]
        return await asyncio.to_thread(lambda: [self.tokenize(p, param, add_special_tokens) for p in prompts])

    def build_subrequests(self, prefix: str, prompts: list[list[int]], req: SamplingRequest,
                          max_new_tokens: int | None, logprobs: int | None, prompt_param: str = "prompt",
                          max_tokens_param: str = "max_tokens", max_tokens_is_default: bool = False,
                          prompt_logprobs: int | None = None) -> list[SubRequest]:
        """P prompts x ``req.n`` choices -> SubRequests with ``index = p * n + j``. 400 when they
        are more than the engine ever queues (a 503 would invite retries that cannot succeed)."""
        fan_out = len(prompts) * req.n
        if self.max_queue_len is not None and fan_out > self.max_queue_len:
            raise APIError(400, f"This request needs {fan_out} engine requests ({len(prompts)} prompt(s) x n={req.n}), "
                           f"more than the server queues (max_queue_len={self.max_queue_len}). Send fewer prompts "
                           "or a smaller n per request.", param="n" if req.n > 1 else "prompt")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        self.check_num_logprobs(logprobs, "sample", "top_logprobs" if "top_logprobs" in type(req).model_fields
                                else "logprobs")
        self.check_num_logprobs(prompt_logprobs, "prompt", "prompt_logprobs" if req.prompt_logprobs is not None
                                else "logprobs")
        subs = []
        for p, ids in enumerate(prompts):
            max_tokens = self.resolve_max_tokens(max_new_tokens, len(ids), prompt_param, max_tokens_param,
                                                 max_tokens_is_default)
            params = self.sampling_params(req, max_tokens, logprobs, prompt_logprobs, self.default_sampling)
            for j in range(req.n):
                index = p * req.n + j
                subs.append(SubRequest(index=index, prompt_index=p, request_id=f"{prefix}-{index}",
                                       prompt_token_ids=ids, params=params.for_sample(j)))
        return subs

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The engine's defaults for the sampling fields a request leaves out (the model's generation
        config: ``launch.generation_config``); {} for an engine without them."""
        return getattr(self.engine, "default_sampling", None) or {}

    @staticmethod
    def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request's ``SamplingParams``: its own fields, else ``defaults`` (the generation config's
        temperature, top_p, top_k, min_p, repetition_penalty: ``default_sampling``), else
        ``SamplingParams``'."""
        fields: dict[str, Any] = {"n": req.n, "max_tokens": max_tokens, "ignore_eos": req.ignore_eos,
                                  "logprobs": logprobs, "include_stop_str_in_output": req.include_stop_str_in_output,
                                  "prompt_logprobs": prompt_logprobs}
        if req.skip_special_tokens is not None:
            fields["skip_special_tokens"] = req.skip_special_tokens
        if req.logit_bias:
            fields["logit_bias"] = openai_logit_bias(req.logit_bias)
        if req.allowed_token_ids is not None:
            fields["allowed_token_ids"] = req.allowed_token_ids
        if req.bad_words is not None:
            fields["bad_words"] = req.bad_words
        defaults = defaults or {}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_tokens"):
            value = getattr(req, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                fields[name] = value
        try:
            return SamplingParams(**fields)
        except ValueError as exc:  # its messages start with the field they refuse ("min_tokens must be ...")
            name = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=name if name in type(req).model_fields else None) from exc

    # ------------------------------------------------------------ endpoints

    def echo_texts(self, prompts: list[str | list[int]], skip_special_tokens: bool = True) -> list[str]:
        """Each prompt's text for ``echo``: a text prompt as sent, token ids decoded (special tokens
        left out unless the request's ``skip_special_tokens`` is false, as the generated text)."""
        if all(isinstance(p, str) for p in prompts):
            return list(prompts)
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "echo of token-id prompts needs a tokenizer to decode them, and this model has none.",
                           param="echo")
        return [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=skip_special_tokens) for p in prompts]

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_supported(req)
        texts_or_ids = req.prompts()
        prompts = await self.tokenize_all(texts_or_ids, add_special_tokens=req.encode_special_tokens)
        if req.truncate_prompt_tokens is not None:
            truncated = [self.truncate(ids, req) for ids in prompts]
            # echo shows the prompt the model saw
            texts_or_ids = [t if len(k) == len(ids) else k for t, ids, k in zip(texts_or_ids, prompts, truncated)]
            prompts = truncated
        echo_texts = self.echo_texts(texts_or_ids, req.skip_special_tokens is not False) if req.echo else None
        self.check_queue()
        request_id = random_id("cmpl")
        # echo with max_tokens 0 (the prompt alone): one token is sampled and dropped, as vLLM does
        max_tokens = 1 if req.echo_only else req.max_tokens
        subs = self.build_subrequests(request_id, prompts, req, max_tokens, req.logprobs,
                                      max_tokens_is_default="max_tokens" not in req.model_fields_set,
                                      prompt_logprobs=req.prompt_scores)
        formatter = CompletionFormatter(request_id, self.reply_model_name(req.model), prompts, req.n, self.token_text,
                                        req.logprobs, continuous_usage=req.continuous_usage, echo_texts=echo_texts,
                                        echo_only=req.echo_only, prompt_logprobs=req.prompt_logprobs)
        return await self.respond(subs, formatter, req, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_supported(req)
        tool_parser = self.tool_calling.parser_for(req)
        num_logprobs = req.num_logprobs
        # off the event loop: rendering and encoding a long conversation takes as long as a long prompt
        ids = await asyncio.to_thread(render_chat_prompt, self.tokenizer("chat messages"), req.messages,
                                      add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                                      documents=req.documents, template_kwargs=req.chat_template_kwargs,
                                      add_special_tokens=req.encode_special_tokens,
                                      continue_final_message=req.continue_final_message,
                                      chat_template=self.chat_template)
        prompts = [self.check_token_ids(self.truncate(ids, req), "messages")]
        self.check_queue()
        request_id = random_id("chatcmpl")
        subs = self.build_subrequests(request_id, prompts, req, req.max_new_tokens, num_logprobs, "messages",
                                      "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                                      prompt_logprobs=req.prompt_logprobs)
        tool_streams = None if tool_parser is None else self.tool_calling.streams(
            tool_parser, self.engine.tokenizer, prompts[0], req.include_stop_str_in_output, req.stop or ())
        formatter = ChatFormatter(request_id, self.reply_model_name(req.model), prompts, req.n, self.token_text,
                                  num_logprobs, continuous_usage=req.continuous_usage, tool_streams=tool_streams,
                                  prompt_logprobs=req.prompt_logprobs)
        return await self.respond(subs, formatter, req, raw)

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs (``token_id:N`` when the model has no tokenizer, as vLLM)."""
        if self.engine.tokenizer is None:
            return f"token_id:{token_id}"
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------ driving the engine

    async def respond(self, subs: list[SubRequest], formatter: Any, req: SamplingRequest,
                       raw: Request) -> Response:
        self.metrics.on_request(subs)
        stream = merge_streams(self.engine, subs, self.metrics)
        try:
            if not req.stream:
                finals = await race_disconnect(self._collect(stream, len(subs)), raw)
                return JSONResponse(formatter.response(finals).model_dump())
            first = await race_disconnect(first_item(stream), raw)
        except ClientDisconnected:  # an abort (counted where the engine ends it), not an answer: no 4xx counted
            await stream.aclose()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            await stream.aclose()
            raise
        return StreamingResponse(self._sse(stream, first, formatter, req.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    async def _collect(stream: AsyncIterator[tuple[int, Any]], num_choices: int) -> list[Any]:
        """The last output of every choice, in index order."""
        finals: dict[int, Any] = {}
        async for index, out in stream:
            finals[index] = out
        if len(finals) != num_choices:
            raise APIError(500, f"The engine ended {num_choices - len(finals)} of {num_choices} choices "
                           "without any output.", type="internal_error")
        return [finals[i] for i in range(num_choices)]

    @staticmethod
    async def _sse(stream: AsyncIterator[tuple[int, Any]], first: tuple[int, Any], formatter: Any,
                   include_usage: bool) -> AsyncIterator[str]:
        """The SSE body; closing it (client gone) closes ``stream``, which aborts the engine requests.
        The formatter frames the events and ends the stream (``encode``, ``error_event``, ``stream_end``)."""
        try:
            for chunk in formatter.stream_start():
                yield formatter.encode(chunk)
            for chunk in formatter.stream_chunks(*first):
                yield formatter.encode(chunk)
            async for index, out in stream:
                for chunk in formatter.stream_chunks(index, out):
                    yield formatter.encode(chunk)
            if include_usage:
                yield formatter.encode(formatter.usage_chunk())
        except APIError as err:
            yield formatter.encode(formatter.error_event(err))
        finally:
            await stream.aclose()
        end = formatter.stream_end()
        if end:
            yield end


# OpenAI's bounds on a logit_bias value; vLLM clamps to them too
LOGIT_BIAS_LIMIT = 100.0


def openai_logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """An OpenAI ``logit_bias`` ({"token id": bias}) as ``SamplingParams.logit_bias``: integer keys,
    biases clamped to [-100, 100]; APIError 400 naming ``logit_bias`` for a key that is not a token id
    or a NaN bias."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = token_id_of_key(key)
        if token is None:
            raise APIError(400, f"logit_bias keys must be token ids (integers >= 0 as strings), got {key!r}"[:200],
                           param="logit_bias")
        if math.isnan(float(value)):  # JSON's NaN extension: no bias at all, not one to clamp
            raise APIError(400, f"logit_bias for token {token} is NaN: a bias must be a number", param="logit_bias")
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return out
