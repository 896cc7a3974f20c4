"""Measurements behind ``simulate calibrate``: GEMM rates by rows, attention, copy bandwidth,
per-call overhead (one process, torch on this machine), and nccl-tests tables parsed into
the ``Hardware.collectives`` format.

Timing: best-of-``repeats`` means over ``iters`` calls after a warm-up, in this process with
the torch threads the caller set (a rank of a sweep runs with its own thread count).
``clock="cpu"`` times with this process's CPU time instead of the wall clock: on an
oversubscribed machine that is the time the work itself takes (one thread per rank only:
with more threads CPU time adds up over them).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def time_call(fn: Callable[[], object], *, iters: int = 20, repeats: int = 3, warmup: int = 3,
              clock: str = "wall") -> float:
    """Seconds per call: the best of ``repeats`` means over ``iters`` calls (``clock``: wall | cpu)."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = now()
        for _ in range(iters):
            fn()
        best = min(best, (now() - start) / iters)
    return best


def best_call_seconds(fn: Callable[[], object], *, repeats: int = 5, budget_s: float = 1.0,
                      clock: str = "wall") -> float:
    """Seconds of one call: the best of up to ``repeats`` timed calls after one timed warm-up,
    as many as fit ``budget_s`` by the warm-up's time (at least the warm-up itself). A path
    that is slow on this machine (PyTorch's bf16 matmul without native bf16 GEMMs: ~2 s for a
    1024^3 product) is timed once instead of holding a benchmark up for ``repeats`` calls."""
    now = CLOCKS[clock]
    start = now()
    fn()
    best = now() - start
    for _ in range(min(repeats, int(budget_s / max(best, 1e-9)))):
        start = now()
        fn()
        best = min(best, now() - start)
    return best


def measure_gemm_rates(dtype: str, rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                       features: int = 1024, clock: str = "wall") -> list[tuple[float, float]]:
    """((M, FLOP/s), ...) of [M, K] x [N, K]^T with K = N = ``features``, through the engine's own
    linear layer (``moe.layers.linear.Linear``): at each M the path the engine takes there, the CPU
    kernel's packed weights or PyTorch's GEMM (``moe.kernels.prefers_library_gemm``), so a machine
    whose kernel out-runs ``F.linear`` (AMX, the small-M streams) is modelled at the rate it serves at."""
    from moe.layers.linear import Linear

    dt = DTYPES[dtype]
    layer = Linear(features, features, bias=False).to(dt).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(features, features))
    out = []
    for m in rows:
        x = torch.randn(m, features).to(dt)
        iters = max(3, min(200, int(2e8 / (2 * m * features * features) + 3)))
        with torch.no_grad():
            t = time_call(lambda x=x: layer(x), iters=iters, clock=clock)
        out.append((float(m), 2.0 * m * features * features / t))
    return out


def measure_call_overhead(dtype: str = "float32", clock: str = "wall") -> float:
    """Seconds of one near-empty ``F.linear`` call ([1, 8] x [8, 8]): the per-kernel floor."""
    dt = DTYPES[dtype]
    x, w = torch.randn(1, 8).to(dt), torch.randn(8, 8).to(dt)
    return time_call(lambda: F.linear(x, w), iters=500, clock=clock)


def measure_copy_bandwidth(num_bytes: int = 128 * 1024**2, clock: str = "wall") -> float:
    """Bytes/s of a large tensor copy, counting read + write."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), iters=3, repeats=3, warmup=1, clock=clock)
    return 2 * num_bytes / t


def measure_read_bandwidth(num_bytes: int, clock: str = "wall") -> float:
    """Bytes/s of reading a float32 buffer of ``num_bytes`` over and over (``sum``): the rate at
    which a decode step streams weights of that working set. On a CPU whose last-level cache
    holds the set this is the cache's rate, not DRAM's (2 vCPUs of an AMX Xeon: 28 GB/s at
    64 MiB, 13 GB/s from 256 MiB on)."""
    buf = torch.ones(max(num_bytes, 4096) // 4, dtype=torch.float32)
    t = time_call(lambda: buf.sum(), iters=3, repeats=3, warmup=1, clock=clock)
    return buf.numel() * 4 / t


def measure_attention_rate(dtype: str, *, batch: int = 8, heads: int = 8, head_dim: int = 64,
                           context: int = 512, clock: str = "wall") -> float:
    """FLOP/s of decode attention (one query per sequence): scores, softmax, weighted sum."""
    dt = DTYPES[dtype]
    q = torch.randn(batch * heads, 1, head_dim).to(dt)
    k = torch.randn(batch * heads, context, head_dim).to(dt)
    v = torch.randn(batch * heads, context, head_dim).to(dt)

    def attend() -> torch.Tensor:
        s = torch.bmm(q, k.transpose(1, 2)).float().softmax(-1).to(dt)
        return torch.bmm(s, v)

    t = time_call(attend, iters=20, clock=clock)
    return 4.0 * batch * heads * head_dim * context / t


_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(-?\d+)\s+([0-9.]+)\s")


def parse_nccl_table(text: str) -> list[tuple[float, float]]:
    """((size bytes, out-of-place seconds), ...) from an nccl-tests / commbench table
    (``all_to_all_perf``, ``all_reduce_perf``: size, count, type, redop, root, time (us), ...).
    Comment lines (#) and rows it cannot read are skipped; ValueError when none is left."""
    rows = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        m = _ROW.match(line)
        if m and float(m.group(6)) > 0:
            rows.append((float(m.group(1)), float(m.group(6)) * 1e-6))
    if not rows:
        raise ValueError("no nccl-tests rows found (expected lines: size count type redop root time algbw busbw ...)")
    return rows


def nccl_table_op(text: str) -> tuple[str | None, int | None]:
    """(op, nranks) named by a table's header, when it says: commbench's '# alltoall on 2 ranks',
    or nccl-tests' '# nThread 1 nGpus 1 ...' / 'all_reduce_perf' with rank lines counted."""
    m = re.search(r"#\s*(alltoall|allreduce|allgather|reducescatter) on (\d+) ranks", text)
    if m:
        return m.group(1), int(m.group(2))
    op = None
    for name, key in (("all_to_all", "alltoall"), ("alltoall", "alltoall"), ("all_reduce", "allreduce"),
                      ("all_gather", "allgather"), ("reduce_scatter", "reducescatter")):
        if name in text:
            op = key
            break
    ranks = len(re.findall(r"^#\s+Rank\s+\d+", text, flags=re.MULTILINE)) or None
    return op, ranks
