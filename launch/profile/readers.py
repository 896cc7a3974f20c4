"""Readers for expert-distribution dumps, all into one ``Recording``.

Formats (chosen by file suffix, then by content):

- this project's safetensors dump (``/dump_expert_distribution_record``, ``profile run``):
  ``logical_count [S, L, E]``; optionally the placement in force ``phy2log [L, P]`` (+
  ``log2phy``, ``logcnt``, ``num_gpus`` = EP size), ``physical_count [S, L, P]`` (exact
  per-slot counts) and ``dropped_count [S, L]`` (capacity drops); metadata ``phases`` (JSON).
- SGLang ``stat`` dump (``torch.save``): ``{"rank", "logical_count" [S, L, E],
  "average_utilization_rate_over_window"}``. Trailing all-zero steps (the unfilled part of
  its ring buffer) are dropped.
- SGLang ``per_pass`` dump (``torch.save``, one file per rank): ``{"records": [{"forward_pass_id",
  "rank", "gatherer_key", "global_physical_count" [L, P], ...}], "last_physical_to_logical_map"
  [L, P]}``. Records of one pass (several ranks or files) are summed; passes in id order.
- ``.npy``: one array ``[S, L, E]`` (or ``[L, E]``, one step); ``.npz``: ``logical_count``
  (or its only array), optionally ``phy2log [L, P]`` and ``dropped_count [S, L]``.
- ``.csv``: a header ``step,layer,e0,e1,...,e{E-1}`` then one row per (step, layer) with that
  layer's E counts; steps 0..S-1 and layers 0..L-1 must all be present, in any order.

``torch.load`` runs with ``weights_only=True`` and the result is checked to hold only
tensors, dicts, lists/tuples, strings and numbers. Every problem raises ``DumpError`` with a
one-line message naming the file.
"""

from __future__ import annotations

import csv
import json
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Dump", "DumpError", "Recording", "read_dump", "read_recording"]


class DumpError(ValueError):
    """A dump that cannot be read as expert counts; the message names the file."""


@dataclass(frozen=True)
class Dump:
    """One file's counts.

    logical_count: [S, L, E] float64 (integral for every format but float .npy/.csv input);
    physical_count: [S, L, P] float64 exact per-slot counts, or None;
    phy2log: [L, P] int64 placement in force (the last one when it changed), or None;
    num_ranks: EP size of that placement when the dump records it; dropped: [S, L] or None;
    phases: (name, first step, end step) of workload phases, steps relative to this dump;
    ranks: SGLang ranks whose records a per_pass dump holds.
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

    @property
    def num_steps(self) -> int:
        return int(self.logical_count.shape[0])


@dataclass(frozen=True)
class Recording:
    """Dumps concatenated in time (same L and E). ``logical_count`` [S, L, E] float64."""

    dumps: tuple[Dump, ...]
    logical_count: np.ndarray
    dropped: np.ndarray | None

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
    def phases(self) -> list[tuple[str, int, int]]:
        """Workload phases with steps in recording coordinates."""
        return [(name, a + off, b + off) for d, off in zip(self.dumps, self.offsets) for name, a, b in d.phases]


# ---- validation ------------------------------------------------------------------------


def _counts(path: Path, name: str, value: Any, ndim: int | tuple[int, ...]) -> np.ndarray:
    arr = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if arr.ndim not in dims:
        want = " or ".join({3: "[steps, L, E]", 2: "[L, E]"}.get(d, f"{d}-D") for d in dims)
        raise DumpError(f"{path}: {name} must be {want}, got shape {list(arr.shape)}")
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise DumpError(f"{path}: {name} must hold numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise DumpError(f"{path}: {name} must hold finite non-negative counts")
    return arr


def _logical(path: Path, value: Any) -> np.ndarray:
    arr = _counts(path, "logical_count", value, (2, 3))
    if arr.ndim == 2:
        arr = arr[None]
    if arr.shape[0] == 0:
        raise DumpError(f"{path}: holds no recorded steps (logical_count is {list(arr.shape)})")
    if arr.shape[1] == 0 or arr.shape[2] == 0:
        raise DumpError(f"{path}: logical_count {list(arr.shape)} has no layers or no experts")
    return arr


def _placement(path: Path, value: Any, num_layers: int, num_experts: int) -> np.ndarray:
    arr = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
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


def _dropped(path: Path, value: Any, shape: tuple[int, int]) -> np.ndarray:
    arr = _counts(path, "dropped_count", value, 2)
    if arr.shape != shape:
        raise DumpError(f"{path}: dropped_count must be [steps, L] = {list(shape)}, got {list(arr.shape)}")
    return arr


# ---- formats ---------------------------------------------------------------------------


def _read_safetensors(path: Path) -> Dump:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise DumpError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    if "logical_count" not in tensors:
        raise DumpError(f"{path}: holds no logical_count (found {sorted(tensors)})")
    count = _logical(path, tensors["logical_count"])
    steps, num_layers, num_experts = count.shape
    phy = _placement(path, tensors["phy2log"], num_layers, num_experts) if "phy2log" in tensors else None
    physical = None
    if "physical_count" in tensors:
        physical = _counts(path, "physical_count", tensors["physical_count"], 3)
        if phy is None or physical.shape != (steps, num_layers, phy.shape[1]):
            raise DumpError(f"{path}: physical_count {list(physical.shape)} does not match logical_count "
                            f"{list(count.shape)} and phy2log")
    ranks = None
    if "num_gpus" in tensors:
        ranks = int(np.asarray(tensors["num_gpus"]).reshape(-1)[0])
        if ranks <= 0 or (phy is not None and phy.shape[1] % ranks):
            raise DumpError(f"{path}: num_gpus={ranks} does not divide the placement's slots")
    dropped = _dropped(path, tensors["dropped_count"], (steps, num_layers)) if "dropped_count" in tensors else None
    return Dump(str(path), "moe-serve", count, physical, phy, ranks, dropped, _phases(path, meta, steps))


def _phases(path: Path, meta: dict[str, str], steps: int) -> tuple[tuple[str, int, int], ...]:
    if "phases" not in meta:
        return ()
    try:
        items = json.loads(meta["phases"])
        phases = tuple((str(p["name"]), int(p["start"]), int(p["end"])) for p in items)
    except (ValueError, KeyError, TypeError):
        raise DumpError(f"{path}: metadata 'phases' is not a JSON list of {{name, start, end}}") from None
    if any(not 0 <= a <= b <= steps for _, a, b in phases):
        raise DumpError(f"{path}: metadata 'phases' names steps outside [0, {steps}]")
    return phases


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
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = next((line for line in str(e).splitlines() if line.strip()), "")
        if "Unsupported global" in str(e) or "weights_only" in str(e).lower():
            first = next((line.strip() for line in str(e).splitlines() if "Unsupported" in line), first)
        raise DumpError(f"{path}: refused: holds more than plain tensors, dicts, lists and numbers "
                        f"({first.strip()[:200]})") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise DumpError(f"{path}: not a readable torch.save file ({first.strip()[:200]})") from None
    _check_plain(path, obj)
    return obj


def _read_torch(path: Path) -> Dump:
    obj = _torch_load(path)
    if not isinstance(obj, dict):
        raise DumpError(f"{path}: expected SGLang's dict dump, found a {type(obj).__name__}")
    if "logical_count" in obj:
        count = _logical(path, obj["logical_count"])
        nonzero = np.flatnonzero(count.reshape(count.shape[0], -1).sum(1) > 0)
        if nonzero.size == 0:
            raise DumpError(f"{path}: every recorded step is empty (no tokens)")
        return Dump(str(path), "sglang-stat", count[: nonzero[-1] + 1])
    if "records" in obj and "last_physical_to_logical_map" in obj:
        return _read_per_pass(path, obj)
    raise DumpError(f"{path}: neither an SGLang stat dump (logical_count) nor a per_pass dump "
                    f"(records + last_physical_to_logical_map); found keys {sorted(map(str, obj))}")


def _read_per_pass(path: Path, obj: dict) -> Dump:
    records = obj["records"]
    if not isinstance(records, list | tuple) or not records:
        raise DumpError(f"{path}: per_pass dump has no records")
    phy_raw = obj["last_physical_to_logical_map"]
    if getattr(phy_raw, "ndim", None) != 2:
        raise DumpError(f"{path}: last_physical_to_logical_map must be [L, P], got {_shape(phy_raw)}")
    num_layers, num_slots = phy_raw.shape
    num_experts = int(phy_raw.max()) + 1
    phy = _placement(path, phy_raw, num_layers, num_experts)
    by_pass: dict[int, np.ndarray] = {}
    ranks = set()
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "global_physical_count" not in rec or "forward_pass_id" not in rec:
            raise DumpError(f"{path}: records[{i}] lacks forward_pass_id or global_physical_count")
        count = _counts(path, f"records[{i}].global_physical_count", rec["global_physical_count"], 2)
        if count.shape != (num_layers, num_slots):
            raise DumpError(f"{path}: records[{i}].global_physical_count is {list(count.shape)}, the map is "
                            f"[{num_layers}, {num_slots}]")
        pid = int(rec["forward_pass_id"])
        by_pass[pid] = by_pass[pid] + count if pid in by_pass else count
        ranks.add(int(rec.get("rank", 0)))
    ids = np.array(sorted(by_pass), dtype=np.int64)
    physical = np.stack([by_pass[int(p)] for p in ids])
    return Dump(str(path), "sglang-per_pass", physical_to_logical(physical, phy, num_experts), physical, phy,
                None, ranks=frozenset(ranks), pass_ids=ids)


def _shape(x: Any) -> str:
    return str(list(x.shape)) if hasattr(x, "shape") else type(x).__name__


def physical_to_logical(physical: np.ndarray, phy2log: np.ndarray, num_experts: int) -> np.ndarray:
    """physical: [S, L, P] per-slot counts; phy2log: [L, P] -> [S, L, E] per-expert counts."""
    steps, num_layers, _ = physical.shape
    out = np.zeros((steps, num_layers, num_experts), dtype=np.float64)
    for layer in range(num_layers):
        np.add.at(out[:, layer], (slice(None), phy2log[layer]), physical[:, layer])
    return out


def _read_npy(path: Path) -> Dump:
    try:
        arr = np.load(str(path), allow_pickle=False)
    except (ValueError, OSError) as e:
        raise DumpError(f"{path}: not a readable .npy file ({str(e).splitlines()[0]})") from None
    return Dump(str(path), "npy", _logical(path, arr))


def _read_npz(path: Path) -> Dump:
    try:
        with np.load(str(path), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise DumpError(f"{path}: not a readable .npz file ({str(e).splitlines()[0]})") from None
    if "logical_count" in arrays:
        count = _logical(path, arrays["logical_count"])
    elif len(arrays) == 1:
        count = _logical(path, next(iter(arrays.values())))
    else:
        raise DumpError(f"{path}: .npz must hold 'logical_count' or a single array; found {sorted(arrays)}")
    steps, num_layers, num_experts = count.shape
    phy = _placement(path, arrays["phy2log"], num_layers, num_experts) if "phy2log" in arrays else None
    dropped = _dropped(path, arrays["dropped_count"], (steps, num_layers)) if "dropped_count" in arrays else None
    return Dump(str(path), "npz", count, phy2log=phy, dropped=dropped)


def _read_csv(path: Path) -> Dump:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as e:
        raise DumpError(f"{path}: not a readable CSV file ({e})") from None
    rows = [r for r in rows if any(c.strip() for c in r)]
    if len(rows) < 2:
        raise DumpError(f"{path}: CSV needs a header 'step,layer,e0,...' and at least one row")
    header = [c.strip() for c in rows[0]]
    if header[:2] != ["step", "layer"] or len(header) < 3:
        raise DumpError(f"{path}: CSV header must start 'step,layer' followed by one column per expert, "
                        f"got {','.join(header[:4])}...")
    num_experts = len(header) - 2
    try:
        data = np.array([[float(c) for c in r] for r in rows[1:]], dtype=np.float64)
    except ValueError:
        raise DumpError(f"{path}: CSV holds a value that is not a number") from None
    if data.ndim != 2 or data.shape[1] != num_experts + 2:
        bad = next(i for i, r in enumerate(rows[1:], 2) if len(r) != num_experts + 2)
        raise DumpError(f"{path}: line {bad} has {len(rows[bad - 1])} columns, the header has {num_experts + 2}")
    keys = data[:, :2]
    if (keys < 0).any() or (keys != np.round(keys)).any():
        raise DumpError(f"{path}: step and layer must be non-negative integers")
    step, layer = keys[:, 0].astype(np.int64), keys[:, 1].astype(np.int64)
    steps, num_layers = int(step.max()) + 1, int(layer.max()) + 1
    seen = np.zeros((steps, num_layers), dtype=np.int64)
    np.add.at(seen, (step, layer), 1)
    if (seen != 1).any():
        s, x = np.argwhere(seen != 1)[0]
        what = "missing" if seen[s, x] == 0 else "repeated"
        raise DumpError(f"{path}: row for step {s}, layer {x} is {what} (every step x layer needs exactly one row)")
    count = np.zeros((steps, num_layers, num_experts), dtype=np.float64)
    count[step, layer] = data[:, 2:]
    return Dump(str(path), "csv", _logical(path, count))


def read_dump(path: str | Path) -> Dump:
    """One dump file, its format chosen by suffix (.safetensors, .pt/.pth/.bin, .npy, .npz,
    .csv) or, for other names, by its first bytes."""
    p = Path(path)
    if not p.is_file():
        raise DumpError(f"{p}: no such file")
    readers = {".safetensors": _read_safetensors, ".pt": _read_torch, ".pth": _read_torch, ".bin": _read_torch,
               ".npy": _read_npy, ".npz": _read_npz, ".csv": _read_csv}
    reader = readers.get(p.suffix.lower())
    if reader is None:
        head = p.open("rb").read(16)
        if head.startswith(b"\x93NUMPY"):
            reader = _read_npy
        elif head.startswith(b"PK"):
            reader = _read_torch
        elif len(head) > 8 and head[8:9] == b"{":
            reader = _read_safetensors
        else:
            raise DumpError(f"{p}: unknown dump format (expected .safetensors, .pt, .npy, .npz or .csv)")
    return reader(p)


def _merge_rank_files(dumps: list[Dump]) -> list[Dump]:
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
                              ranks=prev.ranks | d.ranks, pass_ids=ids)
        else:
            out.append(d)
    return out


def read_recording(paths: list[str | Path]) -> Recording:
    """Read every dump and concatenate them in the order given (same L and E, else DumpError
    naming the file). SGLang per_pass files of several ranks of one dump are summed."""
    if not paths:
        raise DumpError("no dump files given")
    dumps = _merge_rank_files([read_dump(p) for p in paths])
    first = dumps[0]
    shape = first.logical_count.shape[1:]
    for d in dumps[1:]:
        if d.logical_count.shape[1:] != shape:
            raise DumpError(f"{d.path}: {d.logical_count.shape[1]} layers x {d.logical_count.shape[2]} experts, "
                            f"but {first.path} has {shape[0]} x {shape[1]}")
    count = np.concatenate([d.logical_count for d in dumps])
    dropped = None
    if any(d.dropped is not None for d in dumps):
        dropped = np.concatenate([d.dropped if d.dropped is not None else np.zeros(d.logical_count.shape[:2])
                                  for d in dumps])
    return Recording(tuple(dumps), count, dropped)
