"""Executors: how the driver reaches its workers (one in-process rank, or Ray actors).

Both take a ``SchedulerOutput`` (one batch per DP rank) and return one ``StepResult`` per
DP rank (from the rank with tp_rank 0 of that DP group).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Protocol

import torch

from launch.core import SchedulerOutput
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

    def __init__(self, spec: WorkerSpec, *, strategy: str = "PACK", address: str | None = None) -> None:
        from launch.cluster import WorkerGroup, connect_ray

        self.group = None
        self._owns_ray = connect_ray(address, num_cpus=max(spec.world_size, os.cpu_count() or 1))
        try:
            gpus = 1.0 if torch.cuda.is_available() else 0.0
            self.group = WorkerGroup(Worker, spec.world_size, self._make_args(spec), strategy=strategy,
                                     num_gpus_per_rank=gpus, num_cpus_per_rank=cpus_per_rank(spec.world_size))
            self.num_nodes = self.group.num_nodes
            init = self.group.call("rendezvous_address", ranks=[0])[0]
            self.infos = self.group.call("setup", init)
        except BaseException:
            self.shutdown()
            raise
        self.dp_leaders = [r for r, info in enumerate(self.infos) if info["coords"]["tp_rank"] == 0]
        self.dp_of_rank = [info["coords"]["dp_rank"] for info in self.infos]

    @staticmethod
    def _make_args(spec: WorkerSpec):
        def make(rank: int, num_nodes: int) -> tuple[tuple, dict]:
            return (dataclasses.replace(spec, num_nodes=num_nodes), rank), {}

        return make

    def execute(self, output: SchedulerOutput, collect_load: bool) -> list[StepResult]:
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

    def shutdown(self) -> None:
        import ray

        group = getattr(self, "group", None)
        if group is not None:
            # A cluster this process started dies whole with ray.shutdown(); on a shared
            # cluster the placement group must be released explicitly.
            group.shutdown(remove_group=not self._owns_ray)
            self.group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


def cpus_per_rank(world_size: int) -> float:
    """One logical CPU per rank, or an equal share when the whole cluster has fewer CPUs than
    ranks (e.g. ``ray start --head`` on a 2-core box serving 4 ranks): ranks still all fit."""
    import ray

    total = float(ray.cluster_resources().get("CPU", 0.0))
    if total >= world_size or total <= 0:
        return 1.0
    return max(0.01, int(total / world_size * 100) / 100)


def build_executor(spec: WorkerSpec, *, strategy: str = "PACK", address: str | None = None) -> Executor:
    """In-process for one rank, Ray actors otherwise."""
    if spec.world_size == 1:
        return LocalExecutor(spec)
    return RayExecutor(spec, strategy=strategy, address=address)
