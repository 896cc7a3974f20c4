"""``python -m launch bench serve`` end to end against the server on the fake engine (loopback)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from launch.bench.serve import main, sample_random_requests
from launch.server import build_app
from tests.unit.server_fakes import VOCAB, FakeEngine, ServerThread

RESULT_KEYS = ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
               "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
               "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "percentiles",
               "input_lens", "output_lens", "ttfts", "itls", "errors")


def test_bench_serve_against_fake_server(tmp_path, capsys):
    engine = FakeEngine(max_running=3)
    cfg = SimpleNamespace(api_key="k", served_model_name="served", max_queue_len=64, expert_distribution_dir=None)
    with ServerThread(build_app(engine, cfg)) as srv:
        rc = main(["--base-url", srv.base_url, "--api-key", "k", "--vocab-size", str(VOCAB),
                   "--num-prompts", "8", "--random-input-len", "6", "--random-output-len", "5",
                   "--random-range-ratio", "0.5", "--request-rate", "200", "--burstiness", "0.5",
                   "--max-concurrency", "4", "--goodput", "ttft:5000", "tpot:5000", "--seed", "3",
                   "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                   "--result-filename", "r.json"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    result = json.loads((tmp_path / "r.json").read_text())
    for key in RESULT_KEYS:
        assert key in result, key
    assert result["model_id"] == "served"
    assert result["completed"] == 8 and result["errors"] == [""] * 8
    assert result["total_input_tokens"] == sum(result["input_lens"])
    drawn = sample_random_requests(8, 6, 5, 0.5, VOCAB, seed=3, avoid_ids=())
    assert result["input_lens"] == [r.prompt_len for r in drawn]
    assert result["output_lens"] == [r.output_len for r in drawn]  # ignore_eos: exact drawn lengths
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert result["request_goodput"] == result["request_throughput"] > 0
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["p99_itl_ms"] >= result["median_itl_ms"] > 0
    assert result["mean_tpot_ms"] > 0


def test_bench_serve_reports_failures_and_bad_flags(capsys):
    engine = FakeEngine(max_model_len=16)
    cfg = SimpleNamespace(api_key=None, served_model_name=None, max_queue_len=64, expert_distribution_dir=None)
    with ServerThread(build_app(engine, cfg)) as srv:
        # prompts of 32 tokens never fit a 16-token model: every request fails with a 400
        rc = main(["--base-url", srv.base_url, "--vocab-size", str(VOCAB), "--num-prompts", "2",
                   "--random-input-len", "32", "--random-output-len", "2", "--disable-tqdm"])
        assert rc == 1
        assert "Failed requests:" in capsys.readouterr().out
        assert main(["--base-url", srv.base_url, "--num-prompts", "2", "--disable-tqdm"]) == 2
        assert "--vocab-size" in capsys.readouterr().out
        assert main(["--base-url", srv.base_url, "--vocab-size", "9", "--goodput", "nope:1"]) == 2
