"""Expert dispatchers: how routed tokens reach the rank hosting their slot and come back.

``build_dispatcher(backend, groups, layout)`` picks one of:

- ``"alltoall"``: dropless, deduplicated AllToAll-v (``AllToAllDispatcher``);
- ``"allgather"``: all-gather tokens, compute local slots, reduce-scatter (``AllGatherDispatcher``);
- ``"local"``: one EP rank hosts every slot, no communication.

With tp > 1 the dispatcher is wrapped in ``TensorParallelSplit`` so each TP rank sends
only its 1/tp share of the (identical) tokens. All implement ``moe.dispatch.ExpertDispatcher``.
"""

from __future__ import annotations

from moe.capacity import CapacityConfig
from moe.dispatch import ExpertDispatcher, LocalDispatcher
from parallel.dispatch.allgather import AllGatherDispatcher
from parallel.dispatch.alltoall import AllToAllDispatcher
from parallel.dispatch.local import CappedLocalDispatcher
from parallel.dispatch.tp_split import TensorParallelSplit
from parallel.groups import ProcessGroups
from parallel.layout import Layout

BACKENDS = ("alltoall", "allgather", "local")

__all__ = [
    "BACKENDS",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "CappedLocalDispatcher",
    "TensorParallelSplit",
    "build_dispatcher",
]


def build_dispatcher(
    backend: str,
    groups: ProcessGroups | None,
    layout: Layout,
    *,
    global_capacity: CapacityConfig | None = None,
) -> ExpertDispatcher:
    """The dispatcher for this rank. ``groups`` may be None only for ``"local"`` with tp = 1.

    ``global_capacity``: cap each slot's total over the EP group (scope "global"); leave it
    None when the MoE layer enforces capacity per source rank (scope "local") or dropless.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown dispatcher backend {backend!r}; expected one of {BACKENDS}")
    if backend == "local" and layout.ep_size != 1:
        raise ValueError(f"backend 'local' needs ep=1 (every rank hosts every slot), got ep={layout.ep_size}")
    if groups is None and (backend != "local" or layout.tp > 1):
        raise ValueError(f"backend {backend!r} with tp={layout.tp} needs ProcessGroups")
    capped = global_capacity if global_capacity is not None and global_capacity.enabled else None
    inner: ExpertDispatcher
    if backend == "local" and capped is not None and layout.tp > 1:
        # capacity over the whole batch every TP rank holds, then the rows are shared out
        assert groups is not None
        split = TensorParallelSplit(LocalDispatcher(), groups.tp, groups.coords.tp_rank, layout.tp, groups.tp_shm)
        return CappedLocalDispatcher(capped, inner=split, report_stats=groups.coords.tp_rank == 0)
    if backend == "local":
        inner = CappedLocalDispatcher(capped) if capped is not None else LocalDispatcher()
    else:
        assert groups is not None
        if backend == "alltoall":
            inner = AllToAllDispatcher(groups.ep, groups.coords.ep_rank, layout.ep_size, global_capacity=capped,
                                       shm=groups.ep_shm)
        else:
            inner = AllGatherDispatcher(groups.ep, groups.coords.ep_rank, layout.ep_size, global_capacity=capped,
                                        shm=groups.ep_shm)
    if layout.tp > 1:
        assert groups is not None
        return TensorParallelSplit(inner, groups.tp, groups.coords.tp_rank, layout.tp, groups.tp_shm)
    return inner
