"""Host tensors on anonymous memory that asks for transparent huge pages.

A decode step streams every weight it uses from DRAM once, in runs of one expert (~1.5 MB on the
small DeepSeek-style checkpoint) or one projection. On 4 KB pages each run crosses hundreds of
page boundaries, and every one costs a TLB miss whose page walk itself misses the caches (the
weights of a step are far larger than the TLBs reach). Backed by 2 MB pages, the same kernels read
the routed experts 6-11% faster (one thread, Zen 5, ``docs/benchmarks.md``).

Linux's THP setting is usually "madvise": only memory that asks gets huge pages. torch's allocator
does not ask, so the packed weights (``moe.kernels._blocks``) and the KV pools
(``moe.kv_cache.zeroed_pool``) come from ``anonymous_tensor``: a private anonymous mapping with
``MADV_HUGEPAGE``, its first byte on a 2 MB boundary. Elsewhere (not Linux, THP compiled out) the
mapping is plain 4 KB pages and everything still works.

The price is paid once, at load: a 2 MB page fault zeroes (and, with THP defrag "madvise", may
first compact) a whole huge page. Packing the small checkpoint's ~1 GB of weights took ~1.3 s more
CPU there. ``MOE_HUGE_PAGES=0`` packs weights with torch's allocator instead (KV pools stay lazy).
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
from collections.abc import Sequence

import torch

HUGE_PAGE_BYTES = 2 << 20
HUGE_PAGES_ENV = "MOE_HUGE_PAGES"
# Tensors under HUGE_PAGE_BYTES share chunks this large (see packed_tensor), each piece aligned to a
# cache line.
ARENA_CHUNK_BYTES = 16 << 20
ARENA_ALIGN = 64


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def huge_pages_wanted() -> bool:
    """Whether packed weights go to huge-page memory: Linux, and ``$MOE_HUGE_PAGES`` not "0"."""
    return sys.platform.startswith("linux") and os.environ.get(HUGE_PAGES_ENV, "1") != "0"


def anonymous_tensor(shape: Sequence[int], dtype: torch.dtype, *, align: int = HUGE_PAGE_BYTES) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape`` on its own anonymous mapping (pages faulted in on first
    touch, transparent huge pages asked for), starting ``align`` bytes aligned (a power of two).
    Linux only: elsewhere ``torch.zeros``. The tensor keeps the mapping alive; it is unmapped with
    the last view of the tensor. MemoryError (naming the size) where the system refuses the mapping."""
    nbytes = tensor_bytes(shape, dtype)
    if not sys.platform.startswith("linux") or nbytes == 0:
        return torch.zeros(*shape, dtype=dtype)
    if align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    slack = align if align > mmap.PAGESIZE else 0  # mmap returns page-aligned addresses
    try:
        buffer = mmap.mmap(-1, nbytes + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # ENOMEM: more than the system lets this process map
        raise MemoryError(f"cannot map {nbytes / 2**30:.2f} GiB for a {list(shape)} {dtype} tensor: "
                          f"{e.strerror or e}") from None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out: 4 KB pages
            pass
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -raw.data_ptr() % align if slack else 0
    return raw[start : start + nbytes].view(dtype).view(*shape)


class _Arena:
    """Bump allocation of small tensors from huge-page chunks; a piece is a view of its chunk, so a
    chunk is unmapped once the arena has moved on and its last piece is gone."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def take(self, shape: Sequence[int], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        with self._lock:
            start = -(-self._used // ARENA_ALIGN) * ARENA_ALIGN
            if self._chunk is None or start + nbytes > self.chunk_bytes:
                self._chunk, start = anonymous_tensor((self.chunk_bytes,), torch.uint8), 0
            self._used = start + nbytes
            return self._chunk[start : start + nbytes].view(dtype).view(*shape)


_ARENA = _Arena(ARENA_CHUNK_BYTES)


def packed_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor for weights the kernels stream: from ``HUGE_PAGE_BYTES`` up on its
    own huge-page mapping (``anonymous_tensor``), smaller ones side by side in shared huge-page
    chunks (a small projection alone could never fill a 2 MB page). Linux only: elsewhere
    ``torch.zeros``.

    Meant for weights packed once at load: a chunk stays mapped while any of its pieces lives."""
    nbytes = tensor_bytes(shape, dtype)
    if not huge_pages_wanted() or nbytes == 0:
        return torch.zeros(*shape, dtype=dtype)
    if nbytes >= HUGE_PAGE_BYTES:
        return anonymous_tensor(shape, dtype)
    return _ARENA.take(shape, dtype, nbytes)


def is_anonymous(t: torch.Tensor) -> bool:
    """Whether ``t`` (CPU) lives on a mapping ``anonymous_tensor`` made (its storage is not torch's
    allocator's). For tests and reports."""
    return t.device.type == "cpu" and t.untyped_storage().nbytes() > 0 and not t.untyped_storage().resizable()


def huge_page_bytes(pid: str | int = "self") -> int | None:
    """AnonHugePages of a process in bytes (Linux ``/proc/<pid>/smaps_rollup``); None where unreadable."""
    return proc_bytes(f"/proc/{pid}/smaps_rollup", "AnonHugePages")


def proc_bytes(path: str, field: str) -> int | None:
    """A "<field>: <n> kB" line of a /proc file (meminfo, status, smaps_rollup) in bytes; None where
    the file or the field is missing or unreadable."""
    prefix = f"{field}:"
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
