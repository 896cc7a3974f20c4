"""``/metrics`` against vLLM's V1 metrics: names, types, labels, buckets, and counts that stay
consistent through streaming, n > 1, aborted requests and errors.

Fake-engine tests run in-process (tests/unit/server_fakes.py); one live test reads the
engine-side numbers (phase timestamps, tokens per step) from the tiny real engine.
"""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.async_llm import EngineStats
from launch.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from launch.server import build_app
from launch.server.metrics import ServerMetrics
from tests.server.test_server_live import LiveServer, runtime_config
from tests.unit.server_fakes import FakeEngine, ServerThread

# vLLM's (vllm/v1/metrics/loggers.py) bucket upper bounds.
VLLM_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def config(**overrides):
    base = dict(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.fixture
def served():
    engine = FakeEngine(max_model_len=64)
    with ServerThread(build_app(engine, config())) as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url)


def scrape(url: str) -> dict[str, object]:
    """``/metrics`` parsed by prometheus_client's own parser: {family name: Metric}."""
    text = httpx.get(url + "/metrics").text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families, sample_name: str, **labels) -> float:
    """Sum of the samples named ``sample_name`` whose labels include ``labels``."""
    return sum(s.value for f in families.values() for s in f.samples
               if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()))


def bucket_bounds(families, name: str) -> tuple[float, ...]:
    return tuple(float(s.labels["le"]) for s in families[name].samples
                 if s.name == name + "_bucket" and s.labels["le"] != "+Inf")


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "fake-moe", "prompt": "hello", **body}, timeout=30)


def test_exposition_parses_types_labels_and_histograms_consistent(served):
    complete(served.url, max_tokens=4)
    complete(served.url, max_tokens=3, n=2)
    with httpx.stream("POST", served.url + "/v1/completions", timeout=30,
                      json={"model": "fake-moe", "prompt": "hi", "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.read()
    first = scrape(served.url)
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:request_success": "counter", "vllm:iteration_tokens_total": "histogram",
        **{f"vllm:{h}": "histogram" for h in (
            "time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
            "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
            "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
            "request_prompt_tokens", "request_generation_tokens", "request_params_n",
            "request_params_max_tokens")},
    }
    expected.pop("vllm:iteration_tokens_total")  # the fake engine reports no per-step tokens
    for name, kind in expected.items():
        assert name in first, name
        assert first[name].type == kind, (name, first[name].type)
        for sample in first[name].samples:
            assert sample.labels.get("model_name") == "fake-moe", sample
    for family in first.values():
        if family.type != "histogram":
            continue
        buckets: dict[tuple, list] = {}
        counts, sums = {}, {}
        for s in family.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            if s.name.endswith("_bucket"):
                buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                counts[key] = s.value
            elif s.name.endswith("_sum"):
                sums[key] = s.value
        for key, rows in buckets.items():
            bounds = [b for b, _ in rows]
            cumulative = [c for _, c in rows]
            assert bounds == sorted(bounds) and math.isinf(bounds[-1]), family.name
            assert cumulative == sorted(cumulative), family.name
            assert cumulative[-1] == counts[key], family.name
            assert sums[key] >= 0 and (counts[key] > 0 or sums[key] == 0), family.name
    complete(served.url, max_tokens=2)
    second = scrape(served.url)
    for family in first.values():
        if family.type != "counter":
            continue
        for s in family.samples:
            assert value(second, s.name, **s.labels) >= s.value, s


def test_vllm_bucket_boundaries(served):
    families = scrape(served.url)
    assert bucket_bounds(families, "vllm:time_to_first_token_seconds") == VLLM_TTFT
    assert bucket_bounds(families, "vllm:inter_token_latency_seconds") == VLLM_ITL
    assert bucket_bounds(families, "vllm:time_per_output_token_seconds") == VLLM_ITL
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert bucket_bounds(families, "vllm:" + name) == VLLM_REQUEST_LATENCY, name
    # token counts: 1, 2, 5, 10, ... up to max_model_len (64 for the fake engine)
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert bucket_bounds(families, "vllm:" + name) == (1, 2, 5, 10, 20, 50), name
    assert bucket_bounds(families, "vllm:request_params_n") == (1, 2, 5, 10, 20)


def test_finished_reason_series_exist_at_zero(served):
    families = scrape(served.url)
    reasons = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples}
    assert reasons == {"stop": 0.0, "length": 0.0, "abort": 0.0, "error": 0.0}


def test_client_abort_counts_as_finished_reason_abort(served):
    with httpx.stream("POST", served.url + "/v1/completions", timeout=30,
                      json={"model": "fake-moe", "prompt": "hi", "max_tokens": 40, "stream": True}) as r:
        next(r.iter_lines())  # the first chunk, then the client goes away
    deadline = time.monotonic() + 5
    while value(scrape(served.url), "vllm:request_success_total", finished_reason="abort") < 1:
        assert time.monotonic() < deadline, "abort never counted"
    families = scrape(served.url)
    assert value(families, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(families, "vllm:request_success_total", finished_reason="length") == 0
    assert value(families, "moe:requests_aborted_total") == 1
    # the aborted request is one finished request everywhere: E2E and token histograms counted once
    assert value(families, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(families, "vllm:request_generation_tokens_count") == 1
    assert 1 <= value(families, "vllm:request_generation_tokens_sum") < 40


def test_time_per_output_token_counts_tokens_not_requests(served):
    complete(served.url, max_tokens=5)
    families = scrape(served.url)
    # vLLM observes one inter-token gap per generated token after the first
    assert value(families, "vllm:inter_token_latency_seconds_count") == 4
    assert value(families, "vllm:time_per_output_token_seconds_count") == 4
    assert value(families, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(families, "vllm:time_to_first_token_seconds_count") == 1


def test_n_and_max_tokens_params_and_per_choice_counts(served):
    r = complete(served.url, max_tokens=4, n=3)
    assert r.status_code == 200
    families = scrape(served.url)
    assert value(families, "vllm:request_params_n_count") == 1
    assert value(families, "vllm:request_params_n_sum") == 3
    assert value(families, "vllm:request_params_max_tokens_count") == 3
    assert value(families, "vllm:request_params_max_tokens_sum") == 12
    assert value(families, "vllm:request_success_total", finished_reason="length") == 3
    assert value(families, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(families, "vllm:request_generation_tokens_sum") == 12


def test_streaming_counts_match_non_streaming(served):
    with httpx.stream("POST", served.url + "/v1/completions", timeout=30,
                      json={"model": "fake-moe", "prompt": "hi", "max_tokens": 6, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert lines and json.loads(lines[-1][6:])["choices"][0]["finish_reason"] == "length"
    families = scrape(served.url)
    assert value(families, "vllm:request_success_total", finished_reason="length") == 1
    assert value(families, "vllm:request_generation_tokens_sum") == 6
    assert value(families, "vllm:time_to_first_token_seconds_count") == 1


def test_engine_error_and_rejections_do_not_count_as_success(served):
    r = complete(served.url, prompt="x" * 80, max_tokens=2)  # longer than max_model_len: the engine refuses
    assert r.status_code == 400
    families = scrape(served.url)
    assert value(families, "vllm:request_success_total") == 0
    assert value(families, "vllm:e2e_request_latency_seconds_count") == 0


def output(tokens: int, finished: bool, reason: str | None, **times) -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", list(range(tokens)), reason)], finished,
                         metrics=RequestMetrics(**times))


def test_phase_histograms_from_engine_timestamps():
    metrics = ServerMetrics("m")
    timer = metrics.request_timer(3)
    timer.on_output(output(1, False, None, arrival_time=10.0))
    timer.on_output(output(3, True, "stop", arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.25,
                           last_token_time=13.25, finished_time=13.25))
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    assert value(families, "vllm:request_queue_time_seconds_sum") == 0.5
    assert value(families, "vllm:request_prefill_time_seconds_sum") == 0.75
    assert value(families, "vllm:request_decode_time_seconds_sum") == 2.0
    assert value(families, "vllm:request_inference_time_seconds_sum") == 2.75
    assert value(families, "vllm:request_success_total", finished_reason="stop") == 1


def test_deprecated_aliases_and_iteration_tokens_from_stats():
    stats = EngineStats(kv_cache_usage=0.25, prefix_cache_queries=10, prefix_cache_hits=4,
                        iteration_tokens_counts=[1, 2] + [0] * 11 + [1], iteration_tokens_sum=20000)
    metrics = ServerMetrics("m", stats=lambda: stats)
    families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
    assert value(families, "vllm:gpu_cache_usage_perc") == 0.25 == value(families, "vllm:kv_cache_usage_perc")
    assert value(families, "vllm:gpu_prefix_cache_queries_total") == 10
    assert value(families, "vllm:gpu_prefix_cache_hits_total") == 4
    assert bucket_bounds(families, "vllm:iteration_tokens_total") == VLLM_ITERATION_TOKENS
    assert value(families, "vllm:iteration_tokens_total_bucket", le="8.0") == 3
    assert value(families, "vllm:iteration_tokens_total_count") == 4
    assert value(families, "vllm:iteration_tokens_total_sum") == 20000


@pytest.fixture(scope="module")
def live(tiny_ckpt_with_tokenizer, tmp_path_factory):
    with LiveServer(runtime_config(tiny_ckpt_with_tokenizer, tmp_path_factory.mktemp("dist"), max_queue_len=8)) as srv:
        yield srv


def test_live_engine_phases_and_iteration_tokens(live):
    r = httpx.post(live.base_url + "/v1/completions", timeout=60,
                   json={"prompt": "hello world", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    families = scrape(live.base_url)
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    steps = value(families, "vllm:iteration_tokens_total_count")
    assert steps >= 4  # one prefill step (or more chunks), then a step per further token
    assert value(families, "vllm:iteration_tokens_total_sum") == prompt_tokens + 3
    for name in ("queue", "prefill", "decode", "inference"):
        assert value(families, f"vllm:request_{name}_time_seconds_count") == 1, name
    inference = value(families, "vllm:request_inference_time_seconds_sum")
    parts = value(families, "vllm:request_prefill_time_seconds_sum") + \
        value(families, "vllm:request_decode_time_seconds_sum")
    assert inference == pytest.approx(parts)
    assert inference <= value(families, "vllm:e2e_request_latency_seconds_sum") + 1e-3


def test_a_non_streamed_disconnect_is_an_abort_not_a_rejection():
    """A client that leaves before its non-streamed answer is an abort (as one that leaves a stream),
    never also a 4xx in moe:requests_rejected_total: no answer was sent (it counted a 499 there)."""
    engine = FakeEngine(max_model_len=64, step_s=0.05)  # 60 tokens: 3 s
    with ServerThread(build_app(engine, config())) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.base_url + "/v1/completions", timeout=0.3,
                       json={"model": "fake-moe", "prompt": "hi", "max_tokens": 60})
        deadline = time.monotonic() + 10
        while value(scrape(srv.base_url), "moe:requests_aborted_total") < 1:
            assert time.monotonic() < deadline, "abort never counted"
            time.sleep(0.05)
        families = scrape(srv.base_url)
        assert value(families, "vllm:request_success_total", finished_reason="abort") == 1
        assert value(families, "moe:requests_rejected_total") == 0
