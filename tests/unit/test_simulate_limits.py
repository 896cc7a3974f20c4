"""``simulate`` / ``kvcalc`` / ``simulate calibrate`` on inputs at the edges: the nearest misses of a
search with no feasible layout, every expert-load format ``profile report`` reads, expert counts and
block sizes nothing fits, engine limits past int64, binary hardware files, unknown collectives and
the flags ``--base`` leaves without effect."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from launch.calibrate import main as calibrate
from launch.kvcalc import main as kvcalc
from launch.simulate import main as simulate
from parallel.costmodel import Hardware

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "launch/data/models/tiny-dsv3")  # 4 MoE layers of 16 experts
LENGTHS = ["--input-len", "100", "--output-len", "50"]


@pytest.fixture
def ep2(tmp_path: Path) -> Path:
    """The tiny DeepSeek-V3 checkpoint on DP2 EP2, EPLB with 2 redundant experts, 512 MiB a rank."""
    path = tmp_path / "ep2.yaml"
    path.write_text(yaml.safe_dump({
        "model": TINY,
        "parallel": {"tensor_parallel_size": 1, "data_parallel_size": 2, "enable_expert_parallel": True},
        "balancer": {"enable_eplb": True, "num_redundant_experts": 2},
        "engine": {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 256, "memory": "512MiB"}}))
    return path


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize(("slo", "reason"), [("tpot_ms=15", "TPOT"), ("ttft_ms=10", "TTFT")])
def test_a_search_with_no_feasible_layout_lists_the_nearest_misses_first(tmp_path, capsys, slo, reason):
    """DeepSeek-V3 on 4 x 8 H100: the EP32 layouts fit and miss only the SLO; they come before the
    one-node layouts that cannot hold the weights, nearest (predicted / objective) first."""
    out = tmp_path / "s.json"
    assert simulate(["--search", "--model", "deepseek-ai/DeepSeek-V3", "--cluster", "4x8xH100", "--slo", slo,
                     "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    listed = text.split("no layout meets the objectives; the closest, and why:\n")[1].splitlines()
    assert len(listed) == 5 and all(f": {reason}: " in line for line in listed), listed
    ranked = json.loads(out.read_text())["ranked"]
    assert not any(c["feasible"] for c in ranked)
    fits = [not c["bound"].startswith("memory") for c in ranked]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)  # in memory first
    near = [c["miss_ratio"] for c in ranked if not c["bound"].startswith("memory")]
    assert near == sorted(near) and 1 < near[0] < near[-1]
    assert [line.split(": ")[0] for line in listed] == [f"- {c['layout']}" for c in ranked[:5]]
    objective = float(slo.split("=")[1])
    shown = float(re.search(r"takes ([\d.]+) ms", listed[0]).group(1))
    assert shown == pytest.approx(ranked[0]["miss_ratio"] * objective, rel=0.05)


def _write_loads(tmp_path: Path, count: np.ndarray) -> dict[str, Path]:
    """One [S, L, E] count in every format ``profile report`` reads, and as JSON."""
    import torch

    from launch.expert_location import write_expert_distribution_dump

    steps, layers, experts = count.shape
    paths = {"safetensors": write_expert_distribution_dump(tmp_path / "dump", torch.tensor(count))}
    paths["npy"] = tmp_path / "load.npy"
    np.save(paths["npy"], count)
    paths["npz"] = tmp_path / "load.npz"
    np.savez(paths["npz"], logical_count=count)
    paths["csv"] = tmp_path / "load.csv"
    rows = [f"{s},{layer}," + ",".join(str(int(v)) for v in count[s, layer])
            for s in range(steps) for layer in range(layers)]
    paths["csv"].write_text("step,layer," + ",".join(f"e{j}" for j in range(experts)) + "\n" + "\n".join(rows) + "\n")
    paths["json"] = tmp_path / "load.json"
    paths["json"].write_text(json.dumps({"logical_count": count.tolist()}))
    return paths


def test_expert_load_takes_every_dump_format_profile_report_reads(tmp_path, capsys, ep2):
    """``profile run``'s .safetensors (written by the same writer), .npz and .csv used to be refused:
    each now gives the prediction the same load as JSON gives."""
    rng = np.random.default_rng(0)
    count = rng.integers(0, 5, size=(6, 4, 16)) * 10
    count[:, :, :2] += 400  # two hot experts per layer: the placement and the step see the skew
    paths = _write_loads(tmp_path, count)
    results = {}
    for name, path in paths.items():
        out = tmp_path / f"{name}.out.json"
        argv = ["--config", str(ep2), "--hardware", "h100", *LENGTHS, "--expert-load", str(path), "--json", str(out)]
        assert simulate(argv) == 0, (name, capsys.readouterr().err)
        assert capsys.readouterr().err == ""  # 4 layers, as the model: no warning
        results[name] = json.loads(out.read_text())
    uniform = tmp_path / "uniform.json"
    assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS, "--json", str(uniform)]) == 0
    reference = results["json"]
    for name, report in results.items():
        assert report["balancedness"] == reference["balancedness"], name
        assert report["decode"]["breakdown_ms"] == reference["decode"]["breakdown_ms"], name
    assert reference["decode"]["breakdown_ms"]["routed_experts"] != \
        json.loads(uniform.read_text())["decode"]["breakdown_ms"]["routed_experts"]


def test_an_expert_load_of_another_depth_is_cycled_with_a_warning(tmp_path, capsys, ep2):
    path = tmp_path / "c.npy"
    np.save(path, np.ones((50, 3, 16), dtype=np.int64))
    assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS, "--expert-load", str(path)]) == 0
    err = capsys.readouterr().err
    assert err == (f"warning: simulate: --expert-load {path} has 3 MoE layer(s), {TINY} has 4: the load's layers "
                   "are cycled (MoE layer i takes its layer i mod 3)\n")
    wrong = tmp_path / "e8.npy"
    np.save(wrong, np.ones((4, 8)))
    assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS, "--expert-load", str(wrong)]) == 2
    assert _one_line_error(capsys) == (f"error: simulate: --expert-load {wrong}: 8 experts per layer, but {TINY} "
                                       "routes over 16")


def test_an_expert_load_and_a_load_skew_are_refused_together(tmp_path, capsys, ep2):
    path = tmp_path / "c.npy"
    np.save(path, np.ones((4, 16)))
    for skew in ("1", "0"):  # even the default's value: one of the two would be ignored
        assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS, "--expert-load", str(path),
                         "--load-skew", skew]) == 2
        assert _one_line_error(capsys) == (f"error: simulate: --load-skew {skew} and --expert-load {path} both give "
                                           "the expert load (a synthetic Zipf skew, a measured one): pass one")


def test_redundant_experts_no_memory_holds_are_refused_before_any_placement(capsys, monkeypatch, ep2):
    """10,000,000 redundant slots used to hang in the placement (and 100,000 to fail allocating 149 GiB);
    the weights they need are named first, and nothing per slot is built."""
    import launch.simulate as sim

    def no_prediction(*_a, **_k):
        raise AssertionError("predicted a layout whose weights do not fit")

    monkeypatch.setattr(sim, "predict_point", no_prediction)
    for count, weights in ((10_000_000, "1.79 TiB"), (100_000, "18.32 GiB")):
        assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS,
                         "--set", f"balancer.num_redundant_experts={count}"]) == 2
        assert _one_line_error(capsys) == (
            f"error: simulate: TP1 DP2 EP2 1 node(s) +{count} redundant EPLB on H100: no room for the KV cache: the "
            f"weights take {weights} per rank (tp=1) of 0.9 x 512.00 MiB = 460.80 MiB usable; KV needs 960 B per "
            "token (all layers) on top (more expert parallelism, fp8 weights or a bigger memory)")


@pytest.mark.parametrize(("block_size", "tokens", "blocks", "concurrency"), [
    (16, "497,488", "31,093", "1943.31"), (1000, "497,000", "497", "497.00"), (100, "497,400", "4,974", "1658.00")])
def test_kvcalc_counts_whole_blocks(capsys, ep2, block_size, tokens, blocks, concurrency):
    """The 497,497 tokens the budget holds are 31,093 blocks of 16 = 497,488 tokens; a sequence of
    max_model_len 256 takes ceil(256 / block) whole blocks."""
    assert kvcalc(["--model", str(ep2), "--block-size", str(block_size)]) == 0
    out = capsys.readouterr().out
    assert f"tokens that fit: {tokens} ({blocks} blocks of {block_size})" in out
    assert f"concurrent sequences at max_model_len 256: {concurrency}" in out
    assert kvcalc(["--model", str(ep2), "--block-size", str(block_size), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_capacity_tokens"] == report["num_blocks"] * block_size == int(tokens.replace(",", ""))
    assert report["max_num_tokens"] == 497_497  # the budget, before whole blocks


def test_a_block_no_memory_holds_is_refused_by_kvcalc_and_simulate_alike(capsys, ep2):
    words = ("no room for one KV block: a block of 1,000,000 tokens takes 915.53 MiB of KV per rank, over the "
             "455.47 MiB (497,497 tokens) the weights leave; give a smaller block_size")
    assert kvcalc(["--model", str(ep2), "--block-size", "1000000"]) == 2
    assert _one_line_error(capsys) == f"error: kvcalc {ep2}: {words}"
    assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS, "--set", "engine.block_size=1000000"]) == 2
    assert _one_line_error(capsys) == f"error: simulate: TP1 DP2 EP2 1 node(s) +2 redundant EPLB on H100: {words}"


def test_simulate_reports_kv_capacity_in_whole_blocks(tmp_path, capsys, ep2):
    out = tmp_path / "r.json"
    assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS, "--set", "engine.block_size=1000",
                     "--json", str(out)]) == 0
    assert "KV capacity per rank: 497,000 tokens (497 blocks of 1000)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["kv_capacity_tokens"] == report["kv_blocks"] * 1000 == 497_000


@pytest.mark.parametrize("key", ["engine.max_num_batched_tokens", "engine.max_num_seqs", "engine.num_kv_blocks"])
def test_engine_limits_past_int64_are_refused(capsys, ep2, key):
    value = "99999999999999999999999"
    assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS, "--set", f"{key}={value}"]) == 2
    assert _one_line_error(capsys) == (f"error: simulate: {key} 99,999,999,999,999,999,999,999 is past what the cost "
                                       "model computes with (at most 2**63 - 1 = 9,223,372,036,854,775,807)")


def test_the_breakdown_table_keeps_its_columns_apart_for_any_value(capsys, ep2):
    """2**62 tokens per prefill step: 15-digit ms figures, each still its own column."""
    assert simulate(["--config", str(ep2), "--hardware", "h100", *LENGTHS,
                     "--set", f"engine.max_num_batched_tokens={2**62}"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.split("\n\n", 1)[1].splitlines()
    assert header.split() == ["operator", "decode", "ms", "prefill", "ms"]
    assert max(len(r.split()[2]) for r in rows) > 15
    for row in rows:
        assert len(row.split()) == 3 and len(row) == len(header), row
        float(row.split()[2].replace(",", ""))


def test_a_binary_hardware_file_is_named_as_not_yaml_text(tmp_path, capsys, ep2):
    path = tmp_path / "c.npy"
    np.save(path, np.ones((2, 3)))
    words = (f"hardware file {path}: not a YAML text file (it is not UTF-8 text); expected a mapping of hardware "
             "fields (name, flops, memory_bandwidth, ...) as configs/hardware/*.yaml holds")
    assert kvcalc(["--model", "mistralai/Mixtral-8x7B-v0.1", "--hardware", str(path)]) == 2
    assert _one_line_error(capsys) == f"error: kvcalc mistralai/Mixtral-8x7B-v0.1: {words}"
    assert simulate(["--config", str(ep2), "--hardware", str(path)]) == 2
    assert _one_line_error(capsys) == f"error: simulate: {words}"
    assert simulate(["--search", "--model", "deepseek-ai/DeepSeek-V3", "--cluster", f"1x8x{path}"]) == 2
    assert _one_line_error(capsys) == f"error: simulate: {words}"


NCCL_ALLTOALL = """#       size         count      type   redop    root     time   algbw   busbw #wrong     time
     1048576        131072     float    none      -1    25.30   41.45   20.72      0    24.90   42.11   21.06      0
"""


def test_calibrate_names_an_unknown_collective_and_lists_the_known_ones(tmp_path, capsys):
    table = tmp_path / "a2a.txt"
    table.write_text(NCCL_ALLTOALL)
    out = tmp_path / "hw.yaml"
    assert calibrate(["--base", "h100", "--nccl-table", f"{table}:bogus:8", "--out", str(out)]) == 2
    assert _one_line_error(capsys) == (f"error: simulate calibrate: --nccl-table {table}:bogus:8: unknown collective "
                                       "'bogus'; known: allreduce, alltoall, allgather, reducescatter")
    assert calibrate(["--base", "h100", "--nccl-table", f"{table}::8", "--out", str(out)]) == 2  # no op in its header
    assert "cannot tell the collective" in _one_line_error(capsys)
    assert not out.exists()
    named = tmp_path / "all_to_all_perf.txt"
    named.write_text("# ./build/all_to_all_perf -b 1M -e 1M\n" + NCCL_ALLTOALL)
    assert calibrate(["--base", "h100", "--nccl-table", f"{named}::8", "--out", str(out)]) == 0  # its header's op
    assert set(Hardware.from_dict(yaml.safe_load(out.read_text())).collectives) >= {"alltoall:8"}
    with pytest.raises(ValueError, match=r"collective table key 'bogus:8': unknown collective 'bogus' \(known: "
                                         r"allreduce, alltoall, allgather, reducescatter\)"):
        Hardware(name="x", flops={"float32": 1e12}, memory_bandwidth=1e11, memory_bytes=10**9,
                 collectives={"bogus:8": ((1.0, 1e-6),)})


@pytest.mark.parametrize("flag", [["--threads", "2"], ["--threads", "1"], ["--nprocs", "4"], ["--dtypes", "float32"],
                                  ["--no-engine"], ["--engine-dtype", "bfloat16"], ["--clock", "cpu"],
                                  ["--ray-ranks", "2"], ["--model", "checkpoints/x"]])
def test_calibrate_base_refuses_the_measurement_flags_it_would_ignore(tmp_path, capsys, flag):
    table = tmp_path / "a2a.txt"
    table.write_text(NCCL_ALLTOALL)
    out = tmp_path / "hw.yaml"
    assert calibrate(["--base", "h100", "--nccl-table", f"{table}:alltoall:8", "--out", str(out), *flag]) == 2
    assert _one_line_error(capsys) == (f"error: simulate calibrate: {flag[0]} has no effect with --base, which "
                                       "measures nothing here (it adds the --nccl-table tables to that hardware): "
                                       "drop one of them")
    assert not out.exists()
    assert calibrate(["--base", "h100", "--nccl-table", f"{table}:alltoall:8", "--out", str(out)]) == 0
    assert Hardware.from_dict(yaml.safe_load(out.read_text())).collectives["alltoall:8"]
