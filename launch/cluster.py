"""Ray shell around the workers: placement group, one actor per rank, rendezvous.

This is the only module that applies ``ray.remote`` to the worker class. Ranks are
ordered node-major (the ranks of one node are contiguous) so the balancer's
``num_nodes`` is the real node count.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError, UnserializableException
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launch.recovery import WorkerCallError, WorkerDiedError, WorkerTimeoutError

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The Ray cluster cannot host the run: none answers at the address given, or it cannot place the
    ranks (too few nodes for STRICT_SPREAD, too few CPUs or GPUs). The CLI prints it as one line."""


# seconds a TCP connect to the cluster's address may take before it counts as not answering
PROBE_TIMEOUT_S = 3.0

# GCS addresses of the local clusters ``connect_ray`` started in this process (``is_local_cluster``)
_started_here: set[str] = set()


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a "host:port" or "ray://host:port" address; None for "auto", "local" or
    anything else Ray resolves itself."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or "/" in rest or not (port.isascii() and port.isdigit()):
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """ClusterError unless something accepts a TCP connection at ``address`` ("host:port" or
    "ray://host:port"; other forms are left to Ray): Ray itself retries a dead address for minutes."""
    import socket

    where = _host_port(address)
    if where is None:
        return
    try:
        with socket.create_connection(where, timeout=timeout_s):
            pass
    except OSError as e:
        source = "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") == address else "the Ray address"
        raise ClusterError(f"{source} {address}: no Ray cluster answers there ({e.strerror or e}); start one "
                           "(ray start --head) or unset RAY_ADDRESS to run on a local cluster of this process") from e


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
        target = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
        source = "RAY_ADDRESS" if address == "auto" else "the Ray address"
        fix = "give the head's GCS as HOST:PORT (e.g. HEAD:6379), or unset RAY_ADDRESS for a local cluster"
        if target.startswith(("http://", "https://")):
            raise ClusterError(f"{source} {target!r} is a dashboard URL (what `ray job submit` takes), not the "
                               f"cluster's address: {fix}")
        check_reachable(target)
        try:
            with _sigterm_handler_kept():
                ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        except ConnectionError as e:  # "auto" with no cluster running here, a refused connection
            raise ClusterError(f"cannot join the Ray cluster at {target or address!r}: {_first_line(e)}") from e
        except ValueError as e:  # not an address Ray reads (no port, a port that is not a number, ...)
            raise ClusterError(f"{source} {target!r} is not a Ray cluster address ({_first_line(e)}): {fix}") from e
        return False
    with _sigterm_handler_kept():
        return _start_local_ray(num_cpus, runtime_env)


@contextlib.contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """``ray.init`` replaces the SIGTERM handler with one that calls ``sys.exit(15)`` as it starts: a
    handler this process had installed (``serve``'s, which records the signal and shuts down with
    status 0; the CLI's, which unwinds as a Ctrl-C does) is kept. Inside the block a SIGTERM is only
    recorded (Ray's ``set_sigterm_handler`` does nothing there), as ``sigint_held_for_children`` holds
    a Ctrl-C: cut short, ``ray.init`` would leave its agents running. Once the block ends the handler
    is back and gets the held signal. Ray's is installed where there was none (a script's default),
    so that a SIGTERM still shuts Ray down on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous):
        yield
        return
    import ray._private.utils as ray_utils

    held: list[int] = []
    hook = getattr(ray_utils, "set_sigterm_handler", None)
    if hook is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        if hook is not None:
            ray_utils.set_sigterm_handler = hook
        signal.signal(signal.SIGTERM, previous)
    if held:
        previous(signal.SIGTERM, None)


def _start_local_ray(num_cpus: int | None, runtime_env: dict[str, Any]) -> bool:
    try:
        with sigint_held_for_children():
            ray.init(
                address="local",  # a fresh cluster even when some other `ray start` runs on this machine
                num_cpus=num_cpus,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                runtime_env=runtime_env,
                log_to_driver=True,
                configure_logging=False,
            )
    except BaseException:  # a Ctrl-C held during the start lands here: take the half-made cluster down
        if ray.is_initialized():
            ray.shutdown()
        raise
    _started_here.add(ray.get_runtime_context().gcs_address)
    return True


def is_local_cluster() -> bool:
    """True while this process is connected to a local cluster that ``connect_ray`` started here
    (whoever holds it, e.g. a sweep reusing it across points): its nodes are all it will ever have."""
    return ray.is_initialized() and ray.get_runtime_context().gcs_address in _started_here


@contextlib.contextmanager
def sigint_held_for_children() -> Iterator[None]:
    """A Ctrl-C while Ray starts its local processes is held until they are all up, then raised here.

    A Ctrl-C reaches the terminal's whole foreground process group, and one that cuts ``ray.init``
    short (or kills a raylet still starting) leaves the raylet's dashboard and runtime-env agents
    running after this process has gone. So, inside the block: SIGINT is blocked in this thread,
    and Ray's processes, started from it, inherit the mask and never see a Ctrl-C (this process
    stops them with ``ray.shutdown``); in the main thread a press is only recorded, and raised as
    KeyboardInterrupt when the block ends, once ``ray.init`` has finished and can be undone whole."""
    pressed: list[int] = []
    is_main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if is_main else None
    if is_main:
        signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hasattr(signal, "pthread_sigmask") else None
    try:
        yield
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if is_main:
            signal.signal(signal.SIGINT, handler if handler is not None else signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


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
    """rank: the rank in the full group (its position when no rank is missing)."""

    rank: int
    bundle_index: int
    node_id: str
    node_rank: int

    @property
    def bundle_order(self) -> int:
        return self.rank


def placement_problem(num_ranks: int, bundle: dict[str, float], strategy: str, nodes: Sequence[dict]) -> str | None:
    """Why ``num_ranks`` bundles of ``bundle`` can never be placed with ``strategy`` on ``nodes`` (Ray's
    node records: "Resources" per node), or None when they can: STRICT_SPREAD needs a node per rank,
    STRICT_PACK one node holding them all, the others the cluster's total."""
    totals = [n.get("Resources", {}) for n in nodes]
    fits = [min((int(r.get(k, 0.0) // v) if v else num_ranks) for k, v in bundle.items()) for r in totals]
    where = f"{len(nodes)} node(s) with {', '.join(f'{k} {sum(r.get(k, 0.0) for r in totals):g}' for k in bundle)}"
    if strategy == "STRICT_SPREAD" and sum(1 for f in fits if f >= 1) < num_ranks:
        return (f"placement strategy STRICT_SPREAD puts each of the {num_ranks} ranks on its own node, and this "
                f"cluster has {len(nodes)} node(s) that can hold one: use PACK or SPREAD, or add nodes")
    if strategy == "STRICT_PACK" and max(fits, default=0) < num_ranks:
        return (f"placement strategy STRICT_PACK puts all {num_ranks} ranks (each {bundle}) on one node, and no "
                f"node of this cluster ({where}) holds them all")
    if sum(fits) < num_ranks:
        return f"{num_ranks} ranks of {bundle} each do not fit this cluster ({where})"
    return None


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
        fixed_cluster: bool = False,
    ) -> None:
        """make_args(rank, num_nodes) -> (args, kwargs) for the worker constructor. fixed_cluster: the
        cluster's nodes are all it will ever have (a local cluster this process started), so a
        placement it cannot make is refused at once instead of waited for (an autoscaler may add
        nodes to other clusters)."""
        if strategy not in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"placement strategy {strategy!r} is not one of PACK, STRICT_PACK, SPREAD, STRICT_SPREAD")
        self.num_ranks = num_ranks
        self.call_timeout_s = call_timeout_s
        bundle = {"CPU": float(num_cpus_per_rank)}
        if num_gpus_per_rank:
            bundle["GPU"] = num_gpus_per_rank
        if fixed_cluster:
            problem = placement_problem(num_ranks, bundle, strategy, [n for n in ray.nodes() if n.get("Alive")])
            if problem:
                raise ClusterError(problem)
        self.pg = placement_group([dict(bundle) for _ in range(num_ranks)], strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except GetTimeoutError as e:
            remove_placement_group(self.pg)
            raise ClusterError(
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
        self._remote_cls = ray.remote(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank)(worker_cls)
        self._make_args = make_args
        self._abandoned: list = []
        self._standby: list = []  # (RankInfo, actor, ready ref) started for lost ranks
        self.actors: list = []
        self.spawn()

    def spawn(self, make_args: Callable[[int, int], tuple[tuple, dict]] | None = None) -> None:
        """Start one actor per rank in its bundle (after ``kill_actors``: fresh processes, same
        bundles; Ray starts each once its bundle's resources are released)."""
        self._make_args = make_args or self._make_args
        self.actors = [self._start(info) for info in self.ranks]

    def _start(self, info: RankInfo) -> Any:
        args, kwargs = self._make_args(info.rank, self.num_nodes)
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                    placement_group_bundle_index=info.bundle_index)
        return self._remote_cls.options(scheduling_strategy=strategy).remote(*args, **kwargs)

    def kill_actors(self) -> None:
        """Kill every rank's actor (no restart), alive, hung or already dead, standbys too."""
        self.grow()
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort: the actor may be gone already
                log.debug("actor already gone", exc_info=True)
        self.actors = []

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
        # the calls' own timeout is the engine's recovery.step_timeout_s; a ping's or a setup's is fixed
        setting = " (recovery.step_timeout_s)" if timeout_s is None else ""
        try:
            self._wait_all(pending, results, method, ranks, timeout, deadline, setting)
        except BaseException:
            self._abandoned.extend(pending)  # their errors are collected later, not printed by Ray
            raise
        return results

    def _wait_all(self, pending: dict, results: list, method: str, ranks: Sequence[int], timeout: float,
                  deadline: float, setting: str = "") -> None:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                slow = [ranks[i] for i in pending.values()]
                raise WorkerTimeoutError(f"ranks {slow} did not finish {method} within {timeout:.0f}s{setting}: hung",
                                         rank=slow[0] if len(slow) == 1 else -1)
            ref = ready[0]
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except RayActorError as e:
                rank = ranks[i]
                raise WorkerDiedError(f"worker rank {rank} on node {self._node(rank)} died ({_exit_kind(e)})",
                                      rank=rank, detail=_one_line(e)) from e
            except RayTaskError as e:
                rank, cause = ranks[i], e.cause or e
                err = WorkerCallError(f"worker rank {rank} on node {self._node(rank)} failed in {method}: "
                                      f"{_first_line(cause)}", rank=rank, detail=type(cause).__name__)
                err.cause = cause
                raise self.blame_dead_peer(err) from e
            except UnserializableException as e:  # the worker's error could not be rebuilt here
                rank = ranks[i]
                raise WorkerCallError(f"worker rank {rank} on node {self._node(rank)} failed in {method}: "
                                      f"{_last_line(e)}", rank=rank, detail=_one_line(e)) from e

    def collect_abandoned(self, timeout_s: float = 1.0) -> None:
        """Retrieve the results of calls given up on after a fault (Ray would otherwise print
        each unretrieved error with its traceback when the reference is dropped)."""
        refs, self._abandoned = self._abandoned, []
        if not refs:
            return
        ready, rest = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - the fault was already reported once
                pass
        self._abandoned = list(rest)

    peer_ping_timeout_s = 3.0

    def blame_dead_peer(self, err: WorkerCallError) -> WorkerCallError | WorkerDiedError:
        """``err`` as the driver should report it: a rank whose collective broke because a peer
        went away (``PeerGoneError``) did not fail itself, so when Ray says another rank's
        actor is dead within ``peer_ping_timeout_s``, the fault is that rank's death (the
        reporter's line kept in the detail); otherwise ``err`` unchanged."""
        if err.detail != "PeerGoneError":
            return err
        found = self.dead_rank(self.peer_ping_timeout_s)
        if found is None:
            return err
        rank, death = found
        return WorkerDiedError(f"worker rank {rank} on node {self._node(rank)} died ({_exit_kind(death)})",
                               rank=rank, detail=f"{_one_line(death)}; reported by {err.summary}")

    def dead_rank(self, timeout_s: float) -> tuple[int, RayActorError] | None:
        """The lowest rank whose actor Ray reports dead among the ping answers that came within
        ``timeout_s`` (None when none did: ranks that merely have not answered are not dead).
        Returns as soon as a dead rank answered and every lower rank has too."""
        refs = {actor.ping.remote(): r for r, actor in enumerate(self.actors)}
        pending, dead = list(refs), {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                ray.get(ready[0])
            except RayActorError as e:
                dead[refs[ready[0]]] = e
            except Exception:  # noqa: BLE001 - an alive rank whose ping failed otherwise: not dead
                pass
            if dead and all(refs[ref] > min(dead) for ref in pending):
                break
        self._abandoned.extend(pending)
        if not dead:
            return None
        rank = min(dead)
        return rank, dead[rank]

    def responsive_ranks(self, timeout_s: float) -> list[int]:
        """Ranks whose actor answers a ping within ``timeout_s`` (not dead, not stuck in a call)."""
        refs = {actor.ping.remote(): r for r, actor in enumerate(self.actors)}
        ready, rest = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        alive = []
        for ref in ready:
            try:
                ray.get(ref)
                alive.append(refs[ref])
            except Exception:  # noqa: BLE001 - a dead actor: not responsive
                pass
        self._abandoned.extend(rest)
        return sorted(alive)

    def replace(self, ranks: Sequence[int], make_args: Callable[[int, int], tuple[tuple, dict]]) -> None:
        """Kill the actors of ``ranks`` and start new ones in the same bundles."""
        self._make_args = make_args
        for rank in ranks:
            try:
                ray.kill(self.actors[rank], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                log.debug("actor of rank %d already gone", rank, exc_info=True)
            self.actors[rank] = self._start(self.ranks[rank])

    # ---- degraded mode: serve on the survivors while replacements start -------------------

    def shrink(self, lost: Sequence[int]) -> None:
        """Drop the actors of ranks ``lost`` from the group (survivors are renumbered in order)
        and start their replacements in the freed bundles as standbys, joined by ``grow``."""
        lost = set(lost)
        for rank in sorted(lost):
            try:
                ray.kill(self.actors[rank], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                log.debug("actor of rank %d already gone", rank, exc_info=True)
            info = self.ranks[rank]
            actor = self._start(info)
            self._standby.append((info, actor, actor.process_id.remote()))
        self.actors = [a for r, a in enumerate(self.actors) if r not in lost]
        self.ranks = [info for r, info in enumerate(self.ranks) if r not in lost]
        self.num_ranks = len(self.actors)

    @property
    def num_standby(self) -> int:
        return len(self._standby)

    def standby_ready(self) -> bool:
        """True once every standby actor has started (its process answers)."""
        if not self._standby:
            return False
        refs = [ref for _, _, ref in self._standby]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def grow(self) -> None:
        """Take the standbys back in, every rank in its original (node-major) position."""
        members = [(info, actor) for info, actor in zip(self.ranks, self.actors)]
        members += [(info, actor) for info, actor, _ in self._standby]
        for _, _, ref in self._standby:
            self._abandoned.append(ref)
        self._standby = []
        members.sort(key=lambda m: m[0].bundle_order)
        self.ranks = [info for info, _ in members]
        self.actors = [actor for _, actor in members]
        self.num_ranks = len(self.actors)

    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None, timeout_s: float | None = None,
             **kwargs: Any) -> list:
        """Run one method on the given ranks (default all) with the same arguments, waiting at
        most ``timeout_s`` (default ``call_timeout_s``)."""
        ranks = list(range(self.num_ranks)) if ranks is None else list(ranks)
        refs = [getattr(self.actors[r], method).remote(*args, **kwargs) for r in ranks]
        return self.wait(refs, method, ranks, timeout_s)

    def call_each(self, method: str, per_rank_args: Sequence[tuple], timeout_s: float | None = None) -> list:
        """Run one method on every rank with per-rank positional arguments."""
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return self.wait(refs, method, list(range(self.num_ranks)), timeout_s)

    def shutdown(self, *, remove_group: bool = True, timeout_s: float = 10.0) -> None:
        """Kill the actors and remove the placement group (idempotent). The removal is bounded
        by ``timeout_s``: during interpreter or signal teardown the GCS may not answer."""
        self.kill_actors()
        pg, self.pg = self.pg, None
        if pg is not None and remove_group:
            import threading

            remover = threading.Thread(target=_remove_quietly, args=(pg,), daemon=True)
            remover.start()
            remover.join(timeout_s)
            if remover.is_alive():
                log.warning("placement group removal did not finish within %.0fs", timeout_s)


def _exit_kind(error: BaseException) -> str:
    """Why an actor died, in a few words (Ray's message holds ids, pids and OOM advice)."""
    text = str(error)
    if "ray.kill" in text:
        return "killed by the driver"
    if "node has died" in text or "node is dead" in text:
        return "its node was lost"
    return "its process exited"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _last_line(error: BaseException) -> str:
    """The last line of an error's text: for an error Ray could not rebuild, the worker's
    traceback ends with the exception's own "module.Class: message" line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _one_line(error: BaseException) -> str:
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def _remove_quietly(pg) -> None:
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed, or the cluster is going away
        log.debug("placement group already removed", exc_info=True)
