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
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
                        "(default: --model when it is a directory).")
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


async def fetch_model_name(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(trust_env=False) as session, \
            session.get(base_url + "/v1/models", headers=headers) as r:
        if r.status != 200:
            raise ValueError(f"GET {base_url}/v1/models returned {r.status}: {await r.text()}")
        data = (await r.json())["data"]
        if not data:
            raise ValueError(f"{base_url}/v1/models lists no model")
        return data[0]["id"]


async def resolve_target(args: argparse.Namespace) -> tuple[BenchTarget, int, tuple[int, ...]]:
    """``(BenchTarget, vocab_size, token ids to avoid)`` from the parsed flags."""
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    # the local files first: their problems are named whether or not the server is up
    if args.tokenizer is not None and not (Path(args.tokenizer) / "config.json").is_file():
        raise ValueError(f"--tokenizer {args.tokenizer}: no config.json in that directory")
    found = _checkpoint_vocab(args.tokenizer or args.model, need_vocab_size=args.vocab_size is None)
    try:
        model = args.model or await fetch_model_name(base_url, args.api_key)
    except aiohttp.ClientError as exc:
        raise ValueError(f"cannot reach {base_url}: {exc}") from exc
    if args.vocab_size is not None:
        vocab, avoid = args.vocab_size, found[1] if found else ()
    elif found is not None and found[0] is not None:  # need_vocab_size: never None here
        vocab, avoid = found[0], found[1]
    else:
        raise ValueError("need the vocabulary size for random prompts: pass --vocab-size N or "
                         "--tokenizer CHECKPOINT_DIR (with config.json)")
    target = BenchTarget(url=base_url + args.endpoint, model=model, api_key=args.api_key,
                         ignore_eos=args.ignore_eos, extra_body={"temperature": args.temperature})
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
