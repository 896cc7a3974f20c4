"""Prometheus metrics for ``/metrics``: vLLM's names where they exist, ours under ``moe:``.

Each app owns a ``CollectorRegistry`` (two servers in one process never share
series). Latency histograms are observed by the server as outputs stream;
engine-wide numbers (queue depths, token totals, KV usage and pool config, prefix cache,
expert balance) are read from ``engine.stats()`` at scrape time by ``EngineStatsCollector``,
so they can never drift from the engine's own counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from launch.core.outputs import ITERATION_TOKEN_BUCKETS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM pre-creates request_success_total for every finish reason so dashboards see zeros, not gaps.
FINISHED_REASONS = ("stop", "length", "abort", "error")


def compute_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` inclusive (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


TOKEN_BUCKETS = compute_1_2_5_buckets(100000)  # when the engine reports no max_model_len

# (metric name, EngineStats attribute, help); vLLM's names first.
_GAUGES = (
    ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:gpu_cache_usage_perc", "kv_cache_usage",
     "KV-cache usage. 1 means 100 percent usage. DEPRECATED: use vllm:kv_cache_usage_perc."),
    ("moe:balancedness", "balancedness", "Mean over max rank load, summed over MoE layers, over the balancer's "
     "window (the steps since the last rebalance, at most window_size; 1.0 while it is empty). Over any "
     "interval whatever rebalanced: moe:expert_rank_tokens_total."),
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
    ("vllm:gpu_prefix_cache_queries", "prefix_cache_queries",
     "Prefix-cache queries, in tokens. DEPRECATED: use vllm:prefix_cache_queries."),
    ("vllm:gpu_prefix_cache_hits", "prefix_cache_hits",
     "Prefix-cache hits, in tokens. DEPRECATED: use vllm:prefix_cache_hits."),
    ("moe:tokens_dropped", "tokens_dropped", "Token-expert assignments dropped by expert capacity."),
    ("moe:tokens_rerouted", "tokens_rerouted", "Token-expert assignments rerouted by expert capacity."),
    ("moe:rebalances", "num_rebalances", "Expert rebalances applied."),
    ("moe:rebalance_seconds", "rebalance_seconds_total", "Seconds spent rebalancing experts."),
    ("moe:expert_copies_moved", "expert_copies_moved", "Expert weight copies moved between slots."),
    ("moe:rebalance_stays", "num_rebalance_stays",
     "Balancer checks that planned and kept the placement (a move would not pay)."),
    ("moe:rebalance_stay_seconds", "rebalance_stay_seconds_total",
     "Seconds the balancer's checks that kept the placement spent planning (in the engine's step)."),
    ("moe:worker_faults", "num_worker_faults", "Worker ranks lost: died, failed a collective or hung."),
    ("moe:engine_recoveries", "num_recoveries", "Worker groups rebuilt after a fault."),
    ("moe:engine_recovery_seconds", "recovery_seconds_total", "Seconds from worker faults to serving again."),
    ("moe:requests_retried", "num_requests_retried", "Requests requeued from scratch after a worker fault."),
    ("moe:requests_failed", "num_requests_failed", "Requests ended with an error by a worker fault."),
    ("moe:expert_distribution_steps_dropped", "expert_distribution_steps_dropped",
     "Recorded steps dropped from the full expert-distribution buffer before a dump."),
)


def compute_cache_config_labels(kv_cache: Any) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels from ``EngineStats.kv_cache`` (``launch.async_llm.KVCacheInfo``):
    vLLM's ``CacheConfig`` field names, each value ``str()`` of it as vLLM's ``metrics_info`` writes
    it ("True", "0.9", "None"); only the fields this engine has (``num_gpu_blocks`` is per DP rank)."""
    return {
        "block_size": str(kv_cache.block_size),
        "cache_dtype": str(kv_cache.cache_dtype),
        "enable_prefix_caching": str(kv_cache.enable_prefix_caching),
        "gpu_memory_utilization": str(kv_cache.memory_utilization),
        "num_gpu_blocks": str(kv_cache.num_blocks),
        "num_gpu_blocks_override": str(kv_cache.num_blocks_override),
    }


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
        counts = getattr(stats, "iteration_tokens_counts", None)
        if counts is not None and len(counts) == len(ITERATION_TOKEN_BUCKETS) + 1:
            family = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                           labels=["model_name"])
            cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
            bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
            family.add_metric([self._model_name], list(zip(bounds, cumulative)),
                              float(getattr(stats, "iteration_tokens_sum", 0)))
            yield family
        kv_cache = getattr(stats, "kv_cache", None)
        if kv_cache is not None:
            # vLLM's info metric: a gauge of 1 whose labels carry the cache config
            labels = compute_cache_config_labels(kv_cache)
            family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                       labels=["model_name", *labels])
            family.add_metric([self._model_name, *labels.values()], 1.0)
            yield family
        rank_tokens = getattr(stats, "expert_rank_tokens", None)
        if rank_tokens is not None and len(rank_tokens):
            rows = [[float(v) for v in row] for row in rank_tokens]  # [L_moe][R]
            ids = self._moe_layer_ids if self._moe_layer_ids and len(self._moe_layer_ids) == len(rows) \
                else tuple(range(len(rows)))
            family = CounterMetricFamily("moe:expert_rank_tokens",
                                         "Token-expert assignments each EP rank took per MoE layer since the start, "
                                         "under the placement in force at each step. Balancedness over an interval: "
                                         "avg by (layer) of its increase over max by (layer).",
                                         labels=["model_name", "layer", "rank"])
            for layer, row in zip(ids, rows):
                for rank, value in enumerate(row):
                    family.add_metric([self._model_name, str(layer), str(rank)], value)
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
    """The registry of one app: per-request histograms and counters plus the engine collector.

    ``max_model_len`` sets the token-count buckets (1, 2, 5, 10, ... up to it, as vLLM).
    """

    def __init__(self, model_name: str, stats: Callable[[], Any] | None = None,
                 moe_layer_ids: tuple[int, ...] | None = None, max_model_len: int | None = None) -> None:
        self.model_name = model_name
        disable_created_metrics()  # as vLLM does: no *_created series next to every counter
        self.registry = CollectorRegistry(auto_describe=True)
        token_buckets = compute_1_2_5_buckets(max_model_len) if max_model_len else TOKEN_BUCKETS

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Time per output token in seconds (per token, as inter_token_latency_seconds; "
                              "vLLM's older name).", ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Per request: (last token - first token) / (generated tokens - 1), in seconds.",
                                      ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to first scheduled, in seconds.", E2E_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Time from first scheduled to first token, in seconds.", E2E_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Time from first token to last token, in seconds.", E2E_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Time from first scheduled to last token, in seconds.", E2E_BUCKETS)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.generation_len = histogram("vllm:request_generation_tokens", "Generated tokens per request.",
                                        token_buckets)
        self.params_n = histogram("vllm:request_params_n", "The n request parameter, per prompt.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "The max_tokens request parameter, per engine request.", token_buckets)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISHED_REASONS:
            self.success.labels(model_name, reason)
        self.aborted = Counter("moe:requests_aborted", "Requests aborted (client gone or error).",
                               ["model_name"], registry=self.registry).labels(model_name)
        self.rejected = Counter("moe:requests_rejected", "Requests rejected, by HTTP status.",
                                ["model_name", "status"], registry=self.registry)
        if stats is not None:
            self.registry.register(EngineStatsCollector(stats, model_name, moe_layer_ids))

    def request_timer(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)

    def on_request(self, subs: list[Any]) -> None:
        """One API request handed to the engine as ``subs`` (P prompts x n): observes n once
        per prompt and each engine request's max_tokens (when set)."""
        per_prompt: dict[int, int] = {}
        for sub in subs:
            per_prompt[sub.prompt_index] = per_prompt.get(sub.prompt_index, 0) + 1
            if sub.params.max_tokens is not None:
                self.params_max_tokens.observe(sub.params.max_tokens)
        for n in per_prompt.values():
            self.params_n.observe(n)

    def on_rejected(self, status_code: int) -> None:
        self.rejected.labels(self.model_name, str(status_code)).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one engine request's latencies, fed each cumulative ``RequestOutput``.

    An output carrying k new tokens after dt seconds counts as k tokens dt / k apart. The
    phase histograms (queue, prefill, decode, inference) come from the engine's own
    timestamps (``out.metrics``) and are skipped when the engine does not report them. A
    request that ends without a finished output (client gone) counts as finished with
    reason "abort", as vLLM counts it.
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
        m = self._metrics
        now = self._clock()
        num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        new = num_tokens - self._num_tokens
        if new > 0:
            if self._first is None:
                self._first = self._last = now
                m.ttft.observe(now - self._arrival)
                new -= 1
            if new > 0:
                gap = (now - self._last) / new
                for _ in range(new):
                    m.itl.observe(gap)
                    m.tpot.observe(gap)
            self._last = now
            self._num_tokens = num_tokens
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "unknown"
            self._finish(now, str(reason))
            if self._first is not None and self._num_tokens > 1:
                m.request_tpot.observe((self._last - self._first) / (self._num_tokens - 1))
            self._observe_phases(getattr(out, "metrics", None))

    def on_abort(self) -> None:
        if not self._done:
            self._finish(self._clock(), "abort")
            self._metrics.aborted.inc()

    def on_error(self) -> None:
        """The engine ended the request with ``finish_reason="error"`` (a worker fault after it had
        produced output), which reaches the server as the engine's recovering / stopped error."""
        if not self._done:
            self._finish(self._clock(), "error")

    def _finish(self, now: float, reason: str) -> None:
        m = self._metrics
        self._done = True
        m.e2e.observe(now - self._arrival)
        m.prompt_len.observe(self._num_prompt_tokens)
        m.generation_len.observe(self._num_tokens)
        m.success.labels(m.model_name, reason).inc()

    def _observe_phases(self, t: Any) -> None:
        """vLLM's phases from engine timestamps: queue = first scheduled - arrival, prefill =
        first token - first scheduled, decode = last token - first token, inference = last
        token - first scheduled."""
        scheduled = getattr(t, "first_scheduled_time", None)
        first, last = getattr(t, "first_token_time", None), getattr(t, "last_token_time", None)
        if scheduled is None:
            return
        self._metrics.queue_time.observe(max(0.0, scheduled - t.arrival_time))
        if first is not None and last is not None:
            self._metrics.prefill_time.observe(max(0.0, first - scheduled))
            self._metrics.decode_time.observe(max(0.0, last - first))
            self._metrics.inference_time.observe(max(0.0, last - scheduled))
