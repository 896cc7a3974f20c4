"""A local Ray cluster puts every rank on this host: a layout whose rank processes cannot all fit in
the memory available is refused in one line before Ray starts (it started them all and the host ran
out of memory)."""

from __future__ import annotations

import pytest

from launch.cluster import ClusterError
from launch.executor import RayExecutor, local_ranks_memory_problem
from launch.worker import WorkerSpec

MIB, GIB = 2**20, 2**30


def test_ranks_that_fit_pass_and_unknown_figures_refuse_nothing() -> None:
    assert local_ranks_memory_problem(8, 300 * MIB, 21 * GIB) is None
    assert local_ranks_memory_problem(70, 300 * MIB, 21 * GIB) is None  # 20.5 GiB: a lower bound that fits
    assert local_ranks_memory_problem(1000, None, 21 * GIB) is None
    assert local_ranks_memory_problem(1000, 300 * MIB, None) is None


def test_ranks_past_the_memory_are_named_with_how_many_fit() -> None:
    problem = local_ranks_memory_problem(1000, 300 * MIB, 21 * GIB)
    assert problem is not None and "\n" not in problem
    assert problem.startswith("1000 ranks on this machine (a local Ray cluster) need at least 292.97 GiB")
    assert "over the 21.00 GiB available: at most about 71 fit" in problem


def test_the_executor_refuses_before_starting_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import launch.cluster as cluster

    def never(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "connect_ray", never)
    with pytest.raises(ClusterError, match=r"^100000 ranks on this machine \(a local Ray cluster\)"):
        RayExecutor(WorkerSpec(model_path="unused", dp=100000))

