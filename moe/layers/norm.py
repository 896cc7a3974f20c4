"""RMSNorm, computed in float32 like Hugging Face (then scaled in the input dtype)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe import kernels
from moe.plan_watch import WatchedModule


class RMSNorm(WatchedModule):
    """y = weight * (x / sqrt(mean(x^2) + eps)); x: [..., dim] -> [..., dim] in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    use_kernel: bool = True  # False pins the PyTorch expression (the reference in tests)
    DECISION_ATTRS = ("use_kernel", "eps")  # what fused_op's answer reads besides x and the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and self._kernel_applies(x):
            if x.dim() == 2:
                return kernels.rms_norm(x, self.weight, self.eps)
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        in_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(in_dtype)

    def fused_op(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The kernel call ``forward`` makes for a 2-D x [T, D] with the weight bound, or None when
        ``forward`` takes the PyTorch expression (or x is not 2-D)."""
        if not (self.use_kernel and x.dim() == 2 and self._kernel_applies(x)):
            return None
        weight, eps = self.weight, self.eps

        def norm(x: torch.Tensor) -> torch.Tensor:
            return kernels.rms_norm(x, weight, eps)

        return norm

    def fused_add_op(self, x: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The residual add before this norm and the norm as one op: ``add_norm(h, r)`` -> (h + r,
        self(h + r)) for h, r [T, D] like x, bit-equal to the add and ``forward`` (the kernel's
        ``add_rms_norm`` where ``fused_op`` would run the kernel, else the add and this module)."""
        if self.fused_op(x) is None:
            def add_then_norm(h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                s = h + r
                return s, self(s)

            return add_then_norm
        weight, eps = self.weight, self.eps

        def add_norm(h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return kernels.add_rms_norm(h, r, weight, eps)

        return add_norm

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        """The one-op CPU kernel: CPU, x in the weight's dtype (float32 or bfloat16), no autograd, built."""
        return x.dim() >= 1 and kernels.cpu_op_applies(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
