"""Weight-migration transport: apply a balancer ``MovePlan`` to one rank's experts.

Every EP rank calls ``apply_move_plan`` with the same plan between two steps (decide once
on the driver, broadcast, execute everywhere). Per layer, a rank first snapshots the old
slots it must send or copy locally, then posts all its ``isend``/``irecv`` (ordered by the
plan, so every pair of ranks agrees), waits, and writes the received experts into their new
slots. ``method="reload"`` instead re-reads the new experts from the checkpoint, which yields
identical bytes and needs no peer.

Shape legend: P_local slots on this rank, I expert intermediate, D hidden.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from balancer.move_plan import MovePlan, Transfer
from moe.experts import Experts


@dataclass(frozen=True)
class MigrationResult:
    """What one rank did: copies received over the network, local copies, bytes received."""

    num_received: int
    num_sent: int
    num_local_copies: int
    bytes_received: int


def _pack(experts: Experts, local_slot: int) -> torch.Tensor:
    """One slot's weights flattened: [2I*D + D*I] in the experts' dtype."""
    return torch.cat([experts.w13[local_slot].reshape(-1), experts.w2[local_slot].reshape(-1)]).clone()


def _unpack_into(experts: Experts, local_slot: int, flat: torch.Tensor) -> None:
    n13 = experts.w13[local_slot].numel()
    experts.w13[local_slot].copy_(flat[:n13].view_as(experts.w13[local_slot]))
    experts.w2[local_slot].copy_(flat[n13:].view_as(experts.w2[local_slot]))


def _local_index(slot: int, slots_per_rank: int) -> int:
    return slot % slots_per_rank


def apply_move_plan(
    plan: MovePlan,
    experts_per_layer: Sequence[Experts],
    new_phy2log: torch.Tensor,
    ep_rank: int,
    ep_group: dist.ProcessGroup | None,
    *,
    method: str = "p2p",
    checkpoint: str | Path | None = None,
    module_names: Sequence[str] = (),
) -> MigrationResult:
    """Move expert weights so this rank's slots hold ``new_phy2log``'s experts.

    plan: from ``balancer.compute_move_plan(old, new, ...)``, identical on every rank.
    experts_per_layer: this rank's ``Experts`` of each MoE layer (plan layer i = entry i).
    new_phy2log: [L, P] int64. ep_group: the EP process group (None only with one rank or
    ``method="reload"``). Updates each module's ``slot_to_logical``. Every EP rank must call
    this with the same plan: the p2p path is a set of matched collectives.
    """
    if method not in ("p2p", "reload"):
        raise ValueError(f"migration method must be 'p2p' or 'reload', got {method!r}")
    if method == "reload" and checkpoint is None:
        raise ValueError("migration method 'reload' needs the checkpoint path")
    num_layers, num_slots = new_phy2log.shape
    if len(experts_per_layer) != num_layers:
        raise ValueError(f"plan covers {num_layers} MoE layers, this rank has {len(experts_per_layer)}")
    per_rank = num_slots // plan.num_gpus
    received = sent = local = nbytes = 0
    for layer in plan.layers():
        experts = experts_per_layer[layer]
        mine = new_phy2log[layer, ep_rank * per_rank : (ep_rank + 1) * per_rank]
        recvs = plan.recvs(ep_rank, layer)
        copies = plan.local(ep_rank, layer)
        if method == "reload":
            changed = sorted({_local_index(t.dst_slot, per_rank) for t in (*recvs, *copies)})
            experts.slot_to_logical.copy_(mine)
            if changed:
                _reload(checkpoint, experts, module_names[layer], changed)
            received += len(recvs)
            local += len(copies)
            continue
        r, s, c, b = _migrate_layer_p2p(plan, layer, experts, ep_rank, ep_group, per_rank)
        received, sent, local, nbytes = received + r, sent + s, local + c, nbytes + b
        experts.slot_to_logical.copy_(mine)
    return MigrationResult(received, sent, local, nbytes)


def _migrate_layer_p2p(
    plan: MovePlan, layer: int, experts: Experts, ep_rank: int, group: dist.ProcessGroup | None, per_rank: int
) -> tuple[int, int, int, int]:
    sends: list[Transfer] = plan.sends(ep_rank, layer)
    recvs: list[Transfer] = plan.recvs(ep_rank, layer)
    copies: list[Transfer] = plan.local(ep_rank, layer)
    # Snapshot every source before any slot is overwritten: a slot may be both a source and a target.
    send_bufs = [_pack(experts, _local_index(t.src_slot, per_rank)) for t in sends]
    copy_bufs = [_pack(experts, _local_index(t.src_slot, per_rank)) for t in copies]
    numel = experts.w13[0].numel() + experts.w2[0].numel() if experts.num_local_slots else 0
    recv_bufs = [torch.empty(numel, dtype=experts.w13.dtype, device=experts.w13.device) for _ in recvs]
    if sends or recvs:
        if group is None:
            raise ValueError("cross-rank transfers need the EP process group")
        ops = [dist.P2POp(dist.isend, buf, dist.get_global_rank(group, t.dst_rank), group) for t, buf in
               zip(sends, send_bufs)]
        ops += [dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, t.src_rank), group) for t, buf in
                zip(recvs, recv_bufs)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for t, buf in zip(recvs, recv_bufs):
        _unpack_into(experts, _local_index(t.dst_slot, per_rank), buf)
    for t, buf in zip(copies, copy_bufs):
        _unpack_into(experts, _local_index(t.dst_slot, per_rank), buf)
    nbytes = sum(b.numel() * b.element_size() for b in recv_bufs)
    return len(recvs), len(sends), len(copies), nbytes


def _reload(checkpoint: str | Path | None, experts: Experts, module_name: str, slots: list[int]) -> None:
    from moe.loader import load_experts

    load_experts(checkpoint, experts, module_name, slots)
