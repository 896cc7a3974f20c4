"""``simulate`` and ``simulate calibrate``: reports, search, hardware files, nccl-tests tables."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from launch.calibrate import fit_overheads, read_nccl_tables
from launch.cli import resolve
from launch.hardware import hardware_names, load_hardware, save_hardware
from launch.simulate import main, parse_cluster, parse_slo
from moe.config import ModelConfig
from parallel.costmodel import Deployment
from parallel.costmodel.microbench import nccl_table_op, parse_nccl_table
from parallel.costmodel.search import SLO, enumerate_layouts, search_layouts

ROOT = Path(__file__).resolve().parents[2]

NCCL_ALLTOALL = """# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20
#  Rank  0 Group  0 Pid  1 on node0 device  0 [0x1b] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  2 on node0 device  1 [0x29] NVIDIA H100 80GB HBM3
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        131072     float    none      -1    25.30   41.45   20.72      0    24.90   42.11   21.06      0
     4194304        524288     float    none      -1    60.10   69.79   34.89      0    59.80   70.14   35.07      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 27.9
"""


def test_commands_are_registered():
    assert resolve(["simulate", "--help"])[0].target == "launch.simulate:main"
    assert resolve(["simulate", "calibrate"])[0].target == "launch.calibrate:main"


def test_config_report_has_the_throughput_keys(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--config", str(ROOT / "configs/mixtral-8x7b-ep8.yaml"), "--hardware", "h100", "--input-len", "1000",
                 "--output-len", "200", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prefill_input_tokens_per_s_per_node"] > 0 and report["decode_output_tokens_per_s_per_node"] > 0
    assert report["kv_len"] == 1100 and report["decode"]["batch_size"] == 256
    assert report["layout"].startswith("TP1 DP8 EP8")
    assert "routed_experts" in report["decode"]["breakdown_ms"]
    out_text = capsys.readouterr().out
    assert "per node" in out_text and "note:" not in out_text and report["notes"] == []


def test_a_hardware_file_without_node_links_says_what_was_assumed(tmp_path, capsys):
    """No intra_node_bandwidth and no collective tables: one node's ranks exchange at the memory
    bandwidth, and the report says so (a one-rank layout needs no such line)."""
    lines = (ROOT / "configs/hardware/h100.yaml").read_text().splitlines()
    hw = tmp_path / "h100-no-links.yaml"
    hw.write_text("\n".join(line for line in lines if not line.startswith("intra_node_bandwidth")) + "\n")
    out = tmp_path / "r.json"
    assert main(["--config", str(ROOT / "configs/mixtral-8x7b-ep8.yaml"), "--hardware", str(hw), "--json",
                 str(out)]) == 0
    (note,) = json.loads(out.read_text())["notes"]
    assert note.startswith("H100 gives no intra_node_bandwidth and no collective tables: the ranks of one node "
                           "exchange at its memory bandwidth (3,350 GB/s")
    assert f"note: {note}" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--hardware", "h100"], "give --config"),
    (["--config", "configs/mixtral-8x7b-ep8.yaml", "--hardware", "tpu9"], "neither a file nor one of"),
    (["--config", "{missing_model}", "--hardware", "h100"], "none of the shipped model configs"),
    (["--config", "configs/mixtral-8x7b-ep8.yaml", "--hardware", "h100", "--prefix-hit-rate", "1.5"],
     "--prefix-hit-rate"),
    (["--search", "--model", "deepseek-ai/DeepSeek-V3", "--cluster", "4xH100"], "NODESxGPUSxHARDWARE"),
    (["--search", "--model", "deepseek-ai/DeepSeek-V3", "--cluster", "1x8xH100", "--slo", "tpot=5"], "--slo item"),
    (["--config", "configs/deepseek-v3-decode-ep144.yaml", "--hardware", "h100", "--set",
      "parallel.data_parallel_size=8", "--set", "parallel.num_nodes=1", "--set",
      "balancer.num_redundant_experts=0"], "no room for the KV cache: the weights take"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path, argv, message):
    monkeypatch.chdir(ROOT)
    # configs/tiny.yaml with a model that is neither a local folder nor a shipped name (tiny.yaml's own
    # checkpoints/tiny-deepseek-v3 exists once a user has followed docs/layouts.md)
    missing = tmp_path / "missing-model.yaml"
    tiny = (ROOT / "configs/tiny.yaml").read_text()
    assert "model: checkpoints/tiny-deepseek-v3" in tiny
    missing.write_text(tiny.replace("model: checkpoints/tiny-deepseek-v3", f"model: {tmp_path / 'no-such-checkpoint'}"))
    argv = [str(missing) if a == "{missing_model}" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


MIXTRAL_SEARCH = ["--search", "--model", "mistralai/Mixtral-8x7B-v0.1", "--cluster", "1x8xH100"]
MIXTRAL_CONFIG = ["--config", "configs/mixtral-8x7b-ep8.yaml", "--hardware", "h100"]


@pytest.mark.parametrize(("argv", "message"), [
    ([*MIXTRAL_CONFIG, "--kv-len", "0"], "--kv-len must be >= 1, got 0"),
    ([*MIXTRAL_CONFIG, "--kv-len", "-10"], "--kv-len must be >= 1, got -10"),
    ([*MIXTRAL_CONFIG, "--load-skew", "nan"], "--load-skew must be a finite number >= 0, got nan"),
    (["--config", "/tmp", "--hardware", "h100"], "config file /tmp is a directory, not a YAML file"),
    ([*MIXTRAL_SEARCH, "--top", "0"], "--top must be >= 1, got 0"),
    ([*MIXTRAL_SEARCH, "--top", "-1"], "--top must be >= 1, got -1"),
    ([*MIXTRAL_SEARCH, "--slo", "ttft_ms=nan"], "--slo ttft_ms must be a positive number of ms, got nan"),
    ([*MIXTRAL_SEARCH, "--slo", "tpot_ms=inf"], "--slo tpot_ms must be a positive number of ms, got inf"),
    ([*MIXTRAL_SEARCH, "--json", "configs"], "--json: configs is a directory"),  # before the search runs
    ([*MIXTRAL_SEARCH, "--output-len", "0"], "--search ranks layouts by output tokens/s: give --output-len >= 1"),
    ([*MIXTRAL_SEARCH, "--output-len", "1", "--slo", "ttft_ms=500,tpot_ms=20"],
     "--slo tpot_ms needs --output-len >= 2: 1 output token(s) leave no time between tokens to hold to it (give a "
     "longer --output-len or leave tpot_ms out)"),
    (["--search", "--model", "configs/hardware/h100.yaml", "--cluster", "1x8xH100"],
     "configs/hardware/h100.yaml is not a runtime config (unknown config key 'name'; valid keys: ['balancer', "
     "'engine', 'model', 'model_overrides', 'moe', 'parallel', 'recovery', 'server']); expected a checkpoint "
     "directory, its config.json, a runtime config YAML (configs/*.yaml) or a model name such as "
     "deepseek-ai/DeepSeek-V3"),
])
def test_bad_values_are_refused_by_name(capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: simulate: {message}\n"


@pytest.mark.parametrize(("data", "message"), [
    ({"a": 1}, "expected an [L, E] array or a dump with 'logical_count', got an object with keys ['a']"),
    ([[1, "x"]], "expected an [L, E] array of numbers"),
    ([1, 2], "expected an [L, E] (or [steps, L, E]) array, got shape (2,)"),
])
def test_bad_expert_load_files_are_named(tmp_path, capsys, monkeypatch, data, message):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "load.json"
    path.write_text(json.dumps(data))
    assert main([*MIXTRAL_CONFIG, "--expert-load", str(path)]) == 2
    assert capsys.readouterr().err == f"error: simulate: {path}: {message}\n"


_JSON_LOAD = "expected an expert-distribution dump as `profile report` reads them"


@pytest.mark.parametrize(("name", "content", "message"), [
    ("load.json", b"", f"not JSON (Expecting value: line 1 column 1 (char 0)); {_JSON_LOAD}"),
    ("load.json", b"\xff\xfe\x00garbage", f"not JSON (not UTF-8 text); {_JSON_LOAD}"),
    ("load", b"[1, ", f"not JSON (Expecting value: line 1 column 5 (char 4)); {_JSON_LOAD}"),  # sniffed as JSON
    ("load.json", b"[[1, -2]]", "logical_count must hold finite non-negative counts"),
    ("load.npy", b"garbage", "not a .npy file (it does not start with NumPy's header)"),
    ("load.pt", b"garbage", ""),  # the torch reader's own words (launch.profile.sglang_dumps), naming the file
    ("load.bin2", b"garbage", "unknown dump format (expected .safetensors, .pt, .npy, .npz or .csv); --expert-load "
                              "also takes a JSON [L, E]"),
    ("missing.json", None, "no such file"),
])
def test_unreadable_expert_load_files_are_named_with_what_was_expected(tmp_path, capsys, monkeypatch, name,
                                                                       content, message):
    monkeypatch.chdir(ROOT)
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    assert main([*MIXTRAL_CONFIG, "--expert-load", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: simulate: {path}: {message}") and err.count("\n") == 1, err


def test_search_model_that_is_not_a_config_object(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    assert main(["--search", "--model", str(path), "--cluster", "1x8xH100"]) == 2
    assert capsys.readouterr().err == \
        f"error: simulate: {path} is not a model config.json: expected a JSON object, got a list\n"


def test_search_takes_a_runtime_config_as_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "r.json"
    assert main(["--search", "--model", "configs/mixtral-8x7b-ep8.yaml", "--cluster", "1x8xH100", "--slo",
                 "ttft_ms=1000,tpot_ms=200", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "mistralai/Mixtral-8x7B-Instruct-v0.1" and report["num_layouts"] == 20
    assert capsys.readouterr().out.startswith("mistralai/Mixtral-8x7B-Instruct-v0.1 on 1x8xH100")


@pytest.mark.parametrize(("flags", "progress"), [([], True), (["--no-progress"], False)])
def test_search_shows_progress_unless_asked_not_to(monkeypatch, capsys, flags, progress):
    import launch.simulate as simulate

    seen = []
    monkeypatch.setattr(simulate, "search_layouts", lambda *a, **kw: seen.append(kw["progress"] is not None) or [])
    assert main([*MIXTRAL_SEARCH, *flags]) == 0
    assert seen == [progress]


def test_search_progress_bar_waits_a_second(capsys):
    import launch.simulate as simulate

    mixtral = ModelConfig.from_hf("mistralai/Mixtral-8x7B-v0.1", strict=False)
    seen: list[int] = []

    def bar(layouts):
        seen.append(len(layouts))
        return simulate._search_bar(layouts)

    ranked = search_layouts(mixtral, load_hardware("h100"), num_nodes=1, gpus_per_node=8, slo=SLO(), input_len=100,
                            output_len=10, progress=bar)
    assert seen == [len(ranked)] and len(ranked) > 0  # every layout goes through the bar
    assert capsys.readouterr().err == ""  # a fast search stays quiet


def test_slo_and_cluster_parsing():
    assert parse_slo("ttft_ms=1000,tpot_ms=50") == SLO(1000.0, 50.0)
    assert parse_slo("") == SLO()
    nodes, gpus, hw = parse_cluster("4x8xH100")
    assert (nodes, gpus, hw.name) == (4, 8, "H100")


def test_layouts_cover_tp_ep_redundancy_and_overlap():
    mixtral = ModelConfig.from_hf("mistralai/Mixtral-8x7B-v0.1", strict=False)
    layouts = enumerate_layouts(mixtral, 2, 8, Deployment())
    assert {d.tp for d in layouts} == {1, 2, 4, 8}
    assert {d.ep for d in layouts} == {1, 8, 16}
    assert any(d.enable_two_batch_overlap for d in layouts) and any(d.num_redundant_experts for d in layouts)
    for d in layouts:
        assert (8 + d.num_redundant_experts) % d.ep == 0 and d.world_size == 8 * d.num_nodes
        # the runtime spreads experts over every rank or none (parallel.enable_expert_parallel):
        # no EP8 inside a two-node instance, which no config could launch
        assert d.ep in (1, d.world_size), d.describe()


def test_search_ranks_by_goodput_and_respects_the_slo():
    mixtral = ModelConfig.from_hf("mistralai/Mixtral-8x7B-v0.1", strict=False)
    hw = load_hardware("h100")
    ranked = search_layouts(mixtral, hw, num_nodes=1, gpus_per_node=8, slo=SLO(ttft_ms=500, tpot_ms=30),
                            input_len=1000, output_len=200, base=Deployment(max_num_seqs=512))
    feasible = [c for c in ranked if c.feasible]
    assert feasible, [c.bound for c in ranked]
    goodputs = [c.goodput_per_gpu for c in feasible]
    assert goodputs == sorted(goodputs, reverse=True)
    for c in feasible:
        assert c.tpot_ms <= 30 and c.ttft_ms <= 500 and c.bound
    assert all(not c.feasible for c in ranked[len(feasible):])


@pytest.mark.slow
def test_deepseek_on_4x8_h100_answer_in_seconds(capsys):
    assert main(["--search", "--model", "deepseek-ai/DeepSeek-V3", "--cluster", "4x8xH100", "--slo",
                 "ttft_ms=1000,tpot_ms=50", "--dispatch-dtype", "fp8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "1. " in out and "bounded by" in out and "output tok/s per GPU" in out


def test_hardware_files_round_trip(tmp_path):
    assert {"h800", "h100", "h200", "b200"} <= set(hardware_names())
    h100 = load_hardware("H100")
    assert h100.peak_flops("fp8") == pytest.approx(2 * h100.peak_flops("bf16"), rel=1e-3)
    for ext in ("yaml", "json"):
        path = tmp_path / f"hw.{ext}"
        save_hardware(h100, path)
        assert load_hardware(path) == h100
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_hardware(tmp_path / "bad.yaml")


def test_nccl_tests_tables_are_read(tmp_path):
    rows = parse_nccl_table(NCCL_ALLTOALL)
    assert rows == [(1048576.0, pytest.approx(25.30e-6)), (4194304.0, pytest.approx(60.10e-6))]
    assert nccl_table_op(NCCL_ALLTOALL.replace("# nThread", "# all_to_all_perf\n# nThread")) == ("alltoall", 2)
    path = tmp_path / "a2a.txt"
    path.write_text(NCCL_ALLTOALL)
    tables = read_nccl_tables([f"{path}:alltoall:8"])
    assert list(tables) == ["alltoall:8"]
    with pytest.raises(ValueError, match="OP:NRANKS"):
        read_nccl_tables([str(path)])
    with pytest.raises(ValueError, match="no nccl-tests rows"):
        parse_nccl_table("# nothing here\n")


def test_commbench_tables_are_read():
    from parallel.bench.commbench import Row, Timing, format_table

    rows = [Row(1024, 256, "float", "sum", -1, Timing(12.5, 0.08, 0.08, 0), Timing(11.0, 0.09, 0.09, 0))]
    text = format_table("allreduce", rows, 2, "gloo")
    assert nccl_table_op(text) == ("allreduce", 2)
    assert parse_nccl_table(text) == [(1024.0, pytest.approx(12.5e-6))]


def test_overhead_fit_recovers_a_known_model():
    truth = {"step_overhead_s": 2e-3, "layer_overhead_s": 5e-4, "seq_overhead_s": 1e-4, "layer_seq_overhead_s": 0.0}
    samples = [(layers, seqs, 2e-3 + 5e-4 * layers + 1e-4 * seqs) for layers in (2, 3) for seqs in (1, 4, 8)]
    fitted = fit_overheads(samples)
    for key, value in truth.items():
        assert fitted[key] == pytest.approx(value, abs=1e-9)
    assert all(v >= 0 for v in fit_overheads([(2, 1, 5e-3), (3, 1, 4e-3)]).values())


@pytest.mark.slow
def test_calibrate_writes_a_loadable_hardware_file(tmp_path):
    from launch.calibrate import main as calibrate_main

    out = tmp_path / "local.yaml"
    assert calibrate_main(["--out", str(out), "--nprocs", "", "--dtypes", "float32", "--no-engine"]) == 0
    hw = load_hardware(out)
    assert hw.flops["float32"] > 0 and hw.gemm_rates["float32"] and hw.kernel_overhead_s > 0
    assert hw.memory_bandwidth > 0 and 0 < hw.attention_efficiency <= 1


def test_cpu_clock_times_work_and_needs_one_thread():
    from launch.calibrate import calibrate
    from parallel.costmodel.microbench import time_call

    def busy() -> int:
        return sum(range(20000))

    assert time_call(busy, iters=5, clock="cpu") > 0
    with pytest.raises(ValueError, match="--threads 1"):
        calibrate(threads=2, nprocs=(), clock="cpu", measure_engine=False)


def test_best_call_seconds_times_a_slow_call_once_and_a_fast_one_repeatedly(monkeypatch):
    import parallel.costmodel.microbench as mb

    clock = {"now": 0.0}
    calls = []
    monkeypatch.setitem(mb.CLOCKS, "wall", lambda: clock["now"])

    def timed(seconds: float) -> float:
        calls.clear()

        def fn() -> None:
            calls.append(seconds)
            clock["now"] += seconds

        return mb.best_call_seconds(fn, repeats=5, budget_s=1.0)

    assert timed(2.0) == 2.0 and len(calls) == 1  # over the budget: the warm-up is the only call
    assert timed(0.01) == pytest.approx(0.01) and len(calls) == 6  # warm-up + every repeat
    assert timed(0.4) == pytest.approx(0.4) and len(calls) == 3  # warm-up + the two that fit


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "hardware").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_hardware_file_loads_with_public_peaks(path):
    hw = load_hardware(path)
    assert hw.peak_flops("fp8") > hw.peak_flops("bfloat16") > hw.peak_flops("float32")
    assert hw.memory_bytes >= 80e9 and hw.gpus_per_node == 8
    assert hw.intra_node_bandwidth > hw.inter_node_bandwidth > 0
    assert hw.source


def test_collective_tables_are_made_monotone_in_size():
    from launch.calibrate import monotone

    assert monotone([(64, 1.2e-3), (256, 4e-4), (1024, 1.1e-3), (4096, 9e-4)]) == \
        [(64, 4e-4), (256, 4e-4), (1024, 9e-4), (4096, 9e-4)]


def test_nccl_tables_on_top_of_a_shipped_hardware_drive_dispatch(tmp_path):
    from launch.calibrate import main as calibrate_main
    from parallel.costmodel import predict_point

    table = tmp_path / "a2a.txt"
    table.write_text(NCCL_ALLTOALL)
    out = tmp_path / "h100-measured.yaml"
    assert calibrate_main(["--base", "h100", "--nccl-table", f"{table}:alltoall:8", "--out", str(out)]) == 0
    measured, datasheet = load_hardware(out), load_hardware("h100")
    assert measured.collectives["alltoall:8"] == ((1048576.0, pytest.approx(25.3e-6)), (4194304.0, pytest.approx(60.1e-6)))
    assert measured.flops == datasheet.flops and "collectives from" in measured.source
    mixtral = ModelConfig.from_hf("mistralai/Mixtral-8x7B-v0.1", strict=False)
    dep = Deployment(dp=8, ep=8, max_num_seqs=64)
    a = predict_point(mixtral, dep, measured, batch_size=64, kv_len=1000)
    b = predict_point(mixtral, dep, datasheet, batch_size=64, kv_len=1000)
    assert a.decode_breakdown["dispatch"] != b.decode_breakdown["dispatch"]
    assert calibrate_main(["--base", "h100", "--out", str(out)]) == 2  # nothing to add


def test_calibrate_names_the_bad_flag_or_table_before_measuring(tmp_path, capsys):
    from launch.calibrate import main as calibrate_main

    table = tmp_path / "a2a.txt"
    table.write_text("# nothing here\n")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = str(tmp_path / "hw.yaml")
    base = ["--base", "h100"]
    truncated = tmp_path / "truncated"  # a checkpoint whose weights file ends inside its header
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}))
    (truncated / "model.safetensors").write_bytes(b"\x10\x00")
    cases = [
        (["--out", out, "--threads", "0"], "--threads must be >= 1, got 0"),
        (["--out", out, "--nprocs", "2,x"], "--nprocs takes comma-separated integers, got '2,x'"),
        (["--out", out, "--nprocs", "1"], "--nprocs values must be >= 2, got 1"),
        (["--out", out, "--dtypes", ","], "--dtypes names no dtype"),
        (["--out", str(blocker / "hw.yaml")], f"--out: {blocker} is not a directory"),
        ([*base, "--out", out, "--nccl-table", f"{table}:alltoall:x"],
         f"--nccl-table {table}:alltoall:x: NRANKS must be an integer >= 2, got 'x'"),
        ([*base, "--out", out, "--nccl-table", str(tmp_path / "missing.txt")],
         f"--nccl-table {tmp_path / 'missing.txt'}: No such file or directory"),
        ([*base, "--out", out, "--nccl-table", f"{table}:alltoall:8"],
         f"--nccl-table {table}: no nccl-tests rows found"),
        # without --base too: the tables are read before the GEMMs are measured
        (["--out", out, "--nccl-table", str(tmp_path / "missing.txt")],
         f"--nccl-table {tmp_path / 'missing.txt'}: No such file or directory"),
        (["--out", out, "--ray-ranks", "-1"], "--ray-ranks must be 0 (skip) or >= 2, got -1"),
        (["--out", out, "--ray-ranks", "2", "1"], "--ray-ranks must be 0 (skip) or >= 2, got 1"),
        (["--out", out, "--model", str(tmp_path), "--no-engine"],
         "--model times the engine's steps, which --no-engine skips"),
        (["--out", out, "--model", str(truncated)], f"--model {truncated}: {truncated / 'model.safetensors'}: "
                                                     "not a readable safetensors file"),
    ]
    for argv, message in cases:
        assert calibrate_main(argv) == 2, argv
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: simulate calibrate: {message}"), (argv, line)
    assert not Path(out).exists()


def test_gemm_rates_time_the_engines_own_linear(monkeypatch):
    """The calibrated GEMM rates are the engine's linear layer's (the CPU kernel where the engine
    runs it), not ``F.linear``'s."""
    import moe.layers.linear as linear
    from parallel.costmodel.microbench import measure_gemm_rates

    rows_seen: list[int] = []
    forward = linear.Linear.forward

    def counting(self, x):
        rows_seen.append(x.shape[0])
        return forward(self, x)

    monkeypatch.setattr(linear.Linear, "forward", counting)
    rates = measure_gemm_rates("float32", rows=(1, 8), features=64)
    assert [m for m, _ in rates] == [1.0, 8.0] and all(r > 0 for _, r in rates)
    assert set(rows_seen) == {1, 8}


def test_engine_steps_report_the_load_they_routed(tmp_path):
    """Calibration feeds the operator model the expert load the timed steps routed: [L_moe, E]
    tokens per expert, piled on the favoured experts of a skewed checkpoint."""
    from launch.calibrate import _engine_step_seconds
    from launch.tiny_checkpoint import make_tiny_checkpoint
    from moe.config import ModelConfig

    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "skewed", router_skew=3.0)
    mc = ModelConfig.from_hf(path)
    seconds, load = _engine_step_seconds(path, 2, "float32", steps=2)
    assert seconds > 0
    assert load.shape == (len(mc.moe_layer_ids), mc.num_experts) and load.sum() > 0
    share = np.sort(load, axis=1)[:, ::-1] / load.sum(axis=1, keepdims=True)
    assert (share[:, : mc.num_experts_per_tok].sum(axis=1) > 2 * mc.num_experts_per_tok / mc.num_experts).all()


def test_read_bandwidth_is_bytes_over_seconds(monkeypatch):
    import parallel.costmodel.microbench as mb

    monkeypatch.setattr(mb, "time_call", lambda fn, **kw: (fn(), 0.5)[1])
    assert mb.measure_read_bandwidth(8 * 2**20) == pytest.approx(8 * 2**20 / 0.5)


def test_decode_steps_timed_by_the_workers_cpu_time(tmp_path):
    """``worker_cpu``: each timed step is what the engine's counters add for it (the slowest rank's
    CPU time, what a sweep's ``measured_step_cpu_ms`` reads); a multi-rank calibration in CPU time
    times its Ray ranks so, not the driver that waits for them."""
    from launch.calibrate import time_decode_steps
    from launch.config import RuntimeConfig
    from launch.engine import LLMEngine
    from launch.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "tiny")
    engine = LLMEngine(RuntimeConfig.from_dict({"model": str(path), "engine": {
        "dtype": "float32", "max_num_seqs": 4, "max_model_len": 128, "block_size": 16, "num_kv_blocks": 32}}))
    try:
        before = engine.counters.worker_cpu_seconds_total
        steps = time_decode_steps(engine, 2, 16, 3, 1, "worker_cpu")
        assert len(steps) == 3 and all(s > 0 for s in steps)
        assert sum(steps) < engine.counters.worker_cpu_seconds_total - before  # the timed steps are some of them
    finally:
        engine.shutdown()


def test_ray_ranks_times_each_kind_of_instance_apart(tmp_path, monkeypatch):
    """``--ray-ranks 2`` times a TP, an EP and a DP instance, three times each with the kinds in
    turn; each kind's overhead is its median step less the operator model of that layout (TP:
    every rank the whole batch; EP / DP: half each), and a layout the model cannot be split by is
    tried once and left out, not fatal."""
    import launch.calibrate as cal
    from launch.tiny_checkpoint import make_tiny_checkpoint
    from parallel.costmodel import Hardware, build_rank_load, decode_work, predict_phase

    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "tiny")
    asked = []
    times = {"tp": iter([9e-3, 12e-3, 8e-3]), "ep": iter([7e-3, 6e-3, 20e-3])}  # medians 9 and 7 ms

    def fake_steps(model_dir, batch, dtype, steps=16, kind="one", ranks=1, clock="wall"):
        asked.append((kind, ranks, batch, clock))
        if kind == "dp":
            raise ValueError("data_parallel_size 2 needs something this model lacks")
        return next(times[kind]), None

    monkeypatch.setattr(cal, "_engine_step_seconds", fake_steps)
    hw = Hardware(name="t", flops={"float32": 1e11}, memory_bandwidth=2e10, memory_bytes=2**31,
                  intra_node_bandwidth=1e9, inter_node_bandwidth=1e9)
    lines = []
    got = cal.measure_multi_rank_overheads(hw, "float32", 2, lines.append, model=str(path), clock="cpu")
    assert asked == [("tp", 2, 4, "cpu"), ("ep", 2, 4, "cpu"), ("dp", 2, 4, "cpu")] + \
        [("tp", 2, 4, "cpu"), ("ep", 2, 4, "cpu")] * 2
    mc = ModelConfig.from_hf(path)
    for kind, measured, fields, per_rank in (("tp", 9e-3, {"tp": 2}, 4), ("ep", 7e-3, {"dp": 2, "ep": 2}, 2)):
        dep = Deployment(**fields, dtype="float32", max_num_seqs=8, max_num_batched_tokens=256,
                         kv_capacity_tokens=2048)
        modelled = predict_phase(mc, dep, hw, build_rank_load(mc, dep), decode_work(per_rank, 17),
                                 decode=True).step_ms / 1e3
        assert got[kind] == pytest.approx(measured - modelled)
    assert set(got) == {"tp", "ep"} and [line for line in lines if line.startswith("DP2 not timed")] == \
        ["DP2 not timed: data_parallel_size 2 needs something this model lacks"]
    assert any("TP2 on Ray, batch 4: 9.00 / 12.00 / 8.00 ms measured (the slowest rank's CPU time; median 9.00)"
               in line for line in lines)
    assert cal.multi_rank_layout("ep", 4) == ({"data_parallel_size": 4, "enable_expert_parallel": True},
                                              {"dp": 4, "ep": 4})
    with pytest.raises(ValueError, match="unknown multi-rank kind 'pp'"):
        cal.multi_rank_layout("pp", 2)


def test_each_rank_count_is_timed_apart_and_the_widest_stands_for_the_rest(monkeypatch):
    """``--ray-ranks 4 2`` times the kinds at two and at four ranks: "tp:2" and "tp:4" in the
    hardware, the plain "tp" the widest count that timed TP (a kind four ranks cannot build keeps
    its two-rank figure), and the one-figure fallback the largest plain figure."""
    import launch.calibrate as cal
    from parallel.costmodel import Hardware

    asked = []
    figures = {2: {"tp": 1e-3, "ep": 2e-3, "dp": 0.0}, 4: {"ep": 5e-3, "dp": 3e-3}}  # TP4 not buildable

    def fake(hw, dtype, ranks, log, model=None, clock="wall"):
        asked.append((ranks, dtype, model, clock))
        return figures[ranks]

    monkeypatch.setattr(cal, "measure_multi_rank_overheads", fake)
    hw = Hardware(name="t", flops={"float32": 1e11}, memory_bandwidth=2e10, memory_bytes=2**31)
    lines = []
    got = cal.with_multi_rank_overheads(hw, "float32", (4, 1, 2, 4), lines.append, "m", "cpu")
    assert asked == [(2, "float32", "m", "cpu"), (4, "float32", "m", "cpu")]
    assert got.multi_rank_overheads == {"tp:2": 1e-3, "tp": 1e-3, "ep:2": 2e-3, "ep": 5e-3, "dp:2": 0.0, "dp": 3e-3,
                                        "ep:4": 5e-3, "dp:4": 3e-3}
    assert got.multi_rank_step_overhead_s == 5e-3
    assert lines == ["multi-rank step overhead (ms): TP2 1.00, EP2 2.00, DP2 0.00, EP4 5.00, DP4 3.00"]
    assert got.multi_rank_overhead(("tp",), 4) == 1e-3 and got.multi_rank_overhead(("ep",), 2) == 2e-3
    figures[2] = figures[4] = {}
    lines.clear()
    assert cal.with_multi_rank_overheads(hw, "float32", (2, 4), lines.append).multi_rank_overheads == {}
    assert len(lines) == 1 and lines[0].startswith("note: no 2 or 4-rank instance of the model could be built")


def test_more_ranks_than_cores_is_noted():
    """Gloo tables of more ranks than cores include waiting for a core (docs/layouts.md): calibrate
    says so, naming the count; ranks that fit get no note."""
    from launch.calibrate import oversubscribed_note

    assert oversubscribed_note(2, 1, cpus=2) is None and oversubscribed_note(4, 2, cpus=8) is None
    note = oversubscribed_note(4, 1, cpus=2)
    assert note is not None and note.startswith("note: --nprocs 4 x 1 thread(s) is more than this machine's 2 CPUs")
    assert oversubscribed_note(2, 2, cpus=2) is not None
    assert oversubscribed_note(1, 1) is None  # this machine's own CPU count


def test_bandwidth_settles_where_no_engine_step_is_over_predicted():
    """The weight-read benchmark under-measures when other guests hold the shared cache: the read
    rate is raised in 5 % steps until the operator model stops over-predicting the engine's own
    steps (3 % tolerance), never lowered, and capped at 4x."""
    from launch.calibrate import BANDWIDTH_STEP, settle_bandwidth

    weights = [100e6, 150e6]  # bytes each sample reads; measured as if read at 20 GB/s, plus 1 ms

    def predict(bw: float) -> list[float]:
        return [w / bw + 1e-3 for w in weights]

    measured = [w / 20e9 + 1e-3 for w in weights]
    settled = settle_bandwidth(10e9, predict, measured)
    assert settled > 10e9 and all(p <= 1.03 * m for p, m in zip(predict(settled), measured))
    assert any(p > 1.03 * m for p, m in zip(predict(settled / BANDWIDTH_STEP), measured))  # the first that fits
    assert settle_bandwidth(30e9, predict, measured) == 30e9  # a fast read is kept: the slack becomes overheads
    assert settle_bandwidth(1e9, predict, measured) == pytest.approx(4e9)  # at most 4x the measured rate


def test_search_json_has_no_made_up_times_for_infeasible_layouts(tmp_path):
    """A layout the SLO or memory rules out has null for the decode figures the search never reached
    (not 0 ms, which reads as instant); its goodput is 0 and its TTFT is kept where it was computed."""
    out = tmp_path / "s.json"
    assert main(["--search", "--model", "mistralai/Mixtral-8x7B-v0.1", "--cluster", "1x8xH100", "--slo",
                 "ttft_ms=45,tpot_ms=50", "--no-progress", "--json", str(out)]) == 0  # TTFT and memory rule some out
    ranked = json.loads(out.read_text())["ranked"]
    feasible = [c for c in ranked if c["feasible"]]
    ruled_out = [c for c in ranked if not c["feasible"]]
    assert feasible and ruled_out
    assert all(c["tpot_ms"] > 0 and c["decode_step_ms"] > 0 and c["batch_size"] >= 1 for c in feasible)
    for c in ruled_out:
        assert c["tpot_ms"] is None and c["decode_step_ms"] is None and c["batch_size"] is None, c
        assert c["goodput_per_gpu"] == 0.0 and (c["ttft_ms"] is None or c["ttft_ms"] > 0)
    assert any(c["ttft_ms"] is not None for c in ruled_out if c["bound"].startswith(("TTFT", "TPOT")))


def test_search_kv_capacity_is_whole_blocks_as_simulate_config_and_kvcalc_give(tmp_path):
    """The search's KV capacity per rank is the engine's sizing in whole blocks of 16 (it was the
    budget before rounding: 1,084,746 where simulate --config and kvcalc say 1,084,736)."""
    from launch.hardware import compute_kv_capacity_tokens

    out = tmp_path / "s.json"
    assert main(["--search", "--model", "deepseek-ai/DeepSeek-V3", "--cluster", "4x8xH100", "--slo",
                 "ttft_ms=1000,tpot_ms=50", "--input-len", "2000", "--output-len", "500", "--no-progress",
                 "--json", str(out)]) == 0
    model = ModelConfig.from_hf("deepseek-ai/DeepSeek-V3", strict=False)
    hw = load_hardware("h100")
    for c in json.loads(out.read_text())["ranked"]:
        dep = Deployment(**{k: v for k, v in c["deployment"].items() if k != "kv_capacity_tokens"})
        want = compute_kv_capacity_tokens(model, dep, hw.memory_bytes, 16)
        if want:
            assert c["kv_capacity_tokens"] == want and want % 16 == 0, c["layout"]


def test_the_kv_pool_must_hold_a_whole_sequence_not_the_average_context(capsys):
    """2,304 KV tokens per rank hold the average decode context (2,000 + 500 / 2) but not a sequence's
    last token (2,500): refused, as the engine would preempt it for good; 2,512 runs."""
    base = ["--config", str(ROOT / "configs/mixtral-8x7b-ep8.yaml"), "--hardware", "h100", "--input-len", "2000",
            "--output-len", "500"]
    assert main([*base, "--set", "engine.num_kv_blocks=144"]) == 2
    assert capsys.readouterr().err == (
        "error: simulate: TP1 DP8 EP8 1 node(s) +8 redundant EPLB: engine.num_kv_blocks=144 x block_size=16 hold 2,304 "
        "KV tokens per rank, not one 2,500-token sequence (more KV blocks, or a shorter --input-len / --output-len / "
        "--kv-len)\n")
    assert main([*base, "--set", "engine.num_kv_blocks=157"]) == 0
