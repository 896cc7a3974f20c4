"""launch/bench/moe_layer.py: cold-weight timing (the last-level cache evicted before each timed
call), the cache size from sysfs, and one small end-to-end run."""

from __future__ import annotations

import json
import time

import pytest
import torch

from launch.bench import moe_layer


def _cache_index(root, name: str, level: str, size: str) -> None:
    d = root / name
    d.mkdir()
    (d / "level").write_text(level + "\n")
    (d / "size").write_text(size + "\n")


def test_llc_bytes_is_the_highest_level_in_sysfs(tmp_path) -> None:
    _cache_index(tmp_path, "index0", "1", "48K")
    _cache_index(tmp_path, "index2", "2", "2048K")
    _cache_index(tmp_path, "index3", "3", "260M")
    assert moe_layer.llc_bytes(tmp_path) == 260 * 1024**2
    assert moe_layer.llc_bytes(tmp_path / "missing") == 0


def test_time_call_runs_before_ahead_of_each_timed_call_and_leaves_it_untimed() -> None:
    events: list[str] = []

    def before() -> None:
        events.append("before")
        time.sleep(0.05)  # wall time outside the timing

    cpu, wall = moe_layer.time_call(lambda: events.append("call"), min_seconds=0.0, before=before)
    assert events == ["call", "before", "call"]  # the warm-up, then one evicted, timed call
    assert wall < 0.05 and cpu < 0.05


def test_evictor_reads_at_least_twice_the_llc() -> None:
    evict = moe_layer.CacheEvictor()
    assert evict.buffer.nbytes >= max(2 * moe_layer.llc_bytes(), 64 * 1024**2)
    evict()


@pytest.mark.slow
def test_one_small_cell_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "cells.json"
    rc = moe_layer.main(["--shapes", "mixtral", "--tokens", "1", "--impls", "ours", "--min-seconds", "0",
                         "--json", str(out)])
    assert rc == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "MiB read before each timed call (cold weights)" in header
    report = json.loads(out.read_text())
    assert report["cold_weights"] is True and report["bf16_dot_rate"] >= 0.0
    (cell,) = report["cells"]
    assert cell["shape"] == "mixtral" and cell["tokens"] == 1 and cell["cpu_ms"] > 0 and cell["roofline_ms"] > 0


def test_transformers_cells_run_the_eager_loop_and_grouped_mm(monkeypatch) -> None:
    """``transformers`` runs the block's eager experts loop, ``transformers-grouped-mm`` transformers'
    grouped_mm experts (what it picks for a model it loads); both are checked against ours."""
    import torch
    from transformers.integrations import moe as hf_moe

    grouped = hf_moe.ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return grouped(*args, **kwargs)

    monkeypatch.setitem(hf_moe.ALL_EXPERTS_FUNCTIONS, "grouped_mm", counted)
    cells = moe_layer.run_shape("mixtral", [3], ["ours", "transformers", "transformers-grouped-mm"], torch.bfloat16,
                                min_seconds=0.0, bandwidth=1e10, peak_flops=1e12)
    assert [c.impl for c in cells] == ["ours", "transformers", "transformers-grouped-mm"]
    # grouped_mm only for its own cell: a warm-up, one timed call and the output check
    assert len(calls) == 3
    for c in cells[1:]:
        assert c.max_abs_diff is not None and c.max_abs_diff < 0.05


@pytest.mark.parametrize("shape", ["deepseek", "mixtral"])
def test_dense_gemm_cell_runs_the_layers_flops_as_dense_gemms(shape: str) -> None:
    """``dense-gemm``: every token's K rows through expert 0's SwiGLU, its GEMMs as one pair over all
    the rows (the router and the shared expert beside them), and a cell of its own whose speedup line
    is printed."""
    import torch
    import torch.nn.functional as F

    ours, _ = moe_layer.build_layers(shape, torch.bfloat16)
    run = moe_layer.build_dense_gemm(ours)
    x = torch.randn(5, ours.experts.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        y = run(x)
        inter = ours.experts.w2.shape[-1]
        rows = x.repeat_interleave(ours.top_k, dim=0)
        h = F.linear(rows, ours.experts.w13[0])
        want = F.linear(F.silu(h[:, :inter]) * h[:, inter:], ours.experts.w2[0])
    assert y.shape == (5 * ours.top_k, ours.experts.hidden_size) and y.dtype == torch.bfloat16
    assert torch.equal(y, want)
    cells = moe_layer.run_shape(shape, [2], ["ours", "dense-gemm"], torch.bfloat16, min_seconds=0.0,
                                bandwidth=1e10, peak_flops=1e12)
    assert [c.impl for c in cells] == ["ours", "dense-gemm"] and cells[1].max_abs_diff is None
    assert any(line.endswith("x dense-gemm") for line in moe_layer.speedups(cells))


def test_device_cuda_without_a_gpu_is_a_one_line_error(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert moe_layer.main(["--device", "cuda", "--shapes", "mixtral", "--tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --device cuda: no CUDA device is available here"]


def test_cells_are_judged_by_gpu_time_where_they_have_it() -> None:
    cpu = moe_layer.Cell("deepseek", 8, "ours", 2.0, 2.1, 4000.0, 0.1, 0.05)
    gpu = moe_layer.Cell("deepseek", 8, "transformers", 1.0, 9.0, 800.0, 0.1, 0.01, None, 10.0)
    mine = moe_layer.Cell("deepseek", 8, "ours", 1.0, 5.1, 1600.0, 0.1, 0.02, None, 5.0)
    assert cpu.ms == 2.0 and gpu.ms == 10.0
    assert moe_layer.speedups([mine, gpu]) == ["deepseek T=8: ours 2.00x transformers"]


def test_deepspeed_cell_without_deepspeed_is_a_one_line_error(monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert moe_layer.main(["--impls", "ours", "deepspeed", "--shapes", "mixtral", "--tokens", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --impls deepspeed: DeepSpeed is not installed here")


def test_shape_specs_take_the_familys_sizes_and_override_the_ones_given() -> None:
    plain = moe_layer.parse_shape("deepseek")
    assert (plain.hidden, plain.experts, plain.top_k, plain.inter, plain.shared, plain.groups) == (1024, 64, 6, 256, 1, 1)
    s = moe_layer.parse_shape("deepseek:experts=128,top_k=8,groups=8,topk_group=4")
    assert (s.label, s.family, s.hidden, s.experts, s.top_k, s.inter, s.groups, s.topk_group) == (
        "deepseek:experts=128,top_k=8,groups=8,topk_group=4", "deepseek", 1024, 128, 8, 256, 8, 4)
    assert s.describe().endswith("D 1024, E 128, top-8, I 256, 1 shared, 8 groups (top-4)")
    m = moe_layer.parse_shape("mixtral:inter=512")
    assert (m.experts, m.top_k, m.inter, m.shared) == (8, 2, 512, 0)
    assert m.parameters() == 3 * 1024 * 512 * 8 + 8 * 1024


@pytest.mark.parametrize("spec, problem", [
    ("qwen", "unknown family 'qwen': give deepseek, mixtral, qwen3"),
    ("deepseek:experts=x", "experts='x' is not an integer"),
    ("deepseek:foo=3", "'foo=3' is not KEY=N"),
    ("mixtral:shared=1", "mixtral takes no 'shared' (its keys: hidden, experts, top_k, inter)"),
    ("deepseek:experts=8,top_k=9", "top_k 9 > experts 8"),
    ("deepseek:groups=3", "experts 64 must split into groups 3"),
    ("deepseek:groups=8,topk_group=1,top_k=9", "hold top_k 9 experts (8 per group)"),
    ("mixtral:hidden=0", "hidden must be >= 1"),
    ("deepseek:experts=8,experts=16", "experts is given twice"),
])
def test_bad_shape_specs_are_one_line_errors(spec: str, problem: str, capsys) -> None:
    with pytest.raises(moe_layer.ShapeError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        moe_layer.parse_shape(spec)
    assert moe_layer.main(["--shapes", "mixtral", spec, "--tokens", "1", "--impls", "ours"]) == 2
    out = capsys.readouterr()
    (line,) = out.err.strip().splitlines()
    assert line.startswith(f"error: --shapes {spec!r}: ") and problem in line
    assert out.out == ""  # refused before anything ran


def test_a_custom_grouped_shape_runs_exact_against_transformers_block() -> None:
    """Expert groups change which experts a token may take: a layer built without them would not
    match transformers' grouped router."""
    import torch

    spec = "deepseek:hidden=128,experts=16,top_k=4,inter=32,groups=4,topk_group=2"
    ours, hf = moe_layer.build_layers(spec, torch.float32)
    assert (ours.experts.w13.shape, ours.experts.w2.shape) == ((16, 64, 128), (16, 128, 32))
    assert hf.gate.num_group == 4 and hf.gate.topk_group == 2
    cells = moe_layer.run_shape(spec, [9], ["ours", "transformers"], torch.float32, min_seconds=0.0,
                                bandwidth=1e10, peak_flops=1e12)
    assert [c.shape for c in cells] == [spec, spec]
    assert cells[1].max_abs_diff is not None and cells[1].max_abs_diff < 1e-4


@pytest.mark.parametrize("spec", ["mixtral:hidden=40,inter=24,experts=4", "qwen3:hidden=40,inter=24,experts=4,top_k=2",
                                  "deepseek:hidden=40,inter=24,experts=4,top_k=2"])
def test_hidden_sizes_whose_eighth_is_odd_build_and_match(spec: str) -> None:
    """The layer has no attention, but its transformers config does: attention sizes derived from the
    hidden size (hidden / 8 heads: 5) must not make a valid MoE shape fail the config's checks."""
    import torch

    ours, hf = moe_layer.build_layers(spec, torch.float32)
    assert ours.experts.w13.shape == (4, 48, 40)
    # D 40 is not a multiple of 16: the layer runs its PyTorch expert path ("ours" is not run)
    cells = moe_layer.run_shape(spec, [5], ["ours-pytorch", "transformers"], torch.float32, min_seconds=0.0,
                                bandwidth=1e10, peak_flops=1e12)
    assert cells[1].max_abs_diff is not None and cells[1].max_abs_diff < 1e-4


def test_model_shapes_come_from_config_json(tmp_path, capsys) -> None:
    import json as _json

    cfg = moe_layer.hf_config("deepseek:hidden=128,experts=16,top_k=4,inter=32,groups=4,topk_group=2").to_dict()
    cfg.update(routed_scaling_factor=2.5, norm_topk_prob=False)
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text(_json.dumps(cfg))
    s = moe_layer.shape_from_model(str(tmp_path / "my-model"))
    assert (s.label, s.family, s.hidden, s.experts, s.top_k, s.inter, s.shared, s.groups, s.topk_group) == (
        "my-model", "deepseek", 128, 16, 4, 32, 1, 4, 2)
    assert s.routed_scaling == 2.5 and s.norm_topk_prob is False
    hf = moe_layer.hf_config(s)
    assert hf.routed_scaling_factor == 2.5 and hf.norm_topk_prob is False
    assert moe_layer.shape_from_model(str(tmp_path / "my-model" / "config.json")).label == "my-model"
    mixtral = moe_layer.shape_from_model("mistralai/Mixtral-8x7B-v0.1")  # a shipped config
    assert (mixtral.family, mixtral.hidden, mixtral.experts, mixtral.inter) == ("mixtral", 4096, 8, 14336)
    qwen = moe_layer.shape_from_model("Qwen/Qwen3-30B-A3B")
    assert (qwen.family, qwen.hidden, qwen.experts, qwen.top_k, qwen.inter, qwen.shared) == ("qwen3", 2048, 128, 8, 768, 0)
    lite = moe_layer.shape_from_model("deepseek-ai/DeepSeek-V2-Lite")  # its sizes on DeepSeek-V3's block
    assert (lite.label, lite.family, lite.hidden, lite.experts, lite.top_k, lite.inter, lite.shared) == (
        "DeepSeek-V2-Lite", "deepseek", 2048, 64, 6, 1408, 2)
    assert lite.norm_topk_prob is False and lite.describe().endswith("routed as DeepSeek-V3's block routes")
    v2 = moe_layer.shape_from_model("deepseek-ai/DeepSeek-V2")
    assert (v2.experts, v2.groups, v2.topk_group, v2.routed_scaling) == (160, 8, 3, 16.0)
    assert not mixtral.note and "routed as" not in mixtral.describe()
    assert moe_layer.main(["--model", str(tmp_path / "nothing"), "--tokens", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --model '{tmp_path / 'nothing'}': no config.json")


def test_two_checkpoints_in_folders_of_one_name_are_told_apart_by_path(tmp_path, capsys) -> None:
    import json as _json

    for where, hidden in ((tmp_path / "a" / "ckpt", 48), (tmp_path / "b" / "ckpt", 64)):
        where.mkdir(parents=True)
        cfg = moe_layer.hf_config(f"mixtral:hidden={hidden},experts=4,top_k=2,inter=32").to_dict()
        (where / "config.json").write_text(_json.dumps(cfg))
    a, b = str(tmp_path / "a" / "ckpt"), str(tmp_path / "b" / "ckpt")
    out = tmp_path / "r.json"
    assert moe_layer.main(["--model", a, b, "--tokens", "2", "--impls", "ours", "--min-seconds", "0",
                           "--json", str(out)]) == 0
    assert [row["shape"] for row in _json.loads(out.read_text())["cells"]] == [a, b]
    assert capsys.readouterr().out.count("ckpt: D ") == 2
    assert moe_layer.main(["--model", a, a, "--tokens", "2"]) == 2  # the same one twice: still refused
    assert capsys.readouterr().err == f"error: a shape is given twice: {a}, {a}\n"


def test_a_shape_too_large_for_memory_is_refused_before_it_is_built(monkeypatch, capsys) -> None:
    import torch

    from moe import kv_cache

    s = moe_layer.parse_shape("mixtral")
    need = moe_layer.layer_bytes_needed(s, torch.bfloat16, ["ours", "transformers"])
    assert need == s.parameters() * (4 + 3 * 2)
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda *a: need - 1)
    monkeypatch.setattr(moe_layer, "build_layers", lambda *a, **k: pytest.fail("built a layer"))
    assert moe_layer.main(["--shapes", "mixtral", "--tokens", "1", "--impls", "ours", "transformers"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: mixtral: one layer of these sizes (") and "mixtral:experts=" in line
    assert "GiB of host memory" in line


def test_on_cuda_a_shape_must_also_fit_the_devices_free_memory(monkeypatch) -> None:
    import torch

    from moe import kv_cache

    s = moe_layer.parse_shape("mixtral")
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda *a: 1 << 50)
    on_gpu = s.parameters() * 2 * 2  # bf16, ours and transformers' block
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (on_gpu - 1, 1 << 40))
    cuda = torch.device("cuda")
    why = moe_layer.memory_refusal([s], torch.bfloat16, ["ours", "transformers"], cuda)
    assert why is not None and why.startswith("mixtral: one layer of these sizes needs about") and "free" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (on_gpu, 1 << 40))
    assert moe_layer.memory_refusal([s], torch.bfloat16, ["ours", "transformers"], cuda) is None
    assert moe_layer.memory_refusal([s], torch.bfloat16, ["ours", "transformers", "deepspeed"], cuda) is not None


@pytest.mark.parametrize("spec", ["qwen3:hidden=128,experts=16,top_k=4,inter=32", "mixtral:hidden=128,experts=4,inter=64"])
def test_softmax_families_run_exact_against_their_transformers_block(spec: str) -> None:
    """In fp32 (no bf16 near-ties between router logits) ours equals the family's own block."""
    import torch

    ours, hf = moe_layer.build_layers(spec, torch.float32)
    family = spec.split(":")[0]
    assert type(hf).__name__ == {"qwen3": "Qwen3MoeSparseMoeBlock", "mixtral": "MixtralSparseMoeBlock"}[family]
    assert ours.shared_experts is None and ours.top_k == moe_layer.parse_shape(spec).top_k
    cells = moe_layer.run_shape(spec, [11], ["ours", "transformers"], torch.float32, min_seconds=0.0,
                                bandwidth=1e10, peak_flops=1e12)
    assert cells[1].max_abs_diff is not None and cells[1].max_abs_diff < 1e-4


def test_the_int8_cell_is_the_same_layer_with_int8_experts(capsys) -> None:
    """``ours-int8`` (asked for; not in the default set) runs the layer with int8 routed experts: near
    ``ours`` (its max |diff|), and at T = 1 its bound reads about half the routed bytes."""
    assert "ours-int8" not in moe_layer.DEFAULT_IMPLS
    import torch

    cells = moe_layer.run_shape("deepseek:experts=8,top_k=2,groups=1,topk_group=1", [1, 64], ["ours", "ours-int8"],
                                torch.bfloat16, 0.0, bandwidth=10e9, peak_flops=1e15)
    by = {(c.tokens, c.impl): c for c in cells}
    assert 0 < by[(1, "ours-int8")].max_abs_diff < 0.1 and by[(1, "ours")].max_abs_diff is None
    # bytes: the shared expert and router stay, the routed experts' drop from 2 bytes a weight to 1
    assert 0.45 < by[(1, "ours-int8")].roofline_ms / by[(1, "ours")].roofline_ms < 0.8
    assert 0 < by[(64, "ours-int8")].max_abs_diff < 0.1


@pytest.mark.parametrize("hidden, inter, dtype_name", [(45, 20, "bfloat16"), (64, 36, "bfloat16"), (48, 20, "bfloat16"),
                                                        (64, 32, "bfloat16"), (64, 36, "float32"), (45, 20, "float32")])
def test_grouped_mm_width_rule_matches_pytorchs_grouped_gemm(hidden: int, inter: int, dtype_name: str) -> None:
    """The rule is the kernel's: PyTorch's grouped GEMM runs both projections exactly where
    ``grouped_mm_width_problem`` finds none."""
    import torch
    import torch.nn.functional as F

    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        pytest.skip("this torch has no grouped GEMM")
    dtype = moe_layer.DTYPES[dtype_name]
    problem = moe_layer.grouped_mm_width_problem(hidden, inter, dtype)
    offs = torch.tensor([2, 4, 6], dtype=torch.int32)
    try:
        fn(torch.randn(6, hidden).to(dtype), torch.randn(3, 2 * inter, hidden).to(dtype).transpose(-2, -1), offs=offs)
        fn(torch.randn(6, inter).to(dtype), torch.randn(3, hidden, inter).to(dtype).transpose(-2, -1), offs=offs)
        ran = True
    except RuntimeError as e:
        assert "16 bytes" in str(e)
        ran = False
    assert ran == (problem is None), problem


def test_a_shape_grouped_mm_cannot_run_leaves_out_only_that_cell(capsys) -> None:
    import torch

    spec = "deepseek:hidden=45,experts=4,top_k=2,inter=20"
    cells = moe_layer.run_shape(spec, [3], ["ours", "transformers", "transformers-grouped-mm", "dense-gemm"],
                                torch.bfloat16, min_seconds=0.0, bandwidth=1e10, peak_flops=1e12)
    # D 45 is not a multiple of 16 either: the kernel's "ours" cell is left out too
    assert [c.impl for c in cells] == ["transformers", "dense-gemm"]
    assert cells[0].max_abs_diff is not None  # still against the layer's own output
    _, note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    assert note == (f"# {spec}: transformers-grouped-mm not run: grouped_mm needs rows of whole 16 bytes; "
                    "hidden 45 x 2 B = 90 B and inter 20 x 2 B = 40 B are not")
    # in fp32 the same widths are whole 16-byte rows (45 x 4 B is not: hidden alone is named)
    assert moe_layer.cells_not_run(moe_layer.parse_shape(spec), ["transformers-grouped-mm"], torch.float32) == {
        "transformers-grouped-mm": "grouped_mm needs rows of whole 16 bytes; hidden 45 x 4 B = 180 B is not"}


def test_asking_only_for_a_grouped_mm_cell_it_cannot_run_is_a_one_line_error(monkeypatch, capsys) -> None:
    monkeypatch.setattr(moe_layer, "build_layers", lambda *a, **k: pytest.fail("built a layer"))
    spec = "mixtral:hidden=64,experts=4,inter=36"
    assert moe_layer.main(["--shapes", spec, "--tokens", "1", "--impls", "transformers-grouped-mm"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"error: --impls transformers-grouped-mm: {spec}: grouped_mm needs rows of "
                                         "whole 16 bytes; inter 36 x 2 B = 72 B is not\n")


def test_tokens_whose_activations_would_not_fit_are_refused_before_building(monkeypatch, capsys) -> None:
    import torch

    s = moe_layer.parse_shape("mixtral:hidden=64,experts=4,inter=32")
    one = moe_layer.activation_bytes_needed(s, 1, torch.bfloat16, ["ours"])
    # at least x, the K copies of each row through both GEMMs and the output, per token
    assert one >= 2 * (64 + 2 * (2 * 64 + 3 * 32) + 64)
    assert moe_layer.activation_bytes_needed(s, 1000, torch.bfloat16, ["ours"]) == 1000 * one
    assert moe_layer.activation_bytes_needed(s, 1, torch.bfloat16, ["ours", "deepspeed"]) > one
    monkeypatch.setattr(moe_layer, "build_layers", lambda *a, **k: pytest.fail("built a layer"))
    assert moe_layer.main(["--shapes", "mixtral:hidden=64,experts=4,inter=32", "--tokens", "1", "100000000",
                           "--warm-cache", "--impls", "ours"]) == 2
    out = capsys.readouterr()
    (line,) = out.err.splitlines()
    assert out.out == "" and line.startswith("error: mixtral:hidden=64,experts=4,inter=32: T=100000000 needs about ")
    assert "GiB of host memory for one cell's activations" in line and "give fewer --tokens (up to about" in line


def test_activations_count_against_the_devices_free_memory_too(monkeypatch) -> None:
    import torch

    from moe import kv_cache

    s = moe_layer.parse_shape("mixtral:hidden=64,experts=4,inter=32")
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda *a: 1 << 50)
    on_gpu = s.parameters() * 2 * 2  # bf16, ours and transformers' block
    acts = moe_layer.activation_bytes_needed(s, 4096, torch.bfloat16, ["ours", "transformers"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (on_gpu + acts, 1 << 40))
    cuda = torch.device("cuda")
    assert moe_layer.memory_refusal([s], torch.bfloat16, ["ours", "transformers"], cuda, [1, 4096]) is None
    why = moe_layer.memory_refusal([s], torch.bfloat16, ["ours", "transformers"], cuda, [4097])
    assert why is not None and why.startswith(f"{s.label}: T=4097 needs about") and "of cuda for one cell's" in why


def test_json_makes_its_missing_parent_folders(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(moe_layer, "measure_read_bandwidth", lambda **k: 1e10)
    monkeypatch.setattr(moe_layer, "measure_peak_flops", lambda *a, **k: 1e12)
    out = tmp_path / "new" / "deeper" / "cells.json"
    assert moe_layer.main(["--shapes", "mixtral:hidden=64,experts=4,inter=36", "--tokens", "2", "--impls", "ours",
                           "transformers-grouped-mm", "--min-seconds", "0", "--warm-cache", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [c["impl"] for c in report["cells"]] == ["ours"]
    assert report["not_run"] == [{"shape": "mixtral:hidden=64,experts=4,inter=36", "impl": "transformers-grouped-mm",
                                  "reason": "grouped_mm needs rows of whole 16 bytes; inter 36 x 2 B = 72 B is not"}]


def test_several_threads_are_judged_by_wall_time(monkeypatch, capsys) -> None:
    """CPU time adds up the threads': with --num-threads 2 the tok/s, roofline and speedups use wall time,
    and the bandwidth and peak are measured the same way (the header says which)."""
    clocks = []
    monkeypatch.setattr(moe_layer, "measure_read_bandwidth", lambda device=None, clock="cpu": clocks.append(clock) or 1e10)
    monkeypatch.setattr(moe_layer, "measure_peak_flops", lambda dtype, device=None, clock="cpu": clocks.append(clock) or 1e12)
    monkeypatch.setattr(moe_layer, "time_call", lambda fn, min_seconds, before=None: (fn(), 0.004, 0.002)[1:])
    before = torch.get_num_threads()
    try:
        for threads, clock in (("1", "cpu"), ("2", "wall")):
            clocks.clear()
            assert moe_layer.main(["--shapes", "mixtral:hidden=32,experts=4,top_k=2,inter=32", "--tokens", "8",
                                   "--impls", "ours", "transformers", "--num-threads", threads, "--warm-cache"]) == 0
            out = capsys.readouterr().out
            assert clocks == [clock, clock] and f"({clock.replace('cpu', 'CPU')} time)" in out
            row = next(line for line in out.splitlines() if line.split()[2:3] == ["ours"])
            assert row.split()[5] == ("2000" if threads == "1" else "4000")  # 8 tokens / 4 ms CPU or / 2 ms wall
            cell = moe_layer.Cell("s", 8, "ours", 4.0, 2.0, 0.0, 0.0, 0.0, wall_clock=threads == "2")
            assert cell.ms == (4.0 if threads == "1" else 2.0)
    finally:
        torch.set_num_threads(before)


def test_read_bandwidth_is_the_fastest_read_of_a_sum_and_the_kernels_stream(monkeypatch) -> None:
    """A layer is measured against the fastest read this core was seen doing: one core's fp32 sum
    read slower than the kernel's weight stream, and a layer came out above its roofline."""
    from moe import kernels

    size = 64 * 2**20
    monkeypatch.setattr(kernels, "one_row_read_bandwidth", lambda n: None)
    sums = moe_layer.measure_read_bandwidth(size, repeats=2)
    assert 1e8 < sums < 1e13
    sizes: list[int] = []
    monkeypatch.setattr(kernels, "one_row_read_bandwidth", lambda n: sizes.append(n) or 1e14)
    assert moe_layer.measure_read_bandwidth(size, repeats=2) == 1e14
    assert sizes == [size]  # the stream reads as many bytes as the sums: after a flush, less reads faster
    monkeypatch.setattr(kernels, "one_row_read_bandwidth", lambda n: 1.0)
    assert 1e8 < moe_layer.measure_read_bandwidth(size, repeats=2) < 1e13


def test_the_one_row_stream_reads_its_probe_bytes_where_dot_tiles_run() -> None:
    from moe import kernels

    rate = kernels.one_row_read_bandwidth(1 << 20)
    if not kernels.is_available() or not torch.ops.moe_kernels.tile_mode_seconds(1, 1 << 20):
        assert rate is None  # no AVX512-BF16 here: no dot tiles, no stream of theirs to time
    else:
        assert rate is not None and 1e8 < rate < 1e13


def test_tokens_transformers_routes_elsewhere_are_counted_and_left_out_of_the_second_diff(monkeypatch, capsys) -> None:
    """Where transformers' router sends a token to other experts than ours (near ties rounded apart in
    bf16), the cell counts it, its max |diff| over the other tokens stays at bf16 rounding, and a
    ``#`` line says so; tokens routed alike print no such line."""
    import torch

    built = moe_layer.build_layers

    def with_token_0_sent_elsewhere(shape, dtype, seed=0):
        ours, hf = built(shape, dtype, seed)
        route = hf.gate.forward

        def forward(x):
            logits, weights, ids = route(x)
            ids = ids.clone()
            ids[0] = logits[0].float().topk(ids.shape[1], largest=False).indices  # its least likely experts
            return logits, weights, ids

        monkeypatch.setattr(hf.gate, "forward", forward)
        return ours, hf

    cells = moe_layer.run_shape("mixtral:hidden=256,inter=128", [6], ["ours", "transformers"], torch.bfloat16,
                                min_seconds=0.0, bandwidth=1e10, peak_flops=1e12)
    assert cells[1].routed_apart == 0 and cells[1].max_abs_diff_same_experts == cells[1].max_abs_diff < 0.05
    assert "other experts" not in capsys.readouterr().out
    monkeypatch.setattr(moe_layer, "build_layers", with_token_0_sent_elsewhere)
    cells = moe_layer.run_shape("mixtral:hidden=256,inter=128", [6], ["ours", "transformers"], torch.bfloat16,
                                min_seconds=0.0, bandwidth=1e10, peak_flops=1e12)
    c = cells[1]
    assert c.routed_apart == 1 and c.max_abs_diff_same_experts < 0.05 < c.max_abs_diff
    assert "sends 1 of 6 tokens to other experts than ours" in capsys.readouterr().out
