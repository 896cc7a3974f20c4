"""Routing statistics: tokens per physical slot per MoE layer per step, kept in a
ring buffer of `window_size` steps (vLLM's `expert_load_window`).

Each EP rank records the tokens *it* routed to every slot; the runtime sums those
over ranks: `allreduce_tensor()` gives the [L, P] int64 window sum to all-reduce
(SUM), `set_global(reduced)` hands the result back. Every rank must enter that
all-reduce on the same steps, or the collective hangs; the balancer itself runs no
collective.

Memory: window_size * L * P * 8 bytes (DeepSeek-V3, 58 x 288, 1000 steps: 134 MB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from balancer.balancedness import compute_balancedness, rank_load_of_slots


class RoutingStats:
    """Ring buffer of per-step slot loads. record() costs one copy and two in-place
    adds of an [L, P] tensor; window_load() is O(L * P) via a running sum."""

    def __init__(self, num_layers: int, num_slots: int, num_ranks: int, window_size: int) -> None:
        if min(num_layers, num_slots, num_ranks) <= 0 or window_size <= 0:
            raise ValueError(f"num_layers={num_layers}, num_slots={num_slots}, num_ranks={num_ranks}, "
                             f"window_size={window_size} must all be positive")
        if num_slots % num_ranks:
            raise ValueError(f"{num_slots} slots cannot be split evenly over {num_ranks} ranks")
        self.num_layers, self.num_slots, self.num_ranks = num_layers, num_slots, num_ranks
        self.window_size = window_size
        self._buffer = torch.zeros(window_size, num_layers, num_slots, dtype=torch.int64)
        self._sum = torch.zeros(num_layers, num_slots, dtype=torch.int64)
        self._global: torch.Tensor | None = None
        self._pos = 0
        self.num_steps = 0
        self.version = 0  # counts every change of the window (record, reset, set_global)

    @property
    def num_recorded(self) -> int:
        """Steps currently in the window (<= window_size)."""
        return min(self.num_steps, self.window_size)

    @property
    def is_full(self) -> bool:
        return self.num_steps >= self.window_size

    def record(self, slot_load: torch.Tensor | np.ndarray) -> None:
        """slot_load: [L, P] integer tokens routed to each slot this step (this rank; torch or numpy)."""
        slot_load = torch.as_tensor(slot_load)
        if slot_load.shape != self._sum.shape:
            raise ValueError(f"slot_load has shape {tuple(slot_load.shape)}, expected {tuple(self._sum.shape)}")
        row = self._buffer[self._pos]
        self._sum -= row
        row.copy_(slot_load)
        self._sum += row
        self._pos = (self._pos + 1) % self.window_size
        self.num_steps += 1
        self.version += 1
        self._global = None

    def record_many(self, slot_loads: torch.Tensor | np.ndarray) -> None:
        """slot_loads: [K, L, P] integer loads of K consecutive steps, oldest first (torch or numpy):
        the same window as K calls of ``record``, in a few ops (a driver that applies its steps in batches)."""
        slot_loads = torch.as_tensor(slot_loads)
        if slot_loads.dim() != 3 or slot_loads.shape[1:] != self._sum.shape:
            raise ValueError(f"slot_loads has shape {tuple(slot_loads.shape)}, expected [K, "
                             f"{', '.join(str(d) for d in self._sum.shape)}]")
        steps = slot_loads.shape[0]
        if steps == 0:
            return
        kept = slot_loads[-self.window_size:].to(torch.int64)  # older steps leave the window anyway
        skipped = steps - kept.shape[0]
        rows = (self._pos + skipped + torch.arange(kept.shape[0])) % self.window_size
        self._sum -= self._buffer[rows].sum(0)
        self._buffer[rows] = kept
        self._sum += kept.sum(0)
        self._pos = (self._pos + steps) % self.window_size
        self.num_steps += steps
        self.version += 1
        self._global = None

    def reset(self) -> None:
        """Forget the window (after a rebalance the old slots mean other experts)."""
        self._buffer.zero_()
        self._sum.zero_()
        self._pos, self.num_steps, self._global = 0, 0, None
        self.version += 1

    def local_window(self) -> torch.Tensor:
        """[L, P] int64 tokens per slot over the window, this rank's share."""
        return self._sum.clone()

    def allreduce_tensor(self) -> torch.Tensor:
        """[L, P] int64 contiguous tensor for the caller to all-reduce (SUM) over EP ranks."""
        return self._sum.clone().contiguous()

    def set_global(self, reduced: torch.Tensor | np.ndarray) -> None:
        """Accept the all-reduced window; valid until the next record()."""
        reduced = torch.as_tensor(reduced)
        if reduced.shape != self._sum.shape:
            raise ValueError(f"reduced window has shape {tuple(reduced.shape)}, expected {tuple(self._sum.shape)}")
        self._global = reduced.detach().to("cpu", torch.int64).clone()
        self.version += 1

    def window_load(self) -> torch.Tensor:
        """[L, P] int64: the all-reduced window if set since the last record, else local."""
        return self._global.clone() if self._global is not None else self._sum.clone()

    def logical_load(self, phy2log: torch.Tensor | np.ndarray) -> torch.Tensor:
        """[L, E] int64 tokens per logical expert over the window; phy2log: [L, P] (torch or numpy)."""
        phy2log = torch.as_tensor(phy2log)
        if phy2log.shape != self._sum.shape:
            raise ValueError(f"phy2log has shape {tuple(phy2log.shape)}, expected {tuple(self._sum.shape)}")
        num_experts = int(phy2log.max()) + 1
        out = torch.zeros(self.num_layers, num_experts, dtype=torch.int64)
        return out.scatter_add_(1, phy2log.to(torch.int64), self.window_load())

    def balancedness(self) -> tuple[torch.Tensor, float]:
        """(per_layer [L] float64, overall float) of the rank loads in the window."""
        return compute_balancedness(rank_load_of_slots(self.window_load(), self.num_ranks))

    def diagnostics(self, phy2log: torch.Tensor | np.ndarray, top_k: int = 5) -> Diagnostics:
        """The hottest experts and the worst layers of the window."""
        per_layer, overall = self.balancedness()
        load = self.logical_load(phy2log).to(torch.float64)
        total = load.sum(1, keepdim=True).clamp_min(1.0)
        share = load / total  # [L, E] fraction of the layer's tokens
        ranks = torch.from_numpy(rank_load_of_slots(self.window_load(), self.num_ranks))
        worst = torch.argsort(per_layer, stable=True)[:top_k]
        flat = torch.argsort(share.flatten(), descending=True, stable=True)[:top_k]
        num_experts = share.shape[1]
        hottest = [HotExpert(int(i) // num_experts, int(i) % num_experts, float(share.flatten()[i]),
                             int(load.flatten()[i])) for i in flat]
        layers = [LayerReport(int(i), float(per_layer[i]), float(ranks[i].mean()), float(ranks[i].max()))
                  for i in worst]
        return Diagnostics(self.num_recorded, overall, layers, hottest)


@dataclass(frozen=True)
class HotExpert:
    layer: int
    expert: int
    share: float  # fraction of the layer's tokens
    tokens: int


@dataclass(frozen=True)
class LayerReport:
    layer: int
    balancedness: float
    avg_tokens: float  # per rank
    max_tokens: float  # busiest rank


@dataclass(frozen=True)
class Diagnostics:
    """Window report: `to_dict()` for machines, `to_text()` for people."""

    num_steps: int
    balancedness: float
    worst_layers: list[LayerReport] = field(default_factory=list)
    hottest_experts: list[HotExpert] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"num_steps": self.num_steps, "balancedness": self.balancedness,
                "worst_layers": [vars(x) for x in self.worst_layers],
                "hottest_experts": [vars(x) for x in self.hottest_experts]}

    def to_text(self) -> str:
        lines = [f"balancedness {self.balancedness:.4f} over {self.num_steps} steps", "worst layers:"]
        lines += [f"  layer {x.layer:3d}  balancedness {x.balancedness:.4f}  avg_tokens {x.avg_tokens:.1f}  "
                  f"max_tokens {x.max_tokens:.1f}" for x in self.worst_layers]
        lines.append("hottest experts:")
        lines += [f"  layer {x.layer:3d}  expert {x.expert:4d}  {100 * x.share:5.1f}% of tokens  ({x.tokens})"
                  for x in self.hottest_experts]
        return "\n".join(lines)
