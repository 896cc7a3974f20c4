"""launch.sweep.shared_cluster on a fake Ray: one local cluster for a sweep's multi-rank points, started
at the first, shut down at the end, on Ctrl-C and on errors; left alone when Ray is reached otherwise."""

from __future__ import annotations

import subprocess
import time

import pytest

from launch.sweep import runner, shared_cluster
from launch.sweep.report import read_rows
from launch.sweep.shared_cluster import SharedCluster
from tests.unit.test_sweep_runner import fake_run, sweep_base_args


class FakeRay:
    """ray.is_initialized / ray.shutdown and launch.cluster.connect_ray, counted."""

    def __init__(self, monkeypatch) -> None:
        import ray

        import launch.cluster

        self.initialized, self.num_starts, self.num_shutdowns = False, 0, 0
        monkeypatch.setattr(ray, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(ray, "shutdown", self.shutdown)
        monkeypatch.setattr(launch.cluster, "connect_ray", self.connect)
        monkeypatch.setattr(shared_cluster, "cluster_leftovers", lambda: None)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def connect(self, address=None, *, num_cpus=None) -> bool:
        assert address is None and not self.initialized
        self.initialized, self.num_starts = True, self.num_starts + 1
        return True

    def shutdown(self) -> None:
        self.initialized, self.num_shutdowns = False, self.num_shutdowns + 1


@pytest.fixture
def fake_ray(monkeypatch) -> FakeRay:
    return FakeRay(monkeypatch)


def test_one_start_for_every_multi_rank_point_none_for_one_rank(fake_ray):
    with SharedCluster(4) as cluster:
        cluster.acquire(1)
        assert fake_ray.num_starts == 0  # a one-rank point runs in this process
        for _ in range(3):
            cluster.acquire(2)
            cluster.release()
        assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (1, 0)
    assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (1, 1) and not fake_ray.initialized
    cluster.close()  # idempotent
    assert fake_ray.num_shutdowns == 1


def test_a_cluster_it_did_not_start_is_left_alone(fake_ray, monkeypatch):
    fake_ray.initialized = True  # a connection this process already has (a test's ray.init, ...)
    with SharedCluster(4) as cluster:
        cluster.acquire(2)
        cluster.release()
    assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (0, 0)
    fake_ray.initialized = False
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # inside `ray job submit`: each engine joins it
    with SharedCluster(4) as cluster:
        cluster.acquire(2)
    assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (0, 0)


def test_a_cluster_that_does_not_drain_is_restarted_for_the_next_point(fake_ray, monkeypatch):
    left = iter(["1 placement group(s)", None])
    monkeypatch.setattr(shared_cluster, "wait_until_drained", lambda timeout_s: next(left))
    with SharedCluster(4) as cluster:
        cluster.acquire(2)
        cluster.release()  # something of the point is left: shut down
        assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (1, 1)
        cluster.acquire(2)
        cluster.release()
    assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (2, 2)


def dp2_sweep_args(tmp_path) -> list[str]:
    args = sweep_base_args(tmp_path)
    base = tmp_path / "base.yaml"
    base.write_text(base.read_text() + "parallel: {data_parallel_size: 2, enable_expert_parallel: true}\n")
    return [*args, "engine.max_num_seqs=[2,3,4]"]


def cluster_run(config, workload, *, cluster=None, **_kw):
    """fake_run between the shared cluster's acquire and release, as run_point does."""
    cluster.acquire(config.parallel.world_size)
    try:
        return fake_run(config, workload)
    finally:
        cluster.release()


def test_the_sweep_starts_one_cluster_and_shuts_it_down_at_the_end(fake_ray, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_point", cluster_run)
    assert runner.main(dp2_sweep_args(tmp_path)) == 0
    assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (1, 1)
    assert [r["status"] for r in read_rows(tmp_path / "out" / "results.jsonl")] == ["ok"] * 3


def test_ctrl_c_in_a_point_shuts_the_shared_cluster_down(fake_ray, tmp_path, monkeypatch, capsys):
    def interrupted_on_second(config, workload, *, cluster=None, **kw):
        if config.engine.max_num_seqs == 3:
            cluster.acquire(2)
            raise KeyboardInterrupt
        return cluster_run(config, workload, cluster=cluster)

    monkeypatch.setattr(runner, "run_point", interrupted_on_second)
    assert runner.main(dp2_sweep_args(tmp_path)) == runner.EXIT_INTERRUPTED
    assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (1, 1) and not fake_ray.initialized
    assert "interrupted: 1 of 3 runs recorded" in capsys.readouterr().err


def test_an_error_that_ends_the_sweep_shuts_the_shared_cluster_down(fake_ray, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "run_point", cluster_run)

    def disk_full(path, row):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner.report, "append_row", disk_full)
    with pytest.raises(OSError, match="No space left"):
        runner.main(dp2_sweep_args(tmp_path))
    assert (fake_ray.num_starts, fake_ray.num_shutdowns) == (1, 1) and not fake_ray.initialized


def test_actor_processes_are_titled_descendants_other_than_idle_workers_and_agents():
    titles = ["ray::Worker", "ray::IDLE", "ray::DashboardAgent"]
    procs = [subprocess.Popen(["bash", "-c", f'exec -a "{t}" sleep 30']) for t in titles]
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(shared_cluster.actor_processes()) < 1:
            time.sleep(0.05)
        assert shared_cluster.actor_processes() == [procs[0].pid]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert shared_cluster.actor_processes() == []


def test_cluster_cpus_fits_the_widest_point(monkeypatch):
    monkeypatch.setattr(shared_cluster.os, "cpu_count", lambda: 2)
    assert shared_cluster.cluster_cpus([1, 2, 4]) == 4
    assert shared_cluster.cluster_cpus([1]) == 2
