"""Stopping a server with requests in flight (SIGTERM): those that finish within ``GRACE_S`` finish;
the rest end with a 503 the client can read (JSON, or an SSE error event then ``[DONE]`` once a
stream has started), not a cut connection or a plain-text 500 with a traceback per request in the
log; the server exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from launch.serve import DRAIN_S, GRACE_S


def _one(base: str, stream: bool, started: threading.Event) -> tuple:
    body = {"prompt": "a", "max_tokens": 1500, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        return "plain", r.status_code, r.json()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return "stream", r.status_code, r.json()
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                started.set()
        return "stream", 200, events


def test_sigterm_ends_requests_still_running_with_a_503_and_exits_0(tiny_ckpt_with_tokenizer, tmp_path):
    from parallel.groups import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launch", "serve", "--model", str(tiny_ckpt_with_tokenizer),
                             "--port", str(port), "--dtype", "float32", "--max-num-seqs", "1", "--log-level",
                             "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    results: dict[int, tuple] = {}
    started = threading.Event()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _one(base, i % 2 == 0, started)))
                   for i in range(6)]  # 9,000 tokens one sequence at a time: more than GRACE_S of work
        for t in threads:
            t.start()
        assert started.wait(60), "no stream started"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=GRACE_S + DRAIN_S + 30)
        for t in threads:
            t.join(timeout=30)
    finally:
        proc.kill()
    log = proc.stdout.read().decode()
    assert rc == 0 and "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert len(results) == 6
    ended_by_stop = 0
    for kind, status, body in results.values():
        if kind == "stream" and status == 200:  # finished, or its error event then [DONE]
            assert body[-1] == "[DONE]", body[-3:]
            last = json.loads(body[-2])
            if "error" in last:
                ended_by_stop += 1
                assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]
            else:
                assert last["choices"][0]["finish_reason"] == "length"
        elif status == 503:
            ended_by_stop += 1
            assert body["error"]["type"] == "service_unavailable" and "shutting down" in body["error"]["message"]
        else:
            assert status == 200 and body["choices"][0]["finish_reason"] == "length", (status, body)
    assert ended_by_stop >= 1
