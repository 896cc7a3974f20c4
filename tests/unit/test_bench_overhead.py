"""launch/bench_overhead.py: the step breakdown, the recording microbenchmark and ``main()``
end to end on a tiny checkpoint with one in-process rank."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from launch.bench import overhead as bench_overhead
from launch.bench.overhead import (
    StepTiming,
    TimedScheduler,
    is_pure_decode,
    measure_recording,
    summarize,
    time_call,
)
from moe.config import ModelConfig


def test_step_timing_breakdown_adds_up():
    t = StepTiming(step_ms=10.0, execute_ms=7.0, worker_ms=5.5, scheduler_ms=2.0)
    assert t.overhead_ms == pytest.approx(4.5)
    assert t.transport_ms == pytest.approx(1.5)
    assert t.other_ms == pytest.approx(1.0)
    assert t.overhead_ms == pytest.approx(t.transport_ms + t.scheduler_ms + t.other_ms)


def test_summarize_median_p90_min():
    timings = [StepTiming(float(s), float(s) - 1, float(s) - 2, 0.5) for s in range(1, 11)]
    s = summarize(timings)
    assert set(s) == set(bench_overhead.STEP_FIELDS)
    assert s["step_ms"] == {"median": 5.5, "mean": 5.5, "p90": 10.0, "min": 1.0}
    assert s["overhead_ms"]["median"] == pytest.approx(2.0)
    assert s["other_ms"]["median"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no timed steps"):
        summarize([])


def test_is_pure_decode_needs_every_sequence_one_token():
    def out(*batches):
        return SimpleNamespace(batches=[SimpleNamespace(num_seqs=s) for s, _ in batches],
                               num_scheduled_tokens=sum(t for _, t in batches))

    assert is_pure_decode(out((2, 2), (2, 2)), 4)
    assert not is_pure_decode(out((2, 2), (2, 9)), 4)  # one rank still prefilling
    assert not is_pure_decode(out((2, 2), (1, 1)), 4)  # a sequence not scheduled


def test_timed_scheduler_accumulates_and_forwards():
    inner = SimpleNamespace(schedule=lambda: time.sleep(0.01) or "out", update=lambda o, s: [o, s], extra=7)
    sched = TimedScheduler(inner)
    assert sched.schedule() == "out" and sched.update("o", "s") == ["o", "s"] and sched.extra == 7
    assert sched.seconds >= 0.01
    sched.reset()
    assert sched.seconds == 0.0


def test_time_call_counts_calls_and_rejects_bad_input():
    calls = []
    per_call = time_call(lambda: calls.append(1), repeats=10, rounds=3)
    assert len(calls) == 1 + 10 * 3 and per_call > 0
    with pytest.raises(ValueError, match="repeats"):
        time_call(lambda: None, repeats=0)


def test_measure_recording_parts_sum_to_total():
    r = measure_recording(2, 12, 4, 8, 2, 50, repeats=20)
    assert r["bincount_us"] == pytest.approx(2 * r["bincount_per_layer_us"])
    assert r["total_us"] == pytest.approx(r["bincount_us"] + r["worker_collect_us"] + r["driver_record_us"])
    assert all(v > 0 for v in r.values())
    with pytest.raises(ValueError, match="must be >= 1"):
        measure_recording(0, 12, 4, 8, 2, 50, repeats=20)
    fused = measure_recording(2, 12, 4, 8, 2, 50, repeats=20, counted_in_fused_op=True)
    assert fused["bincount_per_layer_us"] == fused["bincount_us"] == 0
    assert fused["total_us"] == pytest.approx(fused["worker_collect_us"] + fused["driver_record_us"])


def test_main_in_process_with_stats_overhead(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "new" / "overhead.json"  # missing parents are made
    rc = bench_overhead.main(["--model", str(tiny_ckpt), "--dtype", "float32", "--enable-expert-parallel", "--enable-eplb",
                              "--num-redundant-experts", "2", "--batch", "3", "--context-len", "5",
                              "--steps", "4", "--warmup-steps", "1", "--stats-overhead", "--repeats", "20",
                              "--num-threads", "1", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "in-process (1 rank)" in printed and "ratio" in printed
    r = json.loads(out.read_text())
    assert r["world_size"] == 1 and r["batch"] == 3 and len(r["timings"]) == 4
    for t in r["timings"]:
        assert t["step_ms"] >= t["execute_ms"] >= t["worker_ms"] > 0
        assert t["step_ms"] >= t["execute_ms"] + t["scheduler_ms"] and t["scheduler_ms"] > 0
    assert r["summary"]["step_ms"]["median"] >= r["summary"]["worker_ms"]["median"]
    s = r["stats_overhead"]
    mc = ModelConfig.from_hf(tiny_ckpt)
    assert s["shapes"] == {"num_layers": len(mc.moe_layer_ids), "num_slots": mc.num_experts + 2, "num_ranks": 1,
                           "tokens_per_rank": 3, "top_k": mc.num_experts_per_tok, "window_size": s["shapes"]["window_size"]}
    assert s["step_ms"] == r["summary"]["step_ms"]["median"]
    assert s["ratio"] == pytest.approx(s["total_us"] / (s["step_ms"] * 1e3))
    assert s["min_step_ms"] == r["summary"]["step_ms"]["min"] <= s["step_ms"]
    assert s["ratio_at_min_step"] == pytest.approx(s["total_us"] / (s["min_step_ms"] * 1e3))
    assert s["ratio_at_min_step"] >= s["ratio"]
    assert s["within_budget"] == (s["ratio_at_min_step"] <= 0.02)
    # float32 on one rank: the layers count their slots in the fused CPU op, where the kernel builds
    from moe import kernels

    assert s["counted_in_fused_op"] == kernels.is_available()
    assert (s["bincount_us"] == 0) == s["counted_in_fused_op"]
    assert ("in the op" in printed) == s["counted_in_fused_op"]


def test_main_times_the_sampler_with_the_requested_settings(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    rc = bench_overhead.main(["--model", str(tiny_ckpt), "--dtype", "float32", "--batch", "3", "--context-len", "5",
                              "--steps", "3", "--warmup-steps", "1", "--num-threads", "1", "--temperature", "0.8",
                              "--top-k", "5", "--top-p", "0.9", "--request-seeds", "--json", str(out)])
    assert rc == 0
    assert "scheduler + sampler" in capsys.readouterr().out
    r = json.loads(out.read_text())
    for t in r["timings"]:
        assert 0 < t["sampler_ms"] < t["worker_ms"]
    median = r["summary"]["sampler_ms"]["median"]
    assert median == sorted(t["sampler_ms"] for t in r["timings"])[1]


def test_main_rejects_bad_input(tiny_ckpt, tmp_path, capsys):
    assert bench_overhead.main(["--model", str(tiny_ckpt), "--batch", "0"]) == 2
    assert "--batch must be >= 1" in capsys.readouterr().err
    assert bench_overhead.main(["--model", str(tiny_ckpt), "-dp", "2", "--stats-overhead"]) == 2
    assert "one in-process rank" in capsys.readouterr().err
    assert bench_overhead.main(["--model", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert bench_overhead.main(["--model", str(tiny_ckpt), "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert bench_overhead.main(["--model", str(tiny_ckpt), "--repeats", "10"]) == 2  # without --stats-overhead
    assert capsys.readouterr().err == ("error: --repeats sets --stats-overhead's timing rounds, which this run does "
                                       "not time: add --stats-overhead or leave --repeats out\n")
    assert bench_overhead.main(["--model", str(tiny_ckpt), "--stats-overhead", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_transports_list_and_side_by_side_ratios():
    from launch.bench.overhead import format_comparison, parse_transports
    from launch.config import ParallelConfig, RuntimeConfig

    ray_config = RuntimeConfig(model="m", parallel=ParallelConfig(data_parallel_size=2, step_transport="socket"))
    assert parse_transports(None, ray_config) == ["socket"]
    assert parse_transports("ray, socket,ray", ray_config) == ["ray", "socket", "ray"]
    with pytest.raises(ValueError, match="comma-separated list"):
        parse_transports("ray,zmq", ray_config)
    with pytest.raises(ValueError, match="needs more than one rank"):
        parse_transports("ray,socket", RuntimeConfig(model="m"))

    def run(name, transport_ms, cpu):
        t = StepTiming(10.0, 5.0 + transport_ms, 5.0, 0.5, cpu + 1, cpu, cpu / 2)
        return {"transport": name, "summary": summarize([t])}

    text = format_comparison([run("ray", 4.0, 4.0), run("socket", 1.0, 1.0)])
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].split()[1:5] == ["transport", "transport_ms", "execute_cpu_ms",
                                                         "execute_thread_cpu_ms"]
    assert lines[2].split()[1] == "socket" and lines[2].split()[-4:] == ["0.25", "0.25", "0.25", "0.40"]


def test_unmeasured_sampler_time_is_null_in_json_and_left_out_of_the_share():
    from launch.bench.overhead import loop_share, without_nan

    ray_step = summarize([StepTiming(10.0, 8.0, 6.0, 0.5, 2.0)])  # no sampler timing: Ray ranks
    assert ray_step["sampler_ms"]["median"] != ray_step["sampler_ms"]["median"]
    assert loop_share(ray_step) is None
    assert json.loads(json.dumps(without_nan({"a": [1.0, float("nan")], "b": (float("nan"),)}))) == \
        {"a": [1.0, None], "b": [None]}
    local = summarize([StepTiming(10.0, 8.0, 6.0, 0.5, 20.0, sampler_ms=0.5)])
    assert loop_share(local).endswith("0.500 + 0.500 ms of a 20.000 ms step's CPU (5.00%)")


def test_the_step_table_keeps_a_space_between_columns() -> None:
    from launch.bench.overhead import STEP_FIELDS, format_steps

    summary = {n: {"median": 12345.678, "p90": 1.0} for n in STEP_FIELDS}
    head, median, _ = format_steps(summary, "in-process").splitlines()
    assert head.split()[2:] == list(STEP_FIELDS)  # no two names run together
    assert median.split()[2:] == ["12345.678"] * len(STEP_FIELDS)


def test_a_context_past_max_model_len_is_refused_before_the_engine_starts(tiny_ckpt, capsys, monkeypatch) -> None:
    import launch.engine

    monkeypatch.setattr(launch.engine.LLMEngine, "__init__", lambda *a, **k: pytest.fail("the engine started"))
    flags = ["--model", str(tiny_ckpt), "--batch", "2", "--steps", "5", "--warmup-steps", "2"]
    # 2 x 2040 prompt tokens prefill in 8 steps of 512: 2040 + 8 + 2 + 5 = 2055 > the model's 2048
    assert bench_overhead.main([*flags, "--context-len", "2040"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --context-len 2040 + 15 tokens decoded per sequence = 2055 "
                                               "exceeds max_model_len=2048 (the model's max_position_embeddings "
                                               "unless --max-model-len)")
    args = bench_overhead.build_parser().parse_args([*flags, "--context-len", "2033"])  # 2033 + 8 + 7 = 2048
    assert bench_overhead.build_config(args).engine.max_num_seqs == 2


def test_the_pool_is_sized_within_max_model_len_and_the_budget(tiny_ckpt, capsys, monkeypatch) -> None:
    """The pool holds each sequence's tokens with headroom, never past max_model_len a sequence nor past
    what the memory budget holds; a batch the budget cannot hold names --batch and --memory, not a
    --num-kv-blocks nobody gave."""
    import launch.engine

    monkeypatch.setattr(launch.engine.LLMEngine, "__init__", lambda *a, **k: pytest.fail("the engine started"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = ["--model", str(tiny_ckpt), "--steps", "2", "--warmup-steps", "0"]
    # 1024 x 500 prompt tokens prefill in hundreds of steps of 1536 (a sequence decodes in each): the pool's
    # headroom (4 tokens a prefill step) is capped at the model's 2048 a sequence
    prefill = bench_overhead.num_prefill_steps(1024, 500, 1536)
    assert 500 + 4 * prefill > 2048 and 500 + prefill + 2 <= 2048
    engine = bench_overhead.build_config(bench_overhead.build_parser().parse_args(
        [*flags, "--batch", "1024", "--context-len", "500"])).engine
    assert engine.num_kv_blocks == 1024 * 2048 // 16 + 1
    engine = bench_overhead.build_config(bench_overhead.build_parser().parse_args(
        [*flags, "--batch", "8", "--context-len", "100"])).engine  # 1 prefill step: 100 + 4 + 4 + 64 = 172 tokens
    assert engine.num_kv_blocks == 8 * -(-172 // 16) + 1
    for given in (["--num-kv-blocks", "300"], ["--set", "engine.num_kv_blocks=300"]):  # a pool asked for is kept
        engine = bench_overhead.build_config(bench_overhead.build_parser().parse_args(
            [*flags, "--batch", "8", "--context-len", "100", *given])).engine
        assert engine.num_kv_blocks == 300, given
    assert bench_overhead.main([*flags, "--batch", "1024", "--context-len", "500", "--memory", "4MiB"]) == 2
    err = capsys.readouterr().err
    tokens = 500 + prefill + 2
    assert err.startswith(f"error: --batch 1024 x {tokens} tokens need {1024 * -(-tokens // 16) + 1:,} KV blocks of 16, "
                          "more than the ") and \
        err.endswith(" that --memory 4MiB holds beside the weights: lower --batch or --context-len, or raise --memory\n")
    assert "--num-kv-blocks" not in err


def test_an_unwritable_json_path_is_refused_before_the_engine_starts(tiny_ckpt, tmp_path, capsys, monkeypatch) -> None:
    import launch.engine

    monkeypatch.setattr(launch.engine.LLMEngine, "__init__", lambda *a, **k: pytest.fail("the engine started"))
    (tmp_path / "afile").write_text("")
    for target, problem in ((tmp_path, f"{tmp_path} is a directory"),
                            (tmp_path / "afile" / "x.json", f"{tmp_path / 'afile'} is not a directory")):
        assert bench_overhead.main(["--model", str(tiny_ckpt), "--json", str(target)]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"error: --json: {problem}\n" and captured.out == ""


def test_a_batch_above_max_num_seqs_or_the_token_budget_is_refused_before_the_engine_starts(
        tiny_ckpt, capsys, monkeypatch) -> None:
    import launch.engine

    monkeypatch.setattr(launch.engine.LLMEngine, "__init__", lambda *a, **k: pytest.fail("the engine started"))
    for flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        assert bench_overhead.main(["--model", str(tiny_ckpt), "--batch", "5", flag, "2"]) == 2
        assert capsys.readouterr().err == f"error: {flag} 2 < --batch 5: the batch could never decode in one step\n"
