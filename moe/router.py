"""Routers: token -> top-k logical experts and their weights, computed in float32.

Shape legend: T tokens, D hidden, E logical experts, K top-k, G expert groups.

- softmax + greedy (Mixtral, Qwen3-MoE, DeepSeek-V2 greedy): top-k of softmax(logits);
  renormalised when ``norm_topk_prob``.
- softmax + group_limited_greedy (DeepSeek-V2): group score = max expert score; keep
  topk_group groups; top-k among them.
- sigmoid + noaux_tc (DeepSeek-V3): scores = sigmoid(logits); selection on
  scores + e_score_correction_bias with group score = sum of the top-2 biased scores;
  weights are the unbiased scores (renormalised when ``norm_topk_prob``).
All weights are finally multiplied by ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe import kernels
from moe.config import ModelConfig
from moe.layers.linear import cached_pack
from moe.plan_watch import WatchedModule

_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}  # moe_kernels.route_topk's method ids


def mask_to_top_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """scores: [T, E]; group_scores: [T, G]. Returns scores with experts outside the
    ``topk_group`` best groups set to ``fill``."""
    t, g = group_scores.shape
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)  # [T, G]
    keep = keep[:, :, None].expand(t, g, scores.shape[1] // g).reshape(t, scores.shape[1])
    return scores.masked_fill(~keep, fill)


class Router(WatchedModule):
    """gate.weight [E, D] (float32) and, for noaux_tc, e_score_correction_bias [E] (float32)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.scoring_func, self.topk_method = config.scoring_func, config.topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown scoring_func {self.scoring_func!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unknown topk_method {self.topk_method!r}")
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size), requires_grad=False)
        if self.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)
        else:
            self.e_score_correction_bias = None
        self._parts: tuple[tuple, torch.Tensor] | None = None  # cached_pack's (weight key, router_split(weight))

    use_kernel: bool = True  # False pins the PyTorch ops below (the reference in tests)
    # what the fused ops' routing arguments and their choice read besides the weights
    DECISION_ATTRS = ("use_kernel", "scoring_func", "topk_method", "top_k", "n_group", "topk_group", "norm_topk_prob",
                      "routed_scaling_factor")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D]. Returns topk_ids [T, K] int64, topk_weights [T, K] float32."""
        ids, weights, _ = self.route(x)
        return ids, weights

    def route(self, x: torch.Tensor, *, with_scores: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: [T, D]. Returns topk_ids [T, K] int64, topk_weights [T, K] float32 and, when asked,
        the selection scores [T, E] float32 the top-k was taken on (bias-corrected for noaux_tc),
        -inf for experts outside the token's top groups; else None."""
        if not with_scores and self._kernel_applies(x):  # the logits, then everything after them: two CPU ops
            logits = kernels.router_logits(x, self.weight, self.logits_parts(x))  # [T, E], as moe_ffn computes them
            ids, weights = kernels.route_topk(logits, **self.selection_args())
            return ids, weights, None
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # [T, E]
        if self.scoring_func == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = logits.sigmoid()
        if self.topk_method == "noaux_tc":
            selection = self._selection_noaux_tc(scores)
            ids = torch.topk(selection, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        else:
            selection = scores
            if self.topk_method == "group_limited_greedy" and self.topk_group < self.n_group:
                group_max = scores.view(-1, self.n_group, self.num_experts // self.n_group).amax(dim=-1)
                scores = mask_to_top_groups(scores, group_max, self.topk_group, 0.0)
                selection = mask_to_top_groups(selection, group_max, self.topk_group, float("-inf"))
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob:
            # transformers adds 1e-20 only on the sigmoid (noaux_tc) path
            eps = 1e-20 if self.topk_method == "noaux_tc" else 0.0
            weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        return ids.to(torch.int64), (weights * self.routed_scaling_factor).float(), selection if with_scores else None

    def logits_parts(self, x: torch.Tensor) -> torch.Tensor | None:
        """``kernels.router_split(weight)`` [S, ceil(E / 16), D / 2, 16, 2] bf16 (S = 1 to 3) when
        ``kernels.router_logits`` reads it for rows like x [T, D] (bf16 rows on AMX), made once and
        kept until the weight changes; else None."""
        weight = self._parameters["weight"]
        if not kernels.router_split_applies(x.dtype, weight.shape[1]):
            return None
        return cached_pack(self, "_parts", (weight,), lambda w: kernels.router_split(w.detach()))

    def selection_args(self) -> dict[str, Any]:
        """This router's selection as ``kernels.route_topk`` (and ``kernels.moe_ffn``) take it: the
        correction bias (float32 [E] or None) and the method's arguments."""
        bias = self.e_score_correction_bias
        return dict(bias=bias.float() if bias is not None else None, sigmoid=self.scoring_func == "sigmoid",
                    method=_METHODS[self.topk_method], n_group=self.n_group or 1,
                    topk_group=self.topk_group or 1, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                    scaling=float(self.routed_scaling_factor))

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        """The CPU ops (``moe_kernels.router_logits`` and ``route_topk``) for rows x [T, D]: CPU, x
        float32 or bfloat16, an fp32 weight, no autograd, the kernel built. The ids come highest
        score first (ties: lower id); torch.topk's unsorted order may differ."""
        return (self.use_kernel and self.weight.dtype == torch.float32 and kernels.cpu_op_applies(x)
                and kernels.cpu_op_applies(self.weight))

    def _selection_noaux_tc(self, scores: torch.Tensor) -> torch.Tensor:
        """scores: [T, E] sigmoid. Returns the bias-corrected scores [T, E] with experts outside
        the top groups at -inf (the top-k is taken on these)."""
        biased = scores + self.e_score_correction_bias.float()
        if self.topk_group >= self.n_group:  # every group kept: the mask changes nothing (8 ops fewer)
            return biased
        per_group = biased.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        return mask_to_top_groups(biased, group_scores, self.topk_group, float("-inf"))
