"""A real ``ray start --head`` + ``ray job submit ... python -m launch generate`` round trip,
started and stopped by the test (the head runs in its own process group, killed at the end)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from launch import LLM, SamplingParams
from parallel.groups import free_port

REPO = Path(__file__).resolve().parents[2]




def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # answering (e.g. 401 under Ray's token auth) is up
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


@pytest.fixture
def ray_head():
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_USAGE_STATS_ENABLED": "0", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "RAY_AUTH_MODE": "disabled"}  # loopback-only test cluster: no token to hand around
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    dash = free_port()
    head = subprocess.Popen(
        [str(bindir / "ray"), "start", "--head", "--block", "--port", str(free_port()), "--node-ip-address",
         "127.0.0.1", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--num-cpus", "2",
         "--disable-usage-stats", "--temp-dir", temp],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{dash}/api/version", 120)
        yield f"http://127.0.0.1:{dash}", env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        try:
            os.killpg(head.pid, signal.SIGKILL)  # stragglers left in the group
        except ProcessLookupError:
            pass
        shutil.rmtree(temp, ignore_errors=True)


def test_job_submit_generate(ray_head, tmp_path):
    from launch.tiny_checkpoint import make_tiny_checkpoint

    address, env = ray_head
    model = make_tiny_checkpoint("deepseek_v3", tmp_path / "ck")
    prompts = [{"prompt": "The expert load"}, {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    dst = tmp_path / "out.jsonl"
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", address, "--working-dir",
           str(REPO), "--", "python", "-m", "launch", "generate", "--model", str(model), "--input", str(src),
           "--output", str(dst), "--data-parallel-size", "4", "--enable-expert-parallel", "--max-tokens", "6",
           "--temperature", "0", "--dtype", "float32"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [6, 4]
    with LLM(str(model), dtype="float32") as llm:
        ref = llm.generate([{"prompt": "The expert load"}, {"prompt_token_ids": [5, 6, 7, 8]}],
                           [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=4)])
    assert [r["token_ids"] for r in rows] == [list(o.outputs[0].token_ids) for o in ref]
    assert rows[0]["text"] == ref[0].outputs[0].text
