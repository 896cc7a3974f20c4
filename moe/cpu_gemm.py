"""One-row bf16 GEMMs on CPU: PyTorch's native GEMV instead of oneDNN.

A decode step multiplies many weights by a single row (a batch of one token, or a routed
expert that one token of the batch picked). For bf16 on CPU PyTorch sends every such
``[1, K] @ [K, N]`` to oneDNN's GEMM, which streams the weight at about half the rate of
PyTorch's own vectorised bf16 GEMV (measured on an AVX512-BF16 Zen 4 core, 1 MB weight:
125 us vs 66 us). The GEMV is reached only with oneDNN switched off, a process-wide
flag: ``native_gemv()`` switches it off for the duration of a block on CPUs whose GEMV has
the AVX512-BF16 path, and is a no-op elsewhere.

The flag is global: a bf16 GEMM that another thread runs inside the block takes the native
kernel too (same math, slower for many rows). The worker runs the model on one thread.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch


def _cpu_has(feature: str) -> bool:
    """Whether PyTorch's CPU capability report lists ``feature`` (False on an older torch without it)."""
    try:
        capability = torch._C._cpu._get_cpu_capability()
    except (AttributeError, RuntimeError):
        return False
    return bool(capability.get(feature, False))


@functools.cache
def has_fast_bf16_gemv() -> bool:
    """Whether this CPU has the AVX512-BF16 instructions PyTorch's native bf16 GEMV uses (an older
    torch: no, keep oneDNN everywhere)."""
    return _cpu_has("avx512_bf16")


@functools.cache
def has_fast_bf16_gemm() -> bool:
    """Whether oneDNN has native bf16 GEMMs here (AVX512-BF16 or AMX); without them PyTorch's bf16
    matmul on CPU converts element by element (about 1 GFLOP/s on an AVX2 Zen 3 core)."""
    return _cpu_has("avx512_bf16") or _cpu_has("amx_bf16")


@functools.cache
def has_amx_bf16() -> bool:
    """Whether this CPU has AMX's bf16 tiles (oneDNN's bf16 GEMMs then outrun fp32 ones)."""
    return _cpu_has("amx_bf16")


def use_native_gemv(dtype: torch.dtype, device: torch.device | str) -> bool:
    """One-row GEMMs of ``dtype`` on ``device`` should run under ``native_gemv()``."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and has_fast_bf16_gemv()


@contextlib.contextmanager
def native_gemv(enabled: bool = True) -> Iterator[None]:
    """oneDNN off inside the block (when ``enabled``), restored after, even on error."""
    if not enabled or not torch.backends.mkldnn.enabled:
        yield
        return
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True
