"""The decoder-only MoE model on one rank's shard (Mixtral, DeepSeek V2/V3, Qwen3-MoE).

Shape legend: T tokens in the flat step batch, B sequences, D hidden, V vocab.

State-dict names are the canonical names of docs/contracts.md (``model.layers.N.self_attn.*``,
``model.layers.N.mlp.experts.w13``, ...). Tensor parallelism is applied after loading
(``shard_for_tp``): attention heads and dense-MLP columns are sliced, and each layer
all-reduces the o_proj / down_proj partial sums over ``tp_group``. Routed experts go through
the dispatcher; shared experts, norms, embeddings and lm_head stay replicated; MLA's latent
cache is replicated across the TP group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from moe.capacity import CapacityConfig
from moe.config import ModelConfig
from moe.decode_plan import DecodePlan, plan_applies
from moe.dispatch import ExpertDispatcher
from moe.experts import Experts
from moe.kv_cache import AttentionMetadata, KVLayerView, PagedKVCache
from moe.layers import DenseMLP, GQAAttention, MLAAttention, RMSNorm, RotaryEmbedding
from moe.layers.linear import Linear
from moe.layers.mla import DecodeAttentionOp
from moe.moe_layer import MoELayer
from moe.router import Router

LocalSlots = Sequence[int] | Mapping[int, Sequence[int]] | None
RowOp = Callable[[torch.Tensor], torch.Tensor]  # x [T, D] -> [T, D]: a norm or an FFN
AddNormOp = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (h, r) -> (h + r, norm(h + r))


class TpAllReduce(Protocol):
    """A faster path for the tensor-parallel all-reduce of some tensors than the group's backend
    (``parallel.shm_allreduce.ShmAllReduce``: small CPU tensors through shared memory)."""

    def applies(self, t: torch.Tensor) -> bool: ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    """Pre-norm attention + FFN (dense MLP or MoE) with residuals. h: [T, D] -> [T, D]."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, local_slots: Sequence[int] | None,
                 dispatcher: ExpertDispatcher | None, capacity: CapacityConfig | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn: nn.Module
        if config.attention == "mla":
            self.self_attn = MLAAttention(config, dtype)
        else:
            self.self_attn = GQAAttention(config, dtype, layer_id=layer_id)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_id):
            self.mlp = MoELayer(config, layer_id, dtype=dtype, local_slots=local_slots, dispatcher=dispatcher,
                                capacity=capacity)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, dtype)
        self.tp_group: dist.ProcessGroup | None = None
        self.tp_size = 1
        self.tp_shm: TpAllReduce | None = None  # small all-reduces through shared memory (one host, CPU)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                cache: KVLayerView) -> torch.Tensor:
        return self.run_ops(h, cos, sin, meta, cache, self.input_layernorm, self.self_attn,
                            self.post_attention_layernorm, self.mlp)

    def run_ops(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                cache: KVLayerView, norm1: RowOp, attn: DecodeAttentionOp | nn.Module, norm2: RowOp, ffn: RowOp) -> torch.Tensor:
        """``forward``'s sequence with each op given: the submodule itself, or the op it resolved to
        (``moe.decode_plan``). h: [T, D] -> [T, D]."""
        a = attn(norm1(h), cos, sin, meta, cache)
        h = h + self._tp_reduce(a)
        f = ffn(norm2(h))
        if isinstance(self.mlp, DenseMLP):  # a dense MLP's output is a TP partial sum (MoE combines its own)
            f = self._tp_reduce(f)
        return h + f

    def run_fused_norms(self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        meta: AttentionMetadata, cache: KVLayerView, attn: DecodeAttentionOp | nn.Module,
                        add_norm2: AddNormOp, ffn: RowOp, add_norm_next: AddNormOp) -> tuple[torch.Tensor, torch.Tensor]:
        """``run_ops`` with each residual add fused into the norm after it (``moe.decode_plan``): h [T, D]
        the residual stream, x = input_layernorm(h). ``add_norm2`` is post_attention_layernorm's
        add-and-norm, ``add_norm_next`` the next layer's input_layernorm's (the final norm's after the
        last layer). Returns (run_ops(h) [T, D], add_norm_next's norm of it [T, D]), bit-equal to the
        separate adds and norms."""
        a = attn(x, cos, sin, meta, cache)
        h, x = add_norm2(h, self._tp_reduce(a))
        f = ffn(x)
        if isinstance(self.mlp, DenseMLP):  # as run_ops
            f = self._tp_reduce(f)
        return add_norm_next(h, f)

    def _tp_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # every TP rank reaches this for every layer of every step (T may be 0): no rank skips it
        if self.tp_size > 1:
            shm = self.tp_shm
            if shm is not None and shm.applies(partial):  # the same answer on every TP rank: same shapes
                return shm.all_reduce(partial)
            dist.all_reduce(partial, group=self.tp_group)
        return partial


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, local_slots: LocalSlots,
                 dispatcher: ExpertDispatcher | None, capacity: CapacityConfig | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, _slots_for(local_slots, i), dispatcher, capacity)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config.rope_dim, config.rope_theta, config.rope_scaling, config.rope_interleave)


def _slots_for(local_slots: LocalSlots, layer_id: int) -> Sequence[int] | None:
    if local_slots is None or not isinstance(local_slots, Mapping):
        return local_slots
    return local_slots.get(layer_id)


class MoEModel(nn.Module):
    """One rank's model shard.

    local_slots: the logical experts this rank hosts, in local-slot order, either one list for
    every MoE layer or a mapping layer_id -> list (default: all experts, identity placement).
    capacity: enforced by every MoE layer when its scope is "local" (None or dropless: none); the
    "global" scope is the dispatcher's, built from the same ``CapacityConfig``.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.bfloat16,
        local_slots: LocalSlots = None,
        dispatcher: ExpertDispatcher | None = None,
        tp_group: dist.ProcessGroup | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        capacity: CapacityConfig | None = None,
        tp_shm: TpAllReduce | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self.config = config
        self.dtype = dtype
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        self.tp_shm = tp_shm
        self.model = _Backbone(config, dtype, local_slots, dispatcher, capacity)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lm_head.weight.requires_grad_(False)
        # all-decode steps call each layer's resolved ops directly (moe.decode_plan; False: the
        # modules every step, the reference)
        self.use_decode_plan = True
        self._plan: DecodePlan | None = None
        self._plan_rows: int | None = None  # the rows of the last forward, when it ran on the plan

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: PagedKVCache) -> torch.Tensor:
        """input_ids, positions: [T] int64 (rows ordered as ``meta``). Returns hidden [T, D]
        after the final norm. Writes this step's KV entries into ``kv_cache``."""
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]")
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(f"{input_ids.shape[0]} tokens but metadata describes {meta.num_tokens}")
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, max(meta.context_lens_list, default=0) - 1)
        if self.use_decode_plan and plan_applies(h, meta):
            self._plan_rows = h.shape[0]
            return self._decode_plan(h, kv_cache).run(h, cos, sin, meta, kv_cache)  # the final norm included
        self._plan_rows = None
        if self._plan is not None and self._plan.weights_changed():
            self._plan = None  # let the modules' caches drop the old packed weights as they repack
        layers = self.model.layers
        if len(layers) == 0:
            return self.model.norm(h)
        # each residual add in one op with the norm after it (RMSNorm.fused_add_op: bit-equal to the
        # add and the norm), as on the decode plan, around the modules themselves
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            norm_next = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, x = layer.run_fused_norms(h, x, cos, sin, meta, kv_cache.layer(i), layer.self_attn,
                                         layer.post_attention_layernorm.fused_add_op(x), layer.mlp,
                                         norm_next.fused_add_op(x))
        return x

    def _decode_plan(self, h: torch.Tensor, kv_cache: PagedKVCache) -> DecodePlan:
        """The layers' resolved ops for decode rows h [B, D]: the kept plan while its state holds."""
        plan = self._plan
        if plan is None or not plan.holds(h, kv_cache):
            self._plan = None  # drop the old plan's bound weights before resolving anew
            plan = self._plan = DecodePlan(self.model.layers, self.model.norm, h, kv_cache, self.lm_head)
        return plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, D]. Returns logits [B, V] float32. After a forward on the decode plan, hidden
        of its rows runs the plan's lm_head op (the call ``lm_head`` would make, bound once)."""
        rows, self._plan_rows = self._plan_rows, None
        plan = self._plan
        if plan is not None and plan.lm_head is not None and rows == hidden.shape[0] and hidden.dtype == plan.key[0]:
            return plan.lm_head(hidden).float()
        return self.lm_head(hidden).float()

    def set_fused_ops(self, enabled: bool) -> int:
        """Switch the small fused CPU ops on or off together (off: their PyTorch ops, the reference):
        RMSNorm, router selection, MLA's rope + latent norm + cache write, MLA's and GQA's whole
        decode attention as one op, MLA's and GQA's paged decode and prefill attention, the routed experts straight
        from the router's output (an EP rank's: over its received rows) and the whole MoE feed-forward as one op. The GEMM kernels
        (``moe.kernels`` experts / linear) stay as they are. Returns how many modules were set."""
        count = 0
        for module in self.modules():
            if isinstance(module, (RMSNorm, Router)):
                module.use_kernel = enabled
            elif isinstance(module, MLAAttention):
                module.use_fused_rope_cache = module.use_paged_kernel = module.use_fused_decode = enabled
                module.use_prefill_kernel = enabled
            elif isinstance(module, GQAAttention):
                module.use_paged_kernel = module.use_fused_decode = module.use_prefill_kernel = enabled
            elif isinstance(module, Experts):
                module.fused_topk = enabled
            elif isinstance(module, MoELayer):
                module.use_fused_ffn = enabled
            else:
                continue
            count += 1
        return count

    def moe_layers(self) -> Iterator[MoELayer]:
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoELayer):
                yield layer.mlp

    def shard_for_tp(self, tp_rank: int | None = None, tp_size: int | None = None) -> None:
        """Slice the loaded full weights to this rank's heads / MLP columns (gpt-fast style) and
        turn on the per-layer all-reduce over ``tp_group``."""
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        tp_size = self.tp_size if tp_size is None else tp_size
        if tp_size == 1:
            return
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        for layer in self.model.layers:
            layer.self_attn.shard_for_tp(tp_rank, tp_size)
            if isinstance(layer.mlp, DenseMLP):
                layer.mlp.shard_for_tp(tp_rank, tp_size)
            layer.tp_group, layer.tp_size, layer.tp_shm = self.tp_group, tp_size, self.tp_shm
        self.tp_rank, self.tp_size = tp_rank, tp_size
