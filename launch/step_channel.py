"""The fast step transport: one TCP connection from the driver to each worker, kept open.

A Ray actor call costs the driver ~0.5 ms of CPU per rank per step (task submission, the
object store, one ``ray.get`` per reply); a step here is one ``sendall`` of a compact message
(``launch.core.wire``) per rank and one framed reply per rank, read with ``selectors``.

Worker side: ``StepServer(handler)`` listens on this node's address, accepts the one driver
connection that presents its token, then answers frames on a daemon thread:
``handler(payload) -> reply`` per step frame; an exception in the handler goes back as an
error frame (the exception's class name and text, as JSON) and the loop keeps serving.
Driver side: ``StepClient(addresses)`` connects to every rank (address = (host, port, token)
as ``StepServer.address`` gives) and ``roundtrip(payloads)`` sends each rank its payload and
returns each rank's reply bytes, raising ``ChannelClosed`` (a rank's process went away:
EOF or reset), ``ChannelTimeout`` (no reply by the deadline) or ``RemoteError`` (the
handler raised; ``.cause`` is a ``WorkerException`` carrying the worker exception's class name
and text: nothing is unpickled from the network).

Frames: 8-byte little-endian length, 1-byte kind, payload. Kinds: ``S`` step, ``X`` close
(driver -> worker); ``R`` reply, ``E`` error (worker -> driver).

Payloads are opaque here: ``launch.core.wire`` encodes the batches, ``StepResult.to_bytes``
the replies. No Ray, no torch: the channel works (and is tested) without either.
"""

from __future__ import annotations

import json
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<QB")
STEP, CLOSE, REPLY, ERROR = b"S"[0], b"X"[0], b"R"[0], b"E"[0]
TOKEN_BYTES = 16
MAX_FRAME = 1 << 34  # 16 GiB: a guard against a corrupt length, far above any step


class ChannelError(RuntimeError):
    """The step channel to ``rank`` failed."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class ChannelClosed(ChannelError):
    """The worker's end went away (its process exited, or it closed the connection)."""


class ChannelTimeout(ChannelError):
    """No reply from ``ranks`` by the deadline (``rank`` is the first of them)."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message, ranks[0])
        self.ranks = list(ranks)


class WorkerException(Exception):
    """An exception raised by a worker's step handler as the driver sees it: ``type_name`` is
    its class name (``"CollectiveError"``), ``str()`` its text."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(message)
        self.type_name = type_name


class RemoteError(ChannelError):
    """The worker's handler raised; ``cause`` is a ``WorkerException`` with its class name and text."""

    def __init__(self, rank: int, cause: WorkerException) -> None:
        super().__init__(f"rank {rank}: {cause.type_name}: {cause}", rank)
        self.cause = cause


def _send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    head = _FRAME.pack(len(payload), kind)
    if len(payload) < 65536:  # one segment for a step's few hundred bytes
        sock.sendall(head + payload)
    else:
        sock.sendall(head)
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """n bytes, or None on EOF before any of them arrived (a partial frame raises)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                return None
            raise ConnectionResetError(f"connection closed inside a frame ({got} of {n} bytes)")
        got += k
    return buf


def _recv_frame(sock: socket.socket) -> tuple[int, bytearray] | None:
    head = _recv_exact(sock, _FRAME.size)
    if head is None:
        return None
    size, kind = _FRAME.unpack(head)
    if size > MAX_FRAME:
        raise ConnectionResetError(f"frame of {size} bytes: not a step channel peer")
    body = _recv_exact(sock, size) if size else bytearray()
    if body is None:
        raise ConnectionResetError("connection closed between a frame's header and its payload")
    return kind, body


# ---------------------------------------------------------------- worker side


class StepServer:
    """Serves one driver connection on a daemon thread (see the module docstring)."""

    def __init__(self, handler: Callable[[bytearray], bytes], host: str = "127.0.0.1",
                 accept_timeout_s: float = 120.0) -> None:
        self.handler = handler
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(accept_timeout_s)
        self.address = (host, self._listener.getsockname()[1], self.token)
        self._conn: socket.socket | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="step-server", daemon=True)
        self._thread.start()

    def _accept(self) -> socket.socket | None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                return None
            conn.settimeout(10.0)
            try:
                token = _recv_exact(conn, TOKEN_BYTES)
            except OSError:
                token = None
            if token is not None and secrets.compare_digest(bytes(token), self.token):
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn
            conn.close()  # not our driver
        return None

    def _serve(self) -> None:
        conn = self._accept()
        self._listener.close()
        if conn is None:
            return
        self._conn = conn  # set, then check: close() sets the flag, then reads _conn
        if self._closed:  # closed while the driver's connection was being accepted
            conn.close()
            return
        try:
            while True:
                frame = _recv_frame(conn)
                if frame is None or frame[0] == CLOSE:
                    break
                try:
                    reply = self.handler(frame[1])
                except BaseException as e:  # noqa: BLE001 - every failure goes back to the driver
                    _send_frame(conn, ERROR, _encode_error(e))
                    continue
                _send_frame(conn, REPLY, reply)
        except OSError:
            log.debug("step channel closed", exc_info=True)
        finally:
            conn.close()

    @property
    def serving(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop serving (the driver sees the connection close)."""
        self._closed = True
        for sock in (self._conn, self._listener):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


def _encode_error(e: BaseException) -> bytes:
    """A handler's exception as JSON: its class name and text (never a pickle)."""
    return json.dumps({"type": type(e).__name__, "message": str(e)}).encode()


# ---------------------------------------------------------------- driver side


class StepClient:
    """The driver's connections to every rank (``addresses[r] = (host, port, token)``)."""

    def __init__(self, addresses: Sequence[tuple[str, int, bytes]], connect_timeout_s: float = 10.0) -> None:
        self.socks: list[socket.socket] = []
        try:
            for host, port, token in addresses:
                sock = socket.create_connection((host, port), timeout=connect_timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(token)
                sock.settimeout(None)
                self.socks.append(sock)
        except BaseException:
            self.close()
            raise
        self._selector = selectors.DefaultSelector()
        for rank, sock in enumerate(self.socks):
            self._selector.register(sock, selectors.EVENT_READ, rank)

    @property
    def num_ranks(self) -> int:
        return len(self.socks)

    def roundtrip(self, payloads: Sequence[bytes], timeout_s: float) -> list[bytearray]:
        """Send ``payloads[r]`` to rank r as a step frame, then wait for every reply.
        Raises ChannelClosed / ChannelTimeout / RemoteError naming the first failed rank;
        after any of them the channel is unusable (close it)."""
        if len(payloads) != len(self.socks):
            raise ValueError(f"{len(payloads)} payloads for {len(self.socks)} ranks")
        for rank, (sock, payload) in enumerate(zip(self.socks, payloads)):
            try:
                _send_frame(sock, STEP, payload)
            except OSError as e:
                raise ChannelClosed(f"rank {rank}: step channel closed while sending ({e})", rank) from e
        replies: list[bytearray | None] = [None] * len(self.socks)
        pending = len(self.socks)
        deadline = time.monotonic() + timeout_s
        while pending:
            events = self._selector.select(max(0.0, deadline - time.monotonic()))
            if not events:
                slow = [r for r, reply in enumerate(replies) if reply is None]
                raise ChannelTimeout(f"ranks {slow} did not answer the step within {timeout_s:.0f}s", slow)
            for key, _ in events:
                rank = key.data
                if replies[rank] is not None:  # already answered; a second frame is a protocol error
                    raise ChannelClosed(f"rank {rank}: unexpected frame on the step channel", rank)
                try:
                    frame = _recv_frame(key.fileobj)
                except OSError as e:
                    raise ChannelClosed(f"rank {rank}: step channel reset ({e})", rank) from e
                if frame is None:
                    raise ChannelClosed(f"rank {rank}: step channel closed by the worker", rank)
                kind, body = frame
                if kind == ERROR:
                    raise RemoteError(rank, _decode_error(body))
                replies[rank] = body
                pending -= 1
        return replies  # type: ignore[return-value]

    def close(self) -> None:
        """Tell every rank to stop serving, then close (idempotent, never raises)."""
        selector = getattr(self, "_selector", None)
        if selector is not None:
            selector.close()
            self._selector = None
        for sock in self.socks:
            try:
                sock.settimeout(0.5)
                _send_frame(sock, CLOSE)
            except OSError:
                pass
            sock.close()
        self.socks = []


def _decode_error(body: bytearray) -> WorkerException:
    try:
        data = json.loads(bytes(body))
        return WorkerException(str(data["type"]), str(data["message"]))
    except (ValueError, KeyError, TypeError):
        return WorkerException("RuntimeError", bytes(body[:200]).decode("utf-8", "replace"))
