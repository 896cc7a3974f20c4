"""launch/bench_throughput.py and launch/bench_decode.py: request sampling, the agreement and
byte accounting, and both ``main()``s end to end on a tiny checkpoint with tiny sizes."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time

import pytest
import torch

from launch.bench import decode as bench_decode
from launch.bench import throughput as bench_throughput
from launch.bench.throughput import agreement, sample_requests
from moe import kernels
from moe.config import ModelConfig
from moe.model import MoEModel


def test_sample_requests_lengths_ids_and_seed():
    reqs = sample_requests(20, (3, 7), (1, 4), 50, seed=5, avoid_ids=(0, 1))
    assert len(reqs) == 20
    for r in reqs:
        assert 3 <= len(r.prompt_token_ids) <= 7 and 1 <= r.output_len <= 4
        assert all(2 <= t < 50 for t in r.prompt_token_ids)
    assert reqs == sample_requests(20, (3, 7), (1, 4), 50, seed=5, avoid_ids=(0, 1))
    assert reqs != sample_requests(20, (3, 7), (1, 4), 50, seed=6, avoid_ids=(0, 1))
    with pytest.raises(ValueError, match="--input-len-range"):
        sample_requests(4, (8, 2), (1, 4), 50)
    with pytest.raises(ValueError, match="--num-prompts"):
        sample_requests(0, (1, 2), (1, 4), 50)


def test_agreement_is_mean_common_prefix_fraction():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 9], [7, 6]]) == pytest.approx((0.5 + 0.0) / 2)


def test_weight_bytes_partition_the_model():
    config = ModelConfig.from_hf(_tiny_config())
    model = MoEModel(config, dtype=torch.bfloat16)
    w = bench_decode.compute_weight_bytes(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    num_slots = [layer.experts.num_local_slots for layer in model.moe_layers()]
    assert len(w.per_slot) == len(config.moe_layer_ids) > 0
    assert w.dense + embed.shape[0] * w.embed_row + sum(n * b for n, b in zip(num_slots, w.per_slot)) == total
    assert w.per_slot[0] == 3 * config.hidden_size * config.moe_intermediate_size * 2
    assert w.slot_params[0] * 2 == w.per_slot[0]  # bf16
    if kernels.is_available():  # int8 experts: the bound counts the bytes the kernel reads
        for layer in model.moe_layers():
            torch.nn.init.normal_(layer.experts.w13), torch.nn.init.normal_(layer.experts.w2)
            layer.experts.set_quantization("int8")
        q = bench_decode.compute_weight_bytes(model)
        d, i = config.hidden_size, config.moe_intermediate_size
        assert q.per_slot[0] == 3 * d * i + 4 * (2 * i + d)  # int8 weights and fp32 per-channel scales
        assert q.dense == w.dense and q.slot_params == w.slot_params
    assert bench_decode.attention_flops_per_key(config) == (
        2 * config.num_hidden_layers * config.num_attention_heads * (2 * config.kv_lora_rank + config.qk_rope_head_dim))


def test_throughput_main_reports_both_sides(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    rc = bench_throughput.main(["--model", str(tiny_ckpt), "--num-prompts", "3", "--input-len-range", "2", "6",
                                "--output-len-range", "1", "3", "--hf-batch-size", "2", "--num-threads", "1",
                                "--json", str(out)])
    assert rc == 0
    assert "Speedup (ours / HF)" in capsys.readouterr().out
    r = json.loads(out.read_text())
    for key in ("elapsed_time", "output_tokens_per_second", "requests_per_second", "tokens_per_second",
                "hf_elapsed_time", "hf_output_tokens_per_second", "speedup", "cpu_time", "hf_cpu_time",
                "speedup_cpu_time"):
        assert r[key] > 0, key
    assert r["num_requests"] == 3 and r["num_threads"] == 1 and r["baseline"] == "hf"
    assert r["dtype"] == "bfloat16"  # the benchmark default, though the tiny checkpoint stores float32
    assert r["hf_dtype"] == "bfloat16"  # transformers runs in ours' dtype unless told otherwise
    assert 3 <= r["total_output_tokens"] <= 9 and 6 <= r["total_input_tokens"] <= 18
    assert r["speedup"] == pytest.approx(r["hf_elapsed_time"] / r["elapsed_time"])
    assert r["speedup_cpu_time"] == pytest.approx(r["hf_cpu_time"] / r["cpu_time"])
    assert r["output_tokens_per_second"] == pytest.approx(r["total_output_tokens"] / r["elapsed_time"])
    assert 0.0 <= r["greedy_agreement"] <= 1.0


def test_throughput_dtype_auto_is_the_checkpoints(tiny_ckpt, tmp_path):
    out = tmp_path / "auto.json"
    assert bench_throughput.main(["--model", str(tiny_ckpt), "--num-prompts", "1", "--input-len-range", "2", "3",
                                  "--output-len-range", "1", "2", "--dtype", "auto", "--num-threads", "1",
                                  "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dtype"] == "float32" and r["hf_elapsed_time"] > 0  # the tiny checkpoint stores float32


def test_throughput_hf_dtype_sets_only_the_baselines_dtype(tiny_ckpt, tmp_path, monkeypatch, capsys):
    seen = []
    real = bench_throughput.run_hf

    def spy(model_path, requests, batch_size, dtype, pad_token_id):
        seen.append(dtype)
        return real(model_path, requests, batch_size, dtype, pad_token_id)

    monkeypatch.setattr(bench_throughput, "run_hf", spy)
    out = tmp_path / "mixed.json"
    assert bench_throughput.main(["--model", str(tiny_ckpt), "--num-prompts", "2", "--input-len-range", "2", "4",
                                  "--output-len-range", "1", "3", "--dtype", "bfloat16", "--hf-dtype", "float32",
                                  "--num-threads", "1", "--json", str(out)]) == 0
    assert seen == [torch.float32]
    r = json.loads(out.read_text())
    assert (r["dtype"], r["hf_dtype"]) == ("bfloat16", "float32")
    assert "HF generate: dtype:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # the parser's one error line
        bench_throughput.main(["--model", str(tiny_ckpt), "--hf-dtype", "int8"])
    assert exit_info.value.code == 2 and "--hf-dtype" in capsys.readouterr().err


def test_throughput_main_rejects_bad_input(tiny_ckpt, tmp_path, capsys):
    assert bench_throughput.main(["--model", str(tiny_ckpt), "--input-len-range", "9", "3", "--baseline",
                                  "none"]) == 2
    assert "--input-len-range" in capsys.readouterr().err
    assert bench_throughput.main(["--model", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    # a memory budget the weights do not leave KV room in: one line, no traceback
    assert bench_throughput.main(["--model", str(tiny_ckpt), "--memory", "64KiB", "--baseline", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "KV cache" in err and "Traceback" not in err


@pytest.fixture
def no_runs(monkeypatch):
    """Fail the test if either side of bench throughput starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark ran for bad input")

    monkeypatch.setattr(bench_throughput, "run_ours", refuse)
    monkeypatch.setattr(bench_throughput, "run_hf", refuse)


@pytest.mark.parametrize("flags,line", [
    (["--output-len-range", "100000", "100000", "--baseline", "none"],
     "error: --input-len-range HI 200 + --output-len-range HI 100000 = 100200 tokens exceeds max_model_len=2048 "
     "(the model's max_position_embeddings unless --max-model-len)"),
    (["--max-model-len", "100", "--input-len-range", "50", "60", "--output-len-range", "30", "41"],
     "error: --input-len-range HI 60 + --output-len-range HI 41 = 101 tokens exceeds max_model_len=100 "
     "(the model's max_position_embeddings unless --max-model-len)"),
    (["--input-len-range", "1000", "1000", "--output-len-range", "1000", "1000", "--num-kv-blocks", "10"],
     "error: a request of up to 2000 tokens (input + output HI) needs KV for 1999 tokens (125 blocks of 16) but a "
     "DP rank's pool has only 10 blocks (raise --memory or --num-kv-blocks, or lower the ranges)"),
    (["--hf-batch-size", "0"], "error: --hf-batch-size must be >= 1, got 0"),
    (["--num-threads", "0"], "error: --num-threads must be >= 1, got 0"),
])
def test_throughput_checks_lengths_and_flags_before_running(tiny_ckpt, no_runs, capsys, flags, line):
    assert bench_throughput.main(["--model", str(tiny_ckpt), *flags]) == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.slow
def test_decode_main_times_the_fused_ops_against_their_pytorch_ops(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "ab.json"
    rc = bench_decode.main(["--model", str(tiny_ckpt), "--batch-sizes", "2", "--context-len", "4", "--steps", "3",
                            "--warmup-steps", "1", "--copy-mib", "4", "--num-threads", "1", "--ab-fused-ops",
                            "--json", str(out)])
    assert rc == 0
    assert "fused small ops on vs off" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["results"]
    assert row["fused_off_cpu_ms"] > 0 and row["step_cpu_ms"] > 0
    # each timed step is followed by two with the fused ops off and one more with them on again
    assert 4 + 1 + 1 < row["mean_context_len"] <= 4 + 1 + 1 + 4 * 3


@pytest.mark.slow
def test_decode_ab_fused_ops_rebuilds_the_plan_only_in_untimed_steps(tiny_ckpt, monkeypatch):
    # a switch changes what the decode plan resolved: the step after it rebuilds the plan. With
    # --ab-fused-ops every run of steps on one side is two or more long and only its first rebuilds,
    # so neither side's timed step (the last of its run) pays for the other's plan.
    steps: list[tuple[bool, bool]] = []  # (fused ops on, the plan was rebuilt) per decode-plan forward
    original = MoEModel._decode_plan

    def recording(self, h, kv_cache):
        before = self._plan
        plan = original(self, h, kv_cache)
        steps.append((self.model.norm.use_kernel, plan is not before))
        return plan

    monkeypatch.setattr(MoEModel, "_decode_plan", recording)
    assert bench_decode.main(["--model", str(tiny_ckpt), "--batch-sizes", "2", "--context-len", "4", "--steps", "3",
                              "--warmup-steps", "1", "--copy-mib", "4", "--num-threads", "1", "--ab-fused-ops"]) == 0
    runs: list[list[bool]] = []  # the rebuilds of each run of steps on one side
    for i, (on, rebuilt) in enumerate(steps):
        if i == 0 or on != steps[i - 1][0]:
            runs.append([])
        runs[-1].append(rebuilt)
    assert [on for on, _ in steps].count(False) == 2 * 3  # a settling and a timed step per timed step
    # the last run is the settling step after the last switch back (no timed step follows)
    assert len(runs) == 1 + 2 * 3 and all(len(run) >= 2 for run in runs[:-1]) and len(runs[-1]) == 1
    assert all(not any(run[1:]) for run in runs)  # only the first step after a switch rebuilds
    assert all(run[0] for run in runs[1:])  # (which it does: the test sees the rebuilds)


@pytest.mark.slow
def test_decode_main_reports_each_batch_size(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "decode.json"
    rc = bench_decode.main(["--model", str(tiny_ckpt), "--batch-sizes", "1", "3", "--context-len", "5",
                            "--steps", "2", "--warmup-steps", "1", "--copy-mib", "4", "--num-threads", "1",
                            "--breakdown", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "bound ms" in printed and "by kind of work" in printed
    r = json.loads(out.read_text())
    assert r["copy_bandwidth_bytes_per_s"] > 0 and r["kv_bytes_per_token"] > 0
    # the kernel and how its dot tiles stream their weights, said in the header and kept in the JSON
    assert r["isa"] == (kernels.isa() if kernels.is_available() else None)
    assert r["tile_modes"] == kernels.tile_modes_text() and r["attention_asks"] == kernels.attention_asks_text()
    if r["tile_modes"] is not None:
        assert f"thread(s); kernel isa {r['isa']}, tiles [one row: pairs " in printed and r["tile_modes"] in printed
    assert [row["batch_size"] for row in r["results"]] == [1, 3]
    config = ModelConfig.from_hf(tiny_ckpt)
    for row in r["results"]:
        for key in ("step_ms", "step_cpu_ms", "worker_ms", "tokens_per_s", "gflop", "compute_bound_ms", "weight_bytes", "kv_bytes", "bound_ms", "ratio"):
            assert row[key] > 0, key
        assert row["bytes_read"] == row["weight_bytes"] + row["kv_bytes"]
        assert row["fused_off_cpu_ms"] is None  # no --ab-fused-ops: not measured, not 0
        assert row["weight_bytes"] > r["dense_weight_bytes"]
        # every sequence decodes after its 5 prompt tokens plus the warm-up token(s)
        assert 5 < row["mean_context_len"] <= 5 + 1 + 1 + 2
        assert row["kv_bytes"] == pytest.approx(row["mean_context_len"] * row["batch_size"] * r["kv_bytes_per_token"],
                                                rel=1e-3)
        assert config.num_experts_per_tok <= row["experts_touched_per_layer"] <= config.num_experts
        assert row["ratio"] == pytest.approx(row["step_ms"] / row["bound_ms"])
        assert row["roof_ms"] == pytest.approx(max(row["bound_ms"], row["compute_bound_ms"]))
        assert row["cpu_roof_ratio"] == pytest.approx(row["step_cpu_ms"] / row["roof_ms"])
        parts = row["breakdown_ms"]  # --breakdown: profiled steps split by kind of work, summing to their total
        assert {"experts kernel", "linear kernel", "torch GEMMs", "outside ops", "total"} <= set(parts)
        assert all(v >= 0 for v in parts.values()) and parts["total"] > 0
        assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"], rel=1e-6)
        if kernels.is_available():  # steady decode steps run the attention and the MoE FFN as one op each
            assert parts["attention op"] > 0 and parts["MoE FFN op"] > 0


def test_decode_main_rejects_bad_input(tiny_ckpt, capsys):
    assert bench_decode.main(["--model", str(tiny_ckpt), "--batch-sizes", "0"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert bench_decode.main(["--model", str(tiny_ckpt), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert bench_decode.main(["--model", str(tiny_ckpt), "--memory", "64KiB", "--num-kv-blocks", "0",
                              "--copy-mib", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if bench decode builds an engine (loads weights)."""
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was built for bad input")

    monkeypatch.setattr("launch.engine.LLMEngine", refuse)


_LEN_HINT = "exceeds max_model_len=2048 (the model's max_position_embeddings unless --max-model-len)"


@pytest.mark.parametrize("flags,line", [
    (["--context-len", "5000"],
     "error: --context-len 5000 + 28 tokens decoded per sequence (warm-up, timed and profiled steps, prefill headroom "
     f"at batch size 1) = 5028 {_LEN_HINT}"),
    (["--context-len", "2030", "--batch-sizes", "4"],
     "error: --context-len 2030 + 28 tokens decoded per sequence (warm-up, timed and profiled steps, prefill headroom "
     f"at batch size 4) = 2058 {_LEN_HINT}"),
    (["--memory", "1KiB"],
     "error: no room for the KV cache: the weights take 505.41 KiB per rank (tp=1) of 0.9 x 1.00 KiB = 922 B usable; "
     "KV needs 240 B per token (all layers) on top"),
    (["--memory", "1MiB", "--batch-sizes", "1", "64"],
     "error: --batch-sizes 64: 64 sequences x 156 tokens need 640 KV blocks of 16, more than the 110 that --memory "
     "1MiB x memory_utilization 0.9 holds after the weights: lower the batch size or --context-len, or raise --memory"),
    (["--batch-sizes", "64", "--num-kv-blocks", "100"],
     "error: --batch-sizes 64: 64 sequences x 156 tokens need 640 KV blocks of 16, more than --num-kv-blocks 100: "
     "lower the batch size or --context-len, or raise --num-kv-blocks"),
    (["--batch-sizes", "8", "--max-num-seqs", "4"],
     "error: --max-num-seqs 4 < the largest --batch-sizes 8: that batch could never decode in one step"),
])
def test_decode_checks_lengths_memory_and_kv_before_loading(tiny_ckpt, no_engine, capsys, flags, line):
    assert bench_decode.main(["--model", str(tiny_ckpt), "--copy-mib", "1", *flags]) == 2
    assert capsys.readouterr().err == line + "\n"


def test_decode_refuses_batches_the_default_memory_budget_cannot_hold(tiny_ckpt, no_engine, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the engine's CPU default budget, 2GiB
    assert bench_decode.main(["--model", str(tiny_ckpt), "--batch-sizes", "100000"]) == 2
    assert capsys.readouterr().err == (
        "error: --batch-sizes 100000: 100000 sequences x 485 tokens need 3100000 KV blocks of 16, more than the 503181 "
        "that the engine's default 2GiB x memory_utilization 0.9 holds after the weights: lower the batch size or "
        "--context-len, or raise --memory\n")


def test_decode_honours_memory_with_a_pool_for_the_largest_batch(tiny_ckpt, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = bench_decode.build_parser().parse_args(["--model", str(tiny_ckpt), "--batch-sizes", "1", "4",
                                                   "--context-len", "8", "--steps", "3", "--memory", "1MiB"])
    config = bench_decode.build_config(args)
    # 4 sequences x (8 + 3 warm-up + 3 timed + 1 prefill step + 4) tokens = 2 blocks each, plus one spare
    assert config.engine.num_kv_blocks == 4 * 2 + 1 and config.engine.memory == "1MiB"


def test_decode_default_batch_sizes_are_those_the_config_allows(tiny_ckpt, monkeypatch):
    """Without --batch-sizes the defaults (1 8 32 128) are cut to what max_num_seqs, the step's
    token budget, max_model_len and the KV pool allow (the shipped configs/tiny.yaml holds 8
    sequences); batch sizes given are checked as given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parse = bench_decode.build_parser().parse_args
    base = ["--model", str(tiny_ckpt), "--context-len", "8", "--steps", "2"]
    args = parse(base)
    assert bench_decode.build_config(args).engine.max_num_seqs == 128 and args.batch_sizes == [1, 8, 32, 128]
    for flags, kept in ((["--set", "engine.max_num_seqs=8"], [1, 8]), (["--max-num-seqs", "31"], [1, 8]),
                        (["--max-num-batched-tokens", "40", "--enable-chunked-prefill"], [1, 8, 32]),
                        (["--num-kv-blocks", "20"], [1, 8]), (["--max-model-len", "18"], [1, 8, 32]),
                        (["--set", "engine.max_num_seqs=1"], [1])):
        args = parse([*base, *flags])
        bench_decode.build_config(args)
        assert args.batch_sizes == kept, flags
    with pytest.raises(ValueError, match=r"^engine.max_num_seqs \(--config/--set\) 8 < the largest --batch-sizes 32"):
        bench_decode.build_config(parse([*base, "--set", "engine.max_num_seqs=8", "--batch-sizes", "1", "32"]))


def test_bench_defaults_yield_to_config_files_and_set(tiny_ckpt, tmp_path, no_engine, monkeypatch, capsys):
    """The benchmarks' own defaults (bf16, room for the largest batch) fill only what neither a flag
    nor --config nor --set gives."""
    from launch.bench import overhead as bench_overhead

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = ["--model", str(tiny_ckpt), "--batch-sizes", "1", "4", "--context-len", "8", "--steps", "3"]
    parse = bench_decode.build_parser().parse_args
    assert bench_decode.build_config(parse(base)).engine.dtype == "bfloat16"
    assert bench_decode.build_config(parse([*base, "--set", "engine.dtype=float32"])).engine.dtype == "float32"
    flat = tmp_path / "vllm.yaml"
    flat.write_text("dtype: float32\nmax-num-seqs: 6\n")
    engine = bench_decode.build_config(parse([*base, "--config", str(flat)])).engine
    assert (engine.dtype, engine.max_num_seqs, engine.max_num_batched_tokens) == ("float32", 6, 8192 + 4)
    assert bench_decode.build_config(parse([*base, "--config", str(flat), "--dtype", "bfloat16"])).engine.dtype == \
        "bfloat16"  # the flag over the file
    assert bench_decode.main([*base, "--set", "engine.max_num_seqs=2"]) == 2
    assert capsys.readouterr().err == ("error: engine.max_num_seqs (--config/--set) 2 < the largest --batch-sizes 4: "
                                       "that batch could never decode in one step\n")
    over = bench_overhead.build_parser().parse_args
    assert bench_overhead.build_config(over(["--model", str(tiny_ckpt), "--batch", "4"])).engine.max_num_seqs == 4
    with pytest.raises(ValueError, match=r"^engine.max_num_seqs \(--config/--set\) 2 < --batch 4"):
        bench_overhead.build_config(over(["--model", str(tiny_ckpt), "--batch", "4", "--set", "engine.max_num_seqs=2"]))


def test_throughput_dtype_from_set_and_hf_flags_without_a_baseline(tiny_ckpt, no_runs, monkeypatch, capsys):
    seen = {}

    def check_args(args):
        seen["dtype"] = args.dtype
        raise ValueError("stop")

    monkeypatch.setattr(bench_throughput, "check_args", check_args)
    assert bench_throughput.main(["--model", str(tiny_ckpt), "--set", "engine.dtype=float32"]) == 2
    assert seen["dtype"] is None  # left to --set's float32
    assert bench_throughput.main(["--model", str(tiny_ckpt)]) == 2 and seen["dtype"] == "bfloat16"
    capsys.readouterr()
    monkeypatch.undo()
    monkeypatch.setattr(bench_throughput, "run_ours", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    for flags, named in ((["--hf-dtype", "float32"], "--hf-dtype sets"),
                         (["--hf-batch-size", "4", "--hf-dtype", "float32"], "--hf-batch-size and --hf-dtype set")):
        assert bench_throughput.main(["--model", str(tiny_ckpt), "--baseline", "none", *flags]) == 2
        assert capsys.readouterr().err == (f"error: {named} transformers' side, which --baseline none does not run: "
                                           "leave it out, or use --baseline hf\n")


def test_decode_pool_stays_within_a_budget_the_largest_batch_fills(tiny_ckpt, monkeypatch):
    """A budget that holds exactly the largest batch's blocks: the pool is that many, not one more
    (the engine refuses a pool past its budget)."""
    import dataclasses

    import launch.engine

    real = launch.engine.check_runtime_config
    monkeypatch.setattr(launch.engine, "check_runtime_config",
                        lambda config: dataclasses.replace(real(config), num_kv_blocks=8))
    args = bench_decode.build_parser().parse_args(["--model", str(tiny_ckpt), "--batch-sizes", "1", "4",
                                                   "--context-len", "8", "--steps", "3", "--memory", "1MiB"])
    assert bench_decode.build_config(args).engine.num_kv_blocks == 8  # 4 sequences x 2 blocks


def _tiny_config() -> dict:
    from moe.tiny import build_tiny_config

    return build_tiny_config("deepseek_v3", size="tiny")


def test_baseline_experts_keep_grouped_mm_unless_its_widths_cannot_run(tmp_path):
    """transformers' default (grouped_mm, its fastest) where PyTorch's grouped GEMM takes the expert
    widths in the baseline's dtype; its eager loop where a row is not whole 16 bytes."""
    from tests.conftest import write_hf_checkpoint

    ckpt = write_hf_checkpoint("qwen3_moe", tmp_path / "h64_i36", moe_intermediate_size=36)
    assert bench_throughput.hf_experts_kwargs(str(ckpt), torch.bfloat16) == {"experts_implementation": "eager"}
    assert bench_throughput.hf_experts_kwargs(str(ckpt), torch.float32) == {}  # 36 x 4 B = 144 B
    aligned = write_hf_checkpoint("qwen3_moe", tmp_path / "h64_i32")
    assert bench_throughput.hf_experts_kwargs(str(aligned), torch.bfloat16) == {}


def test_throughput_baseline_runs_a_checkpoint_of_odd_hidden_size(tmp_path):
    """An odd hidden size: transformers' grouped_mm experts would fail ("strides should be multiple
    of 16 bytes"); the baseline loads on its eager loop and both sides run."""
    from tests.conftest import write_hf_checkpoint

    ckpt = write_hf_checkpoint("mixtral", tmp_path / "odd", hidden_size=45, intermediate_size=20,
                               num_hidden_layers=1)
    out = tmp_path / "odd.json"
    assert bench_throughput.main(["--model", str(ckpt), "--num-prompts", "2", "--input-len-range", "2", "4",
                                  "--output-len-range", "1", "2", "--hf-batch-size", "2", "--num-threads", "1",
                                  "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["hf_elapsed_time"] > 0 and r["total_output_tokens"] >= 2


def test_throughput_checks_json_before_running(tiny_ckpt, tmp_path, no_runs, capsys):
    (tmp_path / "file.txt").write_text("")
    for path, problem in ((tmp_path, f"{tmp_path} is a directory"),
                          (tmp_path / "file.txt" / "out.json", f"{tmp_path / 'file.txt'} is not a directory")):
        assert bench_throughput.main(["--model", str(tiny_ckpt), "--json", str(path)]) == 2
        assert capsys.readouterr().err == f"error: --json: {problem}\n"


def test_throughput_json_makes_its_missing_parent_folders(tiny_ckpt, tmp_path, monkeypatch):
    def fake_run(*args, **kwargs):
        requests = args[1]
        return bench_throughput.RunResult(1.0, [[5] * r.output_len for r in requests], 1.0)

    monkeypatch.setattr(bench_throughput, "run_ours", fake_run)
    monkeypatch.setattr(bench_throughput, "run_hf", fake_run)
    out = tmp_path / "new" / "deeper" / "throughput.json"
    assert bench_throughput.main(["--model", str(tiny_ckpt), "--num-prompts", "2", "--input-len-range", "2", "3",
                                  "--output-len-range", "1", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["num_requests"] == 2


def test_weights_past_the_default_memory_budget_name_the_flag_that_raises_it(tiny_ckpt, no_engine, monkeypatch,
                                                                              capsys):
    import launch.engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch.engine, "DEFAULT_CPU_MEMORY", "1KiB")  # the tiny weights stand in for a large model's
    assert bench_decode.main(["--model", str(tiny_ckpt), "--copy-mib", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no room for the KV cache: the weights take ") and err.endswith(
        "on top (the CPU default 1KiB, as no memory budget was given: give one with --memory, e.g. --memory 8GiB, "
        "or engine.memory)\n")
    assert bench_decode.main(["--model", str(tiny_ckpt), "--copy-mib", "1", "--memory", "1KiB"]) == 2
    assert capsys.readouterr().err.endswith("KV needs 240 B per token (all layers) on top\n")  # the budget given


def test_a_sliding_window_caps_the_kv_read_and_attended_per_sequence():
    from types import SimpleNamespace

    from launch.worker import StepResult

    output = SimpleNamespace(batches=[SimpleNamespace(seqs=[SimpleNamespace(context_len=n) for n in (10, 1500)])])
    result = StepResult(sampled=None, slot_load=torch.tensor([[1, 0, 2]]))
    weights = bench_decode.WeightBytes(dense=1000, embed_row=10, per_slot=(100,), dense_params=500, slot_params=(50,))
    assert bench_decode.step_bytes(output, result, weights, 4) == (1000 + 2 * 10 + 2 * 100, 1510 * 4, 2.0)
    assert bench_decode.step_bytes(output, result, weights, 4, 64) == (1220, (10 + 64) * 4, 2.0)  # 64 of the 1500
    assert bench_decode.step_flops(output, weights, 2, 3) == 2 * 2 * (500 + 2 * 50) + 3 * 1510
    assert bench_decode.step_flops(output, weights, 2, 3, 64) == 2 * 2 * (500 + 2 * 50) + 3 * (10 + 64)


def test_the_dtype_help_says_the_dtype_the_benchmarks_run():
    """decode and throughput run bfloat16 when --dtype is left out, whatever the checkpoint stores: their
    help says so (not the engine's "auto"), and serve's keeps the engine's default."""
    from launch.serve import build_parser as serve_parser

    for parser in (bench_decode.build_parser(), bench_throughput.build_parser()):
        text = " ".join(parser.format_help().split())
        assert "the checkpoint's (bfloat16 when it names none) (default: bfloat16, whatever the checkpoint stores)" in text
        assert parser.parse_args(["--model", "m"]).dtype is None  # set to bfloat16 where the run is built
    assert "the checkpoint's (bfloat16 when it names none) (default: auto)" in " ".join(serve_parser().format_help().split())


def test_a_step_faster_than_its_floor_is_noted_under_the_table():
    """A ratio under 1 means the copy bandwidth ran slow (or the bytes were cached): said, not left to
    read as a step beating the memory."""
    row = bench_decode.DecodeResult(batch_size=8, step_ms=7.0, step_cpu_ms=7.0, worker_ms=6.0, tokens_per_s=1.0,
                                    mean_context_len=130.0, experts_touched_per_layer=2.0, weight_bytes=1, kv_bytes=1,
                                    bytes_read=2, bound_ms=10.0, ratio=0.7, gflop=0.0, compute_bound_ms=0.0,
                                    cpu_ratio=0.7, roof_ms=10.0, cpu_roof_ratio=0.7)
    text = bench_decode.format_table([row, dataclasses.replace(row, batch_size=32, ratio=1.2, cpu_ratio=1.2)],
                                     9.2e9, 1e12)
    (note,) = [line for line in text.splitlines() if line.startswith("# note:")]
    assert note.startswith("# note: batch 8 stepped faster than its bandwidth floor: the copy (9.2 GB/s) ran slow")
    assert "# note:" not in bench_decode.format_table([dataclasses.replace(row, ratio=1.1, cpu_ratio=1.1)], 9.2e9, 1e12)


def test_throughput_report_says_when_transformers_runs_another_model(tiny_ckpt):
    from launch.config import RuntimeConfig

    config = RuntimeConfig.from_dict({"model": str(tiny_ckpt)})
    requests = [bench_throughput.BenchRequest([5, 6, 7], 2)]
    ours = bench_throughput.RunResult(1.0, [[8, 9]], cpu_s=1.0)
    hf = bench_throughput.RunResult(2.0, [[8, 10]], cpu_s=2.0)
    kwargs = dict(num_threads=1, seed=0, dtype="float32", hf_batch_size=8, input_len_range=[3, 3],
                  output_len_range=[2, 2])
    plain = bench_throughput.summarize(config, requests, ours, hf, **kwargs)
    assert "hf_differs" not in plain and "not a rounding measure" not in bench_throughput.format_report(plain)
    other = bench_throughput.summarize(config, requests, ours, hf, hf_differs="moe_layer_freq=2: ...", **kwargs)
    assert other["hf_differs"] == "moe_layer_freq=2: ..." and other["greedy_agreement"] == 0.5
    assert "0.500 (not a rounding measure: moe_layer_freq=2: ...)" in bench_throughput.format_report(other)


def test_decode_rows_against_the_fastest_read_too(monkeypatch):
    """One core reads faster than it copies: each row also gives its CPU time over the bytes at the
    fastest read measured (the stricter floor), in the table and the JSON row."""
    from types import SimpleNamespace

    monkeypatch.setattr(bench_decode, "step_bytes", lambda *a: (1_000_000, 0, 1.0))
    monkeypatch.setattr(bench_decode, "step_flops", lambda *a: 0)
    output = SimpleNamespace(batches=[SimpleNamespace(seqs=[SimpleNamespace(context_len=5)])])
    timed = [(0.004, 0.004, output, SimpleNamespace(seconds=0.003))]
    row = bench_decode.summarize_batch(1, timed, None, 0, 1e9, read_bandwidth=2e9)
    assert (row.bound_ms, row.read_bound_ms) == pytest.approx((1.0, 0.5))
    assert (row.cpu_ratio, row.cpu_read_ratio) == pytest.approx((4.0, 8.0))
    text = bench_decode.format_table([row], 1e9, 1e12, read_bandwidth=2e9)
    assert "fastest read: 2.0 GB/s" in text and text.splitlines()[1].split()[-1] == "cpu/read"
    assert text.splitlines()[2].split()[-1] == "8.00"
    assert "cpu/read" not in bench_decode.format_table([row], 1e9, 1e12)  # no read measured: no column
    assert bench_decode.summarize_batch(1, timed, None, 0, 1e9).cpu_read_ratio == 0.0


def test_profile_steps_keeps_the_profilers_own_lines_off_stderr(capfd):
    # kineto writes "USDT: ... profiler_start/stop" from C++ onto fd 2; the breakdown's profiler start
    # and stop run with fd 2 on /dev/null, and what the steps themselves write still shows
    class Engine:
        steps = 0

        def step(self) -> None:
            self.steps += 1
            torch.ones(64, 64) @ torch.ones(64, 64)
            sys.stderr.write(f"step {self.steps}\n")

    engine = Engine()
    parts = bench_decode.profile_steps(engine, 3)
    err = capfd.readouterr().err
    assert engine.steps == 3 and parts["total"] > 0
    assert "profiler_" not in err and "USDT" not in err
    assert err.splitlines() == ["step 1", "step 2", "step 3"]
    sys.stderr.write("after\n")  # fd 2 is back
    assert capfd.readouterr().err == "after\n"


def test_throughput_report_shows_short_runs_in_significant_digits():
    # a run of a few milliseconds read "elapsed (s): 0.00" beside a finite tokens/s
    assert [bench_throughput.seconds_text(s) for s in (0.0045, 0.123456, 0.999, 1.0, 12.345)] == [
        "0.0045", "0.123", "1.00", "1.00", "12.35"]


def test_bench_help_states_the_benchmarks_own_defaults():
    # bench decode gives max_num_seqs the largest batch (fill_unset): its help says so, not the engine's 256
    from launch.bench import overhead as bench_overhead

    def help_of(parser, dest: str) -> str:
        return next(a.help for a in parser._actions if a.dest == dest)

    decode = bench_decode.build_parser()
    assert help_of(decode, "max_num_seqs") == "sequences running at once per DP rank (default: the largest --batch-sizes)"
    assert help_of(decode, "max_num_batched_tokens").endswith(
        "(default: the largest --batch-sizes + 8192, at least 8192)")
    assert help_of(bench_overhead.build_parser(), "max_num_seqs").endswith("(default: --batch)")
    assert "(default: 256)" not in decode.format_help().replace("\n", " ")


def test_decode_warms_up_for_graphs_only_where_they_are_recorded(monkeypatch):
    import argparse

    def warmup(cuda: bool, graphs: bool | None) -> int:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        args = argparse.Namespace(warmup_steps=None, cuda_graphs=graphs, batch_sizes=[2], context_len=4, steps=2,
                                  copy_mib=4, json=None, num_threads=None)
        bench_decode._check_args(args)
        return args.warmup_steps

    from moe.cuda_graphs import CAPTURE_AFTER

    assert warmup(True, True) == CAPTURE_AFTER + 1
    assert warmup(False, True) == warmup(True, None) == warmup(False, None) == 3  # no graph: the usual 3


def test_decode_table_rounds_the_mean_context_half_up():
    # 8.5 tokens of mean context read "8" (round half to even) where the JSON said 8.5
    fields = {f.name: 1.0 for f in dataclasses.fields(bench_decode.DecodeResult)}
    fields.update(batch_size=300, mean_context_len=8.5, fused_off_cpu_ms=None, breakdown_ms={})
    row = bench_decode.format_table([bench_decode.DecodeResult(**fields)], 1e10, 1e11).splitlines()[-1]
    assert row.split()[:6] == ["300", "1.00", "1.00", "1.00", "1.0", "9"]


def test_compute_rate_takes_pytorchs_linear_where_its_square_matmul_is_slow(monkeypatch):
    """float16 on a CPU without its instructions: PyTorch's square matmul ran at ~0.9 GFLOP/s on an AVX2
    Zen 3, its linear (what the model's layers call) at ~13, and a roof from the matmul alone put a
    decode step at 0.11x its compute bound. The rate is the fastest of the paths the model may run."""
    import parallel.costmodel.microbench as microbench

    times = iter([2.0, 0.01])  # the square matmul, then the linear on 96 rows
    monkeypatch.setattr(microbench, "best_call_seconds", lambda fn, repeats: (fn(), next(times))[1])
    rate, name = bench_decode.measure_matmul_flops(torch.float16, size=64, repeats=1)
    assert name == "torch linear" and rate == pytest.approx(2 * 96 * 64 * 64 / 0.01)
    times = iter([0.001, 0.01])
    assert bench_decode.measure_matmul_flops(torch.float16, size=64, repeats=1)[0] == pytest.approx(2 * 64**3 / 0.001)


class _BurnsInAnotherThread:
    """An engine whose step waits while another thread burns ~20 ms of CPU (an intra-op thread's share)."""

    def step(self) -> None:
        def burn() -> None:
            end = time.thread_time() + 0.02
            while time.thread_time() < end:
                pass

        worker = threading.Thread(target=burn)
        worker.start()
        worker.join()


def test_breakdown_counts_the_stepping_threads_cpu_outside_ops():
    """--breakdown's "outside ops" is the stepping thread's CPU time no op accounts for: at two
    threads the process's CPU time put the second thread's share of every op there (21 ms of a
    38.5 ms step). Here each step waits while another thread burns ~20 ms of CPU."""
    parts = bench_decode.profile_steps(_BurnsInAnotherThread(), 3)
    assert parts["outside ops"] < 10.0 and parts["total"] < 10.0


def test_ab_fused_off_steps_count_every_threads_cpu_as_the_on_steps_do():
    """--ab-fused-ops compares the process's CPU time of a fused-on step with a fused-off one: the
    off side must count the intra-op threads' CPU too (only --breakdown reads the stepping thread's)."""
    from types import SimpleNamespace

    batch = SimpleNamespace(num_seqs=2, num_tokens=2)
    recorder = SimpleNamespace(last=[SimpleNamespace(batches=[batch])])
    switches: list[bool] = []
    cpu = bench_decode._step_with_fused_off(_BurnsInAnotherThread(), recorder, switches.append, 2)
    assert switches == [False, True] and cpu >= 0.015
