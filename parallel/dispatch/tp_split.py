"""Split the MoE hop across a TP group so no expert work is duplicated.

After tensor-parallel attention every rank of a TP group holds the same T tokens. Each
TP rank dispatches only its share (``split_sizes(T, tp)``, torch.tensor_split order)
through the inner dispatcher, and the TP group all-gathers the combined rows back into
the full [T, D]. The all-gather pads every share to ceil(T / tp) rows because the
collective needs equal sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.dispatch import ExpertDispatcher
from moe.experts import Experts
from parallel.dispatch.plan import split_sizes
from parallel.shm_allreduce import ShmAllReduce


class TensorParallelSplit:
    """Wraps an ExpertDispatcher; ``rank``/``num_ranks`` are the inner (EP) ones."""

    def __init__(self, inner: ExpertDispatcher, tp_group: dist.ProcessGroup, tp_rank: int, tp_size: int,
                 shm: ShmAllReduce | None = None) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"TP rank {tp_rank} outside TP size {tp_size}")
        self.inner = inner
        self.tp_group = tp_group
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.shm = shm  # small gathers through shared memory (the TP group's, one host)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def num_ranks(self) -> int:
        return self.inner.num_ranks

    @property
    def capacity_stats(self) -> dict:
        return getattr(self.inner, "capacity_stats", {})

    def dispatch_combine(
        self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: Experts, layer_id: int
    ) -> torch.Tensor:
        """x: [T, D] identical on every TP rank; slot_ids/weights: [T, K]. Returns [T, D] float32."""
        sizes = split_sizes(x.shape[0], self.tp_size)
        lo = sum(sizes[: self.tp_rank])
        hi = lo + sizes[self.tp_rank]
        part = self.inner.dispatch_combine(x[lo:hi], slot_ids[lo:hi], weights[lo:hi], experts, layer_id)
        chunk = max(sizes)
        send = torch.zeros((chunk, x.shape[1]), dtype=torch.float32, device=x.device)
        send[: part.shape[0]] = part
        if chunk and self.shm is not None and self.shm.applies(send):  # the same answer on every TP rank
            gathered = self.shm.all_gather(send).view(self.tp_size * chunk, x.shape[1])
        else:
            gathered = torch.empty((self.tp_size * chunk, x.shape[1]), dtype=torch.float32, device=x.device)
            if chunk:  # T is the same on every TP rank, so they all skip together
                dist.all_gather_single(gathered, send, group=self.tp_group)
        return torch.cat([gathered[i * chunk : i * chunk + n] for i, n in enumerate(sizes)])
