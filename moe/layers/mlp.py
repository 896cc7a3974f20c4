"""Dense SwiGLU MLP (dense layers and shared experts), shardable for tensor parallelism.

On CPU it runs as a one-expert call of the fused expert kernel (``moe.kernels``) on a packed
copy of its weights (remade when they change: loading, TP sharding) unless PyTorch's GEMM is
the faster choice for the dtype and row count (``moe.kernels.prefers_library_experts``): on
CPUs without native bf16 GEMMs PyTorch's bf16 matmul runs at about 1 GFLOP/s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe import kernels
from moe.layers.linear import cached_pack
from moe.plan_watch import WatchedModule


class _Projection(WatchedModule, nn.Linear):
    """``nn.Linear`` (PyTorch's GEMM, its state-dict keys) that announces changes to its parameters
    (``moe.plan_watch``): ``DenseMLP``'s fused op binds its weight."""


class DenseMLP(WatchedModule):
    """down_proj(silu(gate_proj(x)) * up_proj(x)). x: [T, D] -> [T, D].

    After ``shard_for_tp`` the output is this rank's partial sum: the caller all-reduces
    it over the TP group.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.gate_proj = _Projection(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = _Projection(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = _Projection(intermediate_size, hidden_size, bias=False, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_op(x)
        if fused is not None:
            return fused(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fused_op(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The kernel call ``forward`` makes for x [T, D] with the packed weights bound (x [T', D]
        -> [T', D] for any T' in x's row regime), or None when ``forward`` takes PyTorch's ops."""
        packed = self._packed_weights(x)
        if packed is None:
            return None

        def mlp(x: torch.Tensor) -> torch.Tensor:
            return kernels.experts_forward(x.contiguous(), [x.shape[0]], packed)

        return mlp

    def _packed_weights(self, x: torch.Tensor) -> kernels.PackedExperts | None:
        """The kernel's copy of the weights when the kernel should run for x [T, D], else None."""
        mods = self._modules  # without nn.Module.__getattr__: this runs every layer of every step
        gate, up, down = (mods[name]._parameters["weight"] for name in ("gate_proj", "up_proj", "down_proj"))
        if (not x.is_cpu or x.dim() != 2 or x.dtype != gate.dtype or mods["down_proj"].bias is not None
                or kernels.prefers_library_experts(x.dtype, x.shape[0]) or kernels.needs_autograd(x, gate, up, down)):
            return None
        return cached_pack(self, "_packed", (gate, up, down), _pack_dense)

    def shard_for_tp(self, tp_rank: int, tp_size: int) -> None:
        """Keep intermediate columns [r*I/tp, (r+1)*I/tp) of the loaded full weights."""
        inter = self.gate_proj.out_features
        if inter % tp_size:
            raise ValueError(f"intermediate size {inter} is not divisible by tp_size {tp_size}")
        rows = slice(tp_rank * inter // tp_size, (tp_rank + 1) * inter // tp_size)
        shard_linear_(self.gate_proj, out_slice=rows)
        shard_linear_(self.up_proj, out_slice=rows)
        shard_linear_(self.down_proj, in_slice=rows, keep_bias=tp_rank == 0)


def _pack_dense(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> kernels.PackedExperts | None:
    """gate/up [I, D], down [D, I] as a one-expert kernel weight, or None where the kernel cannot take them."""
    w13, w2 = torch.cat([gate, up])[None], down[None]  # [1, 2I, D], [1, D, I]
    if kernels.can_pack(w13, w2) and kernels.is_available():
        return kernels.pack_experts(w13, w2)
    return None


def shard_linear_(
    linear: nn.Linear, *, out_slice: slice | None = None, in_slice: slice | None = None, keep_bias: bool = True
) -> None:
    """Slice a loaded nn.Linear in place. out_slice: column-parallel (rows of weight [out, in]);
    in_slice: row-parallel (columns); a row-parallel bias is kept on one rank only."""
    w = linear.weight.data
    b = None if linear.bias is None else linear.bias.data
    if out_slice is not None:
        w = w[out_slice]
        b = None if b is None else b[out_slice]
    if in_slice is not None:
        w = w[:, in_slice]
        if b is not None and not keep_bias:
            b = torch.zeros_like(b)
    linear.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    linear.in_features, linear.out_features = w.shape[1], w.shape[0]
    if b is not None:
        linear.bias = nn.Parameter(b.contiguous(), requires_grad=False)
