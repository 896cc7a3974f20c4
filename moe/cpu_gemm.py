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
import os
from collections.abc import Iterator, Mapping

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


# oneDNN's instruction-set ceilings (ONEDNN_MAX_CPU_ISA, or the older DNNL_MAX_CPU_ISA), lowest first:
# a process started with one of them gets no GEMM above it, whatever the CPU has.
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
                "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")


def onednn_isa_ceiling(environ: Mapping[str, str] | None = None) -> str | None:
    """The ceiling set by ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) in ``environ`` (the process's
    by default), upper-cased; None when unset, ``ALL``/``DEFAULT``, or a value oneDNN does not know (it
    ignores those)."""
    env = os.environ if environ is None else environ
    value = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return value if value in _ONEDNN_ISAS else None


def onednn_allows(feature: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether oneDNN may use ``feature`` ("avx512_bf16" or "amx_bf16") under its ISA ceiling: a
    machine whose cores have AMX, run with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, gets oneDNN's
    AVX512-BF16 GEMMs (half the fp32 FMA's rate on Intel cores), not its AMX ones."""
    if feature not in ("avx512_bf16", "amx_bf16"):
        raise ValueError(f"onednn_allows: unknown feature {feature!r}")
    ceiling = onednn_isa_ceiling(environ)
    if ceiling is None:
        return True
    if feature == "amx_bf16":
        return "AMX" in ceiling
    return _ONEDNN_ISAS.index(ceiling) >= _ONEDNN_ISAS.index("AVX512_CORE_BF16")


@functools.cache
def has_fast_bf16_gemm() -> bool:
    """Whether oneDNN has native bf16 GEMMs here (AVX512-BF16 or AMX, within ``ONEDNN_MAX_CPU_ISA``);
    without them PyTorch's bf16 matmul on CPU converts element by element (about 1 GFLOP/s on an
    AVX2 Zen 3 core)."""
    return any(_cpu_has(f) and onednn_allows(f) for f in ("avx512_bf16", "amx_bf16"))


@functools.cache
def has_amx_bf16() -> bool:
    """Whether oneDNN's bf16 GEMMs run on AMX's tiles here (then they outrun fp32 ones): the CPU has
    them and ``ONEDNN_MAX_CPU_ISA`` does not rule them out."""
    return _cpu_has("amx_bf16") and onednn_allows("amx_bf16")


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
