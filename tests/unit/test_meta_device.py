"""The GPU's op-by-op step, checked on the CPU: every tensor on PyTorch's ``meta`` device (not the CPU,
no data). A CPU-only op of the C++ extension (registered for the CPU only) raises there, and so does
any read back to the host (``.item()``, ``.tolist()``, ``nonzero``, boolean masks), so these steps
running through to the logits means the path a CUDA rank takes (bf16 experts on PyTorch's grouped
GEMM) has neither. tests/gpu runs the same steps on a GPU where a session has one."""

from __future__ import annotations

import functools

import pytest
import torch

from moe import cuda_graphs
from moe import experts as experts_mod
from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.model import MoEModel
from moe.tiny import build_tiny_config

FAMILIES = ["deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe"]
BLOCK = 4


@pytest.fixture
def grouped_gemm_on_meta(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """PyTorch's grouped GEMM (the CUDA experts' path) taken for meta tensors too; counts its uses."""
    library = functools.partial(experts_mod.library_grouped_mm, device_types=("cuda", "meta"))
    monkeypatch.setattr(experts_mod, "library_grouped_mm", library)
    monkeypatch.setattr(cuda_graphs, "library_grouped_mm", library)
    calls = {"grouped": 0}
    forward = experts_mod.grouped_gemm_forward

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["grouped"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(experts_mod, "grouped_gemm_forward", counted)
    return calls


def _meta_model(arch: str) -> tuple[MoEModel, PagedKVCache]:
    config = ModelConfig.from_hf(build_tiny_config(arch, size="tiny"))
    model = MoEModel(config, dtype=torch.bfloat16).to("meta")
    return model, PagedKVCache(config, 64, BLOCK, torch.bfloat16, device="meta")


def _step(model: MoEModel, cache: PagedKVCache, qlens: list[int], ctxs: list[int]) -> torch.Tensor:
    tables = [[1 + 12 * i + j for j in range(-(-c // BLOCK))] for i, c in enumerate(ctxs)]
    meta = AttentionMetadata.build(qlens, ctxs, tables, BLOCK, device="meta")
    ids = torch.zeros(sum(qlens), dtype=torch.int64, device="meta")
    pos = torch.zeros(sum(qlens), dtype=torch.int64, device="meta")
    return model.compute_logits(model(ids, pos, meta, cache))


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_step_off_the_cpu_takes_no_cpu_op_and_reads_nothing_back(arch: str, grouped_gemm_on_meta) -> None:
    model, cache = _meta_model(arch)
    with torch.inference_mode():
        decode = _step(model, cache, [1, 1, 1], [5, 9, 3])
        mixed = _step(model, cache, [1, 9, 10, 11, 40], [4, 9, 10, 11, 40])  # prefill chunks beside a decode row
        assert cuda_graphs.not_capturable(model) is None
        graphs = cuda_graphs.DecodeGraphs(model, cache, scratch_block=63, max_batch=4, max_blocks=4,
                                          backend=cuda_graphs.EagerBackend(), capture_after=1)
        replays = [graphs.run([1, 2, 3], [4, 5, 6], [5, 6, 7], [[1, 2], [3, 4], [5, 6]]) for _ in range(3)]
    vocab = model.config.vocab_size
    assert decode.shape == (3, vocab) and mixed.shape == (71, vocab) and decode.device.type == "meta"
    assert graphs.disabled is None and graphs.captures == 1
    assert all(r is not None and r.shape == (3, vocab) for r in replays)
    assert grouped_gemm_on_meta["grouped"] >= 2 * len(list(model.moe_layers()))


def test_the_meta_check_catches_a_host_read(grouped_gemm_on_meta, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the check above rests on: a read back to the host inside the step raises on meta."""
    model, cache = _meta_model("mixtral")
    layer = next(model.moe_layers())
    forward = layer.forward

    def reads_back(x, *args, **kwargs):  # type: ignore[no-untyped-def]
        x.sum().item()
        return forward(x, *args, **kwargs)

    monkeypatch.setattr(layer, "forward", reads_back)
    with torch.inference_mode(), pytest.raises((RuntimeError, NotImplementedError)):
        _step(model, cache, [1, 1], [5, 9])
