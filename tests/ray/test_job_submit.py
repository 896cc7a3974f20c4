"""The README's multi-node flow on a real head, as written: ``ray start --head`` (which turns on
Ray 2.60's token authentication, because a token exists, as on any machine where Ray ran
before), then ``python -m launch submit ... -- python -m launch generate``. The head runs in
its own process group with its own HOME (its token), temp dir and free ports (so it can run
beside another Ray on this machine), killed at the end. Ray still binds a few fixed ports of
its own: run it rarely."""

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
    home = Path(tempfile.mkdtemp(prefix="rjhome", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update({"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})
    # A machine where Ray ran before holds ~/.ray/auth_token; `ray start --head` then turns
    # token authentication on (Ray 2.60).
    subprocess.run([str(bindir / "ray"), "get-auth-token", "--generate"], env=env, check=True,
                   capture_output=True, timeout=120)
    assert (home / ".ray" / "auth_token").is_file()
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    dash = free_port()
    # Every port the head binds is picked free: another Ray on this machine (a test's
    # ray.init with a dashboard) may hold a default one, e.g. the job agent's 52365, and then
    # the head never gets a job agent ("No available agent to submit job").
    ports = [arg for flag in ("--port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                              "--ray-client-server-port", "--metrics-export-port", "--runtime-env-agent-port",
                              "--node-manager-port", "--object-manager-port")
             for arg in (flag, str(free_port()))]
    head = subprocess.Popen(
        [str(bindir / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), *ports, "--num-cpus", "2",
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
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.slow
def test_job_submit_generate(ray_head, tmp_path):
    from launch.tiny_checkpoint import make_tiny_checkpoint

    address, env = ray_head
    with pytest.raises(urllib.error.HTTPError) as unauthorised:  # the head does want a token
        urllib.request.urlopen(f"{address}/api/version", timeout=10)
    assert unauthorised.value.code == 401
    model = make_tiny_checkpoint("deepseek_v3", tmp_path / "ck")
    prompts = [{"prompt": "The expert load"}, {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 4}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    dst = tmp_path / "out.jsonl"
    job = ["--address", address, "--working-dir", str(REPO), "--", "python", "-m", "launch", "generate",
           "--model", str(model), "--input", str(src), "--output", str(dst), "--data-parallel-size", "4",
           "--enable-expert-parallel", "--max-tokens", "6", "--temperature", "0", "--dtype", "float32"]
    # What Ray's own client does with that head: no token sent, so it is refused.
    bare = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "submit", *job], env=env,
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bare.returncode != 0 or not dst.exists()
    assert "Missing authentication token" in bare.stdout + bare.stderr
    # The README's command.
    done = subprocess.run([sys.executable, "-m", "launch", "submit", *job], env=env, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [6, 4]
    with LLM(str(model), dtype="float32") as llm:
        ref = llm.generate([{"prompt": "The expert load"}, {"prompt_token_ids": [5, 6, 7, 8]}],
                           [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=4)])
    assert [r["token_ids"] for r in rows] == [list(o.outputs[0].token_ids) for o in ref]
    assert rows[0]["text"] == ref[0].outputs[0].text
