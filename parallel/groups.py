"""torch.distributed process groups for a ``Layout``: built once, passed explicitly.

``new_group`` is itself a collective over the whole world: every process must create
every group, in the same order, even the groups it is not a member of. That is why
``build_process_groups`` walks ``layout.tp_groups()``, ``dp_groups()`` and
``ep_groups()`` in full on every rank and keeps only its own.
"""

from __future__ import annotations

import datetime
import os
import socket
import urllib.parse
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.layout import Layout, RankCoords
from parallel.shm_allreduce import ShmAllReduce

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's groups. ``ep``: the expert hop; ``tp``: attention/dense shards;
    ``dp``: ranks sharing this rank's tp_rank. ``device``: where collective buffers
    live (cpu for gloo, the rank's cuda device for nccl)."""

    world: dist.ProcessGroup
    ep: dist.ProcessGroup
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    rank: int
    coords: RankCoords
    backend: str
    device: torch.device
    tp_shm: ShmAllReduce | None = None  # small all-reduces over tp through shared memory (gloo, one host)
    ep_shm: ShmAllReduce | None = None  # the EP all-to-alls of small steps, the same way


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend() -> str:
    """nccl when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _timeout(timeout: float | datetime.timedelta) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"collective timeout must be positive seconds, got {timeout}")
    return datetime.timedelta(seconds=timeout)


def parse_init_method(init_method: str | None) -> tuple[str, int]:
    """(host, port) of a ``tcp://HOST:PORT`` init method, or of MASTER_ADDR / MASTER_PORT for
    ``env://`` (None). IPv6 hosts may be bracketed: ``tcp://[::1]:29500``."""
    if init_method is None or init_method == "env://":
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise ValueError("init_distributed with env:// needs MASTER_ADDR and MASTER_PORT in the environment")
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    else:
        parsed = urllib.parse.urlsplit(init_method)
        if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
            raise ValueError(f"init_method must be env:// or tcp://HOST:PORT, got {init_method!r}")
        host, port = parsed.hostname, parsed.port
    if not (str(port).isascii() and str(port).isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"rendezvous port must be 1..65535, got {port!r}")
    return host, int(port)


def create_rendezvous_store(host: str, port: int, rank: int, world_size: int,
                            timeout: datetime.timedelta) -> dist.TCPStore:
    """The TCPStore the ranks meet at. Rank 0 serves it on ``host:port`` only: torch's own
    tcp:// and env:// rendezvous listen on every interface, whatever host they are given,
    which would expose the store beyond the address the ranks use (loopback on one machine)."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, port), family=family, backlog=max(128, world_size))
    try:
        # detach(): the store owns the descriptor from here on (and closes it).
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                             master_listen_fd=listener.detach())
    except BaseException:
        listener.close()
        raise


def init_distributed(
    rank: int,
    world_size: int,
    *,
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S,
) -> None:
    """Join the default process group through a store on ``init_method``'s host and port
    (``tcp://HOST:PORT``; env:// or None reads MASTER_ADDR and MASTER_PORT, and says so when
    they are missing). Rank 0's store listens on that host only (``create_rendezvous_store``).
    """
    host, port = parse_init_method(init_method)
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    td = _timeout(timeout)
    store = create_rendezvous_store(host, port, rank, world_size, td)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)


def build_process_groups(
    layout: Layout, rank: int, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S
) -> ProcessGroups:
    """Create every TP, DP and EP group of ``layout`` (collectively) and return this rank's.

    Requires an initialised default group whose size equals ``layout.world_size``.
    ``timeout`` (seconds or timedelta) bounds every collective on the new groups.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs torch.distributed initialised (see init_distributed)")
    layout.check_world_size(dist.get_world_size())
    if dist.get_rank() != rank:
        raise ValueError(f"rank argument {rank} differs from torch.distributed rank {dist.get_rank()}")
    backend = dist.get_backend()
    td = _timeout(timeout)
    mine: dict[str, dist.ProcessGroup] = {}
    # Same order on every rank: new_group is collective over the world.
    for kind, groups in (("tp", layout.tp_groups()), ("dp", layout.dp_groups()), ("ep", layout.ep_groups())):
        for ranks in groups:
            group = dist.new_group(ranks, timeout=td, backend=backend)
            if rank in ranks:
                mine[kind] = group
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tp_shm = ShmAllReduce.for_group(mine["tp"], timeout_s=td.total_seconds()) if layout.tp > 1 else None
    ep_shm = ShmAllReduce.for_group(mine["ep"], timeout_s=td.total_seconds()) if layout.ep_size > 1 else None
    return ProcessGroups(
        world=dist.group.WORLD,
        ep=mine["ep"],
        tp=mine["tp"],
        dp=mine["dp"],
        rank=rank,
        coords=layout.coords(rank),
        backend=backend,
        device=device,
        tp_shm=tp_shm,
        ep_shm=ep_shm,
    )
