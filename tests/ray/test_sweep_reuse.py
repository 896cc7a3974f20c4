"""``launch sweep`` starts one local Ray cluster for all its multi-rank points (lazily, at the first)
and leaves no Ray process behind, at the end and on Ctrl-C; a point run after others on the reused
cluster gives the row it gives on a fresh one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launch.sweep import runner
from launch.sweep.report import read_rows
from moe.tiny import write_tiny_checkpoint

# what a run must reproduce whatever ran before it (times aside)
DETERMINISTIC = ("status", "num_requests", "num_output_tokens", "kv_tokens", "drop_rate", "num_steps",
                 "num_decode_steps", "ep_size", "balancedness", "expert_load")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("tiny"))


def sweep_args(tiny: Path, tmp_path: Path, grid: list[str], *extra: str) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [0, *range(3 + i, 30 + i, 3)]}) + "\n"
                               for i in range(4)))
    base = tmp_path / "base.yaml"
    base.write_text(f"model: {tiny}\nengine: {{dtype: float32, max_num_seqs: 4, memory: 32MiB}}\n")
    return ["--config", str(base), "--workload", str(prompts), "--max-tokens", "4", "--out", str(tmp_path / "out"),
            "--no-progress", "--hardware", "none", "--warmup-prompts", "2", *extra, "--grid", *grid]


def ray_processes(root: int) -> list[str]:
    """Command lines of ``root``'s descendants that belong to Ray (gcs_server, raylet, agents, workers)."""
    found = []
    for proc in psutil.Process(root).children(recursive=True):
        try:
            cmdline = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if "ray" in cmdline:
            found.append(f"{proc.pid} {cmdline[:120]}")
    return found


def wait_no_ray_processes(root: int, timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := ray_processes(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.slow
def test_one_cluster_serves_every_multi_rank_point_and_is_gone_after(tiny, tmp_path, monkeypatch):
    import ray

    import launch.cluster

    if ray.is_initialized():
        ray.shutdown()
    inits, clusters = [], []
    real_init, real_group_init = ray.init, launch.cluster.WorkerGroup.__init__

    def counted_init(*args, **kwargs):
        inits.append(kwargs.get("address"))
        return real_init(*args, **kwargs)

    def recorded_group(self, *args, **kwargs):
        clusters.append(ray.get_runtime_context().gcs_address)
        real_group_init(self, *args, **kwargs)

    monkeypatch.setattr(ray, "init", counted_init)
    monkeypatch.setattr(launch.cluster.WorkerGroup, "__init__", recorded_group)
    # EP2 first on the fresh cluster, then one rank, then a placement this one-node cluster can never
    # make (refused at once: the cluster counts as fixed), and with the repeat EP2 again after them all
    grid = ["parallel.data_parallel_size,parallel.enable_expert_parallel,parallel.placement_strategy="
            "[[2,true,PACK],[1,false,PACK],[2,true,STRICT_SPREAD]]"]
    started = time.monotonic()
    assert runner.main(sweep_args(tiny, tmp_path, grid, "--repeats", "2", "--baseline", "never")) == 0
    elapsed = time.monotonic() - started

    assert inits == ["local"], inits  # one start, for the first multi-rank point
    assert len(clusters) == 4 and len(set(clusters)) == 1, clusters  # 2 x EP2, 2 x STRICT_SPREAD
    rows = {(r["settings"]["parallel.placement_strategy"], r["settings"]["parallel.data_parallel_size"],
             r["repeat"]): r for r in read_rows(tmp_path / "out" / "results.jsonl")}
    for repeat in (0, 1):
        spread = rows[("STRICT_SPREAD", 2, repeat)]
        assert spread["status"] == "skipped" and spread["reason"].startswith("placement strategy STRICT_SPREAD")
    fresh, reused = rows[("PACK", 2, 0)], rows[("PACK", 2, 1)]
    assert fresh["status"] == "ok" and fresh["ep_size"] == 2
    assert {c: reused.get(c) for c in DETERMINISTIC} == {c: fresh.get(c) for c in DETERMINISTIC}
    assert not ray.is_initialized()
    assert wait_no_ray_processes(os.getpid()) == []
    assert elapsed < 120


SWEEP = """
import sys
from launch.sweep import runner
sys.exit(runner.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_ctrl_c_after_a_point_on_the_shared_cluster_leaves_no_ray_process(tiny, tmp_path):
    """SIGINT to the whole process group (a terminal's Ctrl-C) while the second multi-rank point runs
    on the cluster the first one started."""
    grid = ["moe.capacity_factor=[0,1.5,2]", "parallel.data_parallel_size=[2]"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("RAY_ADDRESS", None)
    results = tmp_path / "out" / "results.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", SWEEP, *sweep_args(tiny, tmp_path, grid, "--baseline", "never")],
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=Path(__file__).resolve().parents[2],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not read_rows(results) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(read_rows(results)) == 1, "the first point did not finish"
        time.sleep(1.0)  # into the second point, on the same cluster
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == runner.EXIT_INTERRUPTED, out[-2000:]
        assert "interrupted:" in out and len(read_rows(results)) < 3
        deadline = time.monotonic() + 20
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert group_members(proc.pid) == []
    finally:
        for line in group_members(proc.pid):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def group_members(pgid: int) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.split()[1] == str(pgid)]
