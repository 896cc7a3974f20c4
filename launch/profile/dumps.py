"""Expert counts read from one dump file (``Dump``), a recording of several (``Recording``),
and the checks every reader applies. Shape legend: S steps, L layers, E experts, P slots."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Dump", "DumpError", "EmptyDumpError", "Recording", "check_counts", "check_dropped", "check_logical",
           "check_placement", "model_metadata", "physical_to_logical"]

# Metadata keys of our safetensors dump that carry what the report needs from the model.
META_N_GROUP = "n_group"
META_MOE_LAYERS = "moe_layer_ids"


class DumpError(ValueError):
    """A dump that cannot be read as expert counts; the message names the file."""


class EmptyDumpError(DumpError):
    """A readable dump that holds no recorded steps (or only steps without tokens)."""


def model_metadata(model_config: Any) -> dict[str, str]:
    """The dump metadata the report reads back (``n_group``, ``moe_layer_ids`` as JSON) from a
    ``moe.config.ModelConfig``, so a report from the dump draws what ``profile run`` drew."""
    return {META_N_GROUP: str(int(model_config.n_group or 1)),
            META_MOE_LAYERS: json.dumps([int(x) for x in model_config.moe_layer_ids])}


@dataclass(frozen=True)
class Dump:
    """One file's counts.

    logical_count: [S, L, E] float64 (integral for every format but float .npy/.csv input);
    physical_count: [S, L, P] float64 exact per-slot counts, or None;
    phy2log: [L, P] int64 placement in force (the last one when it changed), or None;
    num_ranks: EP size of that placement when the dump records it; dropped: [S, L] or None;
    phases: (name, first step, end step) of workload phases, steps relative to this dump;
    ranks: SGLang ranks whose records a per_pass dump holds; rank_slot_load: {rank: [P]} each
    of those ranks' records summed over passes and layers (which slots it counted); n_group:
    the model's expert groups and model_layers: the model layer id of each of the L MoE
    layers, when the dump records them (ours, metadata ``n_group`` / ``moe_layer_ids``).
    """

    path: str
    format: str
    logical_count: np.ndarray
    physical_count: np.ndarray | None = None
    phy2log: np.ndarray | None = None
    num_ranks: int | None = None
    dropped: np.ndarray | None = None
    phases: tuple[tuple[str, int, int], ...] = ()
    ranks: frozenset[int] = field(default_factory=frozenset)
    pass_ids: np.ndarray | None = None
    rank_slot_load: dict[int, np.ndarray] = field(default_factory=dict)
    n_group: int | None = None
    model_layers: tuple[int, ...] | None = None

    @property
    def num_steps(self) -> int:
        return int(self.logical_count.shape[0])


@dataclass(frozen=True)
class Recording:
    """Dumps concatenated in time (same L and E). ``logical_count`` [S, L, E] float64;
    ``skipped``: (path, reason) of the given dumps left out because they hold no steps."""

    dumps: tuple[Dump, ...]
    logical_count: np.ndarray
    dropped: np.ndarray | None
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def num_steps(self) -> int:
        return int(self.logical_count.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.logical_count.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.logical_count.shape[2])

    @property
    def offsets(self) -> list[int]:
        """First step of each dump in the concatenated recording."""
        return [int(x) for x in np.cumsum([0] + [d.num_steps for d in self.dumps])[:-1]]

    @property
    def num_groups(self) -> int | None:
        """The model's expert groups when the dumps record it (and agree), it is above 1 and
        divides E (what the hierarchical what-if uses); else None."""
        said = {d.n_group for d in self.dumps if d.n_group is not None}
        groups = said.pop() if len(said) == 1 else None
        return groups if groups and groups > 1 and self.num_experts % groups == 0 else None

    @property
    def model_layers(self) -> list[int] | None:
        """Model layer id of each MoE layer when the dumps record them (and agree); else None."""
        said = {d.model_layers for d in self.dumps if d.model_layers is not None}
        return list(said.pop()) if len(said) == 1 else None

    @property
    def phases(self) -> list[tuple[str, int, int]]:
        """Workload phases with steps in recording coordinates."""
        return [(name, a + off, b + off) for d, off in zip(self.dumps, self.offsets) for name, a, b in d.phases]


# ---- validation ------------------------------------------------------------------------


def as_array(value: Any) -> np.ndarray:
    """A torch tensor (any dtype, bfloat16 included), numpy array or nested list -> numpy."""
    if hasattr(value, "detach"):
        t = value.detach().cpu()
        return (t.double() if t.is_floating_point() else t).numpy()
    return np.asarray(value)


MAX_COUNT = float(2**53)  # float64 counts exactly up to here; the placement's sums need headroom


def check_counts(path: Path, name: str, value: Any, ndim: int | tuple[int, ...]) -> np.ndarray:
    arr = as_array(value)
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if arr.ndim not in dims:
        want = " or ".join({3: "[steps, L, E]", 2: "[L, E]"}.get(d, f"{d}-D") for d in dims)
        raise DumpError(f"{path}: {name} must be {want}, got shape {list(arr.shape)}")
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise DumpError(f"{path}: {name} must hold numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise DumpError(f"{path}: {name} must hold finite non-negative counts")
    if arr.size and arr.max() > MAX_COUNT:  # sums of such values overflow or stop counting
        raise DumpError(f"{path}: {name} holds {arr.max():.3g}, past 2**53 = {MAX_COUNT:.3g}: not a token count")
    return arr


def check_logical(path: Path, value: Any) -> np.ndarray:
    arr = check_counts(path, "logical_count", value, (2, 3))
    if arr.ndim == 2:
        arr = arr[None]
    if arr.shape[0] == 0:
        raise EmptyDumpError(f"{path}: holds no recorded steps (logical_count is {list(arr.shape)})")
    if arr.shape[1] == 0 or arr.shape[2] == 0:
        raise DumpError(f"{path}: logical_count {list(arr.shape)} has no layers or no experts")
    return arr


def check_placement(path: Path, value: Any, num_layers: int, num_experts: int) -> np.ndarray:
    arr = as_array(value)
    if arr.ndim != 2 or arr.shape[0] != num_layers or arr.shape[1] < num_experts:
        raise DumpError(f"{path}: placement (physical to logical map) must be [L={num_layers}, P>={num_experts}], "
                        f"got shape {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise DumpError(f"{path}: placement must hold integer expert ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.min() < 0 or arr.max() >= num_experts:
        raise DumpError(f"{path}: placement holds expert ids outside [0, {num_experts})")
    covered = np.zeros((num_layers, num_experts), dtype=bool)
    covered[np.arange(num_layers)[:, None], arr] = True
    if not covered.all():
        layer, expert = np.argwhere(~covered)[0]
        raise DumpError(f"{path}: placement gives expert {expert} of layer {layer} no slot")
    return arr


def check_dropped(path: Path, value: Any, counts: np.ndarray) -> np.ndarray:
    """dropped_count [steps, L] of a dump whose logical_count is ``counts`` [steps, L, E]: no step drops
    more assignments than its layer routed (DumpError naming the first step and layer that does)."""
    arr = check_counts(path, "dropped_count", value, 2)
    shape = counts.shape[:2]
    if arr.shape != shape:
        raise DumpError(f"{path}: dropped_count must be [steps, L] = {list(shape)}, got {list(arr.shape)}")
    routed = counts.sum(axis=2)
    if (arr > routed).any():
        step, layer = np.argwhere(arr > routed)[0]
        raise DumpError(f"{path}: dropped_count at step {step}, layer {layer} is {arr[step, layer]:g}, more than the "
                        f"{routed[step, layer]:g} assignments logical_count routes there")
    return arr


def physical_to_logical(physical: np.ndarray, phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """physical: [S, L, P] per-slot counts; phy2log: [L, P] -> [S, L, E] per-expert counts."""
    steps, num_layers, _ = physical.shape
    out = np.zeros((steps, num_layers, num_experts), dtype=np.float64)
    for layer in range(num_layers):
        np.add.at(out[:, layer], (slice(None), phy2log[layer]), physical[:, layer])
    return out
