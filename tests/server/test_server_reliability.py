"""Tests that break the real server: schema fuzzing, overload, client disconnects and a soak.

One ``python -m launch serve`` process on a tiny DeepSeek-V3 checkpoint (one rank, loopback,
an API key), shared by the tests of this module. Every test ends by checking that the server
is healthy and its metrics are back to idle (nothing running, nothing waiting, no KV blocks
held). Figures (examples tried, statuses seen, RSS) are printed with ``-s`` and recorded in
docs/reliability.md. Knobs: ``MOE_FUZZ_EXAMPLES`` (per endpoint, default 200),
``MOE_SOAK_SECONDS`` (default 90).
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from parallel.groups import free_port

REPO = Path(__file__).resolve().parents[2]
KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NUM_SEQS = 2
MAX_QUEUE_LEN = 8
MAX_MODEL_LEN = 96
FUZZ_EXAMPLES = int(os.environ.get("MOE_FUZZ_EXAMPLES", "200"))
SOAK_SECONDS = float(os.environ.get("MOE_SOAK_SECONDS", "90"))
REQUEST_TIMEOUT_S = 120.0  # a request that takes longer counts as a hang

pytestmark = pytest.mark.slow  # (the folder is slow too)


class Server:
    """``python -m launch serve`` in its own process group, on a free loopback port."""

    def __init__(self, model: Path, dump_dir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "launch", "serve", "--model", str(model), "--port", str(self.port),
               "--api-key", KEY, "--dtype", "float32", "--max-num-seqs", str(MAX_NUM_SEQS),
               "--max-queue-len", str(MAX_QUEUE_LEN), "--max-model-len", str(MAX_MODEL_LEN),
               "--expert-distribution-dir", str(dump_dir), "--expert-distribution-recorder-buffer-size", "16",
               "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("server did not become healthy within 180 s")

    def rss(self) -> int:
        """Resident bytes of the server process and its children (none on one rank)."""
        proc = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_ckpt_with_tokenizer):
    root = tmp_path_factory.mktemp("reliability")
    srv = Server(tiny_ckpt_with_tokenizer, root / "dumps", root / "server.log")
    try:
        yield srv
    finally:
        srv.stop()


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {series name (labels dropped): value}, summed over label sets."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([-+0-9.eEinfa]+)$", line)
        if m:
            out[m.group(1)] += float(m.group(3))
    return out


def assert_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Healthy, and metrics back to idle within ``timeout``: nothing running or waiting, no KV held."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"])
        if idle == (0, 0, 0):
            break
        assert time.monotonic() < deadline, f"not idle after {timeout:.0f}s: running/waiting/kv = {idle}"
        time.sleep(0.2)
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    return m


def completion(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    return client.post(url + "/v1/completions", json=body, headers=AUTH, timeout=REQUEST_TIMEOUT_S)


# ---------------------------------------------------------------- schema fuzzing


def test_schema_fuzz_no_5xx_no_hang(server):
    """schemathesis draws bodies from the server's own /openapi.json (valid ones and, in
    negative mode, ones that break the schema) for both generation endpoints."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    doc = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=30).json()
    schema = schemathesis.openapi.from_dict(doc)
    tried: collections.Counter = collections.Counter()
    statuses: collections.Counter = collections.Counter()
    server_errors: list[str] = []
    slowest = [0.0]
    session = httpx.Client()

    def check(path: str, mode: GenerationMode) -> None:
        operation = schema[path]["POST"]

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def one(case) -> None:
            kwargs = case.as_transport_kwargs(base_url=server.url)
            started = time.monotonic()
            r = session.request(kwargs["method"], kwargs["url"], headers={**AUTH, **(kwargs.get("headers") or {})},
                                content=_body_bytes(kwargs), timeout=REQUEST_TIMEOUT_S)
            slowest[0] = max(slowest[0], time.monotonic() - started)
            tried[path] += 1
            statuses[r.status_code] += 1
            stream_failed = r.status_code == 200 and '"type":"internal_error"' in r.text
            if r.status_code >= 500 or stream_failed:
                server_errors.append(f"{path} {r.status_code} {_body_bytes(kwargs)!r:.300} -> {r.text[:300]}")

        one()

    for path in ("/v1/completions", "/v1/chat/completions"):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            check(path, mode)
    session.close()
    print(f"\nfuzz: tried {dict(tried)}, statuses {dict(sorted(statuses.items()))}, "
          f"5xx {len(server_errors)}, slowest {slowest[0]:.2f}s")
    assert sum(tried.values()) >= FUZZ_EXAMPLES  # hypothesis may stop early only on exhausted input
    assert not server_errors, "\n".join(server_errors[:10])
    assert statuses[200] > 0 and statuses[400] > 0  # both accepted and rejected bodies were tried
    assert_idle(server.url)


def _body_bytes(kwargs: dict) -> bytes | None:
    if "json" in kwargs:
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("data")
    return data.encode() if isinstance(data, str) else data


# ---------------------------------------------------------------- overload


def test_overload_gets_503_and_nothing_is_lost(server):
    """3x more concurrent requests than running slots + queue: each one either completes with
    the greedy answer or gets 503 + Retry-After; the 503s succeed when sent again."""
    n = 3 * (MAX_NUM_SEQS + MAX_QUEUE_LEN)
    body = {"prompt": "The expert load", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    before = metrics(server.url)
    with httpx.Client() as client:
        reference = completion(client, server.url, body).json()["choices"][0]["text"]
        with ThreadPoolExecutor(n) as pool:
            responses = list(pool.map(lambda _: completion(client, server.url, body), range(n)))
        codes = collections.Counter(r.status_code for r in responses)
        print(f"\noverload: {n} concurrent -> {dict(codes)}")
        assert set(codes) <= {200, 503} and codes[503] > 0 and codes[200] >= MAX_NUM_SEQS
        for r in responses:
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                assert choice["text"] == reference and choice["finish_reason"] == "length"
                assert r.json()["usage"]["completion_tokens"] == 16
            else:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "server_overloaded"
                # one wording whether the server's check or the engine's turned it away
                assert re.fullmatch(rf"The server is overloaded: \d+ requests are waiting \(max_queue_len="
                                    rf"{MAX_QUEUE_LEN}\)\. Retry later\.", r.json()["error"]["message"]), r.json()
        retried = [completion(client, server.url, body) for r in responses if r.status_code == 503]
        assert all(r.status_code == 200 and r.json()["choices"][0]["text"] == reference for r in retried)
    after = assert_idle(server.url)
    completed = codes[200] + len(retried) + 1
    success = after["vllm:request_success_total"] - before["vllm:request_success_total"]
    assert success == completed  # every request the server accepted finished, none vanished
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 16 * completed
    assert after["moe:requests_rejected_total"] - before["moe:requests_rejected_total"] == codes[503]


# ---------------------------------------------------------------- disconnects


def test_client_disconnects_abort_requests(server):
    """Streams closed after two chunks, and non-streaming requests whose client times out,
    are aborted: counted, not finished, KV freed, metrics idle."""
    long = {"prompt": "Disconnect me", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "wait"}], **long}
    # The client's timeout is a quarter of what the whole request took just before, so the client
    # leaves mid-generation however fast the engine is (a fixed timeout was outrun). Other load on
    # the box can end between the two (a request then finishes inside its timeout): such a request
    # is counted as finished and the pair is tried again, up to five times.

    def calibrated_timeout() -> float:
        start = time.monotonic()
        assert httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=REQUEST_TIMEOUT_S,
                          json=chat).status_code == 200
        return (time.monotonic() - start) / 4

    client_timeout = calibrated_timeout()
    before = metrics(server.url)
    for _ in range(3):
        with httpx.Client() as client, client.stream("POST", server.url + "/v1/completions", headers=AUTH,
                                                     json={**long, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            chunks = 0
            while chunks < 2:
                if next(lines).startswith("data: {"):
                    chunks += 1
        # leaving the block closes the connection mid-stream
    timed_out = completed = 0
    for attempt in range(5):
        if attempt:
            client_timeout = calibrated_timeout()
            completed += 1  # the calibration request finishes
        try:
            httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=client_timeout, json=chat)
            completed += 1
        except httpx.ReadTimeout:
            timed_out += 1
            if timed_out == 2:
                break
    assert timed_out == 2, f"the client timeout ({client_timeout * 1e3:.0f} ms) was outrun five times"
    after = assert_idle(server.url)
    aborted = after["moe:requests_aborted_total"] - before["moe:requests_aborted_total"]
    # request_success_total counts aborts too, under finished_reason="abort" (as vLLM)
    finished = after["vllm:request_success_total"] - before["vllm:request_success_total"] - aborted
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    print(f"\ndisconnects: aborted {aborted:.0f}, finished {finished:.0f}, tokens generated {generated:.0f} "
          f"(of {(5 + completed) * long['max_tokens']} asked, {completed} finished; client timeout {client_timeout * 1e3:.0f} ms)")
    # every request ends once, aborted or finished; a timed-out one the engine ends before the
    # server sees its client gone (a loaded box) is finished, not aborted: at most one such
    assert aborted + finished == 5 + completed and aborted >= 4
    assert generated < (5 + completed) * long["max_tokens"]


# ---------------------------------------------------------------- soak


def test_soak_rss_flat_and_metrics_idle(server):
    """Steady load (3 clients, mixed endpoints, streaming and not, n up to 2: at most 6 engine
    requests, within running slots + queue, so none is turned away; expert distribution
    recording on throughout) for MOE_SOAK_SECONDS: no failure, server RSS flat
    (after warm-up, growth within max(32 MiB, 10 %)), the record stays within its buffer,
    metrics back to idle."""
    stop = threading.Event()
    outcomes: collections.Counter = collections.Counter()
    errors: list[str] = []
    lock = threading.Lock()
    assert httpx.post(server.url + "/start_expert_distribution_record", headers=AUTH).status_code == 200

    def client_loop(seed: int) -> None:
        i = 0
        with httpx.Client() as client:
            while not stop.is_set():
                i += 1
                kind = (seed + i) % 4
                try:
                    if kind == 0:
                        r = completion(client, server.url, {"prompt": f"soak {seed} {i}", "max_tokens": 8})
                    elif kind == 1:
                        r = client.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=REQUEST_TIMEOUT_S,
                                        json={"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 8,
                                              "n": 2, "temperature": 0.8, "seed": i})
                    elif kind == 2:
                        r = completion(client, server.url, {"prompt": [5, 6, 7, i % 400 + 2], "max_tokens": 12,
                                                            "stream": True, "logprobs": 2})
                    else:
                        r = completion(client, server.url, {"prompt": "x", "max_tokens": 6, "min_p": 0.1,
                                                            "stop": ["."], "temperature": 1.0})
                    key = r.status_code
                except httpx.HTTPError as exc:
                    key = type(exc).__name__
                with lock:
                    outcomes[key] += 1
                    if key != 200:
                        errors.append(f"{kind}: {key}")

    samples: list[tuple[float, int]] = []
    started = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        for seed in range(3):
            pool.submit(client_loop, seed)
        while time.monotonic() - started < SOAK_SECONDS:
            samples.append((time.monotonic() - started, server.rss()))
            time.sleep(2.0)
        stop.set()
    m = assert_idle(server.url)
    dump = httpx.post(server.url + "/dump_expert_distribution_record", headers=AUTH, timeout=60)
    assert dump.status_code == 200
    from launch.expert_location import read_expert_distribution_dump

    steps = read_expert_distribution_dump(dump.json()["path"])["logical_count"].shape[0]
    warm = [rss for t, rss in samples if t >= SOAK_SECONDS / 3]
    base, peak, end = warm[0], max(warm), warm[-1]
    tolerance = max(32 << 20, base // 10)
    print(f"\nsoak: {SOAK_SECONDS:.0f}s, requests {dict(outcomes)}, RSS start {samples[0][1] / 2**20:.1f} MiB, "
          f"warm {base / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB, end {end / 2**20:.1f} MiB "
          f"(tolerance {tolerance / 2**20:.0f} MiB), record {steps} steps, "
          f"{m['moe:expert_distribution_steps_dropped_total']:.0f} dropped")
    assert not errors, errors[:10]
    assert outcomes[200] > 20
    assert end - base <= tolerance and peak - base <= tolerance
    assert steps == 16  # the recorder kept its buffer size, no more
    assert m["moe:expert_distribution_steps_dropped_total"] > 0
    assert httpx.post(server.url + "/stop_expert_distribution_record", headers=AUTH).status_code == 200


def test_auth_guards_v1_and_the_record_routes(server):
    """vLLM's rule: the key guards the routes under /v1 (an unknown one included) and, as SGLang's,
    the expert-distribution routes; /health, /ping, /version, /metrics, /tokenize, /detokenize and
    /openapi.json never need it."""
    guarded = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
               ("GET", "/v1/no-such-route"), ("POST", "/start_expert_distribution_record"),
               ("POST", "/stop_expert_distribution_record"), ("POST", "/dump_expert_distribution_record")]
    for method, path in guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, server.url + path, headers=headers, timeout=30)
            assert r.status_code == 401, (method, path, r.status_code)
    open_ = [("GET", "/health", None), ("GET", "/ping", None), ("POST", "/ping", None), ("GET", "/version", None),
             ("GET", "/metrics", None), ("GET", "/openapi.json", None), ("POST", "/tokenize", {"prompt": "a"}),
             ("POST", "/detokenize", {"tokens": [1]})]
    for method, path, body in open_:
        r = httpx.request(method, server.url + path, json=body, timeout=30)
        assert r.status_code == 200, (method, path, r.status_code, r.text)
    assert httpx.get(server.url + "/no-such-route", timeout=10).status_code == 404
    # The server listens on loopback only (the default bind).
    conns = [c for c in psutil.Process(server.proc.pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert conns and all(c.laddr.ip == "127.0.0.1" for c in conns), conns
    socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
