"""Reusable communication buffers.

Fresh multi-MiB CPU tensors cost page faults on every step (the allocator hands large
blocks back to the OS), which at EP message sizes is comparable to the copy itself. A
dispatcher keeps its send/receive buffers here and reuses them while they are big enough.
A view from ``get`` is valid until the next ``get`` of the same name: never return one to
a caller that keeps it.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Named byte buffers that grow (by 25 % headroom) and are reused."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` backed by buffer ``name``."""
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device):
            buf = torch.empty(max(nbytes + nbytes // 4, 64), dtype=torch.uint8, device=device)
            self._buffers[name] = buf
        return buf[:nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())
