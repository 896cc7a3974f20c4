"""``python -m launch bench serve`` end to end against the server on the fake engine (loopback)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from launch.bench import serve as bench_serve
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
        # ids drawn from a vocabulary the server does not say it lacks: every request fails with a 400
        rc = main(["--base-url", srv.base_url, "--vocab-size", "100000", "--num-prompts", "2",
                   "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm"])
        assert rc == 1
        printed = capsys.readouterr()
        assert "Failed requests:" in printed.out
        assert printed.err == "error: all 2 requests failed (reasons above)\n"
        assert main(["--base-url", srv.base_url, "--num-prompts", "2", "--disable-tqdm"]) == 2
        printed = capsys.readouterr()
        assert "--vocab-size" in printed.err and printed.out == ""
        assert main(["--base-url", srv.base_url, "--vocab-size", "9", "--goodput", "nope:1"]) == 2


def test_failed_requests_print_their_reasons(capsys):
    engine = FakeEngine(max_model_len=16)
    cfg = SimpleNamespace(api_key="k", served_model_name=None, max_queue_len=64, expert_distribution_dir=None)
    with ServerThread(build_app(engine, cfg)) as srv:
        common = ["--base-url", srv.base_url, "--vocab-size", str(VOCAB), "--num-prompts", "3",
                  "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm"]
        # a wrong key: /v1/models answers 401, so the named model is sent to unchecked and every request fails
        assert main([*common, "--api-key", "wrong", "--model", "fake-moe"]) == 1
        out = capsys.readouterr().out
        reasons = out.split("Failure reasons (requests x reason):\n")[1].splitlines()
        assert len(reasons) == 1 and reasons[0].startswith("  3 x HTTP 401: ")
        assert "API key" in reasons[0]  # the server's reason
        # a model the server does not serve is refused before any request is sent
        assert main([*common, "--api-key", "k", "--model", "no-such-model"]) == 2
        printed = capsys.readouterr()
        assert printed.out == ""
        assert printed.err == f"error: --model no-such-model is not served by {srv.base_url}; it serves: fake-moe\n"


@pytest.mark.parametrize("flags,line", [
    (["--metric-percentiles", "101"], "error: --metric-percentiles must be in [0, 100], got 101"),
    (["--metric-percentiles", "50,-1"], "error: --metric-percentiles must be in [0, 100], got -1"),
    (["--metric-percentiles", "nan"], "error: --metric-percentiles must be in [0, 100], got nan"),
    (["--metric-percentiles", "abc"],
     "error: --metric-percentiles takes comma-separated numbers in [0, 100], got 'abc'"),
    (["--metric-percentiles", "99,"], "error: --metric-percentiles takes comma-separated numbers in [0, 100], got ''"),
    (["--random-prefix-len", "-3"], "error: --random-prefix-len must be >= 0, got -3"),
    (["--random-range-ratio", "1"], "error: --random-range-ratio must be in [0, 1), got 1.0"),
    (["--num-prompts", "0"], "error: --num-prompts must be >= 1, got 0"),
    (["--random-output-len", "-1"], "error: --random-output-len must be >= 1, got -1"),
    (["--max-concurrency", "0"], "error: --max-concurrency must be >= 1 (omit it for no limit), got 0"),
    (["--max-concurrency", "-2"], "error: --max-concurrency must be >= 1 (omit it for no limit), got -2"),
])
def test_bad_flags_are_refused_before_contacting_the_server(monkeypatch, capsys, flags, line):
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    assert main(["--vocab-size", "9", "--disable-tqdm", *flags]) == 2
    printed = capsys.readouterr()
    assert printed.err == line + "\n" and printed.out == ""


def test_unwritable_result_paths_are_refused_up_front(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    monkeypatch.chdir(tmp_path)
    regular = tmp_path / "file"
    regular.write_text("x")
    cases = [(["--save-result", "--result-dir", str(regular)], f"error: --result-dir: {regular} exists and is not a directory"),
             (["--result-filename", "file/r.json"], f"error: --result-filename: {regular} is not a directory"),
             (["--result-filename", "."], "error: --result-filename: . is a directory"),
             (["--result-dir", str(tmp_path), "--result-filename", "file/r.json"],
              "error: --result-filename must be a plain file name (no path separator, not . or ..) inside "
              "--result-dir, got 'file/r.json'"),
             (["--result-dir", str(tmp_path), "--result-filename", "."],
              "error: --result-filename must be a plain file name (no path separator, not . or ..) inside "
              "--result-dir, got '.'")]
    for flags, line in cases:
        assert main(["--vocab-size", "9", "--disable-tqdm", *flags]) == 2
        assert capsys.readouterr().err == line + "\n"
    # without --save-result or --result-filename nothing is written, so --result-dir is not checked
    monkeypatch.setattr(bench_serve, "resolve_target", _no_server)
    assert main(["--vocab-size", "9", "--result-dir", str(regular)]) == 2
    assert capsys.readouterr().err == "error: no server\n"


async def _refuse(*args, **kwargs):
    raise AssertionError("the server was contacted for bad input")


async def _no_server(*args, **kwargs):
    raise ValueError("no server")
