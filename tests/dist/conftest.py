"""Spawn N gloo ranks on loopback, run a function on each, and bring its results back.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (spawn context),
each joining a fresh gloo group on 127.0.0.1 with a short collective timeout, calls
``fn(rank, world_size, *args)`` and ships its (picklable / torch.save-able) return value
back through a file. A rank that raises, hangs past ``timeout_s`` or dies fails the
caller with that rank's traceback; the other ranks are terminated.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from parallel.groups import free_port, init_distributed

COLLECTIVE_TIMEOUT_S = 60.0
DIST_ENV = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}




def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    out = Path(out_dir)
    try:
        os.environ.update(DIST_ENV, MASTER_PORT=str(port))
        torch.set_num_threads(1)
        init_distributed(rank, world_size, backend="gloo", timeout=COLLECTIVE_TIMEOUT_S)  # store on loopback only
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks. Returns results by rank."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="distrank") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, out_dir), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            _wait(procs, deadline, Path(out_dir))
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(5)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _wait(procs: list, deadline: float, out: Path) -> None:
    while any(p.is_alive() for p in procs):
        errors = sorted(out.glob("rank*.err"))
        if errors:
            raise RuntimeError(f"{errors[0].stem} failed:\n{errors[0].read_text()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks still running after the deadline: {[p.pid for p in procs if p.is_alive()]}")
        time.sleep(0.05)
    errors = sorted(out.glob("rank*.err"))
    if errors:
        raise RuntimeError(f"{errors[0].stem} failed:\n{errors[0].read_text()}")
    for rank, p in enumerate(procs):
        if p.exitcode != 0:
            raise RuntimeError(f"rank{rank} exited with code {p.exitcode}")
