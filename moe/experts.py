"""Stacked routed experts and their grouped computation.

Shape legend: T tokens, D hidden, I expert intermediate, K top-k,
P_local physical expert slots hosted by this rank, N routed (token, slot) rows.

Experts are stored stacked, gpt-fast style: ``w13 [P_local, 2I, D]`` (gate rows
first, then up rows) and ``w2 [P_local, D, I]``. A slot holds a copy of one
logical expert; which one is decided by the placement (``phy2log``) and is
recorded in ``slot_to_logical`` so the loader and the balancer's migration know
what each slot must contain.

On CPU the grouped computation runs the fused kernel of ``moe.kernels`` on a packed copy
of the weights, made on first use and remade whenever ``w13`` / ``w2`` change in place
(loading, migration): their version counters key the copy. ``grouped_expert_forward``
(PyTorch GEMMs) is the fallback (shapes the kernel does not take, no compiler) and the
reference the kernel is tested against; on CUDA it runs bf16 experts as PyTorch's grouped GEMM
(one launch per projection for all slots), other dtypes as one GEMM pair per slot. ``quantization="int8"`` packs
the routed experts as int8 with per-output-channel scales (weight-only; activations stay
in fp32 inside the kernel); the PyTorch path then runs on the dequantized weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe import kernels
from moe.cpu_gemm import native_gemv, use_native_gemv
from moe.plan_watch import WatchedModule

# Rows per fp32 staging chunk when accumulating expert outputs into tokens: one
# index_add per chunk instead of one [N, D] fp32 temporary.
ACCUMULATE_CHUNK_ROWS = 1024


def grouped_expert_forward(
    x_sorted: torch.Tensor,
    counts: list[int],
    w13: torch.Tensor,
    w2: torch.Tensor,
    row_weights: torch.Tensor | None = None,
    *,
    grouped_gemm: bool = True,
) -> torch.Tensor:
    """SwiGLU experts over rows already grouped by local slot.

    x_sorted: [N, D], rows of slot 0 first, then slot 1, ...
    counts: P_local ints summing to N (rows per local slot; zeros allowed).
    w13: [P_local, 2I, D]; w2: [P_local, D, I]. row_weights: optional [N] float32; row n's
    output is scaled by it (applied to the [n, I] activation before the down projection,
    which is linear, so it costs I instead of D multiplies per row).
    Returns: [N, D] in x_sorted's dtype. Where ``library_grouped_mm`` serves (bf16 on CUDA) and
    ``grouped_gemm`` allows it, one grouped GEMM per projection; else one GEMM pair per non-empty slot, and on CPUs where
    ``moe.cpu_gemm.use_native_gemv`` holds, one-row slots run as PyTorch's native GEMV.
    """
    inter = w2.shape[-1]
    library = library_grouped_mm(x_sorted, w13, w2) if grouped_gemm else None
    if library is not None:  # one grouped GEMM per projection over every slot (CUDA, bf16)
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x_sorted.device)
        return _grouped_swiglu(library, x_sorted, offs, w13, w2, row_weights)
    spans, start = [], 0
    for slot, n in enumerate(counts):
        if n:
            spans.append((slot, start, start + n))
        start += n
    # one-row slots (common in decode) run as GEMVs: see moe.cpu_gemm
    gemv = use_native_gemv(w13.dtype, w13.device)
    groups = ([s for s in spans if s[2] - s[1] > 1], [s for s in spans if s[2] - s[1] == 1]) if gemv else (spans, [])
    # Per slot only the two GEMMs; the activation and the row weights run once over all rows
    # (elementwise, so the values are those of a per-slot computation).
    h = x_sorted.new_empty(x_sorted.shape[0], 2 * inter)  # [N, 2I]
    _grouped_mm(x_sorted, w13, groups, h)
    act = F.silu(h[:, :inter]) * h[:, inter:]  # [N, I]
    if row_weights is not None:
        act = act * row_weights[:, None].to(act.dtype)
    out = torch.empty_like(x_sorted)
    _grouped_mm(act, w2, groups, out)
    return out


def grouped_mm_row_fits(n: int, element_size: int) -> bool:
    """Whether PyTorch's grouped GEMM can read or write rows of ``n`` elements of ``element_size``
    bytes: its kernels need whole 16-byte units."""
    return n * element_size % 16 == 0


def library_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, device_types: tuple[str, ...] = ("cuda",)
                       ) -> Callable[..., torch.Tensor] | None:
    """PyTorch's grouped GEMM (``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``) when
    it serves ``grouped_expert_forward`` here, else None (the per-slot loop runs).

    It serves bf16 inputs and weights on the ``device_types`` (CUDA: compute capability 8.0 and up)
    whose widths (D, 2I, I) are whole 16-byte rows, as its kernels require, without autograd.
    x: [N, D]; w13: [P, 2I, D]; w2: [P, D, I]. On CUDA one launch per projection replaces one
    GEMM launch per non-empty slot; the sums are fp32 rounded once to bf16, as the loop's are, in
    another order (not bit-equal to the loop's)."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None or x.device.type not in device_types or torch.is_grad_enabled() and (
            x.requires_grad or w13.requires_grad or w2.requires_grad):
        return None
    if not (x.dtype == w13.dtype == w2.dtype == torch.bfloat16) or x.dim() != 2 or w13.dim() != 3 or not x.shape[0]:
        return None
    if not all(grouped_mm_row_fits(n, x.element_size()) for n in (x.shape[1], w13.shape[1], w2.shape[-1])):
        return None
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return None
    return fn


def count_ids(ids: torch.Tensor, n: int, *, weights: torch.Tensor | None = None,
              sync_free: bool | None = None) -> torch.Tensor:
    """How often each value of ``ids`` [M] int64 (all in [0, n)) occurs: [n] int64, as
    ``torch.bincount(ids, minlength=n)``; with ``weights`` [M] int64, each occurrence counts its
    weight (0 leaves it out). CUDA's bincount reads ids' min and max back to the host (two waits on the
    stream per call); ``sync_free`` (the default off the CPU) counts with an ``index_add_`` into n zeros
    instead, which never waits, and so do weighted counts (bincount's would be float64). Integer adds:
    the same counts either way."""
    if sync_free is None:
        sync_free = ids.device.type != "cpu"
    if weights is None and not sync_free:
        return torch.bincount(ids, minlength=n)
    ones = torch.ones_like(ids) if weights is None else weights
    return torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, ids, ones)


def group_ends(sorted_keys: torch.Tensor, n: int) -> torch.Tensor:
    """sorted_keys [M] int64, ascending. Returns [n] int32: for each group g < n the number of keys
    <= g (the end of its rows when rows are sorted by key; keys >= n sort past the last end). A
    binary search on the device: no host read, no atomics."""
    bounds = torch.arange(n, dtype=sorted_keys.dtype, device=sorted_keys.device)
    return torch.searchsorted(sorted_keys, bounds, right=True).to(torch.int32)


def _grouped_swiglu(grouped_mm: Callable[..., torch.Tensor], x_sorted: torch.Tensor, offs: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, row_weights: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU of rows grouped by slot on ``grouped_mm``: x_sorted [N, D], offs [P] int32 group ends
    (rows past offs[-1] are left unwritten), row_weights [N] or None scaling each row's activation.
    Returns [N, D] in x_sorted's dtype."""
    inter = w2.shape[-1]
    h = grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offs)  # [N, 2I]
    act = F.silu(h[:, :inter]) * h[:, inter:]  # [N, I]
    if row_weights is not None:
        act = act * row_weights[:, None].to(act.dtype)
    return grouped_mm(act.contiguous(), w2.transpose(-2, -1), offs=offs)  # [N, D]


def grouped_gemm_forward(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                         w2: torch.Tensor, grouped_mm: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``Experts.forward`` on ``grouped_mm`` (``library_grouped_mm``'s answer) without a host sync:
    no row counts read back, so a CUDA stream runs ahead of the host.

    x: [T, D]; slot_ids: [T, K] int64 (-1 = dropped); weights: [T, K] float32; w13: [P, 2I, D];
    w2: [P, D, I]. Returns [T, D] float32, sum_k weights[t, k] * expert_{slot[t, k]}(x[t]), the
    K terms added in k order (no atomics: the same bits on every run). Dropped assignments sort
    after every slot, past the last group's end, where the grouped GEMM writes nothing; their rows
    are zeroed before the sum."""
    num_slots = w13.shape[0]
    tokens, top_k = slot_ids.shape
    flat = slot_ids.reshape(-1)  # [T K]
    kept = flat >= 0
    keys = torch.where(kept, flat, num_slots)
    order = torch.argsort(keys, stable=True)  # [T K] rows grouped by slot, dropped last
    offs = group_ends(keys[order], num_slots)  # [P] ends (not bincount: on CUDA it reads back to the host)
    y = _grouped_swiglu(grouped_mm, x[order // top_k], offs, w13, w2, weights.reshape(-1)[order]).float()  # [T K, D]
    y = torch.where(kept[order][:, None], y, 0.0)
    rows = torch.empty_like(y)
    rows[order] = y  # back to (token, k) order: a permutation, no two writes to one row
    return rows.view(tokens, top_k, -1).sum(dim=1)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, groups: tuple[list, list], out: torch.Tensor) -> None:
    """out[lo:hi] = x[lo:hi] @ w[slot].T for each (slot, lo, hi); the second group as GEMVs."""
    many, single = groups
    for slot, lo, hi in many:
        torch.mm(x[lo:hi], w[slot].t(), out=out[lo:hi])
    if single:
        with native_gemv():
            for slot, lo, hi in single:
                torch.mm(x[lo:hi], w[slot].t(), out=out[lo:hi])


def compute_local_routing(
    slot_ids: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Group flattened (token, k) assignments by slot.

    slot_ids: [T, K] int64 slot per assignment; values < 0 are dropped assignments.
    Returns: (order [M] int64 indices into the flattened [T*K] assignments, sorted by
    slot, dropped ones excluded; token_of_row [M] int64 token index of each row;
    counts: num_slots ints, rows per slot).
    """
    flat = slot_ids.reshape(-1)
    valid = flat >= 0
    idx = torch.nonzero(valid, as_tuple=False).squeeze(1)
    keys = flat[idx]
    perm = torch.argsort(keys, stable=True)
    order = idx[perm]
    counts = torch.bincount(keys, minlength=num_slots).tolist() if keys.numel() else [0] * num_slots
    token_of_row = order // slot_ids.shape[1]
    return order, token_of_row, counts


class Experts(WatchedModule):
    """The routed experts hosted by one rank.

    w13: [P_local, 2I, D]; w2: [P_local, D, I]; slot_to_logical: [P_local] int64
    (the logical expert each local slot holds). quantization: None or "int8".
    """

    DECISION_ATTRS = ("use_kernel", "fused_topk", "quantization", "num_local_slots")  # fused_packed_for's switches

    def __init__(
        self,
        num_local_slots: int,
        hidden_size: int,
        intermediate_size: int,
        slot_to_logical: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.num_local_slots = num_local_slots
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(
            torch.empty(num_local_slots, 2 * intermediate_size, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_local_slots, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
        )
        if slot_to_logical is None:
            slot_to_logical = torch.arange(num_local_slots, dtype=torch.int64)
        self.register_buffer("slot_to_logical", slot_to_logical.to(torch.int64).clone(), persistent=False)
        self.quantization: str | None = None
        # the fused CPU kernel when available, on CUDA PyTorch's grouped GEMM (False: always the
        # per-slot PyTorch loop, the reference)
        self.use_kernel = True
        self.fused_topk = True  # forward() in one op from the router's output (False: group in PyTorch first)
        self._packed: tuple[tuple, kernels.PackedExperts | None] | None = None
        self._dequantized: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.set_quantization(quantization)

    def set_quantization(self, quantization: str | None) -> None:
        """None (the stored dtype) or "int8" (weight-only, per-output-channel scales)."""
        if quantization not in (None, *kernels.QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {list(kernels.QUANTIZATIONS)} or None, "
                             f"got {quantization!r}")
        self.quantization = quantization
        self._packed = self._dequantized = None

    def _weights_key(self) -> tuple:
        w13, w2 = self._parameters["w13"], self._parameters["w2"]
        return (w13._version, w2._version, w13.data_ptr(), w2.data_ptr(), w13.dtype, w13.device, self.quantization)

    def packed_weights(self) -> kernels.PackedExperts | None:
        """The kernel's copy of the weights (packed, int8 when quantized), or None when the fused
        kernel does not apply (not CPU, a shape or dtype it does not take, or not built)."""
        params = self._parameters
        if not self.use_kernel or not kernels.can_pack(params["w13"], params["w2"]) or not kernels.is_available():
            return None
        key = self._weights_key()
        if self._packed is None or self._packed[0] != key:
            self._packed = None  # drop the old copy before making the new one
            self._packed = (key, kernels.pack_experts(self.w13.detach(), self.w2.detach(), self.quantization))
        return self._packed[1]

    def reference_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the PyTorch path multiplies them: the stored weights, or with int8 the
        dequantized ones (q * scale, in the stored dtype)."""
        if self.quantization is None:
            return self.w13, self.w2
        key = self._weights_key()
        if self._dequantized is None or self._dequantized[0] != key:
            q13, s13 = kernels.quantize_int8(self.w13.detach())
            q2, s2 = kernels.quantize_int8(self.w2.detach())
            dtype = self.w13.dtype
            self._dequantized = (key, (kernels.dequantize_int8(q13, s13, dtype), kernels.dequantize_int8(q2, s2, dtype)))
        return self._dequantized[1]

    def grouped(self, x_sorted: torch.Tensor, counts: list[int], row_weights: torch.Tensor | None = None,
                *, out_fp32: bool = False) -> torch.Tensor:
        """SwiGLU over rows grouped by local slot. x_sorted: [N, D]; counts: P_local ints summing
        to N; row_weights: [N] float32 or None. Returns [N, D], row n scaled by row_weights[n], in
        x's dtype; with ``out_fp32`` the fused kernel (CPU) returns float32 instead (unrounded),
        the PyTorch path still x's dtype (callers accept either)."""
        differentiable = kernels.needs_autograd(x_sorted, self.w13, self.w2, row_weights)
        packed = self.packed_weights() if x_sorted.device.type == "cpu" and not differentiable else None
        busy = sum(1 for n in counts if n)
        if packed is not None and not packed.quantized and kernels.prefers_library_experts(
                x_sorted.dtype, x_sorted.shape[0] / max(busy, 1)):
            packed = None  # prefill-size groups: the library GEMM is faster than the kernel here
        if packed is not None and x_sorted.dtype in (torch.float32, torch.bfloat16):
            return kernels.experts_forward(x_sorted.contiguous(), counts, packed, row_weights, out_fp32=out_fp32)
        w13, w2 = self.reference_weights()
        return grouped_expert_forward(x_sorted, counts, w13, w2, row_weights=row_weights, grouped_gemm=self.use_kernel)

    def forward_grouped(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x_sorted: [N, D] grouped by local slot; counts: P_local ints. Returns [N, D]."""
        return self.grouped(x_sorted, counts)

    def forward(self, x: torch.Tensor, local_slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Single-rank routed experts.

        x: [T, D]; local_slot_ids: [T, K] int64 (-1 = dropped); weights: [T, K] float32.
        Returns: [T, D] float32, sum_k weights[t, k] * expert_{slot[t, k]}(x[t]).
        """
        packed = self._fused_packed(x, local_slot_ids, weights)
        if packed is not None:  # grouping, gather, experts and the per-token sum in one op
            return kernels.experts_forward_topk(x, local_slot_ids, weights, packed)
        params = self._parameters
        library = library_grouped_mm(x, params["w13"], params["w2"]) if self.use_kernel else None
        if library is not None and local_slot_ids.numel() and not kernels.needs_autograd(weights):
            w13, w2 = self.reference_weights()  # (CUDA; int8: dequantized once and cached)
            return grouped_gemm_forward(x, local_slot_ids, weights, w13, w2, library)
        order, token_of_row, counts = compute_local_routing(local_slot_ids, self.num_local_slots)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        if order.numel() == 0:
            return out
        w = weights.reshape(-1)[order].float()  # [M]
        y = self.grouped(x[token_of_row], counts, w, out_fp32=True)  # [M, D] weighted
        if y.dtype == torch.float32:
            return out.index_add_(0, token_of_row, y)
        for lo in range(0, y.shape[0], ACCUMULATE_CHUNK_ROWS):  # accumulate in fp32, bounded staging
            hi = lo + ACCUMULATE_CHUNK_ROWS
            out.index_add_(0, token_of_row[lo:hi], y[lo:hi].float())
        return out

    def _fused_packed(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
                      ) -> kernels.PackedExperts | None:
        """The packed weights when ``kernels.experts_forward_topk`` should serve this call: CPU,
        fp32/bf16 x, no autograd, the kernel built, and not prefill-size groups in a dtype with a
        fast library GEMM (judged on the fewest rows per slot the assignments allow, since the
        per-slot counts are the op's own work)."""
        if kernels.needs_autograd(weights):
            return None
        return self.fused_packed_for(x, slot_ids.numel())

    def fused_packed_for(self, x: torch.Tensor, assignments: int) -> kernels.PackedExperts | None:
        """``_fused_packed``'s answer for x [T, D] and ``assignments`` (token, k) pairs, routing
        weights not needing autograd."""
        packed = self._one_op_weights(x)
        if packed is None:
            return None
        if not packed.quantized and kernels.prefers_library_experts(x.dtype, assignments / max(1, min(
                self.num_local_slots, assignments))):
            return None
        return packed

    def _one_op_weights(self, x: torch.Tensor) -> kernels.PackedExperts | None:
        """The packed weights when a one-op CPU path (``experts_forward_topk``, ``experts_forward_rows``)
        may take rows like x: CPU, fp32/bf16 in the weights' dtype, ``fused_topk`` on, no autograd
        through x or the weights, the kernel built; else None."""
        if not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16) or not self.fused_topk:
            return None
        params = self._parameters  # without nn.Module.__getattr__: this runs every layer of every step
        if x.dtype != params["w13"].dtype or kernels.needs_autograd(x, params["w13"], params["w2"]):
            return None  # rows in another dtype: the op-by-op path's answer (an error), not a silent cast
        return self.packed_weights()

    def forward_rows_fused(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                           first_slot: int = 0) -> torch.Tensor | None:
        """``forward_rows`` in one CPU op (``kernels.experts_forward_rows``: the grouping, the gather,
        the experts and the per-row sums, the same values), or None where it does not apply: not
        CPU, no packed weights, autograd, or groups of prefill size that ``grouped`` gives the
        library GEMMs. x: [M, D] (rows may lie any stride apart, e.g. in the receive buffer);
        slot_ids: [M, K] int32 or int64, slot s being local slot s - first_slot where that is in
        [0, P) and not here otherwise (an expert-parallel rank passes the wire's physical slots
        and its first slot); weights: [M, K]. Returns [M, D] in x's dtype."""
        if slot_ids.dtype not in (torch.int32, torch.int64) or x.dim() != 2 or kernels.needs_autograd(weights):
            return None
        packed = self._one_op_weights(x)
        if packed is None:
            return None
        library = not packed.quantized and kernels.prefers_library_experts(x.dtype, kernels.LIBRARY_GEMM_MIN_ROWS)
        return kernels.experts_forward_rows(x, slot_ids, weights.float(), first_slot, packed,
                                            kernels.LIBRARY_GEMM_MIN_ROWS if library else math.inf)

    def forward_rows(self, x: torch.Tensor, local_slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed experts returning each row's weighted sum in x's dtype (the EP wire format).

        x: [T, D]; local_slot_ids: [T, K] int64 (-1 = not here / dropped); weights: [T, K] float32.
        Returns: [T, D] in x.dtype, sum_k weights[t, k] * expert_{slot[t, k]}(x[t]) accumulated
        in fp32 and rounded once (one gather + sum over the expert outputs, no fp32 [T, D]
        temporary and no zero-fill; a row with no local assignment gets zeros).
        """
        fused = self.forward_rows_fused(x, local_slot_ids, weights)
        if fused is not None:
            return fused
        order, token_of_row, counts = compute_local_routing(local_slot_ids, self.num_local_slots)
        w = weights.reshape(-1)[order].float()  # [M]
        y = self.grouped(x[token_of_row], counts, w)  # [M, D] weighted, x's dtype
        # y's rows are slot-major; list them per row (token-major, k ascending) for the bag sum
        valid = local_slot_ids >= 0  # [T, K]
        position = torch.empty(valid.numel(), dtype=torch.int64, device=x.device)
        position[order] = torch.arange(order.numel(), device=x.device)
        index = position[valid.reshape(-1)]
        per_row = valid.sum(1)
        return F.embedding_bag(index, y, torch.cumsum(per_row, 0) - per_row, mode="sum")
