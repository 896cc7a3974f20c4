"""The sweep's local Ray cluster: started at the first multi-rank point, reused by every later one.

Starting a local cluster costs seconds (4-10 s on 2 cores), once per sweep instead of once
per multi-rank point. What a point creates on it is its own: ``run_point`` shuts its engine
down (``RayExecutor.shutdown`` on a cluster it did not start kills the rank actors, closes the
step channels and removes the placement group; the gloo groups and their ports die with the
actor processes), then ``release`` waits until the cluster holds nothing of the point: every
CPU free again, no placement group but removed ones, no actor process. A cluster that does
not get there within ``drain_timeout_s`` is shut down, and the next multi-rank point starts a
fresh one. ``close`` (the end of the ``with`` block: the sweep's end, an error, a Ctrl-C)
shuts the cluster down.

Inside ``ray job submit`` (RAY_ADDRESS set), or when this process is already connected to a
cluster, nothing here starts or stops one: each point's engine joins that cluster, as before.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)


class SharedCluster:
    """One local Ray cluster for the multi-rank points of a sweep (``acquire`` / ``release`` per point)."""

    def __init__(self, num_cpus: int, *, drain_timeout_s: float = 30.0) -> None:
        """num_cpus: the cluster's logical CPUs, enough for the widest point's ranks."""
        self.num_cpus = num_cpus
        self.drain_timeout_s = drain_timeout_s
        self.is_started = False  # a cluster this object started is up
        self.num_starts = 0

    def __enter__(self) -> SharedCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def acquire(self, world_size: int) -> None:
        """Before a point of ``world_size`` ranks: start the local cluster unless one rank is
        all it needs, one is up, or Ray is reached some other way (RAY_ADDRESS, a connection
        this process already has). A Ctrl-C during the start takes the half-made cluster down
        (``connect_ray``) and is raised here."""
        import ray

        from launch.cluster import connect_ray

        if world_size <= 1 or self.is_started or ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
            return
        self.is_started = connect_ray(num_cpus=self.num_cpus)
        self.num_starts += int(self.is_started)

    def release(self) -> None:
        """After a point (its engine shut down): wait until nothing of it is left on the cluster
        this object started; if that does not happen in time, shut the cluster down."""
        if not self.is_started:
            return
        left = wait_until_drained(self.drain_timeout_s)
        if left:
            log.warning("the local Ray cluster still holds %s after the point: restarting it for the next point",
                        left)
            self.close()

    def close(self) -> None:
        """Shut down the cluster this object started (idempotent); a Ctrl-C during the shutdown
        is held until it is done, then raised."""
        if not self.is_started:
            return
        import ray

        from launch.cluster import sigint_held_for_children

        self.is_started = False
        with sigint_held_for_children():
            if ray.is_initialized():
                ray.shutdown()


def cluster_leftovers() -> str | None:
    """What a finished point may have left on this process's cluster, in words, or None when
    nothing: CPUs still reserved, placement groups not removed, actor processes still running."""
    import ray
    from ray.util.placement_group import placement_group_table

    left = []
    total, free = ray.cluster_resources().get("CPU", 0.0), ray.available_resources().get("CPU", 0.0)
    if free < total:
        left.append(f"{total - free:g} of {total:g} CPUs reserved")
    groups = [g for g in placement_group_table().values() if g.get("state") != "REMOVED"]
    if groups:
        left.append(f"{len(groups)} placement group(s)")
    actors = actor_processes()
    if actors:
        left.append(f"actor processes {actors}")
    return ", ".join(left) or None


def actor_processes() -> list[int]:
    """Pids of this process's descendants that run a Ray actor or task (titled ``ray::NAME``, other
    than idle pooled workers and Ray's own agents); exited ones (zombies) do not count."""
    import psutil

    pids = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        title = cmdline[0].strip() if cmdline else ""
        if title.startswith("ray::") and title != "ray::IDLE" and not title.endswith("Agent"):
            pids.append(proc.pid)
    return pids


def wait_until_drained(timeout_s: float, poll_s: float = 0.1) -> str | None:
    """Poll ``cluster_leftovers`` until it is None (returns None) or ``timeout_s`` passes
    (returns the last leftovers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = cluster_leftovers()
        if left is None or time.monotonic() >= deadline:
            return left
        time.sleep(poll_s)


def cluster_cpus(world_sizes: list[int]) -> int:
    """Logical CPUs for a cluster shared by points of these world sizes: as ``RayExecutor`` asks
    for one point (its ranks, or this machine's CPUs when more), for the widest point."""
    return max([*world_sizes, os.cpu_count() or 1])
