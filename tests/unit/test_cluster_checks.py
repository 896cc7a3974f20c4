"""launch/cluster.py's up-front checks (a dead Ray address, a placement a fixed cluster cannot make)
and the CLI's one line for the run-time errors a command lets through (launch/cli.py)."""

from __future__ import annotations

import socket
import time

import pytest

from launch import cli
from launch.cluster import ClusterError, _host_port, check_reachable, placement_problem
from launch.recovery import WorkerCallError


def _node(cpus: float, gpus: float = 0.0) -> dict:
    return {"Alive": True, "Resources": {"CPU": cpus, **({"GPU": gpus} if gpus else {})}}


def test_placements_a_fixed_cluster_cannot_make_are_named() -> None:
    one = [_node(4)]
    assert placement_problem(2, {"CPU": 1.0}, "PACK", one) is None
    assert placement_problem(4, {"CPU": 1.0}, "STRICT_PACK", one) is None
    assert "STRICT_SPREAD puts each of the 2 ranks on its own node" in placement_problem(2, {"CPU": 1.0},
                                                                                        "STRICT_SPREAD", one)
    assert placement_problem(2, {"CPU": 1.0}, "STRICT_SPREAD", [_node(2), _node(2)]) is None
    assert "no node of this cluster" in placement_problem(4, {"CPU": 1.0}, "STRICT_PACK", [_node(2), _node(2)])
    assert placement_problem(4, {"CPU": 1.0}, "SPREAD", [_node(2), _node(2)]) is None
    assert "do not fit this cluster (1 node(s) with CPU 4, GPU 0)" in placement_problem(
        2, {"CPU": 1.0, "GPU": 1.0}, "PACK", one)
    assert placement_problem(2, {"CPU": 1.0, "GPU": 1.0}, "PACK", [_node(4, gpus=2)]) is None


def test_addresses_probed_and_left_to_ray() -> None:
    assert _host_port("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert _host_port("ray://head:10001") == ("head", 10001)
    assert _host_port("[::1]:6379") == ("::1", 6379)
    for other in ("auto", "local", "http://127.0.0.1:8265", "head"):
        assert _host_port(other) is None
        check_reachable(other)  # nothing to probe: Ray resolves these


def test_a_dead_ray_address_is_refused_in_seconds(monkeypatch) -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(ClusterError, match=rf"^RAY_ADDRESS 127.0.0.1:{port}: no Ray cluster answers there"):
        check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 5
    with socket.socket() as s:  # something listening: accepted
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}")


@pytest.mark.parametrize("error, status", [
    (ClusterError("placement strategy STRICT_SPREAD puts each of the 2 ranks on its own node"), 2),
    (WorkerCallError("worker rank 1 on node 0 (ab12) failed in setup: wait timeout after 1ms", rank=1), 1),
])
def test_run_time_errors_a_command_lets_through_are_one_line(monkeypatch, capsys, error, status) -> None:
    def fails(argv: list[str]) -> int:
        raise error

    monkeypatch.setattr(cli, "load", lambda cmd: fails)
    assert cli.main(["generate"]) == status
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"error: generate: {error}"
    monkeypatch.setenv("MOE_TRACEBACK", "1")
    with pytest.raises(type(error)):
        cli.main(["generate"])


@pytest.mark.parametrize("address, message", [
    ("http://127.0.0.1:8265", "RAY_ADDRESS 'http://127.0.0.1:8265' is a dashboard URL (what `ray job submit` takes)"),
    ("127.0.0.1", "RAY_ADDRESS '127.0.0.1' is not a Ray cluster address (Invalid address format"),
])
def test_a_ray_address_that_is_not_one_is_one_line(monkeypatch, address, message) -> None:
    import ray

    from launch.cluster import connect_ray

    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ClusterError) as info:
        connect_ray()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_hung_ping_names_no_setting_but_a_call_names_step_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ping's timeout is fixed (the idle health check's 10 s): its message named
    recovery.step_timeout_s, which sets only the calls' own timeout."""
    import types

    import launch.cluster as cluster
    from launch.recovery import WorkerTimeoutError

    monkeypatch.setattr(cluster.ray, "wait", lambda refs, num_returns, timeout: ([], refs))
    group = types.SimpleNamespace(call_timeout_s=36.0, _abandoned=[])
    group._wait_all = types.MethodType(cluster.WorkerGroup._wait_all, group)
    with pytest.raises(WorkerTimeoutError, match=r"^ranks \[0\] did not finish ping within 10s: hung$"):
        cluster.WorkerGroup.wait(group, ["ref"], "ping", [0], 10.0)
    with pytest.raises(WorkerTimeoutError, match=r"did not finish execute within 36s \(recovery.step_timeout_s\): hung"):
        cluster.WorkerGroup.wait(group, ["ref"], "execute", [0])
