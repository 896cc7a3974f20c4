"""The OpenAI server on the real engine: ``AsyncLLM`` on a tiny DeepSeek-V3 checkpoint, single process.

Collected always; skipped (with the reason) only while ``launch/async_llm.py`` does not
exist. Two servers run in background threads on free loopback ports: ``main`` (roomy)
and ``small`` (one running sequence, a one-deep queue, started from a hand-made
expert-location dump so the placement round trip is checked through the engine).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from safetensors.torch import load_file

from launch.server import build_app

pytestmark = pytest.mark.skipif(importlib.util.find_spec("launch.async_llm") is None,
                                reason="launch/async_llm.py (AsyncLLM, the lead's engine front end) has not landed")

MAX_MODEL_LEN = 96


class LiveServer:
    """``AsyncLLM.from_config(cfg)`` + ``build_app`` under uvicorn, all in one background event loop."""

    def __init__(self, cfg) -> None:
        from parallel.groups import free_port
        self.cfg = cfg
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.engine = None
        self.server = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # surfaced by __enter__
            self.error = exc
            self._ready.set()

    async def _main(self) -> None:
        from launch.async_llm import AsyncLLM
        self.engine = AsyncLLM.from_config(self.cfg)
        try:
            app = build_app(self.engine, self.cfg.server)
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
            self.server.install_signal_handlers = lambda: None  # not the main thread
            self._ready.set()
            await self.server.serve()
        finally:
            await self.engine.shutdown()

    def __enter__(self) -> LiveServer:
        self._thread.start()
        self._ready.wait(timeout=120)
        deadline = time.monotonic() + 60
        while self.error is None and not (self.server is not None and self.server.started):
            if time.monotonic() > deadline:
                raise RuntimeError("live server did not start")
            time.sleep(0.02)
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self._thread.join(timeout=30)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def runtime_config(ckpt: Path, dist_dir: Path, **server):
    from launch.config import RuntimeConfig
    return RuntimeConfig.from_dict({
        "model": str(ckpt),
        "engine": {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64, "block_size": 8,
                   "max_num_seqs": server.pop("max_num_seqs", 8)},
        "server": {"expert_distribution_dir": str(dist_dir), **server},
    })


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt_with_tokenizer) -> Path:
    return tiny_ckpt_with_tokenizer


@pytest.fixture(scope="module")
def main_server(ckpt, tmp_path_factory):
    with LiveServer(runtime_config(ckpt, tmp_path_factory.mktemp("dist"), max_queue_len=64)) as srv:
        yield srv


def wait_until(predicate, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def engine_idle(srv: LiveServer) -> bool:
    s = srv.engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0


def test_completions_text_and_token_ids(main_server):
    client = main_server.client()
    out = client.completions.create(model=main_server.cfg.served_model_name, prompt="The quick brown fox",
                                    max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    prompt_ids = main_server.engine.tokenizer.encode("The quick brown fox")
    assert out.usage.prompt_tokens == len(prompt_ids)
    again = client.completions.create(model=main_server.cfg.served_model_name, prompt=prompt_ids, max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == out.choices[0].text  # same ids as the text prompt, greedy
    batch = client.completions.create(model=main_server.cfg.served_model_name, prompt=[prompt_ids, [5, 6, 7]],
                                      max_tokens=3, n=2, temperature=0.8, seed=1, extra_body={"ignore_eos": True})
    assert len(batch.choices) == 4 and batch.usage.completion_tokens == 12
    assert batch.usage.prompt_tokens == len(prompt_ids) + 3


def test_chat_and_streamed_chat_with_usage(main_server):
    client = main_server.client()
    msgs = [{"role": "user", "content": "Tell me about experts."}]
    full = client.chat.completions.create(model=main_server.cfg.served_model_name, messages=msgs, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=main_server.cfg.served_model_name, messages=msgs, max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_vllm_prompt_and_text_fields_on_the_real_tokenizer(main_server):
    """continue_final_message (an assistant prefill through the checkpoint's template),
    truncate_prompt_tokens and skip_special_tokens, each against what the tokenizer itself gives."""
    client, name, tok = main_server.client(), main_server.cfg.served_model_name, main_server.engine.tokenizer
    msgs = [{"role": "user", "content": "Tell me about experts."}, {"role": "assistant", "content": "Experts are"}]
    cont = client.chat.completions.create(model=name, messages=msgs, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True, "continue_final_message": True,
                                                      "add_generation_prompt": False})
    open_ids = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    open_ids = tok.encode(open_ids, add_special_tokens=False) if isinstance(open_ids, str) else open_ids
    assert cont.usage.prompt_tokens == len(open_ids)
    assert tok.decode(open_ids).endswith("Experts are")  # the message is left open, not closed
    prompt_ids = tok.encode("The quick brown fox jumps")
    short = client.completions.create(model=name, prompt="The quick brown fox jumps", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True, "truncate_prompt_tokens": 2})
    direct = client.completions.create(model=name, prompt=prompt_ids[-2:], max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert short.usage.prompt_tokens == 2 and short.choices[0].text == direct.choices[0].text
    eos = tok.eos_token_ids[0]
    kept = client.completions.create(model=name, prompt=[eos, *prompt_ids[-3:]], max_tokens=1, temperature=0,
                                     echo=True, extra_body={"skip_special_tokens": False})
    dropped = client.completions.create(model=name, prompt=[eos, *prompt_ids[-3:]], max_tokens=1, temperature=0,
                                        echo=True)
    assert kept.choices[0].text.startswith(tok.decode([eos], skip_special_tokens=False))
    assert not dropped.choices[0].text.startswith(tok.decode([eos], skip_special_tokens=False))


@pytest.mark.parametrize("body,status", [
    (b"{oops", 400),
    ({"prompt": "x", "max_tokens": -1}, 400),
    ({"prompt": "x", "max_tokens": 10**6}, 400),
    ({"prompt": [0, 10**7]}, 400),
    ({"prompt": [3] * (MAX_MODEL_LEN + 1)}, 400),
    ({"prompt": "x", "model": "no-such-model"}, 404),
    ({"prompt": "x", "temperature": "hot"}, 400),
])
def test_bad_requests_and_server_keeps_serving(main_server, body, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(main_server.base_url + "/v1/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = main_server.client().completions.create(model=main_server.cfg.served_model_name, prompt=[1, 2, 3],
                                                 max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_disconnecting_stream_frees_its_blocks(main_server):
    assert wait_until(lambda: engine_idle(main_server))
    body = {"prompt": [4, 5, 6, 7], "max_tokens": 80, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", main_server.base_url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        assert main_server.engine.stats().kv_cache_usage > 0
    assert wait_until(lambda: engine_idle(main_server)), main_server.engine.stats()


def test_clients_disconnecting_at_any_moment_leave_the_engine_healthy(ckpt, tmp_path):
    """Non-streaming clients give up 0-9 ms after sending (while their request is being
    added, waiting or running) next to a busy stream: every one is aborted and freed.
    (Its own server, so that a failure here cannot take the other tests' engine down.)"""
    with LiveServer(runtime_config(ckpt, tmp_path, max_queue_len=64)) as srv:
        check_disconnects_at_any_moment(srv)


def check_disconnects_at_any_moment(main_server: LiveServer) -> None:
    body = {"prompt": [4, 5, 6, 7], "max_tokens": 40, "ignore_eos": True}
    with httpx.stream("POST", main_server.base_url + "/v1/completions", json=dict(body, stream=True),
                      timeout=30) as busy:
        lines = busy.iter_lines()
        next(lines)
        for i in range(20):
            try:
                r = httpx.post(main_server.base_url + "/v1/completions", json=body,
                               timeout=httpx.Timeout(10, read=0.001 * (i % 10)))
                assert r.status_code == 200, r.text  # too fast to give up on: must still be served
            except (httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError):
                pass
    assert wait_until(lambda: engine_idle(main_server)), main_server.engine.stats()
    ok = main_server.client().completions.create(model=main_server.cfg.served_model_name, prompt=[1, 2],
                                                 max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2
    assert httpx.get(main_server.base_url + "/health").status_code == 200


def test_metrics_report_engine_numbers(main_server):
    text = httpx.get(main_server.base_url + "/metrics").text
    name = main_server.cfg.served_model_name
    for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "moe:layer_balancedness"):
        assert f'{metric}{{' in text and f'model_name="{name}"' in text, metric
    gen = next(ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total{"))
    assert float(gen.split()[-1]) > 0
    assert "vllm:time_to_first_token_seconds_count" in text


def test_expert_distribution_dump(main_server):
    url, client = main_server.base_url, main_server.client()
    assert httpx.post(url + "/start_expert_distribution_record").status_code == 200
    client.completions.create(model=main_server.cfg.served_model_name, prompt=[9, 8, 7, 6], max_tokens=4,
                              extra_body={"ignore_eos": True})
    assert httpx.post(url + "/stop_expert_distribution_record").status_code == 200
    r = httpx.post(url + "/dump_expert_distribution_record")
    assert r.status_code == 200, r.text
    tensors = load_file(r.json()["path"])
    mc = main_server.engine.model_config
    count = tensors["logical_count"]
    assert count.ndim == 3 and count.shape[1:] == (len(mc.moe_layer_ids), mc.num_experts)
    assert count.sum() >= 4 * mc.num_experts_per_tok
    assert tensors["phy2log"].shape == (len(mc.moe_layer_ids), mc.num_experts)


def test_bench_serve_against_live_server(main_server, ckpt, tmp_path, capsys):
    from launch.bench.serve import main
    rc = main(["--base-url", main_server.base_url, "--tokenizer", str(ckpt), "--num-prompts", "4",
               "--random-input-len", "12", "--random-output-len", "6", "--max-concurrency", "2",
               "--disable-tqdm", "--result-filename", str(tmp_path / "bench.json")])
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 4 and result["total_output_tokens"] == 24 and result["total_input_tokens"] == 48
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert result[key] > 0, key
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_queue_full_503_and_init_expert_location(ckpt, tmp_path):
    """One running slot, queue of one: the third request gets 503; the placement comes from a dump."""
    from launch.expert_location import write_expert_distribution_dump
    from moe.config import ModelConfig
    mc = ModelConfig.from_hf(ckpt)
    num_layers, num_experts = len(mc.moe_layer_ids), mc.num_experts
    phy2log = torch.stack([torch.roll(torch.arange(num_experts), i + 1) for i in range(num_layers)])
    dump = write_expert_distribution_dump(tmp_path, torch.ones(1, num_layers, num_experts, dtype=torch.int64),
                                          phy2log)
    cfg = runtime_config(ckpt, tmp_path / "dumps", max_queue_len=1, max_num_seqs=1,
                         init_expert_location=str(dump))
    with LiveServer(cfg) as srv, ThreadPoolExecutor(1) as pool:
        body = {"prompt": [4, 5, 6], "max_tokens": 60, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()
            next(lines)
            # Hold the first request in its slot (no engine steps) until the queue has been tried:
            # on a fast CPU its 60 tokens could otherwise finish before the second request queues.
            resume = threading.Event()
            engine, step = srv.engine.engine, srv.engine.engine.step
            engine.step = lambda: step() if resume.is_set() else time.sleep(0.01) or []
            second = pool.submit(httpx.post, srv.base_url + "/v1/completions",
                                 json={"prompt": [7, 8], "max_tokens": 2, "ignore_eos": True}, timeout=60)
            assert wait_until(lambda: srv.engine.stats().num_waiting == 1)
            third = httpx.post(srv.base_url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=30)
            assert third.status_code == 503 and "retry-after" in third.headers
            resume.set()
        assert second.result().status_code == 200
        assert wait_until(lambda: engine_idle(srv))
        r = httpx.post(srv.base_url + "/dump_expert_distribution_record")
        assert torch.equal(load_file(r.json()["path"])["phy2log"], phy2log)  # dump -> init -> same placement
        out = srv.client().completions.create(model=cfg.served_model_name, prompt=[3, 4], max_tokens=3,
                                              extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3


def test_python_m_launch_serve_cli(ckpt, tmp_path):
    """The real command line: serve on a free port, answer, exit cleanly on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    from parallel.groups import free_port
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "launch", "serve", "--model", str(ckpt), "--port", str(port),
                             "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "32",
                             "--api-key", "sk-test", "--served-model-name", "tiny", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return proc.poll() is not None
        assert wait_until(healthy, timeout=90) and proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert httpx.get(base + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, proc.stdout.read().decode()[-3000:]
