"""SGLang's expert-distribution dumps (``torch.save`` files of ``expert_distribution.py``).

- ``stat`` mode: ``{"rank": int, "logical_count": [S, L, E], "average_utilization_rate_over_window":
  float | None}``; trailing all-zero steps (the unfilled part of its ring buffer) are dropped.
- ``per_pass`` mode, one file per rank: ``{"records": [{"forward_pass_id": int, "rank": int,
  "gatherer_key": str, "global_physical_count": [L, P], ...}], "last_physical_to_logical_map":
  [L, P]}``; the records of one pass are summed, passes in id order. A rank's records count
  either every slot (the tokens it routed) or only its own slots (the tokens it received,
  DeepEP): then, and whenever the rank ids skip one, ``missing_ranks_problem`` names the ranks
  whose files were not given.

Loaded with ``torch.load(weights_only=True)``, then checked to hold only tensors, dicts,
lists/tuples, strings and numbers; anything else is refused with a one-line ``DumpError``.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from launch.profile.dumps import (
    Dump,
    DumpError,
    EmptyDumpError,
    as_array,
    check_counts,
    check_logical,
    check_placement,
    physical_to_logical,
)

__all__ = ["merge_rank_files", "missing_ranks_problem", "read_torch_dump"]


def _check_plain(path: Path, obj: Any, where: str = "") -> None:
    import torch

    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, bool | int | float | str):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str | int):
                raise DumpError(f"{path}: dict key {k!r} at {where or 'top level'} is not a string or number")
            _check_plain(path, v, f"{where}.{k}" if where else str(k))
        return
    if isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _check_plain(path, v, f"{where}[{i}]")
        return
    raise DumpError(f"{path}: {where or 'top level'} holds a {type(obj).__name__}, not plain tensors, dicts, "
                    "lists or numbers")


def _torch_load(path: Path) -> Any:
    import pickle

    import torch

    try:
        # torch warns about a plain pickle's protocol before refusing it: the refusal is the one line to show.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        if "Unsupported global" in str(e) or "weights_only" in str(e).lower():
            first = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line), first)
        raise DumpError(f"{path}: refused: holds more than plain tensors, dicts, lists and numbers "
                        f"({first.strip()[:200]})") from None
    except Exception as e:  # any other failure to read it (torch's unpickler raises IndexError, ...)
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise DumpError(f"{path}: not a readable torch.save file ({first.strip()[:200]})") from None
    _check_plain(path, obj)
    return obj


def read_torch_dump(path: Path) -> Dump:
    obj = _torch_load(path)
    if not isinstance(obj, dict):
        raise DumpError(f"{path}: expected SGLang's dict dump, found a {type(obj).__name__}")
    if "logical_count" in obj:
        count = check_logical(path, obj["logical_count"])
        nonzero = np.flatnonzero(count.reshape(count.shape[0], -1).sum(1) > 0)
        if nonzero.size == 0:
            raise EmptyDumpError(f"{path}: every recorded step is empty (no tokens)")
        return Dump(str(path), "sglang-stat", count[: nonzero[-1] + 1])
    if "records" in obj and "last_physical_to_logical_map" in obj:
        return _read_per_pass(path, obj)
    raise DumpError(f"{path}: neither an SGLang stat dump (logical_count) nor a per_pass dump "
                    f"(records + last_physical_to_logical_map); found keys {sorted(map(str, obj))}")


def _read_per_pass(path: Path, obj: dict) -> Dump:
    records = obj["records"]
    if not isinstance(records, list | tuple):
        raise DumpError(f"{path}: per_pass 'records' must be a list, found a {type(records).__name__}")
    if not records:
        raise EmptyDumpError(f"{path}: per_pass dump has no records")
    phy_raw = obj["last_physical_to_logical_map"]
    if getattr(phy_raw, "ndim", None) != 2:
        raise DumpError(f"{path}: last_physical_to_logical_map must be [L, P], got {_shape(phy_raw)}")
    phy_arr = as_array(phy_raw)
    num_layers, num_slots = phy_arr.shape
    if phy_arr.size == 0:
        raise DumpError(f"{path}: last_physical_to_logical_map {list(phy_arr.shape)} has no layers or no slots")
    if not np.issubdtype(phy_arr.dtype, np.integer):
        raise DumpError(f"{path}: placement must hold integer expert ids, got dtype {phy_arr.dtype}")
    # Every expert 0..max needs a slot: a larger id than P - 1 cannot be a placement (and would size arrays).
    num_experts = int(phy_arr.max()) + 1
    if num_experts > num_slots:
        raise DumpError(f"{path}: last_physical_to_logical_map names expert {num_experts - 1} but has only "
                        f"{num_slots} slots")
    phy = check_placement(path, phy_arr, num_layers, num_experts)
    by_pass: dict[int, np.ndarray] = {}
    rank_slots: dict[int, np.ndarray] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "global_physical_count" not in rec or "forward_pass_id" not in rec:
            raise DumpError(f"{path}: records[{i}] lacks forward_pass_id or global_physical_count")
        count = check_counts(path, f"records[{i}].global_physical_count", rec["global_physical_count"], 2)
        if count.shape != (num_layers, num_slots):
            raise DumpError(f"{path}: records[{i}].global_physical_count is {list(count.shape)}, the map is "
                            f"[{num_layers}, {num_slots}]")
        pid = _record_int(path, i, rec, "forward_pass_id")
        by_pass[pid] = by_pass[pid] + count if pid in by_pass else count
        rank = _record_int(path, i, rec, "rank", 0)
        rank_slots[rank] = rank_slots.get(rank, 0.0) + count.sum(0)
    ids = np.array(sorted(by_pass), dtype=np.int64)
    physical = np.stack([by_pass[int(p)] for p in ids])
    return Dump(str(path), "sglang-per_pass", physical_to_logical(physical, phy, num_experts), physical, phy,
                None, ranks=frozenset(rank_slots), pass_ids=ids, rank_slot_load=rank_slots)


def _record_int(path: Path, i: int, rec: dict, key: str, default: int | None = None) -> int:
    """records[i][key] as an int (a Python or numpy int, or a one-element integer tensor)."""
    value = rec.get(key, default)
    try:
        return operator.index(value)
    except (TypeError, RuntimeError):
        raise DumpError(f"{path}: records[{i}].{key} must be an integer, got {value!r:.40}") from None


def _shape(x: Any) -> str:
    return str(list(x.shape)) if hasattr(x, "shape") else type(x).__name__


def merge_rank_files(dumps: list[Dump]) -> list[Dump]:
    """Consecutive SGLang per_pass dumps of different ranks under one map are one recording:
    their passes are summed by forward_pass_id."""
    out: list[Dump] = []
    for d in dumps:
        prev = out[-1] if out else None
        if (prev is not None and d.format == prev.format == "sglang-per_pass" and not (d.ranks & prev.ranks)
                and np.array_equal(d.phy2log, prev.phy2log)
                and np.intersect1d(d.pass_ids, prev.pass_ids).size):
            ids = np.union1d(prev.pass_ids, d.pass_ids)
            physical = np.zeros((ids.size, *d.physical_count.shape[1:]), dtype=np.float64)
            physical[np.searchsorted(ids, prev.pass_ids)] += prev.physical_count
            physical[np.searchsorted(ids, d.pass_ids)] += d.physical_count
            experts = prev.logical_count.shape[2]
            out[-1] = replace(prev, path=f"{prev.path}+{Path(d.path).name}", physical_count=physical,
                              logical_count=physical_to_logical(physical, d.phy2log, experts),
                              ranks=prev.ranks | d.ranks, pass_ids=ids,
                              rank_slot_load={**prev.rank_slot_load, **d.rank_slot_load})
        else:
            out.append(d)
    return out


def _rank_list(runs: list[tuple[int, int]]) -> str:
    """Runs of rank ids, first and last: [(1, 3), (5, 5), (7, 8)] -> "1-3, 5, 7, 8"."""
    return ", ".join(f"{a}-{b}" if b > a + 1 else ", ".join(map(str, range(a, b + 1))) for a, b in runs)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as (first, last) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _gaps(seen: list[int], total: int) -> list[tuple[int, int]]:
    """The ids of 0..total-1 not in sorted ``seen``, as (first, last) runs (never a list of them
    all: a rank id read from a file can be huge)."""
    gaps, nxt = [], 0
    for i in [r for r in seen if 0 <= r < total] + [total]:
        if i > nxt:
            gaps.append((nxt, i - 1))
        nxt = i + 1
    return gaps


def implied_num_ranks(rank_slot_load: dict[int, np.ndarray]) -> int | None:
    """The fewest ranks R (R > every rank id, R dividing the P slots) over which every rank's
    records counted only its own block of P / R slots (rank_slot_load: {rank: [P]}): records of
    the tokens each rank received, so the other ranks' files hold the rest. None when no R
    fits (the records count every slot), no record counted anything, or a rank id is negative."""
    if not rank_slot_load or min(rank_slot_load) < 0 or not any(v.any() for v in rank_slot_load.values()):
        return None
    num_slots = next(iter(rank_slot_load.values())).shape[0]
    for num_ranks in range(max(2, max(rank_slot_load) + 1), num_slots + 1):
        if num_slots % num_ranks:
            continue
        block = num_slots // num_ranks
        if all(not v[: r * block].any() and not v[(r + 1) * block:].any() for r, v in rank_slot_load.items()):
            return num_ranks
    return None


def missing_ranks_problem(dump: Dump) -> str | None:
    """One line naming the ranks whose per_pass files a (merged) per_pass dump lacks: the rank
    ids skip one (ranks 0 and 2 but not 1), or the records count only their own rank's slots
    (``implied_num_ranks``) and some rank's file is not there. None for other formats and for
    a complete set, or one rank's file whose records count every slot (its tokens' load)."""
    if dump.format != "sglang-per_pass" or not dump.rank_slot_load:
        return None
    seen = sorted(dump.rank_slot_load)
    implied = implied_num_ranks(dump.rank_slot_load)
    missing = _gaps(seen, implied or seen[-1] + 1)
    if not missing:
        return None
    given = f"holds the records of rank(s) {_rank_list(_runs(seen))}"
    if implied:
        num_slots = next(iter(dump.rank_slot_load.values())).shape[0]
        why = (f"each counts only its own {num_slots // implied} of the {num_slots} slots, so the run had "
               f"{implied} ranks")
    else:
        why = f"rank ids run to {seen[-1]}"
    return (f"{dump.path}: SGLang per_pass dump {given}; {why}, and the file(s) of rank(s) {_rank_list(missing)} "
            "are missing: give every rank's file of the dump together")
