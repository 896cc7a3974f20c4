"""A deterministic stand-in for ``AsyncLLM`` and a uvicorn-in-a-thread harness (tests only).

``FakeEngine`` follows the engine surface in docs/contracts.md: cumulative
``RequestOutput``s, ``ValueError`` for unservable prompts, ``EngineQueueFull`` past
``max_queue_len`` waiting requests, abort on generator close, ``stats()``, and the
expert-distribution record/dump methods. Its "model" emits token
``(last + 7 * step + seed) % 90 + 1`` each step, so greedy output depends only on the
prompt and the seed. Token i is the character ``chr(32 + i)``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import uvicorn

from launch.async_llm import EngineQueueFull, EngineStats
from launch.core.outputs import CompletionOutput, RequestOutput
from launch.core.sampling_params import SamplingParams
from launch.expert_location import write_expert_distribution_dump
from parallel.groups import free_port

VOCAB = 95
EOS = 94


class CharTokenizer:
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(max(ord(c) - 32, 0), VOCAB - 1) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i) for i in ids if not (skip_special_tokens and i == EOS))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if messages[0]["role"] == "assistant":
            raise ValueError("conversation must not start with an assistant message")
        text = "".join(f"<tool:{t['function']['name']}>" for t in tools or [])
        text += "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def fake_stats() -> EngineStats:
    """The engine's own stats record, with distinctive balancer figures for /metrics tests."""
    return EngineStats(balancedness_per_layer=[0.5, 0.75], balancedness=0.6, tokens_dropped=3,
                       tokens_rerouted=2, num_rebalances=1, rebalance_seconds_total=0.25, expert_copies_moved=4)


class FakeEngine:
    """Runs at most ``max_running`` requests at a time, one token per ``step_s``; others wait."""

    def __init__(self, *, max_model_len: int = 64, max_running: int = 4, max_queue_len: int = 8,
                 step_s: float = 0.002, max_logprobs: int = 20) -> None:
        self.model_name = "fake-moe"
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs  # engine.max_logprobs (vLLM's --max-logprobs; -1: the vocabulary)
        self.model_config = SimpleNamespace(vocab_size=VOCAB, moe_layer_ids=(1, 2), num_experts=4)
        self.tokenizer = CharTokenizer()
        self.max_running = max_running
        self.max_queue_len = max_queue_len
        self.step_s = step_s
        self.running: set[str] = set()
        self.waiting: list[str] = []
        self.aborted: list[str] = []
        self.seen_params: list[SamplingParams] = []
        self.totals = fake_stats()
        self.recording = False
        self.recorded_steps = 0

    def stats(self) -> EngineStats:
        s = self.totals
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_cache_usage = len(self.running) / self.max_running
        return s

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        self.running.discard(request_id)
        if request_id in self.waiting:
            self.waiting.remove(request_id)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str):
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens is longer than max_model_len")
        if len(self.waiting) >= self.max_queue_len:
            raise EngineQueueFull(f"{len(self.waiting)} requests waiting")
        self.seen_params.append(params)
        self.waiting.append(request_id)
        try:
            while len(self.running) >= self.max_running:
                await asyncio.sleep(self.step_s)
            self.waiting.remove(request_id)
            self.running.add(request_id)
            self.totals.prompt_tokens_total += len(prompt_token_ids)
            async for out in self._decode(prompt_token_ids, params, request_id):
                yield out
        finally:
            self._release(request_id)

    async def _decode(self, prompt: list[int], params: SamplingParams, request_id: str):
        ids: list[int] = []
        logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        last, seed = prompt[-1], params.seed or 0
        limit = min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt))
        while True:
            await asyncio.sleep(self.step_s)
            last = (last + 7 * len(ids) + seed) % 90 + 1
            ids.append(last)
            self.totals.generation_tokens_total += 1
            if self.recording:
                self.recorded_steps += 1
            if logprobs is not None:
                logprobs.append({last: -0.5, **{(last + k) % 90 + 1: -1.0 - k for k in range(1, params.logprobs + 1)}})
            text = CharTokenizer().decode(ids)  # the engine detokenizes even when the server has no tokenizer
            reason, stop_reason = (None, None)
            hit = next((s for s in params.stop if s in text), None)
            if hit is not None:
                text, reason, stop_reason = text[: text.index(hit)], "stop", hit
            elif len(ids) >= limit:
                reason = "length"
            done = reason is not None
            yield RequestOutput(request_id, None, list(prompt), [CompletionOutput(
                0, text, list(ids), reason, stop_reason, None if logprobs is None else list(logprobs))], done)
            if done:
                return

    def start_expert_distribution_record(self) -> None:
        self.recording, self.recorded_steps = True, 0

    def stop_expert_distribution_record(self) -> None:
        self.recording = False

    def dump_expert_distribution_record(self, directory: Path) -> Path:
        steps = max(self.recorded_steps, 1)
        count = torch.arange(steps * 2 * 4, dtype=torch.int64).reshape(steps, 2, 4)
        phy2log = torch.tensor([[0, 1, 2, 3, 3], [3, 2, 1, 0, 0]])
        return write_expert_distribution_dump(directory, count, phy2log)




class ServerThread:
    """uvicorn serving ``app`` on a free loopback port in a daemon thread."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def assert_read_timeout_aborts(engine: FakeEngine, url: str, body: dict, aborts: int = 1) -> None:
    """A non-streaming POST of ``body`` to ``url`` whose client gives up reading (0.3 s, the fake
    engine slowed to 50 ms a token) ends in ``aborts`` engine aborts and nothing left running."""
    before = len(engine.aborted)
    step_s, engine.step_s = engine.step_s, 0.05
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=httpx.Timeout(10, read=0.3))
        assert wait_until(lambda: len(engine.aborted) >= before + aborts)
        assert wait_until(lambda: engine.stats().num_running == 0)
    finally:
        engine.step_s = step_s
