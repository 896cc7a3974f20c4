"""The move plan between two placements (pure; every rank derives the same one).

For each layer and each new slot whose expert differs from the old one in that slot,
the source is, in order of preference: a slot on the destination rank that already
held the expert (a local copy, no transfer), a slot on the same node, any other slot.
Among equally near sources the one with the fewest sends so far is taken (then the
lowest slot id), which spreads sends across replicas. Transfers are listed by
(layer, destination slot), so the k-th send of rank a to rank b in a layer matches the
k-th receive of b from a: isend/irecv pairs line up without negotiation.

Local copies read the *old* contents of their source slot: apply them from a copy of
the old weights (or before any receive overwrites a source).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from balancer.balancedness import as_numpy


@dataclass(frozen=True)
class Transfer:
    """Expert `expert` of `layer` goes from old slot src_slot on src_rank to new slot
    dst_slot on dst_rank (src_rank == dst_rank: a local copy)."""

    layer: int
    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


@dataclass(frozen=True)
class MovePlan:
    """transfers: cross-rank moves; local_copies: same-rank copies; both sorted by
    (layer, dst_slot). num_copies_moved counts transfers; total_bytes their bytes."""

    transfers: tuple[Transfer, ...]
    local_copies: tuple[Transfer, ...]
    num_gpus: int
    gpus_per_node: int
    expert_bytes: int
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # (kind, rank, layer) -> transfers in plan order; layer None: all layers.
        index: dict[tuple[str, int, int | None], list[Transfer]] = {}
        for kind, items, rank_of in (("send", self.transfers, lambda t: t.src_rank),
                                     ("recv", self.transfers, lambda t: t.dst_rank),
                                     ("local", self.local_copies, lambda t: t.dst_rank)):
            for t in items:
                index.setdefault((kind, rank_of(t), t.layer), []).append(t)
                index.setdefault((kind, rank_of(t), None), []).append(t)
        object.__setattr__(self, "_index", index)

    @property
    def num_copies_moved(self) -> int:
        return len(self.transfers)

    @property
    def total_bytes(self) -> int:
        return len(self.transfers) * self.expert_bytes

    @property
    def cross_node_bytes(self) -> int:
        g = self.gpus_per_node
        return sum(self.expert_bytes for t in self.transfers if t.src_rank // g != t.dst_rank // g)

    @property
    def is_empty(self) -> bool:
        return not self.transfers and not self.local_copies

    def sends(self, rank: int, layer: int | None = None) -> list[Transfer]:
        """Transfers `rank` sends (in plan order), optionally of one layer."""
        return list(self._index.get(("send", rank, layer), ()))

    def recvs(self, rank: int, layer: int | None = None) -> list[Transfer]:
        """Transfers `rank` receives (in plan order), optionally of one layer."""
        return list(self._index.get(("recv", rank, layer), ()))

    def local(self, rank: int, layer: int | None = None) -> list[Transfer]:
        """Same-rank copies onto `rank` (in plan order), optionally of one layer."""
        return list(self._index.get(("local", rank, layer), ()))

    def layers(self) -> list[int]:
        """Layers with any change, ascending."""
        return sorted({t.layer for t in self.transfers} | {t.layer for t in self.local_copies})

    def summary(self) -> dict[str, int]:
        return {"num_copies_moved": self.num_copies_moved, "num_local_copies": len(self.local_copies),
                "total_bytes": self.total_bytes, "cross_node_bytes": self.cross_node_bytes}


def compute_move_plan(
    old_phy2log: torch.Tensor | np.ndarray,
    new_phy2log: torch.Tensor | np.ndarray,
    num_gpus: int,
    gpus_per_node: int,
    expert_bytes: int,
) -> MovePlan:
    """old_phy2log, new_phy2log: [L, P] int; P % num_gpus == 0; num_gpus % gpus_per_node == 0;
    expert_bytes: bytes of one expert's weights in one layer. Every expert of the new
    placement must have a copy in the old one."""
    old = as_numpy(old_phy2log, "old_phy2log", 2).astype(np.int64)
    new = as_numpy(new_phy2log, "new_phy2log", 2).astype(np.int64)
    if old.shape != new.shape:
        raise ValueError(f"old_phy2log {old.shape} and new_phy2log {new.shape} differ in shape")
    num_layers, num_slots = old.shape
    if num_gpus <= 0 or num_slots % num_gpus:
        raise ValueError(f"{num_slots} slots cannot be split evenly over num_gpus={num_gpus}")
    if gpus_per_node <= 0 or num_gpus % gpus_per_node:
        raise ValueError(f"num_gpus={num_gpus} is not a multiple of gpus_per_node={gpus_per_node}")
    if expert_bytes < 0:
        raise ValueError(f"expert_bytes={expert_bytes} must be >= 0")
    per_gpu = num_slots // num_gpus
    transfers: list[Transfer] = []
    local: list[Transfer] = []
    for layer in range(num_layers):
        _plan_layer(layer, old[layer], new[layer], per_gpu, gpus_per_node, transfers, local)
    return MovePlan(tuple(transfers), tuple(local), num_gpus, gpus_per_node, int(expert_bytes))


def _plan_layer(layer, old, new, per_gpu, gpus_per_node, transfers, local) -> None:
    changed = np.nonzero(old != new)[0]
    if changed.size == 0:
        return
    sources: dict[int, list[int]] = {}
    for slot, expert in enumerate(old.tolist()):
        sources.setdefault(expert, []).append(slot)
    sent: dict[int, int] = {}
    for dst in changed.tolist():
        expert = int(new[dst])
        slots = sources.get(expert)
        if not slots:
            raise ValueError(f"layer {layer}: expert {expert} has no copy in the old placement")
        dst_rank = dst // per_gpu
        same_rank = [s for s in slots if s // per_gpu == dst_rank]
        if same_rank:
            src = same_rank[0]
            local.append(Transfer(layer, expert, dst_rank, src, dst_rank, dst))
            continue
        dst_node = dst_rank // gpus_per_node
        src = min(slots, key=lambda s: (s // per_gpu // gpus_per_node != dst_node, sent.get(s, 0), s))
        sent[src] = sent.get(src, 0) + 1
        transfers.append(Transfer(layer, expert, src // per_gpu, src, dst_rank, dst))
