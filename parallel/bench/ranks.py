"""Spawned benchmark ranks and their timing: shared by commbench and the dispatch benchmarks.

``spawn(fn, nprocs, *args)`` starts ``nprocs`` fresh processes (gloo on CPU, nccl with one GPU
per rank under CUDA) joined on a loopback rendezvous and returns rank 0's result;
``time_op`` times a callable collectively (slowest rank's mean seconds per call).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.groups import default_backend, free_port, init_distributed


def _rank_entry(rank: int, world: int, port: int, threads: int, fn: Callable[..., Any], args: tuple,
                queue: Any) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = default_backend()
    if backend != "nccl":
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    init_distributed(rank, world, backend=backend)  # the store listens on MASTER_ADDR only
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, threads: int = 0) -> Any:
    """Run fn(rank, world, *args) on nprocs fresh ranks; returns rank 0's result. ``threads``:
    torch CPU threads per rank (0: cpu_count // nprocs)."""
    if torch.cuda.is_available() and nprocs > torch.cuda.device_count():
        raise ValueError(f"-np {nprocs} exceeds the {torch.cuda.device_count()} visible GPUs")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank_entry, args=(nprocs, free_port(), threads, fn, args, queue), nprocs=nprocs,
                       join=True, start_method="spawn")
    return queue.get()


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_op(op: Callable[[], Any], warmup: int, iters: int) -> float:
    """Mean seconds per call on the slowest rank (collective over the world)."""
    import time

    for _ in range(warmup):
        op()
    synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        op()
    synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / max(iters, 1)], dtype=torch.float64, device=current_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())
