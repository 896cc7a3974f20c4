"""Running one API request's sub-requests on the engine and merging their streams.

An API request with P prompts and ``n`` choices becomes P * n engine requests
(choice ``index = p * n + j``). ``merge_streams`` runs them concurrently and yields
``(index, RequestOutput)`` as outputs arrive. Closing the merged stream (the client
went away, or a sibling failed) cancels every sub-request still running; the engine
aborts a request whose generator is closed, and we also call ``engine.abort`` so
its KV blocks are freed even if the generator never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from starlette.requests import Request

from launch.core.sampling_params import TOKEN_ID_FIELDS
from launch.server.metrics import RequestTimer, ServerMetrics
from launch.server.protocol import APIError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineClient(Protocol):
    """What the server needs from ``launch.async_llm.AsyncLLM`` (see docs/contracts.md)."""

    model_name: str
    max_model_len: int
    tokenizer: Any
    model_config: Any

    def generate(self, prompt_token_ids: list[int], params: Any, request_id: str) -> AsyncIterator[Any]: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> Any: ...


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the response was complete."""


@dataclass(frozen=True)
class SubRequest:
    """One engine request: choice ``index`` of the API request, on prompt ``prompt_index``."""

    index: int
    prompt_index: int
    request_id: str
    prompt_token_ids: list[int]
    params: Any


def _is(exc: BaseException, name: str) -> bool:
    """Matched by class name: the engine's error classes live with the engine."""
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def is_queue_full(exc: BaseException) -> bool:
    """True for the engine's ``EngineQueueFull``."""
    return _is(exc, "EngineQueueFull")


# Seconds a client is asked to wait while the engine rebuilds a worker group.
RECOVERY_RETRY_AFTER_S = 5


def unavailable_error(exc: BaseException) -> APIError | None:
    """503 for an engine that is recovering (with Retry-After) or dead (``launch.recovery``);
    None for any other error. The reason is the engine's one-line summary, no Ray internals."""
    if _is(exc, "EngineRecoveringError"):
        return APIError(503, f"The engine is recovering: {exc}", type="service_unavailable",
                        headers={"Retry-After": str(RECOVERY_RETRY_AFTER_S)})
    if _is(exc, "EngineDeadError"):
        return APIError(503, f"The engine has stopped: {exc}", type="service_unavailable")
    return None


# the engine's "[request 'id': ]<field>: ..." (a token id outside the vocabulary, no token left to draw)
_TOKEN_ID_FIELD = re.compile(rf"^(?:request '[^']*': )?(?P<field>{'|'.join(TOKEN_ID_FIELDS)}): ")
_ENGINE_REQUEST_PREFIX = re.compile(r"^request '[^']*': ")


def engine_error(exc: Exception) -> APIError:
    """Map an exception raised by ``engine.generate`` to the HTTP error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if is_queue_full(exc):
        return APIError(503, f"The server is overloaded: {exc}. Retry later.", type="server_overloaded",
                        headers={"Retry-After": "1"})
    unavailable = unavailable_error(exc)
    if unavailable is not None:
        return unavailable  # the engine logged the fault once; nothing per request
    if isinstance(exc, ValueError):
        field = _TOKEN_ID_FIELD.match(str(exc))
        # the engine names its sub-request ("request 'cmpl-...-0': "), an id the client never sent
        param = field["field"] if field else getattr(exc, "param", None)  # the KV pool check names its field
        return APIError(400, _ENGINE_REQUEST_PREFIX.sub("", str(exc)), param=param)
    logger.exception("engine failed a request", exc_info=exc)
    return APIError(500, f"Internal engine error: {type(exc).__name__}: {exc}", type="internal_error")


class _Mailbox:
    """The latest undelivered output of each sub-request (outputs are cumulative, so a
    newer one supersedes an older one: a slow reader costs O(choices) memory, not O(tokens))."""

    def __init__(self, num_subs: int) -> None:
        self.latest: dict[int, Any] = {}
        self.num_open = num_subs
        self.error: APIError | None = None
        self.changed = asyncio.Event()

    def put(self, index: int, out: Any) -> None:
        self.latest[index] = out
        self.changed.set()

    def close(self, error: APIError | None = None) -> None:
        self.num_open -= 1
        self.error = self.error or error
        self.changed.set()


async def _pump(engine: EngineClient, sub: SubRequest, box: _Mailbox, timer: RequestTimer) -> None:
    """Feed one sub-request's outputs into ``box``; always closes its slot, with or without an error."""
    stream = engine.generate(sub.prompt_token_ids, sub.params, sub.request_id)
    finished = False
    error = None
    try:
        async for out in stream:
            finished = bool(out.finished)
            timer.on_output(out)
            box.put(sub.index, out)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # handed to the consumer, which raises it
        finished = True
        error = engine_error(exc)
        if getattr(exc, "finish_reason", None) == "error":  # a worker fault ended it after it ran
            timer.on_error()
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()
        if not finished:
            timer.on_abort()
            # Shielded: a second cancellation (the caller's cancel scope) must not cancel the
            # abort half-way; the engine is asked once and finishes it on its own.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(engine.abort(sub.request_id))
    box.close(error)


async def merge_streams(engine: EngineClient, subs: list[SubRequest],
                        metrics: ServerMetrics) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(index, RequestOutput)`` from all ``subs`` as they arrive; raises ``APIError``.

    Consecutive outputs of one sub-request not yet read are coalesced (the newest wins);
    each sub-request's finished output is always delivered. When the consumer stops early
    (``aclose``, cancellation, an error) every unfinished sub-request is cancelled and
    aborted before this generator returns.
    """
    box = _Mailbox(len(subs))
    tasks = [asyncio.create_task(_pump(engine, sub, box, metrics.request_timer(len(sub.prompt_token_ids))))
             for sub in subs]
    try:
        while True:
            if box.error is not None:
                raise box.error
            if box.latest:
                index = next(iter(box.latest))
                yield index, box.latest.pop(index)
            elif box.num_open == 0:
                return
            else:
                box.changed.clear()
                await box.changed.wait()
    finally:
        for task in tasks:
            task.cancel()
        # Shielded so that a repeated cancellation of the consumer cannot re-cancel the
        # pumps' cleanup (each pump closes and aborts its own engine request).
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(awaitable: Awaitable[T], request: Request) -> T:
    """Await ``awaitable`` unless the client disconnects first: then cancel it and raise."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def first_item(stream: AsyncIterator[T]) -> T:
    """The first item of ``stream``; a 500 ``APIError`` if the engine produced nothing."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise APIError(500, "The engine ended the request without any output.", type="internal_error") from None
