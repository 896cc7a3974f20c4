"""AsyncLLM: the engine stepped in a background thread, results handed to asyncio.

The scheduler is not thread-safe, so every mutation (add, abort, record/dump) travels to
the engine thread through one inbox; outputs come back to each request's asyncio queue
with ``call_soon_threadsafe``. ``stats()`` returns the snapshot published after each step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch.config import RuntimeConfig
from launch.core import RequestOutput, RequestOutputKind, SamplingParams
from launch.engine import LLMEngine
from launch.recovery import DEAD, ENGINE_STATES, EngineDeadError, EngineRecoveringError, WorkerFault

log = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineQueueFull", "EngineRecoveringError", "EngineStats", "KVCacheInfo"]


class EngineQueueFull(RuntimeError):
    """Too many requests are waiting; the server answers 503 with Retry-After."""


@dataclass(frozen=True)
class KVCacheInfo:
    """The KV pool as configured and sized at start-up (``/metrics``' ``vllm:cache_config_info``):
    ``num_blocks`` per DP rank (each rank has a pool of that size), ``num_blocks_override`` the
    configured count (None: sized from memory), ``cache_dtype`` as configured ("auto": the model's)."""

    num_blocks: int
    block_size: int
    cache_dtype: str
    memory_utilization: float
    enable_prefix_caching: bool
    num_blocks_override: int | None


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    balancedness_per_layer: list[float] = field(default_factory=list)
    balancedness: float = 1.0
    tokens_dropped: int = 0
    tokens_rerouted: int = 0
    num_rebalances: int = 0
    rebalance_seconds_total: float = 0.0
    expert_copies_moved: int = 0
    num_rebalance_stays: int = 0
    rebalance_stay_seconds_total: float = 0.0
    # [L_moe, R] float64 tokens each EP rank took per MoE layer since the start (EplbDriver.run_totals)
    expert_rank_tokens: Any = None
    expert_distribution_steps_buffered: int = 0
    expert_distribution_steps_dropped: int = 0
    num_steps: int = 0
    step_seconds_total: float = 0.0
    engine_state: int = 0  # index in launch.recovery.ENGINE_STATES: 0 serving, 1 recovering, 2 dead
    num_worker_faults: int = 0
    num_recoveries: int = 0
    recovery_seconds_total: float = 0.0
    num_requests_retried: int = 0
    num_requests_failed: int = 0
    num_missing_ranks: int = 0  # ranks a degraded group serves without
    # tokens per executed step: one count per launch.core.outputs.ITERATION_TOKEN_BUCKETS bound, then +Inf
    iteration_tokens_counts: list[int] | None = None
    iteration_tokens_sum: int = 0
    kv_cache: KVCacheInfo | None = None


def kv_cache_info(engine: LLMEngine) -> KVCacheInfo:
    """``engine``'s KV pool: the blocks it sized per DP rank and the engine config's cache fields."""
    e = engine.config.engine
    return KVCacheInfo(num_blocks=engine.num_kv_blocks, block_size=e.block_size, cache_dtype=e.kv_cache_dtype,
                       memory_utilization=e.memory_utilization, enable_prefix_caching=e.enable_prefix_caching,
                       num_blocks_override=e.num_kv_blocks)


def snapshot_stats(engine: LLMEngine) -> EngineStats:
    s = engine.scheduler.stats()
    c = engine.counters
    out = EngineStats(
        num_running=s.num_running, num_waiting=s.num_waiting, num_preemptions=s.num_preemptions,
        kv_cache_usage=sum(s.kv_cache_usage) / max(1, len(s.kv_cache_usage)),
        prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
        prompt_tokens_total=c.prompt_tokens_total, generation_tokens_total=c.generation_tokens_total,
        tokens_dropped=c.tokens_dropped, tokens_rerouted=c.tokens_rerouted, num_steps=c.num_steps,
        step_seconds_total=c.step_seconds_total,
        iteration_tokens_counts=list(c.iteration_tokens_counts), iteration_tokens_sum=c.iteration_tokens_sum,
        kv_cache=kv_cache_info(engine),
    )
    sup = engine.supervisor
    k = sup.counters
    out.engine_state = ENGINE_STATES.index(sup.state)
    out.num_worker_faults, out.num_recoveries = k.num_worker_faults, k.num_recoveries
    out.recovery_seconds_total = k.recovery_seconds_total
    out.num_requests_retried, out.num_requests_failed = k.num_requests_retried, k.num_requests_failed
    out.num_missing_ranks = engine.recovery.num_missing_ranks
    if engine.eplb is not None:
        # taken after every step: the window as applied (the engine's steps are applied in batches)
        out.balancedness_per_layer, out.balancedness = engine.eplb.balancedness(applied=True)
        k = engine.eplb.counters
        out.num_rebalances, out.rebalance_seconds_total = k.num_rebalances, k.rebalance_seconds_total
        out.expert_copies_moved = k.expert_copies_moved
        out.num_rebalance_stays, out.rebalance_stay_seconds_total = k.num_stays, k.stay_seconds_total
        out.expert_rank_tokens = engine.eplb.run_totals(applied=True)[0]
        out.expert_distribution_steps_buffered = engine.eplb.recorder.num_steps
        out.expert_distribution_steps_dropped = engine.eplb.recorder.num_steps_dropped
    return out


class AsyncLLM:
    """Async front of ``LLMEngine`` for the OpenAI server (see docs/contracts.md)."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.runtime_config = config
        self.engine = LLMEngine(config)
        self.model_config = self.engine.model_config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.max_logprobs = self.engine.max_logprobs  # engine.max_logprobs (vLLM's --max-logprobs)
        self.default_sampling = self.engine.default_sampling  # the generation config's (launch.generation_config)
        self.model_name = config.served_model_name
        self.model_path = config.model
        self.max_queue_len = config.server.max_queue_len
        self._inbox: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future | None]] = \
            queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = snapshot_stats(self.engine)
        self._error: BaseException | None = None
        self._last_check = time.monotonic()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> AsyncLLM:
        return cls(config)

    # ---- engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._running:
                busy = self.engine.has_unfinished_requests() or self.engine.needs_recovery
                self._drain(block=not busy)
                if not self._running:
                    break
                if self.engine.has_unfinished_requests() or self.engine.needs_recovery:
                    outputs = self.engine.step()  # rebuilds the workers first after a fault
                    self._stats = snapshot_stats(self.engine)
                    for out in outputs:
                        self._deliver(out.request_id, self._as_error(out) or out)
        except BaseException as e:  # noqa: BLE001 - hand the failure to every waiting request
            if isinstance(e, EngineDeadError):
                error = e  # the supervisor logged the reason once
            else:
                log.exception("engine loop stopped")
                error = EngineDeadError(f"engine failed: {type(e).__name__}: {e}")
            self._error = error
            for request_id in list(self._streams):
                self._deliver(request_id, error)
        finally:
            self._stats = snapshot_stats(self.engine)

    def _as_error(self, out: RequestOutput) -> EngineRecoveringError | EngineDeadError | None:
        """A request the engine failed after a worker fault: the error its client gets (the engine
        recovering, 503 with a retry; or stopped for good, when the fault policy gave up)."""
        if out.finished and any(c.finish_reason == "error" for c in out.outputs):
            supervisor = self.engine.supervisor
            reason = (supervisor.reason or "a worker failed").removesuffix("; engine recovering")
            if supervisor.state == DEAD:
                error: EngineRecoveringError | EngineDeadError = EngineDeadError(f"{reason}; this request was cut short")
            else:
                error = EngineRecoveringError(f"{reason}; this request had already produced output, so it was not "
                                              "retried: send it again")
            error.finish_reason = "error"  # the request ran and ended so (the server counts it), not refused
            return error
        return None

    def _check_workers(self) -> None:
        """While idle, ping the ranks every ``recovery.health_check_interval_s`` so that a rank
        that died between requests is rebuilt before the next request needs it."""
        now = time.monotonic()
        if now - self._last_check < self.runtime_config.recovery.health_check_interval_s:
            return
        self._last_check = now
        check = getattr(self.engine.executor, "check_alive", None)
        if check is None or self.engine.needs_recovery:
            return
        try:
            check()
        except WorkerFault as exc:
            self.engine.on_worker_fault(exc)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block:
                self._check_workers()
                for out in self.engine.recovery.maybe_restore():  # idle: take a replacement in now
                    self._deliver(out.request_id, self._as_error(out) or out)
                self._stats = snapshot_stats(self.engine)
            return
        while True:
            fn, fut = item
            # A caller that gave up (cancelled future) no longer wants its command run.
            if fut is None or fut.set_running_or_notify_cancel():
                try:
                    result = fn()
                    if fut is not None:
                        fut.set_result(result)
                except BaseException as e:  # noqa: BLE001 - returned to the caller
                    if fut is not None:
                        fut.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                self._stats = snapshot_stats(self.engine)
                return

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if self._error is not None:
            raise self._error
        if not self._running:
            raise EngineDeadError("engine is shut down")
        self.engine.supervisor.check_serving()  # 503 while recovering
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((fn, fut))
        return fut

    def call(self, fn: Callable[[LLMEngine], Any], timeout: float | None = 600.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (blocking)."""
        return self._submit(lambda: fn(self.engine)).result(timeout)

    # ---- requests ----------------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs until finished, as ``params.output_kind`` says (vLLM's): CUMULATIVE each
        step's whole output so far; DELTA only what each step added (each completion's new token
        ids, text, logprobs and ranks; ``cumulative_logprob`` and the finish fields as they stand;
        the prompt logprobs in the first output only); FINAL_ONLY the finished output alone.
        Closing the iterator early aborts the request."""
        kind = params.output_kind
        sent: dict[int, tuple[int, int]] = {}  # DELTA: completion index -> (token ids, characters) yielded
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = (loop, q)
        finished = False
        try:
            await asyncio.wrap_future(self._submit(lambda: self._add(request_id, prompt_token_ids, params)))
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if kind == RequestOutputKind.FINAL_ONLY and not finished:
                    continue
                yield delta_output(item, sent) if kind == RequestOutputKind.DELTA else item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._running:
                self._inbox.put((lambda: self.engine.abort_request(request_id), None))

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        waiting = self.engine.scheduler.num_waiting
        if waiting >= self.max_queue_len:
            raise EngineQueueFull(f"{waiting} requests are waiting (max_queue_len={self.max_queue_len})")
        self.engine.add_request(request_id, list(prompt_token_ids), params)

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(lambda: self.engine.abort_request(request_id)))

    def fail_requests(self, reason: str) -> int:
        """End every request a caller still awaits with ``EngineDeadError(reason)`` (the server's 503;
        the engine aborts each as its stream closes), e.g. those still running when the server stops.
        Thread-safe; returns how many."""
        streams = list(self._streams)
        for request_id in streams:
            self._deliver(request_id, EngineDeadError(reason))
        return len(streams)

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def errored(self) -> bool:
        """True once the engine loop has stopped on an error (``/health`` answers 503)."""
        return self._error is not None or not self._thread.is_alive()

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine can no longer serve, EngineRecoveringError
        while it rebuilds its workers (``/health`` answers 503 with the reason either way)."""
        if self._error is not None:
            raise self._error
        if not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        self.engine.supervisor.check_serving()

    # ---- expert distribution (SGLang's endpoints) ---------------------------------------

    def _eplb(self):
        if self.engine.eplb is None:
            raise ValueError("this model has no MoE layers: nothing to record")
        return self.engine.eplb

    def start_expert_distribution_record(self) -> None:
        self.call(lambda e: self._eplb().start_record())

    def stop_expert_distribution_record(self) -> None:
        self.call(lambda e: self._eplb().stop_record())

    def dump_expert_distribution_record(self, directory: str | Path | None = None) -> Path:
        directory = directory or self.runtime_config.server.expert_distribution_dir
        if directory is None:
            raise ValueError("no directory for the dump: set server.expert_distribution_dir")
        from launch.profile.dumps import model_metadata

        # n_group and the MoE layer ids let `profile report` draw the dump as `profile run` would.
        return self.call(lambda e: self._eplb().dump_record(directory, metadata=model_metadata(e.model_config)))

    # ---- lifecycle ---------------------------------------------------------------------

    async def shutdown(self) -> None:
        self.shutdown_sync()

    def shutdown_sync(self, timeout: float = 60.0) -> None:
        if not self._running:
            return
        self._running = False
        self._inbox.put((lambda: None, None))
        deadline = time.monotonic() + timeout
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self.engine.shutdown()


def delta_output(out: RequestOutput, sent: dict[int, tuple[int, int]]) -> RequestOutput:
    """What ``out`` (a cumulative output) adds to what ``sent`` says was yielded before (completion
    index -> (token ids, characters) of it; updated here): a new RequestOutput whose completions hold
    only their new token ids, text, logprobs and ranks; the prompt logprobs only on the first call
    (``sent`` empty)."""
    first = not sent
    outputs = []
    for c in out.outputs:
        tokens, chars = sent.get(c.index, (0, 0))
        outputs.append(dataclasses.replace(
            c, token_ids=list(c.token_ids[tokens:]), text=c.text[chars:],
            logprobs=None if c.logprobs is None else list(c.logprobs[tokens:]),
            logprob_ranks=None if c.logprob_ranks is None else list(c.logprob_ranks[tokens:])))
        sent[c.index] = (len(c.token_ids), len(c.text))
    return dataclasses.replace(out, outputs=outputs, prompt_logprobs=out.prompt_logprobs if first else None,
                               prompt_logprob_ranks=out.prompt_logprob_ranks if first else None)
