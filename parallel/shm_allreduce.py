"""Sum all-reduce and reduce-scatter, all-gather(-v) and all-to-all-v of small CPU tensors through
shared memory, for the ranks of a group on one host.

gloo over loopback takes 340-590 us of wall time for an all-reduce of a decode step's few rows
(2 ranks, 4-16 KiB, Intel Xeon with AMX; ``docs/parallel.md``), nearly all of it the TCP round
trips of its rounds. A tensor-parallel decode step makes one such all-reduce per layer. Ranks on
one host can instead write their tensors into a shared segment and each sum all of them.

Protocol (``ShmAllReduce.all_reduce``): the n-th call of every rank writes its tensor into its slot
of buffer n % 2, then publishes n in its flag; each rank waits until every flag reads at least n,
sums the slots in rank order and returns. A rank reaching call n + 2 (the same buffer again) has
seen every flag at n + 1, which each rank sets only after it finished reading call n, so two
buffers are enough. Every rank sums the same slots in the same order: the results are the same
bits on every rank (for two ranks also gloo's: a + b is commutative). Stores are published in
program order, which x86's memory model guarantees; other machines keep gloo.

The segment is a file in /dev/shm that rank 0 creates and unlinks once every rank has mapped it,
so nothing is left behind if a rank dies. A waiting rank checks its peers' processes every 50 ms
and raises ``torch.distributed.DistError`` when one has exited (gloo raises on the closed socket),
or when ``timeout_s`` (the group's collective timeout) passed.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import time
import uuid

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
DEFAULT_CAPACITY_BYTES = 1 << 20  # per rank and buffer: larger tensors (prefill) stay on gloo
FLAG_STRIDE = 8  # int64s per rank's flag: one 64-byte line each
PEER_CHECK_S = 0.05
TOKEN_BYTES = 64  # the segment's first line: rank 0's random token, which every rank checks
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shm_allreduce_wanted() -> bool:
    """Whether groups on one host use shared memory for small all-reduces: on x86-64 Linux with
    /dev/shm, unless MOE_SHM_ALLREDUCE=0."""
    if os.environ.get("MOE_SHM_ALLREDUCE", "1") == "0":
        return False
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


class ShmAllReduce:
    """Collectives of CPU tensors of at most ``capacity_bytes`` a rank over ``group``'s ranks, which
    share this host: an in-place sum all-reduce, a reduce-scatter, an all-gather, and an all-gather
    and an all-to-all-v of varying numbers of rows, on one call sequence. Build it with ``for_group``
    (collective), which returns None where it does not apply."""

    def __init__(self, group: dist.ProcessGroup, segment: torch.Tensor, peers: list[int],
                 capacity_bytes: int = DEFAULT_CAPACITY_BYTES, timeout_s: float = 600.0) -> None:
        """Over ``segment`` (the mapped [header + 2 * R * slot] uint8 file; slot: capacity_bytes in
        whole lines) and the peers' pids; ``for_group`` builds both."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.capacity = capacity_bytes
        self.timeout_s = timeout_s
        self.calls = 0
        self.peers = peers
        flags_bytes, meta_bytes = _header_bytes(self.world)
        self.segment = segment
        at = TOKEN_BYTES
        self.flags = segment[at:at + flags_bytes].view(torch.int64).view(self.world, FLAG_STRIDE)[:, 0]  # [R]
        at += flags_bytes
        # per buffer, per rank: [fits, counts to each rank (R)], a line-padded row of int64
        self.meta = segment[at:at + meta_bytes].view(torch.int64).view(2, self.world, -1)
        # each slot starts on a line (any dtype's view lines up); its first capacity_bytes are used
        self.data = segment[at + meta_bytes:].view(2, self.world, _slot_bytes(capacity_bytes))

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                  timeout_s: float = 600.0) -> ShmAllReduce | None:
        """A ``ShmAllReduce`` over ``group`` when its ranks share this host and run gloo on a machine
        where the protocol holds (``shm_allreduce_wanted``), and the segment could be made and mapped
        on every rank; None otherwise (a warning says why when /dev/shm refused). Collective over
        group: every rank gets the same answer."""
        world = dist.get_world_size(group)
        if world < 2 or dist.get_backend(group) != "gloo":
            return None
        rank = dist.get_rank(group)
        hosts: list = [None] * world
        dist.all_gather_object(hosts, (socket.gethostname(), shm_allreduce_wanted(), os.getpid()), group=group)
        if len({h for h, _, _ in hosts}) != 1 or not all(w for _, w, _ in hosts):
            return None
        size = TOKEN_BYTES + sum(_header_bytes(world)) + 2 * world * _slot_bytes(capacity_bytes)
        made: list = [None]
        if rank == 0:
            token = uuid.uuid4().hex
            path = os.path.join(SHM_DIR, f"moe-allreduce-{token}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, size)  # the pages now: a full /dev/shm is an error here, not SIGBUS
                    os.pwrite(fd, token.encode(), 0)
                finally:
                    os.close(fd)
                made = [(path, token, None)]
            except OSError as e:
                made = [(path, token, str(e))]
        dist.broadcast_object_list(made, src=dist.get_global_rank(group, 0), group=group)
        path, token, problem = made[0]
        segment = None
        if problem is None:
            try:  # the file rank 0 made, not one of the same name elsewhere (a container's own /dev/shm)
                if not os.path.isfile(path) or os.path.getsize(path) != size:
                    raise OSError(f"{path} is not the {size}-byte segment rank 0 made (another /dev/shm?)")
                segment = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                if bytes(segment[:len(token)].tolist()) != token.encode():
                    raise OSError(f"{path} does not hold rank 0's token (another /dev/shm?)")
            except (OSError, RuntimeError) as e:
                problem = str(e)
        problems: list = [None] * world
        dist.all_gather_object(problems, problem, group=group)  # every rank has it mapped, or none uses it
        if rank == 0 and os.path.exists(path):
            os.unlink(path)
        if any(problems):
            if rank == 0:
                log.warning("shared-memory all-reduce not used: %s", next(p for p in problems if p))
            return None
        peers = [pid for r, (_, _, pid) in enumerate(hosts) if r != rank]
        return cls(group, segment, peers, capacity_bytes, timeout_s)

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``all_gather`` takes t: a contiguous CPU tensor (any dtype) within capacity."""
        return (t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
                and t.numel() * t.element_size() <= self.capacity)

    def applies(self, t: torch.Tensor) -> bool:
        """Whether ``all_reduce`` and ``reduce_scatter`` take t: ``fits(t)`` and a float dtype."""
        return t.dtype in DTYPES and self.fits(t)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group's ranks, in place (every rank calls it, with tensors of one shape
        and dtype; ``applies(t)`` must hold). Returns t. Sums in rank order, fp16/bf16 in fp32 and
        rounded once, so every rank gets the same bits."""
        t.copy_(_rank_order_sum(self._exchange(t)))
        return t

    def reduce_scatter(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the sum of every rank's ``t`` [N, ...] (one shape and dtype on every
        rank, ``applies(t)``; each rank names its own rows): a new [stop - start, ...] tensor of t's
        dtype, summed as ``all_reduce`` sums. The same calls and buffers as the others."""
        return _rank_order_sum(self._exchange(t)[:, start:stop]).to(t.dtype)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (one shape and dtype on every rank; ``fits(t)`` must hold), stacked
        in rank order: [R, *t.shape], a new tensor. The same calls and buffers as ``all_reduce``."""
        return self._exchange(t).clone()

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Write ``t`` into this rank's slot of the next call's buffer, publish the call and wait for
        every rank's: the slots [R, *t.shape] in t's dtype, valid until this rank's next-but-one call."""
        self.calls += 1
        n = self.calls
        nbytes = t.numel() * t.element_size()
        slots = self.data[n % 2, :, :nbytes]  # [R, nbytes]
        slots[self.rank].view(t.dtype).view(t.shape).copy_(t)
        self.flags[self.rank] = n  # published after the data (x86 keeps stores in order)
        self._wait(n)
        return slots.view(t.dtype).view(self.world, *t.shape)

    def all_to_all_v(self, send: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor | None, list[int]]:
        """An all-to-all-v of rows: send [N, W] (contiguous CPU; its rows for rank 0 first, then rank
        1's ...), send_counts: R ints summing to N. Returns (the rows every rank sent here, source-major:
        [sum of recv_counts, W] of send's dtype, a new tensor; recv_counts: R ints, what each rank sent
        here). Where any rank's rows exceed the capacity, no rows move and the first is None: every rank
        gets None together and the recv_counts, so it can make the exchange itself (gloo) without the
        count exchange. Collective over the group, in the same call sequence as the others."""
        b, table = self._publish_rows(send, send_counts)  # table: [R][fits, counts to each rank...]
        recv_counts = [row[1 + self.rank] for row in table]
        if not all(row[0] for row in table):
            return None, recv_counts
        row_bytes = _row_bytes(send)
        return self._read_rows(b, [(src, sum(row[1:1 + self.rank]) * row_bytes, n * row_bytes)
                                   for src, (row, n) in enumerate(zip(table, recv_counts))], send), recv_counts

    def all_gather_v(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
        """An all-gather of a varying number of rows: rows [N_r, W] (contiguous CPU, one W and dtype on
        every rank). Returns (every rank's rows in rank order, [sum of N, W] of rows' dtype, a new
        tensor; each rank's N). Where any rank's rows exceed the capacity, none move and the first is
        None on every rank, with the counts. Collective over the group, in the same call sequence."""
        b, table = self._publish_rows(rows, [rows.shape[0]])  # table: [R][fits, N]
        sizes = [row[1] for row in table]
        if not all(row[0] for row in table):
            return None, sizes
        row_bytes = _row_bytes(rows)
        return self._read_rows(b, [(src, 0, n * row_bytes) for src, n in enumerate(sizes)], rows), sizes

    def _publish_rows(self, send: torch.Tensor, meta: list[int]) -> tuple[int, list[list[int]]]:
        """Write ``send``'s bytes (where they fit) and [fits, *meta] into this rank's slot of the next
        call's buffer, publish the call and wait for every rank's. Returns (the buffer, every rank's
        [fits, *meta])."""
        self.calls += 1
        n, b = self.calls, self.calls % 2
        nbytes = send.numel() * send.element_size()
        fits = self.fits(send)
        mine = self.meta[b, self.rank]
        mine[1:1 + len(meta)] = torch.tensor(meta, dtype=torch.int64)
        mine[0] = int(fits)
        if fits and nbytes:
            self.data[b, self.rank, :nbytes].copy_(send.reshape(-1).view(torch.uint8))
        self.flags[self.rank] = n
        self._wait(n)
        return b, self.meta[b, :, : 1 + len(meta)].tolist()

    def _read_rows(self, b: int, spans: list[tuple[int, int, int]], like: torch.Tensor) -> torch.Tensor:
        """The (source rank, byte offset, bytes) spans of buffer ``b``, concatenated: a new [M, W]
        tensor of ``like``'s dtype and width."""
        width = like.shape[1] if like.dim() == 2 else 1
        total = sum(size for _, _, size in spans)
        out = torch.empty((total // max(1, _row_bytes(like)), width), dtype=like.dtype)
        flat = out.view(-1).view(torch.uint8)
        at = 0
        for src, first, size in spans:
            if size:
                flat[at:at + size].copy_(self.data[b, src, first:first + size])
            at += size
        return out

    def _wait(self, n: int) -> None:
        flags = self.flags
        if int(flags.min()) >= n:
            return
        start = last_check = time.monotonic()
        while int(flags.min()) < n:
            os.sched_yield()
            now = time.monotonic()
            if now - last_check >= PEER_CHECK_S:
                last_check = now
                for pid in self.peers:
                    if not _alive(pid):
                        raise dist.DistError(f"shared-memory collective: peer process {pid} exited "
                                             f"(call {n} of rank {self.rank} of {self.world}): Connection lost")
                if now - start > self.timeout_s:
                    raise dist.DistError(f"shared-memory collective timed out: call {n} waited "
                                         f"{self.timeout_s:g} s for its peers")


def _rank_order_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts [R, ...]: their fp32 sum, added in rank order (a new tensor)."""
    total = parts[0].to(torch.float32, copy=True)  # a copy: parts are the shared slots
    for r in range(1, parts.shape[0]):
        total += parts[r]  # widened exactly, added in fp32
    return total


def _slot_bytes(capacity_bytes: int) -> int:
    """A rank's slot in each buffer: ``capacity_bytes`` rounded up to whole 64-byte lines."""
    return (capacity_bytes + 63) // 64 * 64


def _row_bytes(rows: torch.Tensor) -> int:
    """Bytes of one row of [N, W] (or of one element of [N])."""
    return (rows.shape[1] if rows.dim() == 2 else 1) * rows.element_size()


def _header_bytes(world: int) -> tuple[int, int]:
    """(flags, per-buffer meta) bytes of a segment for ``world`` ranks: one 64-byte line per rank's
    flag; per buffer and rank [fits, R counts] padded to whole lines."""
    meta_stride = (1 + world + FLAG_STRIDE - 1) // FLAG_STRIDE * FLAG_STRIDE
    return world * FLAG_STRIDE * 8, 2 * world * meta_stride * 8


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: not gone and not a zombie waiting for its parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in (b"Z", b"X")
