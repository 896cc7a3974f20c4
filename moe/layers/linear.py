"""``nn.Linear`` that runs the packed linear kernel of ``moe.kernels`` on CPU.

On CPUs without native bf16 GEMMs (no AVX512-BF16 / AMX) PyTorch's bf16 matmul converts
element by element at about 1 GFLOP/s, so the attention projections and lm_head of a bf16
model, not the routed experts, set the decode step time. ``Linear`` keeps ``nn.Linear``'s
parameters, state-dict keys and in-place slicing (TP sharding, ``shard_linear_``) and swaps
only the compute: a packed copy of the weight (remade when the weight changes) through
``kernels.linear_forward``. PyTorch's GEMM runs instead where it is the faster choice
(``kernels.prefers_library_gemm``: prefill-size row counts in a dtype with a fast library
GEMM), off CPU, under autograd, or when the kernel is unavailable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from moe import kernels
from moe.plan_watch import WatchedModule

T = TypeVar("T")


class Linear(WatchedModule, nn.Linear):
    """x: [..., in_features] -> [..., out_features]; ``nn.Linear`` with a CPU kernel path.

    ``use_kernel = False`` pins PyTorch's ``F.linear`` (the reference in tests).
    """

    use_kernel: bool = True
    DECISION_ATTRS = ("use_kernel",)  # what the kernel-or-library choice reads besides x and the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight(x)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2:
            return kernels.linear_forward(x, packed, self.bias)  # the op makes x contiguous if it is not
        rows = x.reshape(-1, x.shape[-1])
        out = kernels.linear_forward(rows, packed, self.bias)
        return out.view(*x.shape[:-1], packed.out_features)

    def fused_op(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The kernel call ``forward`` makes for a 2-D x [T, in_features] with the packed weight and
        bias bound (``moe.decode_plan`` binds lm_head so), or None when ``forward`` runs ``F.linear``."""
        packed = self.packed_weight(x) if x.dim() == 2 else None
        if packed is None:
            return None
        bias = self.bias

        def linear(x: torch.Tensor) -> torch.Tensor:
            return kernels.linear_forward(x, packed, bias)

        return linear

    def packed_weight(self, x: torch.Tensor) -> kernels.PackedLinear | None:
        """The kernel's copy of the weight when the kernel should run for x [..., in_features], else None."""
        if not self.use_kernel or x.dim() == 0 or not kernel_applies(x, self.weight, x.numel() // max(1, x.shape[-1])):
            return None
        return self.packed()

    def packed(self) -> kernels.PackedLinear:
        """The kernel's packed copy of the weight (made on first use, remade when the weight changes),
        without asking whether the kernel should run: a whole-block op that checked that binds it."""
        return cached_pack(self, "_packed", (self.weight,), kernels.pack_linear)


def kernel_applies(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Whether ``rows`` rows of x times ``weight`` ([C, K] or [G, C, K]) should run on the packed
    linear kernel: CPU, same dtype, no autograd, not a row count where the library GEMM is faster
    (``kernels.prefers_library_gemm``), and the kernel built."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype and kernels.can_pack_linear(weight)
            and not kernels.needs_autograd(x, weight)
            and not kernels.prefers_library_gemm(x.dtype, rows) and kernels.is_available())


def kernel_weights(linears: Sequence[Linear], dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    """The weights of ``linears`` when each would run the packed kernel on rows of ``dtype`` (its
    switch on, its weight in ``dtype`` and packable, no autograd), else None. A whole-block op
    checks its projections once with this; rows, device and the library-GEMM choice are its own."""
    weights = tuple(lin._parameters["weight"] for lin in linears)  # without nn.Module.__getattr__
    for lin, w in zip(linears, weights):
        if not (lin.use_kernel and w.dtype == dtype and kernels.can_pack_linear(w)):
            return None
    return None if kernels.needs_autograd(*weights) else weights


def cached_pack(owner: object, attr: str, weights: tuple[torch.Tensor, ...], pack: Callable[..., T]) -> T:
    """``pack(*weights)``, cached on ``owner.<attr>`` and remade when any weight's storage,
    version (in-place writes: loading, migration), shape or dtype changes."""
    key = tuple((w._version, w.data_ptr(), w.shape, w.dtype) for w in weights)
    cached = getattr(owner, attr, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    packed = pack(*weights)
    setattr(owner, attr, (key, packed))
    return packed
