"""Prometheus metrics for ``/metrics``: vLLM's names where they exist, ours under ``moe:``.

Each app owns a ``CollectorRegistry`` (two servers in one process never share
series). Latency histograms are observed by the server as outputs stream;
engine-wide numbers (queue depths, token totals, KV usage, prefix cache, expert
balance) are read from ``engine.stats()`` at scrape time by ``EngineStatsCollector``,
so they can never drift from the engine's own counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# (metric name, EngineStats attribute, help); vLLM's names first.
_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    ("moe:balancedness", "balancedness", "Mean over max rank load, summed over MoE layers (1.0 is perfect)."),
    ("moe:engine_state", "engine_state", "0 serving, 1 recovering from a worker fault, 2 stopped."),
    ("moe:worker_ranks_missing", "num_missing_ranks", "Ranks a degraded group serves without (0 at full size)."),
    ("moe:expert_distribution_steps_buffered", "expert_distribution_steps_buffered",
     "Steps the expert-distribution record holds for the next dump (at most its buffer size)."),
)
# Counters: prometheus_client appends the ``_total`` suffix on exposition.
_COUNTERS = (
    ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    ("vllm:prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
    ("moe:tokens_dropped", "tokens_dropped", "Token-expert assignments dropped by expert capacity."),
    ("moe:tokens_rerouted", "tokens_rerouted", "Token-expert assignments rerouted by expert capacity."),
    ("moe:rebalances", "num_rebalances", "Expert rebalances applied."),
    ("moe:rebalance_seconds", "rebalance_seconds_total", "Seconds spent rebalancing experts."),
    ("moe:expert_copies_moved", "expert_copies_moved", "Expert weight copies moved between slots."),
    ("moe:worker_faults", "num_worker_faults", "Worker ranks lost: died, failed a collective or hung."),
    ("moe:engine_recoveries", "num_recoveries", "Worker groups rebuilt after a fault."),
    ("moe:engine_recovery_seconds", "recovery_seconds_total", "Seconds from worker faults to serving again."),
    ("moe:requests_retried", "num_requests_retried", "Requests requeued from scratch after a worker fault."),
    ("moe:requests_failed", "num_requests_failed", "Requests ended with an error by a worker fault."),
    ("moe:expert_distribution_steps_dropped", "expert_distribution_steps_dropped",
     "Recorded steps dropped from the full expert-distribution buffer before a dump."),
)


def _scalar(value: Any) -> float | None:
    """A stats field as one number: per-DP-rank sequences (e.g. KV usage of each rank's pool,
    pools of equal size) are averaged."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return sum(float(v) for v in value) / len(value) if value else None
    return float(value)


class EngineStatsCollector(Collector):
    """Reads ``stats()`` at scrape time and exposes it with a ``model_name`` label.

    ``moe:layer_balancedness{layer}`` carries ``stats.balancedness_per_layer`` [L_moe],
    labelled with the model's MoE layer ids when ``moe_layer_ids`` matches its length.
    A stats field the engine does not report is left out rather than reported as 0.
    """

    def __init__(self, stats: Callable[[], Any], model_name: str,
                 moe_layer_ids: tuple[int, ...] | None = None) -> None:
        self._stats = stats
        self._model_name = model_name
        self._moe_layer_ids = moe_layer_ids

    def describe(self) -> list[Metric]:
        return []  # dynamic: nothing to check at registration time

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, attr, doc in _GAUGES:
            value = _scalar(getattr(stats, attr, None))
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self._model_name], float(value))
                yield family
        for name, attr, doc in _COUNTERS:
            value = _scalar(getattr(stats, attr, None))
            if value is not None:
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self._model_name], float(value))
                yield family
        per_layer = getattr(stats, "balancedness_per_layer", None)
        if per_layer is not None:
            values = [float(v) for v in per_layer]
            ids = self._moe_layer_ids if self._moe_layer_ids and len(self._moe_layer_ids) == len(values) \
                else tuple(range(len(values)))
            family = GaugeMetricFamily("moe:layer_balancedness",
                                       "Per MoE layer: mean rank load / max rank load (1.0 is perfect).",
                                       labels=["model_name", "layer"])
            for layer, value in zip(ids, values):
                family.add_metric([self._model_name, str(layer)], value)
            yield family


class ServerMetrics:
    """The registry of one app: per-request latency histograms plus the engine collector."""

    def __init__(self, model_name: str, stats: Callable[[], Any] | None = None,
                 moe_layer_ids: tuple[int, ...] | None = None) -> None:
        self.model_name = model_name
        disable_created_metrics()  # as vLLM does: no *_created series next to every counter
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token in seconds.",
                              labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                    labels, buckets=TOKEN_BUCKETS, registry=self.registry).labels(model_name)
        self.generation_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                        labels, buckets=TOKEN_BUCKETS, registry=self.registry
                                        ).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.aborted = Counter("moe:requests_aborted", "Requests aborted (client gone or error).",
                               labels, registry=self.registry).labels(model_name)
        self.rejected = Counter("moe:requests_rejected", "Requests rejected, by HTTP status.",
                                ["model_name", "status"], registry=self.registry)
        if stats is not None:
            self.registry.register(EngineStatsCollector(stats, model_name, moe_layer_ids))

    def request_timer(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)

    def on_rejected(self, status_code: int) -> None:
        self.rejected.labels(self.model_name, str(status_code)).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one engine request's TTFT, inter-token latencies and end-to-end latency.

    Fed each cumulative ``RequestOutput``; an output carrying k new tokens after dt
    seconds counts as k tokens dt / k apart.
    """

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._metrics = metrics
        self._clock = clock
        self._num_prompt_tokens = num_prompt_tokens
        self._arrival = clock()
        self._first: float | None = None
        self._last = self._arrival
        self._num_tokens = 0
        self._done = False

    def on_output(self, out: Any) -> None:
        if self._done:
            return
        now = self._clock()
        num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        new = num_tokens - self._num_tokens
        if new > 0:
            if self._first is None:
                self._first = self._last = now
                self._metrics.ttft.observe(now - self._arrival)
                new -= 1
            if new > 0:
                gap = (now - self._last) / new
                for _ in range(new):
                    self._metrics.itl.observe(gap)
            self._last = now
            self._num_tokens = num_tokens
        if out.finished:
            self._done = True
            self._metrics.e2e.observe(now - self._arrival)
            self._metrics.prompt_len.observe(self._num_prompt_tokens)
            self._metrics.generation_len.observe(self._num_tokens)
            if self._first is not None and self._num_tokens > 1:
                self._metrics.tpot.observe((now - self._first) / (self._num_tokens - 1))
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "unknown"
            self._metrics.success.labels(self._metrics.model_name, str(reason)).inc()

    def on_abort(self) -> None:
        if not self._done:
            self._done = True
            self._metrics.aborted.inc()
