"""The MoE layer on CUDA: bf16 experts through PyTorch's grouped GEMM equal the per-slot loop and
the CPU layer within bf16 rounding. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape", ["deepseek", "mixtral"])
def test_cuda_layer_grouped_gemm_equals_loop_and_cpu(shape: str) -> None:
    from launch.bench.moe_layer import build_layers
    from moe import experts as experts_mod

    cpu_layer, _ = build_layers(shape, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, cpu_layer.experts.hidden_size, generator=gen).bfloat16()  # [T, D]
    with torch.inference_mode():
        want = cpu_layer(x).float()
        layer = cpu_layer.cuda()
        xc = x.cuda()
        assert experts_mod.library_grouped_mm(xc, layer.experts.w13, layer.experts.w2) is not None
        grouped = layer(xc).float().cpu()
        layer.experts.use_kernel = False  # the per-slot loop
        loop = layer(xc).float().cpu()
    assert grouped.shape == want.shape == (300, cpu_layer.experts.hidden_size)
    scale = want.abs().max()
    assert (grouped - loop).abs().max() <= 2e-2 * scale
    assert (grouped - want).abs().max() <= 2e-2 * scale


@pytest.mark.parametrize("shape", ["deepseek", "mixtral"])
def test_cuda_layer_drops_the_rows_the_cpu_layer_drops(shape: str) -> None:
    """A capacity factor on CUDA (``moe.capacity``'s tensor ops; the CPU's one-pass drop is CPU
    only): the same slot load, the same dropped count, and the output within bf16 rounding."""
    from launch.bench.moe_layer import build_layers
    from moe.capacity import CapacityConfig

    cpu_layer, _ = build_layers(shape, torch.bfloat16)
    cpu_layer.capacity = CapacityConfig(1.0)
    x = torch.randn(300, cpu_layer.experts.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    results = []
    with torch.inference_mode():
        for device in ("cpu", "cuda"):
            layer = cpu_layer.to(device)
            layer.counters["dropped"] = 0
            layer.slot_load.zero_()
            out = layer(x.to(device)).float().cpu()
            results.append((out, layer.slot_load.cpu().clone(), int(layer.counters["dropped"])))
    (want, want_load, want_dropped), (got, load, dropped) = results
    assert got.shape == want.shape == (300, cpu_layer.experts.hidden_size)
    assert torch.equal(load, want_load) and dropped == want_dropped > 0
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
