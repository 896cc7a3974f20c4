"""bench serve's metric math on hand-made timings, its dataset and arrival process."""

from __future__ import annotations

import math

import numpy as np
import pytest

from launch.bench.serve import (
    arrival_intervals,
    compute_metrics,
    compute_tpot,
    failure_reasons,
    format_summary,
    parse_goodput,
    parse_percentiles,
    sample_random_requests,
    summarize,
)
from launch.bench.serve_client import RequestOutcome


def outcome(ttft, latency, itl, out, prompt_len=10, success=True):
    return RequestOutcome(prompt_len=prompt_len, success=success, ttft=ttft, latency=latency, itl=list(itl),
                          output_tokens=out)


def test_tpot_is_decode_time_per_token_after_the_first():
    assert compute_tpot(outcome(0.1, 1.1, [], 11)) == pytest.approx(0.1)
    assert compute_tpot(outcome(0.2, 0.2, [], 1)) == 0.0
    assert compute_tpot(outcome(0.0, 0.0, [], 0)) == 0.0


def test_summarize_matches_hand_computed_percentiles():
    stats = summarize([0.1, 0.2, 0.3], [50, 99, 99.9])
    assert stats["mean"] == pytest.approx(200.0)
    assert stats["median"] == pytest.approx(200.0)
    assert stats["std"] == pytest.approx(math.sqrt((100**2 + 0 + 100**2) / 3))
    assert stats["p99"] == pytest.approx(200 + 0.98 * 100)  # linear interpolation at rank 1.98
    assert stats["p99.9"] == pytest.approx(200 + 0.998 * 100)
    assert summarize([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_compute_metrics_on_hand_made_timings():
    outs = [outcome(0.1, 0.5, [0.1, 0.1, 0.2], 5, prompt_len=10),   # tpot = 0.4 / 4 = 0.1
            outcome(0.3, 1.3, [0.5, 0.5], 3, prompt_len=20),        # tpot = 1.0 / 2 = 0.5
            outcome(0.2, 0.2, [], 1, prompt_len=30),                # one token: no tpot sample
            outcome(0.0, 0.0, [], 0, prompt_len=40, success=False)]
    r = compute_metrics(outs, 2.0, slos_ms={"ttft": 250, "tpot": 200}, percentiles=[99])
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 60 and r["total_output_tokens"] == 9
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(4.5)
    assert r["total_token_throughput"] == pytest.approx(34.5)
    # good: #1 (ttft 100, tpot 100) and #3 (ttft 200, tpot 0); #2 misses both SLOs.
    assert r["request_goodput"] == pytest.approx(1.0)
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(300.0) and r["median_tpot_ms"] == pytest.approx(300.0)
    assert r["mean_itl_ms"] == pytest.approx(1400 / 5) and r["median_itl_ms"] == pytest.approx(200.0)
    assert r["p99_itl_ms"] == pytest.approx(np.percentile([100, 100, 200, 500, 500], 99))
    assert r["mean_e2el_ms"] == pytest.approx(2000 / 3)
    assert r["p99_e2el_ms"] == pytest.approx(np.percentile([500, 1300, 200], 99))
    assert r["std_ttft_ms"] == pytest.approx(np.std([100, 300, 200]))
    assert r["percentiles"]["ttft"] == [[99.0, r["p99_ttft_ms"]]]
    assert r["output_lens"] == [5, 3, 1, 0] and r["input_lens"] == [10, 20, 30, 40]
    no_slo = compute_metrics(outs, 2.0, slos_ms={}, percentiles=[99])
    assert no_slo["request_goodput"] is None
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(outs, 0.0, slos_ms={}, percentiles=[99])


def test_goodput_e2el_slo():
    outs = [outcome(0.1, 0.5, [], 5), outcome(0.1, 1.5, [], 5)]
    r = compute_metrics(outs, 1.0, slos_ms={"e2el": 1000}, percentiles=[99])
    assert r["request_goodput"] == pytest.approx(1.0)


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "tpot:50.5", "e2el:1000"]) == {"ttft": 200.0, "tpot": 50.5, "e2el": 1000.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_random_dataset_lengths_ids_and_determinism():
    reqs = sample_random_requests(200, 100, 20, 0.5, 50, prefix_len=4, seed=7, avoid_ids=(0, 49))
    assert len(reqs) == 200
    in_lens = [r.prompt_len - 4 for r in reqs]
    out_lens = [r.output_len for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150 and len(set(in_lens)) > 20
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert ids <= set(range(1, 49)) and len(ids) == 48
    assert len({tuple(r.prompt_token_ids[:4]) for r in reqs}) == 1  # shared prefix
    again = sample_random_requests(200, 100, 20, 0.5, 50, prefix_len=4, seed=7, avoid_ids=(0, 49))
    assert again == reqs
    fixed = sample_random_requests(3, 16, 8, 0.0, 1000, seed=1)
    assert [r.prompt_len for r in fixed] == [16] * 3 and [r.output_len for r in fixed] == [8] * 3
    with pytest.raises(ValueError, match="range-ratio"):
        sample_random_requests(3, 16, 8, 1.0, 1000)
    with pytest.raises(ValueError, match="--random-prefix-len must be >= 0, got -3"):
        sample_random_requests(3, 16, 8, 0.0, 1000, prefix_len=-3)


def test_arrivals_poisson_and_gamma():
    assert arrival_intervals(5, float("inf"), 1.0, 0) == [0.0] * 5
    poisson = np.array(arrival_intervals(20000, 10.0, 1.0, 0))
    assert poisson.mean() == pytest.approx(0.1, rel=0.03)
    assert (poisson.std() / poisson.mean()) ** 2 == pytest.approx(1.0, rel=0.05)  # exponential: CV^2 = 1
    bursty = np.array(arrival_intervals(20000, 10.0, 0.25, 0))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)  # gamma: CV^2 = 1 / shape
    with pytest.raises(ValueError, match="burstiness"):
        arrival_intervals(3, 1.0, 0.0, 0)


def test_summary_table_has_vllms_rows():
    outs = [outcome(0.1, 0.5, [0.1, 0.1, 0.2], 5)]
    r = compute_metrics(outs, 1.0, slos_ms={"ttft": 500}, percentiles=[99])
    text = format_summary(r, max_concurrency=4, request_rate=2.0, percentiles=[99])
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for row in ("Successful requests:", "Maximum request concurrency:", "Request rate configured (RPS):",
                "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                "Request throughput (req/s):", "Request goodput (req/s):", "Output token throughput (tok/s):",
                "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):",
                "Mean E2EL (ms):"):
        assert any(line.startswith(row) for line in lines), row
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert next(ln for ln in lines if ln.startswith("Mean TTFT")).split()[-1] == "100.00"


def test_parse_percentiles():
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert parse_percentiles("0,100") == [0.0, 100.0]
    for bad in ("101", "-0.5", "abc", "inf", "50,,99"):
        with pytest.raises(ValueError, match="--metric-percentiles"):
            parse_percentiles(bad)


def test_failure_reasons_most_common_first_with_counts():
    errors = ["", "HTTP 400: too\n  long", "HTTP 404: no model", "HTTP 400: too long", "", "boom", "x" * 300, "z"]
    assert failure_reasons(errors, limit=2) == ["2 x HTTP 400: too long", "1 x HTTP 404: no model",
                                                "... and 3 other distinct reason(s)"]
    assert failure_reasons(["x" * 300], width=10) == ["1 x xxxxxxx..."]
    assert failure_reasons(["", ""]) == []


def test_summary_lists_failure_reasons_after_the_table():
    outs = [outcome(0.1, 0.5, [0.1], 2), outcome(0, 0, [], 0, success=False)]
    outs[1].error = "HTTP 400: prompt too long"
    r = compute_metrics(outs, 1.0, slos_ms={}, percentiles=[99])
    lines = format_summary(r, max_concurrency=None, request_rate=float("inf"), percentiles=[99]).splitlines()
    assert lines[-3:] == ["=" * 50, "Failure reasons (requests x reason):", "  1 x HTTP 400: prompt too long"]
