"""Ray shell around the workers: placement group, one actor per rank, rendezvous.

This is the only module that applies ``ray.remote`` to the worker class. Ranks are
ordered node-major (the ranks of one node are contiguous) so the balancer's
``num_nodes`` is the real node count.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A worker actor died; names its rank and node."""

    def __init__(self, rank: int, node: str, cause: BaseException) -> None:
        super().__init__(f"worker rank {rank} on node {node} died: {type(cause).__name__}: {cause}")
        self.rank = rank
        self.node = node


class WorkerCallError(RuntimeError):
    """A worker raised while executing a method; names its rank and node."""

    def __init__(self, rank: int, node: str, method: str, cause: BaseException) -> None:
        super().__init__(f"worker rank {rank} on node {node} failed in {method}: {cause}")
        self.rank = rank
        self.node = node


def connect_ray(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Join a running cluster or start a local one on loopback.

    address: "auto", "ray://..." or None. With None, a job started by ``ray job submit``
    (RAY_ADDRESS set) joins its cluster; otherwise a local embedded cluster starts.
    Returns True when this call started a local cluster (the caller shuts it down).
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    env = {"MASTER_ADDR", "GLOO_SOCKET_IFNAME", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "OMP_NUM_THREADS"}
    runtime_env = {"env_vars": {k: os.environ[k] for k in env if k in os.environ}}
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = "auto"
    if address is not None:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return False
    ray.init(
        address="local",  # a fresh cluster even when some other `ray start` runs on this machine
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env=runtime_env,
        log_to_driver=True,
        configure_logging=False,
    )
    return True


def compute_node_major_order(bundle_nodes: Sequence[str]) -> list[int]:
    """Bundle indices ordered node-major.

    bundle_nodes: node id of each bundle. Nodes are ordered by their lowest bundle index,
    bundles within a node by index. Returns: rank -> bundle index.
    """
    first: dict[str, int] = {}
    for i, node in enumerate(bundle_nodes):
        first.setdefault(node, i)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first[bundle_nodes[i]], i))


def compute_layout_nodes(rank_nodes: Sequence[str]) -> int:
    """Nodes the layout and the balancer may assume: every node must hold the same number of
    ranks, else the cluster counts as one node (with a warning)."""
    counts = {n: rank_nodes.count(n) for n in dict.fromkeys(rank_nodes)}
    if len(set(counts.values())) == 1:
        return len(counts)
    log.warning("ranks are spread unevenly over nodes %s: the layout treats them as one node", counts)
    return 1


def compute_rendezvous_host(rank_ips: Sequence[str]) -> str:
    """The address the ranks meet at: loopback when every rank is on one machine (one IP),
    else the IP of rank 0's node. rank_ips: each rank's node IP, by rank."""
    if not rank_ips:
        raise ValueError("no ranks")
    return "127.0.0.1" if len(set(rank_ips)) == 1 else rank_ips[0]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    bundle_index: int
    node_id: str
    node_rank: int


class WorkerGroup:
    """One Ray actor per rank, in a placement group, addressed by rank."""

    def __init__(
        self,
        worker_cls: type,
        num_ranks: int,
        make_args: Callable[[int, int], tuple[tuple, dict]],
        *,
        strategy: str = "PACK",
        num_gpus_per_rank: float = 0.0,
        num_cpus_per_rank: float = 1.0,
        ready_timeout_s: float = 120.0,
        call_timeout_s: float = 600.0,
    ) -> None:
        """make_args(rank, num_nodes) -> (args, kwargs) for the worker constructor."""
        if strategy not in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"placement strategy {strategy!r} is not one of PACK, STRICT_PACK, SPREAD, STRICT_SPREAD")
        self.num_ranks = num_ranks
        self.call_timeout_s = call_timeout_s
        bundle = {"CPU": float(num_cpus_per_rank)}
        if num_gpus_per_rank:
            bundle["GPU"] = num_gpus_per_rank
        self.pg = placement_group([dict(bundle) for _ in range(num_ranks)], strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except GetTimeoutError as e:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"placement group of {num_ranks} bundles {bundle} ({strategy}) not ready after "
                f"{ready_timeout_s:.0f}s: the cluster lacks resources ({ray.cluster_resources()})"
            ) from e
        bundle_nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        nodes = [bundle_nodes[i] for i in range(num_ranks)]
        order = compute_node_major_order(nodes)
        node_ids = list(dict.fromkeys(nodes[b] for b in order))
        self.num_nodes = compute_layout_nodes([nodes[b] for b in order])
        self.ranks = [
            RankInfo(rank=r, bundle_index=b, node_id=nodes[b], node_rank=node_ids.index(nodes[b]))
            for r, b in enumerate(order)
        ]
        remote_cls = ray.remote(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank)(worker_cls)
        self.actors = []
        for info in self.ranks:
            args, kwargs = make_args(info.rank, self.num_nodes)
            strategy_ = PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=info.bundle_index
            )
            self.actors.append(remote_cls.options(scheduling_strategy=strategy_).remote(*args, **kwargs))

    def rendezvous_host(self) -> str:
        """``compute_rendezvous_host`` over the node IPs Ray reports for the ranks."""
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        return compute_rendezvous_host([ips.get(info.node_id, info.node_id) for info in self.ranks])

    def _node(self, rank: int) -> str:
        info = self.ranks[rank]
        return f"{info.node_rank} ({info.node_id[:12]})"

    def wait(self, refs: list, method: str, ranks: Sequence[int], timeout_s: float | None = None) -> list:
        """ray.get on one ref per rank, turning failures into errors that name the rank."""
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * len(refs)
        pending = dict(zip(refs, range(len(refs))))
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                slow = [ranks[i] for i in pending.values()]
                raise TimeoutError(f"{method} did not finish within {timeout:.0f}s on ranks {slow}")
            ref = ready[0]
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except RayActorError as e:
                raise WorkerDiedError(ranks[i], self._node(ranks[i]), e) from e
            except RayTaskError as e:
                raise WorkerCallError(ranks[i], self._node(ranks[i]), method, e.cause or e) from e
        return results

    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any) -> list:
        """Run one method on the given ranks (default all) with the same arguments."""
        ranks = list(range(self.num_ranks)) if ranks is None else list(ranks)
        refs = [getattr(self.actors[r], method).remote(*args, **kwargs) for r in ranks]
        return self.wait(refs, method, ranks)

    def call_each(self, method: str, per_rank_args: Sequence[tuple]) -> list:
        """Run one method on every rank with per-rank positional arguments."""
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return self.wait(refs, method, list(range(self.num_ranks)))

    def shutdown(self, *, remove_group: bool = True, timeout_s: float = 10.0) -> None:
        """Kill the actors and remove the placement group (idempotent). The removal is bounded
        by ``timeout_s``: during interpreter or signal teardown the GCS may not answer."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort during teardown
                log.debug("actor already gone", exc_info=True)
        self.actors = []
        pg, self.pg = self.pg, None
        if pg is not None and remove_group:
            import threading

            remover = threading.Thread(target=_remove_quietly, args=(pg,), daemon=True)
            remover.start()
            remover.join(timeout_s)
            if remover.is_alive():
                log.warning("placement group removal did not finish within %.0fs", timeout_s)


def _remove_quietly(pg) -> None:
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed, or the cluster is going away
        log.debug("placement group already removed", exc_info=True)
