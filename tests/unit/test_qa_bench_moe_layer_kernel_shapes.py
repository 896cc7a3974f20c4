"""``bench moe-layer``: the ``ours`` / ``ours-int8`` cells are the fused CPU kernel's; a shape the kernel
cannot take (D not a multiple of 16) must not be timed on the PyTorch path under the kernel's name."""

from __future__ import annotations

import json

import torch

from launch.bench import moe_layer
from moe import kernels

ODD = "mixtral:hidden=40,experts=3,top_k=2,inter=20"
EVEN = "mixtral:hidden=48,experts=3,top_k=2,inter=20"


def test_kernel_cells_of_a_shape_the_kernel_cannot_take_are_not_run(capsys) -> None:
    cells = moe_layer.run_shape(ODD, [3], ["ours", "ours-int8", "ours-pytorch", "transformers"], torch.float32,
                                min_seconds=0.0, bandwidth=1e10, peak_flops=1e12)
    assert [c.impl for c in cells] == ["ours-pytorch", "transformers"]
    # the reference is the PyTorch path itself here: no distance of ours-pytorch from itself (a 0.00e+00
    # read as the kernel's exact match); transformers' is still measured
    assert cells[0].max_abs_diff is None
    assert cells[1].max_abs_diff is not None and cells[1].max_abs_diff < 1e-4
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    assert notes == [f"# {ODD}: {impl} not run: the fused CPU expert kernel needs hidden a multiple of 16, got 40 "
                     "(ours-pytorch is this shape's expert path)" for impl in ("ours", "ours-int8")]


def test_a_shape_the_kernel_takes_runs_every_cell() -> None:
    assert moe_layer.cells_not_run(moe_layer.parse_shape(EVEN), ["ours", "ours-int8"], torch.bfloat16) == {}
    cells = moe_layer.run_shape(EVEN, [3], ["ours", "ours-int8", "ours-pytorch"], torch.float32, min_seconds=0.0,
                                bandwidth=1e10, peak_flops=1e12)
    assert [c.impl for c in cells] == ["ours", "ours-int8", "ours-pytorch"]
    if kernels.is_available():  # the kernel against the PyTorch path: a distance measured, fp32-small
        assert cells[2].max_abs_diff is not None and cells[2].max_abs_diff < 1e-4


def test_on_cuda_the_kernel_rule_does_not_apply() -> None:
    # ours runs the PyTorch path on the GPU by design: nothing is left out there for D
    assert moe_layer.cells_not_run(moe_layer.parse_shape(ODD), ["ours"], torch.bfloat16, torch.device("cuda")) == {}


def test_only_kernel_cells_asked_for_a_shape_it_cannot_take_is_a_one_line_error(capsys) -> None:
    assert moe_layer.main(["--shapes", ODD, "--tokens", "1", "--impls", "ours", "--warm-cache"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (f"error: --impls ours: {ODD}: the fused CPU expert kernel needs hidden a "
                                         "multiple of 16, got 40 (ours-pytorch is this shape's expert path)\n")


def test_json_lists_the_kernel_cells_not_run(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    assert moe_layer.main(["--shapes", ODD, "--tokens", "1", "--impls", "ours", "ours-pytorch", "--warm-cache",
                           "--min-seconds", "0", "--dtype", "float32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [c["impl"] for c in result["cells"]] == ["ours-pytorch"]
    assert [(r["impl"], r["shape"]) for r in result["not_run"]] == [("ours", ODD)]
    assert "T=1: ours" not in capsys.readouterr().out  # no speedup line against a cell that did not run
