"""A Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the sweep's engine
starts its local Ray cluster (``launch.cluster.connect_ray``) leaves no Ray process behind: before,
one landing inside ``ray.init`` left the raylet's dashboard and runtime-env agents running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from launch.cluster import connect_ray
    threading.Timer(float(sys.argv[1]), lambda: os.killpg(os.getpgrp(), signal.SIGINT)).start()
    try:
        connect_ray(num_cpus=1)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    print("not interrupted", flush=True)
""")


def group_members(pgid: int) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.split()[1] == str(pgid)]


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.5, 1.5])
def test_ctrl_c_while_the_local_cluster_starts_leaves_no_ray_process(delay_s):
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(delay_s)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 130 and "interrupted" in out, out[-2000:]
        deadline = time.monotonic() + 20
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(1)
        assert group_members(proc.pid) == []
    finally:
        for line in group_members(proc.pid):
            os.kill(int(line.split()[0]), signal.SIGKILL)
