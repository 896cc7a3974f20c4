"""Which rank does what: tensor-, data- and expert-parallel coordinates of a world.

Pure: no torch.distributed, no processes. Everything here is arithmetic on ints and
placement tensors, so it is tested in milliseconds.

Conventions (vLLM / SGLang DP-attention):

- world = tp * dp ranks; ranks are node-major (the ranks of node n are
  ``[n * ranks_per_node, (n + 1) * ranks_per_node)``) and TP is innermost, so a TP
  group is ``tp`` consecutive ranks and stays inside a node whenever
  ``ranks_per_node % tp == 0``.
- attention is data-parallel across DP ranks (each DP rank attends only its own
  sequences) and tensor-parallel inside a TP group (heads and dense MLPs sharded;
  tokens are identical on the ranks of a TP group after attention).
- expert parallelism: ``ep`` defaults to ``tp * dp`` (one EP group spanning every rank).
  Any ``ep`` dividing the world is accepted: EP groups are ``ep`` consecutive ranks,
  and each EP group hosts every physical slot once (``P / ep`` slots per rank), so
  ``ep < world`` replicates the experts across EP groups.
- physical slot ``p`` lives on EP rank ``p // (P // ep)``, at local index ``p % (P // ep)``.

Shape legend: L MoE layers, P physical slots per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankCoords:
    """Coordinates of one global rank under a ``Layout``."""

    rank: int
    node: int
    local_rank: int  # index inside its node
    tp_rank: int
    dp_rank: int
    ep_rank: int
    ep_group: int  # which EP group (0 when ep == world)


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel dimensions.

    tp: tensor-parallel size (attention heads, dense MLPs); dp: data-parallel
    attention size; ep: expert-parallel size (None = tp * dp); num_nodes: machines,
    each holding ``world_size / num_nodes`` consecutive ranks.
    """

    tp: int = 1
    dp: int = 1
    ep: int | None = None
    num_nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "num_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name} must be a positive int, got {value!r}")
        if self.ep is not None and (not isinstance(self.ep, int) or self.ep < 1):
            raise ValueError(f"Layout.ep must be a positive int or None, got {self.ep!r}")
        world = self.tp * self.dp
        if world % self.num_nodes:
            raise ValueError(
                f"world size tp*dp = {self.tp}*{self.dp} = {world} is not divisible by num_nodes={self.num_nodes}"
            )
        if world % self.ep_size:
            raise ValueError(f"ep={self.ep_size} does not divide the world size tp*dp = {world}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, ep: int | None = None, num_nodes: int = 1) -> Layout:
        """Layout with dp = world_size / tp; raises if tp does not divide the world."""
        if tp < 1 or world_size < 1 or world_size % tp:
            raise ValueError(f"tp={tp} does not divide world_size={world_size}")
        return cls(tp=tp, dp=world_size // tp, ep=ep, num_nodes=num_nodes)

    # -- sizes -------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def ep_size(self) -> int:
        return self.tp * self.dp if self.ep is None else self.ep

    @property
    def num_ep_groups(self) -> int:
        return self.world_size // self.ep_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes

    @property
    def tp_spans_nodes(self) -> bool:
        """True when some TP group crosses a node boundary (legal, but slow)."""
        return self.ranks_per_node % self.tp != 0 and self.tp > 1

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless this layout covers exactly ``world_size`` ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"layout tp={self.tp} x dp={self.dp} = {self.world_size} ranks does not match "
                f"the world size {world_size}"
            )

    # -- coordinates -------------------------------------------------------------------

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of global ``rank`` (node-major, TP innermost)."""
        self._check_rank(rank)
        return RankCoords(
            rank=rank,
            node=rank // self.ranks_per_node,
            local_rank=rank % self.ranks_per_node,
            tp_rank=rank % self.tp,
            dp_rank=rank // self.tp,
            ep_rank=rank % self.ep_size,
            ep_group=rank // self.ep_size,
        )

    def rank_of(self, *, dp_rank: int, tp_rank: int) -> int:
        """Global rank holding attention coordinates (dp_rank, tp_rank)."""
        if not 0 <= dp_rank < self.dp or not 0 <= tp_rank < self.tp:
            raise ValueError(f"(dp_rank={dp_rank}, tp_rank={tp_rank}) outside dp={self.dp}, tp={self.tp}")
        return dp_rank * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        """All TP groups, each ``tp`` consecutive ranks, in ascending order."""
        return [list(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """All DP groups (ranks sharing a tp_rank), ordered by tp_rank."""
        return [list(range(t, self.world_size, self.tp)) for t in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        """All EP groups, each ``ep`` consecutive ranks, in ascending order."""
        ep = self.ep_size
        return [list(range(g * ep, (g + 1) * ep)) for g in range(self.num_ep_groups)]

    def node_ranks(self, node: int) -> list[int]:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} outside num_nodes={self.num_nodes}")
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    # -- expert slots ------------------------------------------------------------------

    def num_local_slots(self, num_slots: int) -> int:
        """P / ep; raises if the physical slots do not split evenly over the EP ranks."""
        if num_slots < 1 or num_slots % self.ep_size:
            raise ValueError(f"num_slots={num_slots} physical slots are not divisible by ep={self.ep_size}")
        return num_slots // self.ep_size

    def local_slots(self, rank: int, num_slots: int) -> range:
        """Physical slots hosted by global ``rank``: a contiguous range of P / ep slots."""
        per_rank = self.num_local_slots(num_slots)
        ep_rank = self.coords(rank).ep_rank
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    def slot_owner(self, slot: int, num_slots: int) -> int:
        """EP rank (inside any EP group) hosting physical ``slot``."""
        if not 0 <= slot < num_slots:
            raise ValueError(f"slot {slot} outside [0, {num_slots})")
        return slot // self.num_local_slots(num_slots)

    def local_experts(self, phy2log: torch.Tensor, rank: int) -> torch.Tensor:
        """Logical experts held by ``rank``'s slots.

        phy2log: [L, P] int64 placement. Returns: [L, P / ep] int64, row l = the
        logical expert of each local slot in layer l (what the loader must load).
        """
        if phy2log.dim() != 2:
            raise ValueError(f"phy2log must be [L, P], got shape {tuple(phy2log.shape)}")
        slots = self.local_slots(rank, phy2log.shape[1])
        return phy2log[:, slots.start : slots.stop].clone()

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} (tp={self.tp}, dp={self.dp})")

    def describe(self) -> str:
        return (
            f"tp={self.tp} dp={self.dp} ep={self.ep_size} nodes={self.num_nodes} "
            f"(world {self.world_size}, {self.num_ep_groups} EP group(s))"
        )
