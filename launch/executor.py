"""Executors: how the driver reaches its workers (one in-process rank, or Ray actors).

Both take a ``SchedulerOutput`` (one batch per DP rank) and return one ``StepResult`` per
DP rank (from the rank with tp_rank 0 of that DP group).

Ray actors get their steps over the step channel (``launch.step_channel``: one TCP
connection per rank, compact ``launch.core.wire`` messages) when it can be opened, else as
Ray actor calls; everything else (setup, moves, introspection) is a Ray call.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Protocol

import torch

from launch.config import STEP_TRANSPORTS
from launch.core import SchedulerOutput
from launch.core.wire import encode_batch
from launch.worker import StepResult, Worker, WorkerSpec

log = logging.getLogger(__name__)



class Executor(Protocol):
    num_nodes: int

    def execute(self, output: SchedulerOutput, collect_load: bool) -> list[StepResult]: ...

    def apply_move_plan(self, plan: Any, new_phy2log: torch.Tensor) -> list[dict[str, int]]: ...

    def call(self, method: str, *args: Any) -> list[Any]: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One rank in this process (tp = dp = 1)."""

    num_nodes = 1

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.world_size != 1:
            raise ValueError(f"LocalExecutor runs one rank; the layout has {spec.world_size}")
        self.worker = Worker(spec, 0)
        self.worker.setup()

    def execute(self, output: SchedulerOutput, collect_load: bool) -> list[StepResult]:
        return [self.worker.execute(output.batches[0], collect_load)]

    def apply_move_plan(self, plan: Any, new_phy2log: torch.Tensor) -> list[dict[str, int]]:
        return [self.worker.apply_move_plan(plan, new_phy2log)]

    def call(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayExecutor:
    """One Ray actor per rank (node-major), rendezvous through rank 0's address."""

    def __init__(self, spec: WorkerSpec, *, strategy: str = "PACK", address: str | None = None,
                 call_timeout_s: float = 600.0, transport: str = "auto") -> None:
        from launch.cluster import WorkerGroup, connect_ray, is_local_cluster

        if transport not in STEP_TRANSPORTS:
            raise ValueError(f"step transport must be one of {list(STEP_TRANSPORTS)}, got {transport!r}")
        self.group = None
        self.transport = transport
        self.channel = None
        self._reopen = False
        self.spec = self.full_spec = spec
        if address is None and not os.environ.get("RAY_ADDRESS"):  # a local cluster: every rank on this host
            from launch.cluster import ClusterError
            from moe.host_memory import proc_bytes

            own = proc_bytes("/proc/self/status", "VmRSS")  # a rank is at least a Python process with torch
            problem = local_ranks_memory_problem(spec.world_size, own and min(own, RANK_PROCESS_FLOOR_BYTES),
                                                 proc_bytes("/proc/meminfo", "MemAvailable"))
            if problem is not None:
                raise ClusterError(problem)
        self._owns_ray = connect_ray(address, num_cpus=max(spec.world_size, os.cpu_count() or 1))
        try:
            gpus = 1.0 if torch.cuda.is_available() else 0.0
            self.group = WorkerGroup(Worker, spec.world_size, self._make_args(spec), strategy=strategy,
                                     num_gpus_per_rank=gpus, num_cpus_per_rank=cpus_per_rank(spec.world_size),
                                     call_timeout_s=call_timeout_s,
                                     fixed_cluster=self._owns_ray or is_local_cluster())
            self.num_nodes = self.group.num_nodes
            if spec.num_nodes not in (1, self.num_nodes):  # the ranks landed elsewhere than asked
                log.warning("--num-nodes %d: the ranks run on %d node(s) of this cluster; the layout and the "
                            "balancer use %d", spec.num_nodes, self.num_nodes, self.num_nodes)
            self._setup()
        except BaseException:
            self.shutdown()
            raise

    def _setup(self) -> None:
        """Rendezvous on rank 0's address, build and load every shard (bounded by ``setup_timeout_s``).
        Waits for every actor to be up first: the rendezvous itself only waits
        ``collective_timeout_s`` for the slowest rank, and a new process may take longer to start."""
        self.group.call("process_id", timeout_s=self.setup_timeout_s)
        # Rank 0 serves the store on this address only (loopback when one machine holds every rank).
        self.init_method = self.group.call("rendezvous_address", self.group.rendezvous_host(), ranks=[0])[0]
        from launch.recovery import WorkerCallError
        from moe.loading.errors import LoadError

        try:
            self.infos = self.group.call("setup", self.init_method, timeout_s=self.setup_timeout_s)
        except WorkerCallError as e:
            if not isinstance(e.cause, LoadError):
                raise
            # a checkpoint a rank cannot load is the user's to fix, as in one process: the rank's own
            # error (its class, so callers catch it as they would there), its message naming the rank
            e.cause.args = (e.summary,)
            raise e.cause from None
        self.dp_leaders = [r for r, info in enumerate(self.infos) if info["coords"]["tp_rank"] == 0]
        self.dp_of_rank = [info["coords"]["dp_rank"] for info in self.infos]
        self.open_channel()  # at start and after every rebuild: the ranks serve fresh channels

    # ---- the fast step transport ---------------------------------------------------------

    def open_channel(self) -> None:
        """Connect the step channel to every rank (transport "socket" or "auto"); with "auto"
        a failure (no route to a node, a port that cannot be bound) leaves steps on Ray calls."""
        from launch.step_channel import StepClient

        self.close_channel()
        self._reopen = False
        if self.transport == "ray":
            return
        try:
            self.channel = StepClient(self.group.call("open_step_channel"))
        except Exception as e:
            if self.transport == "socket":
                raise
            log.warning("step channel unavailable (%s: %s): steps go through Ray actor calls",
                        type(e).__name__, e)
            self.close_channel()

    def close_channel(self) -> None:
        """Close the driver's ends; each rank's server thread sees it and stops (no Ray call:
        a hung rank cannot hold this up)."""
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()

    fault_ping_timeout_s = 10.0

    @property
    def active_transport(self) -> str:
        """"socket" while the step channel is up, else "ray"."""
        return "socket" if self.channel is not None else "ray"

    def _execute_channel(self, output: SchedulerOutput, collect_load: bool) -> list[StepResult]:
        from launch.step_channel import ChannelError

        flag = b"\x01" if collect_load else b"\x00"
        messages = {dp: flag + encode_batch(batch) for dp, batch in enumerate(output.batches)}
        try:
            replies = self.channel.roundtrip([messages[dp] for dp in self.dp_of_rank], self.group.call_timeout_s)
        except ChannelError as e:
            self.close_channel()  # a failed round trip leaves replies unread: never reuse it
            self._reopen = True  # the next step (after a rebuild, say) connects afresh
            raise self._channel_fault(e) from e
        return [StepResult.from_bytes(reply) for reply in replies]

    def _channel_fault(self, error: Exception) -> Exception:
        """The ``WorkerFault`` the Ray path would have raised for the same fault."""
        from launch.recovery import WorkerCallError, WorkerTimeoutError
        from launch.step_channel import ChannelClosed, ChannelTimeout, RemoteError

        rank = error.rank
        where = f"worker rank {rank} on node {self.group._node(rank)}"
        if isinstance(error, RemoteError):
            cause = error.cause
            first = next((line.strip() for line in str(cause).splitlines() if line.strip()), cause.type_name)
            return self.group.blame_dead_peer(
                WorkerCallError(f"{where} failed in execute: {first}", rank=rank, detail=cause.type_name))
        if isinstance(error, ChannelTimeout):
            return WorkerTimeoutError(f"ranks {error.ranks} did not finish execute within "
                                      f"{self.group.call_timeout_s:.0f}s (recovery.step_timeout_s): hung",
                                      rank=rank if len(error.ranks) == 1 else -1)
        assert isinstance(error, ChannelClosed)
        # Ask Ray whether the actor is gone: it raises the typed WorkerDiedError with Ray's cause.
        self.group.wait([self.group.actors[rank].ping.remote()], "ping", [rank], self.fault_ping_timeout_s)
        reason = str(error).split(": ", 1)[-1]  # without its own "rank N: " prefix
        return WorkerCallError(f"{where}: {reason}", rank=rank, detail="ChannelClosed")

    setup_timeout_s = 600.0

    restart_ping_timeout_s = 5.0

    def restart(self, phy2log: torch.Tensor | None) -> None:
        """After a worker fault: ranks that still answer drop their broken process groups and
        model; the others (dead, or stuck in a call) are killed and replaced by new actors in
        their placement-group bundles; then every rank rendezvous afresh and loads its shard
        from the checkpoint with placement ``phy2log [L, P]`` (the one in force on the driver).
        KV caches start empty. Raises what the rebuild raised; the caller decides on a retry."""
        self.group.grow()  # a fault while degraded: rebuild the full group
        self.spec = dataclasses.replace(self.full_spec, phy2log=None if phy2log is None else phy2log.clone())
        alive = self.group.responsive_ranks(self.restart_ping_timeout_s)
        self.group.collect_abandoned()
        if alive:
            try:
                self.group.call("reset", self.spec, ranks=alive, timeout_s=self.restart_ping_timeout_s * 4)
            except Exception as exc:  # noqa: BLE001 - replace them all then
                log.warning("resetting the surviving ranks failed (%s): replacing every rank", exc)
                alive = []
        dead = [r for r in range(self.group.num_ranks) if r not in alive]
        log.warning("rebuilding the worker group: reusing ranks %s, starting new actors for ranks %s", alive, dead)
        self.group.replace(dead, self._make_args(self.spec))
        self._setup()

    @staticmethod
    def _make_args(spec: WorkerSpec):
        def make(rank: int, num_nodes: int) -> tuple[tuple, dict]:
            return (dataclasses.replace(spec, num_nodes=num_nodes), rank), {}

        return make

    # ---- degraded mode (launch.recovery): fewer ranks until the replacements join ----------

    def find_lost_ranks(self) -> list[int]:
        """After a fault: the ranks that do not answer a ping (dead, or stuck in a call)."""
        alive = self.group.responsive_ranks(self.restart_ping_timeout_s)
        self.group.collect_abandoned()
        return [r for r in range(self.group.num_ranks) if r not in alive]

    def degrade(self, lost: list[int], data_parallel_size: int, phy2log: torch.Tensor | None) -> None:
        """Serve on the survivors: drop ranks ``lost`` (replacements start in their bundles as
        standbys), renumber the others and rebuild them as a group of ``data_parallel_size``
        DP ranks (tp 1) with placement ``phy2log [L, P']``; KV caches start empty."""
        self.group.shrink(lost)
        ep = data_parallel_size if (self.full_spec.ep or 1) > 1 else 1
        self.spec = dataclasses.replace(self.full_spec, dp=data_parallel_size, ep=ep, num_nodes=1,
                                        phy2log=None if phy2log is None else phy2log.clone())
        self.group.call_each("reset", [(self.spec, r) for r in range(self.group.num_ranks)],
                             timeout_s=self.restart_ping_timeout_s * 4)
        self._setup()

    @property
    def is_degraded(self) -> bool:
        return self.group.num_standby > 0

    def standby_ready(self) -> bool:
        """True when every replacement rank started by ``degrade`` is up."""
        return self.group.standby_ready()

    def restore(self, phy2log: torch.Tensor | None) -> None:
        """Take the standbys in and rebuild the full layout with placement ``phy2log [L, P]``."""
        self.group.grow()
        self.spec = dataclasses.replace(self.full_spec, phy2log=None if phy2log is None else phy2log.clone())
        self.group.call_each("reset", [(self.spec, r) for r in range(self.group.num_ranks)],
                             timeout_s=self.restart_ping_timeout_s * 4)
        self._setup()

    def execute(self, output: SchedulerOutput, collect_load: bool) -> list[StepResult]:
        if self._reopen:
            self._reopen = False
            self.open_channel()
        if self.channel is not None:
            results = self._execute_channel(output, collect_load)
        else:
            args = [(output.batches[dp], collect_load) for dp in self.dp_of_rank]
            results = self.group.call_each("execute", args)
        leaders = {self.dp_of_rank[r]: results[r] for r in self.dp_leaders}
        for r, result in enumerate(results):
            if r not in self.dp_leaders:  # a TP follower's own global-capacity drops
                leader = leaders[self.dp_of_rank[r]]
                leader.capacity = [(a + c, b + d) for (a, b), (c, d) in zip(leader.capacity, result.capacity)]
                leader.cpu_seconds = max(leader.cpu_seconds, result.cpu_seconds)
        return [leaders[dp] for dp in sorted(leaders)]

    def apply_move_plan(self, plan: Any, new_phy2log: torch.Tensor) -> list[dict[str, int]]:
        return self.group.call("apply_move_plan", plan, new_phy2log)

    def call(self, method: str, *args: Any) -> list[Any]:
        return self.group.call(method, *args)

    def check_alive(self, timeout_s: float = 10.0) -> None:
        """Ping every rank; raises a ``WorkerFault`` naming a rank that is gone or hung."""
        self.group.call("ping", timeout_s=timeout_s)

    def shutdown(self) -> None:
        import ray

        group = getattr(self, "group", None)
        if getattr(self, "channel", None) is not None:
            self.channel.close()  # the actors are killed next: no need to tell them
            self.channel = None
        if group is not None:
            # A cluster this process started dies whole with ray.shutdown(); on a shared
            # cluster the placement group must be released explicitly.
            group.shutdown(remove_group=not self._owns_ray)
            self.group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


# What a rank process holds at least before its weights: a Python process that imported torch
# (223 MiB on the x86 Linux boxes this runs on; this process, when it is smaller)
RANK_PROCESS_FLOOR_BYTES = 192 * 2**20


def local_ranks_memory_problem(world_size: int, process_bytes: int | None, available_bytes: int | None) -> str | None:
    """Why ``world_size`` rank processes cannot all start on this host (a local Ray cluster), or None:
    each takes at least ``process_bytes`` before any weights, and together they would take more than
    the memory available (``available_bytes``, MemAvailable). A lower bound, so it refuses only
    layouts that cannot fit (None when either figure is unknown)."""
    if not process_bytes or not available_bytes or world_size * process_bytes <= available_bytes:
        return None
    from launch.core.kv_sizing import format_memory

    fit = max(1, available_bytes // process_bytes)
    return (f"{world_size} ranks on this machine (a local Ray cluster) need at least "
            f"{format_memory(world_size * process_bytes)} for their processes alone ({format_memory(process_bytes)} "
            f"each before any weights), over the {format_memory(available_bytes)} available: "
            f"at most about {fit} fit; use fewer ranks, or a multi-node cluster (RAY_ADDRESS)")


def cpus_per_rank(world_size: int) -> float:
    """One logical CPU per rank, or an equal share when the whole cluster has fewer CPUs than
    ranks (e.g. ``ray start --head`` on a 2-core box serving 4 ranks): ranks still all fit."""
    import ray

    total = float(ray.cluster_resources().get("CPU", 0.0))
    if total >= world_size or total <= 0:
        return 1.0
    return max(0.01, int(total / world_size * 100) / 100)


def build_executor(spec: WorkerSpec, *, strategy: str = "PACK", address: str | None = None,
                   call_timeout_s: float = 600.0, transport: str = "auto") -> Executor:
    """In-process for one rank, Ray actors otherwise. call_timeout_s: how long the driver waits
    for the ranks on one step or move before it declares them hung (``WorkerTimeoutError``).
    transport: how steps reach the actors ("auto": the step channel when every rank can be
    reached, else Ray calls)."""
    if spec.world_size == 1:
        return LocalExecutor(spec)
    return RayExecutor(spec, strategy=strategy, address=address, call_timeout_s=call_timeout_s, transport=transport)
