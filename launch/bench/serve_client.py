"""The client side of ``bench serve``: target resolution and one streamed completion request.

``send_request`` posts token-id prompts to an OpenAI ``/v1/completions`` endpoint with
``stream=True`` and ``stream_options.include_usage`` and times every SSE chunk that
carries choices (as vLLM's benchmark client does): TTFT at the first, ITL between
consecutive ones, latency at the end of the stream. The output length is the
server's ``usage.completion_tokens`` (the chunk count when the server sends none).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp


@dataclass(frozen=True)
class RequestInput:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class BenchTarget:
    """Where and how to send: the endpoint URL, the model name, and fixed request fields."""

    url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    max_model_len: int | None = None  # the served model's context (its /v1/models card), None if not said


@dataclass
class RequestOutcome:
    """Timings in seconds, relative to when the request was sent."""

    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="openai", choices=["openai", "vllm"],
                   help="Request format; both mean the OpenAI completions API.")
    p.add_argument("--base-url", default=None, help="Server base URL (overrides --host/--port).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="Model name to request (default: the server's first model).")
    p.add_argument("--tokenizer", default=None,
                   help="Checkpoint directory whose config.json gives vocab_size and EOS/BOS ids "
                        "(default: --model when it is a directory, else the directory the server's "
                        "/v1/models card names as its root when it is on this machine).")
    p.add_argument("--vocab-size", type=int, default=None, help="Draw prompt ids from [0, N).")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="Send ignore_eos so each output has exactly its drawn length (default on).")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))


def _checkpoint_vocab(path: str | None, need_vocab_size: bool = True) -> tuple[int | None, tuple[int, ...]] | None:
    """``(vocab_size, special ids)`` from ``path/config.json``, or None when there is none.
    ValueError naming the file when it is not JSON, has special ids that are not integers, or (when
    ``need_vocab_size``; else that size is None) no integer ``vocab_size``."""
    if not path or not (Path(path) / "config.json").is_file():
        return None
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object")
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        if need_vocab_size:
            raise ValueError(f"{file} has no integer vocab_size: pass --vocab-size N")
        vocab_size = None
    special = []
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = config.get(key)
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{file}: {key} must be an integer or a list of integers, got {value!r}")
        special.extend(values)
    return vocab_size, tuple(special)


def _url_problem(url: str) -> str | None:
    """Why ``url`` is not an http(s) URL with a host (and a valid port, if any), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "no http:// or https:// scheme"
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    return None


def _host_port_url(host: str, port: int) -> str:
    """``http://HOST:PORT``, an IPv6 address in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _is_host(host: str, port: int) -> bool:
    """``host`` is one host name or address: ``http://HOST:PORT`` parses back to that host."""
    url = _host_port_url(host, port)
    return (bool(host) and not any(c.isspace() for c in host) and _url_problem(url) is None
            and urlsplit(url).hostname == host.strip("[]").lower())


def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or _host_port_url(args.host, args.port)).rstrip("/")


def target_flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags that say where and what to send (one line naming the flag), or
    None; checked before the server is contacted, as the server would refuse every request (or none
    could be sent) otherwise."""
    if not 1 <= args.port <= 65535:
        return f"--port must be in 1-65535, got {args.port}"
    if args.base_url is not None:
        if (problem := _url_problem(args.base_url)) is not None:
            return f"--base-url must be an http:// or https:// URL with a host ({problem}), got {args.base_url!r}"
    elif not _is_host(args.host, args.port):
        return f"--host must be a host name or IP address, got {args.host!r}"
    endpoint = args.endpoint
    if not endpoint.startswith("/"):
        return f"--endpoint must be a path starting with '/', got {endpoint!r}"
    path = urlsplit(endpoint).path.rstrip("/")
    if path.endswith("/chat/completions"):
        return (f"--backend {args.backend} sends completions requests (token-id prompts), not chat ones: "
                f"--endpoint {endpoint} is the chat API; use --endpoint /v1/completions")
    if not path.endswith("/completions"):
        return (f"--backend {args.backend} sends OpenAI completions requests: --endpoint must be a "
                f"completions path such as /v1/completions, got {endpoint!r}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):  # SamplingParams' rule
        return f"--temperature must be a finite number >= 0, got {args.temperature}"
    if args.vocab_size is not None and args.vocab_size < 1:
        return f"--vocab-size must be >= 1, got {args.vocab_size}"
    return None


class ModelsUnavailable(ValueError):
    """``/v1/models`` answered, but not with a model list (an HTTP error or another body)."""


async def fetch_models(base_url: str, api_key: str | None) -> list[dict[str, Any]]:
    """The model cards of ``base_url/v1/models`` (each a dict with a string ``id``), in order.
    ModelsUnavailable when the server answers otherwise; aiohttp.ClientError when it cannot be reached."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(trust_env=False) as session, \
            session.get(base_url + "/v1/models", headers=headers) as r:
        if r.status != 200:
            raise ModelsUnavailable(f"GET {base_url}/v1/models returned {r.status}: {(await r.text())[:200]}")
        try:
            data = (await r.json(content_type=None))["data"]
        except (json.JSONDecodeError, UnicodeDecodeError, aiohttp.ContentTypeError, KeyError, TypeError):
            raise ModelsUnavailable(f"GET {base_url}/v1/models did not return a model list") from None
    if not isinstance(data, list) or not all(isinstance(c, dict) and isinstance(c.get("id"), str) for c in data):
        raise ModelsUnavailable(f"GET {base_url}/v1/models did not return a model list")
    return data


def _card_int(card: dict[str, Any], key: str) -> int | None:
    value = card.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def resolve_target(args: argparse.Namespace) -> tuple[BenchTarget, int, tuple[int, ...]]:
    """``(BenchTarget, vocab_size, token ids to avoid)`` from the parsed flags. ValueError (one line
    naming the flag) for a model the server does not serve, or a ``--vocab-size`` larger than the
    vocabulary that ``--tokenizer`` or the server gives."""
    base_url = base_url_of(args)
    # the local files first: their problems are named whether or not the server is up
    if args.tokenizer is not None and not (Path(args.tokenizer) / "config.json").is_file():
        raise ValueError(f"--tokenizer {args.tokenizer}: no config.json in that directory")
    source = args.tokenizer or args.model
    found = _checkpoint_vocab(source, need_vocab_size=args.vocab_size is None)
    if args.vocab_size is not None and found is not None and found[0] is not None and args.vocab_size > found[0]:
        flag = "--tokenizer" if args.tokenizer else "--model"
        raise ValueError(f"--vocab-size {args.vocab_size} is larger than the vocabulary of {flag} {source} "
                         f"({found[0]} token ids)")
    try:
        cards = await fetch_models(base_url, args.api_key)
    except aiohttp.ClientError as exc:
        raise ValueError(f"cannot reach {base_url}: {exc}") from exc
    except ModelsUnavailable:
        if args.model is None:
            raise
        cards = None  # the named model cannot be checked: send to it as asked
    served = [c["id"] for c in cards] if cards is not None else []
    if cards is not None:
        if args.model is None and not served:
            raise ValueError(f"{base_url}/v1/models lists no model")
        if args.model is not None and args.model not in served:
            raise ValueError(f"--model {args.model} is not served by {base_url}; it serves: "
                             f"{', '.join(served) or 'no model'}")
    model = args.model or served[0]
    card = next((c for c in cards if c["id"] == model), {}) if cards is not None else {}
    if found is None and isinstance(card.get("root"), str):
        # the served checkpoint's directory (vLLM's card field ``root``), when it is on this machine
        source = card["root"]
        found = _checkpoint_vocab(source, need_vocab_size=args.vocab_size is None)
    if args.vocab_size is not None:
        vocab, avoid = args.vocab_size, found[1] if found else ()
    elif found is not None and found[0] is not None:  # need_vocab_size: never None here
        vocab, avoid = found[0], found[1]
    else:
        raise ValueError("need the vocabulary size for random prompts: pass --vocab-size N or "
                         "--tokenizer CHECKPOINT_DIR (with config.json)")
    if (served_vocab := _card_int(card, "vocab_size")) is not None and vocab > served_vocab:
        what = f"--vocab-size {vocab}" if args.vocab_size is not None else f"the vocab_size {vocab} of {source}"
        raise ValueError(f"{what} is larger than the vocabulary of the served model {model} "
                         f"({served_vocab} token ids)")
    target = BenchTarget(url=base_url + args.endpoint, model=model, api_key=args.api_key,
                         ignore_eos=args.ignore_eos, extra_body={"temperature": args.temperature},
                         max_model_len=_card_int(card, "max_model_len"))
    return target, vocab, avoid


async def send_request(session: aiohttp.ClientSession, target: BenchTarget, request: RequestInput) -> RequestOutcome:
    """Stream one completion; never raises for HTTP or server errors (they land in ``error``)."""
    body = {"model": target.model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": target.ignore_eos,
            **target.extra_body}
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    outcome = RequestOutcome(prompt_len=request.prompt_len)
    chunks, usage_tokens, done = 0, None, False
    start = last = time.perf_counter()
    try:
        async with session.post(target.url, json=body, headers=headers) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return outcome
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    outcome.error = str(event["error"].get("message", event["error"]))
                    return outcome
                now = time.perf_counter()
                if event.get("choices"):
                    if chunks == 0:
                        outcome.ttft = now - start
                    else:
                        outcome.itl.append(now - last)
                    last = now
                    chunks += 1
                    outcome.generated_text += event["choices"][0].get("text") or ""
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
            outcome.latency = last - start if chunks else time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
    if not done:
        outcome.error = "stream ended without [DONE]"
        return outcome
    outcome.output_tokens = usage_tokens if usage_tokens is not None else chunks
    outcome.success = chunks > 0
    if not outcome.success:
        outcome.error = "no tokens streamed"
    return outcome
