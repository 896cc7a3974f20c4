"""How a trained model routes each shipped workload, and how well it predicts it.

For every kind of ``launch.workloads`` (held-out prompts, not training text) the model runs
each prompt once; per MoE layer the expert counts give

- ``balancedness``: mean rank load / max rank load with the experts split contiguously over
  ``ep`` ranks and no EPLB (1.0 is perfect), the figure the balancer starts from;
- ``expert_balancedness``: the same with one expert per rank (mean / max expert load);
- ``hot_experts``: the three most loaded experts, most loaded first, and their share;
- ``loss``: next-token cross-entropy (nats/token) of the prompts.

``shift`` is, per layer, the share of routed tokens that would have to move to turn one
kind's expert-load distribution into another's (total variation distance), for each pair.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from launch.tokenizer import Tokenizer
from launch.training.model import TrainableMoE
from launch.workloads import WORKLOAD_NAMES, load_workload

DEFAULT_EP = 4


def compute_balancedness(counts: torch.Tensor, ep: int) -> list[float]:
    """counts: [L, E] expert loads, E divisible by ep. Returns per layer mean / max of the
    ``ep`` contiguous rank loads (1.0 when a layer saw no tokens)."""
    rank = counts.float().view(counts.shape[0], ep, -1).sum(-1)  # [L, ep]
    peak = rank.amax(-1)
    return [1.0 if float(m) == 0 else float(a / m) for a, m in zip(rank.mean(-1), peak)]


@torch.no_grad()
def workload_load(model: TrainableMoE, tok: Tokenizer, prompts: list[str]) -> tuple[torch.Tensor, float]:
    """Returns expert counts [L_moe, E] int64 summed over the prompts, and their mean loss."""
    total = torch.zeros(len(model.moe_layers()), model.config.num_experts, dtype=torch.int64)
    nll, n = 0.0, 0
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        logits = model(ids)
        total += model.last_expert_counts
        if ids.shape[1] > 1:
            nll += float(F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
            n += ids.shape[1] - 1
    return total, nll / max(n, 1)


def routing_report(model: TrainableMoE, tok: Tokenizer, ep: int = DEFAULT_EP, max_prompts: int | None = None) -> dict:
    """Per-kind routing and loss of ``model`` on the shipped workloads (see module doc);
    ``max_prompts`` keeps only the first prompts of each."""
    ep = ep if model.config.num_experts % ep == 0 else 1
    kinds, loads = {}, {}
    was_training = model.training
    model.eval()
    for name in WORKLOAD_NAMES:
        counts, loss = workload_load(model, tok, load_workload(name)[:max_prompts])
        loads[name] = counts
        share = counts.float() / counts.sum(-1, keepdim=True).clamp(min=1)
        top = share.topk(3, dim=-1)
        kinds[name] = {
            "loss": round(loss, 4),
            "ep": ep,
            "balancedness": [round(b, 4) for b in compute_balancedness(counts, ep)],
            "expert_balancedness": [round(b, 4) for b in compute_balancedness(counts, counts.shape[1])],
            "hot_experts": top.indices.tolist(),
            "hot_share": [[round(float(s), 4) for s in row] for row in top.values],
        }
    model.train(was_training)
    shift = {}
    names = list(WORKLOAD_NAMES)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa = loads[a].float() / loads[a].sum(-1, keepdim=True).clamp(min=1)
            pb = loads[b].float() / loads[b].sum(-1, keepdim=True).clamp(min=1)
            shift[f"{a}->{b}"] = [round(float(x), 4) for x in 0.5 * (pa - pb).abs().sum(-1)]
    return {"uniform_loss": round(math.log(model.config.vocab_size), 4), "kinds": kinds, "shift": shift}
