"""SIGTERM to a multi-rank ``generate`` (``kill PID``, ``ray job stop``), whenever it lands (while the
local cluster starts, while the ranks load, mid-run): one "terminated" line, exit status 143, and no
process of its session left. Before, ``ray.init`` replaced the CLI's handler with Ray's
``sys.exit(15)``: exit status 15, and one landing inside ``ray.init`` left its agents running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def session_members(sid: int) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if line.split()[1] == str(sid)]


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [1.0, 4.0, 12.0])
def test_sigterm_to_a_multi_rank_generate_exits_143_and_leaves_nothing(tiny_ckpt, tmp_path, delay_s):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": [5 + i, 6, 7], "max_tokens": 2000, "ignore_eos": True,
                                       "temperature": 0}) + "\n" for i in range(32)))
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "launch", "generate", "--model", str(tiny_ckpt), "--input",
                             str(src), "--output", str(tmp_path / "out.jsonl"), "-dp", "2",
                             "--enable-expert-parallel"],
                            cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(delay_s)
        assert proc.poll() is None, "generate finished before the signal: give it more work"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 143 and out.rstrip().endswith("terminated"), out[-3000:]
        assert "Traceback" not in out and not (tmp_path / "out.jsonl").exists()
        deadline = time.monotonic() + 30
        while session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(1)
        assert session_members(proc.pid) == []
    finally:
        proc.kill()
        for line in session_members(proc.pid):
            os.kill(int(line.split()[0]), signal.SIGKILL)
