"""Decode steps without the per-layer Python: every layer's ops resolved once, then called directly.

Shape legend: B decode rows (one new token per sequence), D hidden.

A step whose rows are all decode rows runs the same ops with the same weights step after step;
only the rows, positions and block tables change. The module path re-decides every layer of every
step whether each whole-block CPU op applies and rebuilds its argument lists: on the small
DeepSeek-style checkpoint that Python is ~2-3 ms of a ~20 ms batch-1 step. ``DecodePlan`` asks
each module once (``RMSNorm.fused_op``, ``MLAAttention`` / ``GQAAttention.fused_decode_op``, ``MoELayer.fused_ffn_op``,
``DenseMLP.fused_op``; the module itself where it has none or declines) and then runs the layers
through ``DecoderLayer.run_fused_norms`` (``forward``'s own sequence) with those ops. Each residual add
runs in one op with the norm after it (``RMSNorm.fused_add_op``: the next layer's input norm, the
final norm after the last layer): two ops fewer per layer, the same bits.

The plan holds while its ``state`` is unchanged: the row dtype, the row-count regime
(``kernels.prefers_library_gemm`` at B rows, ``prefers_library_experts`` at B * top_k expert
assignments), the cache pools' dtypes, every switch its decisions read (each module class's
``DECISION_ATTRS``), and every parameter's identity and in-place version (loading, TP slicing and
expert migration all show there). ``holds`` answers that without reading every switch and parameter
back each step when the modules announce their changes (``moe.plan_watch``): the announcement
count, one C++ loop over the parameters' versions and addresses, and the switches held on a class;
otherwise, or after an announcement, it compares the whole state. The placement
(log2phy, logcnt, rank, slot_load) is read at each call, so a rebalance needs no new plan.
Outputs, cache writes and slot loads are bit-equal to the module path's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from moe import kernels, plan_watch
from moe.kv_cache import AttentionMetadata, KVLayerView, PagedKVCache

Op = Callable[..., torch.Tensor]


def _layer_ops(layer: nn.Module, next_norm: nn.Module, x: torch.Tensor, view: KVLayerView) -> tuple[Op, Op, Op, Op]:
    """A decoder layer's (attention, post-attention add-and-norm, FFN, add-and-norm into ``next_norm``)
    for ``DecoderLayer.run_fused_norms``: the attention and FFN submodules' resolved ops (or the
    submodules themselves where they have none or decline), the norms' ``fused_add_op``."""
    mods = layer._modules
    mlp = mods["mlp"]
    return (_resolved(mods["self_attn"], "fused_decode_op", x, view), mods["post_attention_layernorm"].fused_add_op(x),
            _resolved(mlp, "fused_ffn_op" if hasattr(mlp, "fused_ffn_op") else "fused_op", x),
            next_norm.fused_add_op(x))


def _resolved(module: nn.Module, method: str, *args: Any) -> Op:
    """module.<method>(*args) when it has that method and it returns an op, else the module itself."""
    resolve = getattr(module, method, None)
    op = resolve(*args) if resolve is not None else None
    return op if op is not None else module


class DecodePlan:
    """The decoder layers, the final norm and lm_head of a model resolved for decode rows like x [B, D]
    (see the module docstring).

    layers: the model's ``DecoderLayer`` list; final_norm: the norm after the last layer; x: this
    step's hidden rows (only dtype, device and row count are read); kv_cache: the paged cache the
    layers write; lm_head: the output projection (``lm_head`` is then its resolved op, or the module)."""

    def __init__(self, layers: Sequence[nn.Module], final_norm: nn.Module, x: torch.Tensor,
                 kv_cache: PagedKVCache, lm_head: nn.Module | None = None) -> None:
        modules = [m for layer in layers for m in layer.modules()] + list(final_norm.modules())
        if lm_head is not None:
            modules += list(lm_head.modules())
        self._modules = modules
        self._switches = [(m, name) for m in modules for name in plan_watch.decision_attrs(type(m))]
        self._params = [m._parameters for m in modules if m._parameters]
        self._expert_shapes = sorted({(int(m.experts.num_local_slots), int(m.top_k)) for m in modules
                                      if hasattr(m, "fused_ffn_op")})
        self.key = self.state(x, kv_cache)  # before resolving: packing happens below
        norms = [layer._modules["input_layernorm"] for layer in layers] + [final_norm]
        self._first_norm = _resolved(norms[0], "fused_op", x)
        self._ops = [(layer, _layer_ops(layer, norms[i + 1], x, kv_cache.layer(i))) for i, layer in enumerate(layers)]
        self.lm_head: Op | None = _resolved(lm_head, "fused_op", x) if lm_head is not None else None
        self._arm()

    def state(self, x: torch.Tensor, kv_cache: PagedKVCache) -> tuple[Any, ...]:
        """Everything the resolved ops depend on, for x [B, D] (equal states: the same ops)."""
        switches = tuple(getattr(m, name) for m, name in self._switches)
        return (*self._step_state(x, kv_cache), switches, self._weights())

    def holds(self, x: torch.Tensor, kv_cache: PagedKVCache) -> bool:
        """Whether this plan serves x [B, D] over kv_cache: ``state(x, kv_cache) == key``, answered
        from the announcements (``moe.plan_watch``) while there are none since the plan was armed."""
        if self._quiet():
            return self._step_state(x, kv_cache) == self.key[:5]
        if self.state(x, kv_cache) != self.key:
            return False
        self._arm()  # an announcement that changed nothing this plan reads
        return True

    def weights_changed(self) -> bool:
        """Whether a parameter changed since the plan was made (its bound packed copies are stale)."""
        return not self._weights_quiet() and self._weights() != self.key[-1]

    def _step_state(self, x: torch.Tensor, kv_cache: PagedKVCache) -> tuple[Any, ...]:
        """The state's first five entries: what the step's rows and cache decide (read every step)."""
        rows = x.shape[0]
        regime = (kernels.prefers_library_gemm(x.dtype, rows),
                  *(kernels.prefers_library_experts(x.dtype, rows * k / max(1, min(p, rows * k)))
                    for p, k in self._expert_shapes))
        return (x.dtype, x.device, regime, id(kv_cache), tuple(pool.dtype for pool in kv_cache.pools))

    def _arm(self) -> None:
        """Record what ``_quiet`` compares: the announcement count, a watch over the parameters (None
        without the C++ extension, or when a module that matters does not announce its changes:
        then ``holds`` compares the whole state every step), and the switches held on a class (read
        back from the class every step; an instance's own switch changes only by an announced
        assignment: the full comparison holds the same object, so it could not see a mutable value
        changed in place either)."""
        self._epoch = plan_watch.epoch()
        announced = all(isinstance(m, plan_watch.WatchedModule) for m in self._modules
                        if m._parameters or plan_watch.decision_attrs(type(m)))
        params = [p for d in self._params for p in d.values() if p is not None]
        self._watch = kernels.tensor_watch(params) if announced else None
        self._read_back = sorted({(type(m), name) for m, name in self._switches if name not in m.__dict__},
                                 key=lambda owner_name: (owner_name[0].__qualname__, owner_name[1]))
        self._read_back_values = tuple(getattr(owner, name) for owner, name in self._read_back)

    def _quiet(self) -> bool:
        """Nothing this plan reads has changed, by the announcements (False when it cannot tell)."""
        return (self._weights_quiet()
                and tuple(getattr(owner, name) for owner, name in self._read_back) == self._read_back_values)

    def _weights_quiet(self) -> bool:
        """No announcement since the plan was armed and no watched parameter changed (False without a watch)."""
        return self._watch is not None and plan_watch.epoch() == self._epoch and not self._watch.changed()

    def _weights(self) -> tuple[tuple[int, int] | None, ...]:
        return tuple((p._version, p.data_ptr()) if p is not None else None for d in self._params for p in d.values())

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv_cache: PagedKVCache) -> torch.Tensor:
        """Every layer's ``run_fused_norms`` on its resolved ops, then the final norm (fused into the
        last residual add). h: [B, D]; cos, sin: [B, R/2]. Returns the normed hidden rows [B, D]."""
        x = self._first_norm(h)
        for i, (layer, ops) in enumerate(self._ops):
            h, x = layer.run_fused_norms(h, x, cos, sin, meta, kv_cache.layer(i), *ops)
        return x


def plan_applies(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether a step of rows x [T, D] can run on a plan: every row a decode row, outside autograd
    (the resolved ops have no backward)."""
    rows = x.shape[0]
    return rows > 0 and rows == len(meta.query_lens_list) and not torch.is_grad_enabled() and not x.requires_grad
