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
from pathlib import Path

import numpy as np

from launch.profile.dumps import (
    Dump,
    DumpError,
    Recording,
    check_counts,
    check_dropped,
    check_logical,
    check_placement,
)
from launch.profile.sglang_dumps import merge_rank_files, read_torch_dump

__all__ = ["Dump", "DumpError", "Recording", "read_dump", "read_recording"]


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
    count = check_logical(path, tensors["logical_count"])
    steps, num_layers, num_experts = count.shape
    phy = check_placement(path, tensors["phy2log"], num_layers, num_experts) if "phy2log" in tensors else None
    physical = None
    if "physical_count" in tensors:
        physical = check_counts(path, "physical_count", tensors["physical_count"], 3)
        if phy is None or physical.shape != (steps, num_layers, phy.shape[1]):
            raise DumpError(f"{path}: physical_count {list(physical.shape)} does not match logical_count "
                            f"{list(count.shape)} and phy2log")
    ranks = None
    if "num_gpus" in tensors:
        ranks = int(np.asarray(tensors["num_gpus"]).reshape(-1)[0])
        if ranks <= 0 or (phy is not None and phy.shape[1] % ranks):
            raise DumpError(f"{path}: num_gpus={ranks} does not divide the placement's slots")
    dropped = check_dropped(path, tensors["dropped_count"], (steps, num_layers)) if "dropped_count" in tensors else None
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


def _read_npy(path: Path) -> Dump:
    try:
        arr = np.load(str(path), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DumpError(f"{path}: not a readable .npy file ({str(e).splitlines()[0] if str(e) else 'empty'})") from None
    return Dump(str(path), "npy", check_logical(path, arr))


def _read_npz(path: Path) -> Dump:
    try:
        with np.load(str(path), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise DumpError(f"{path}: not a readable .npz file ({str(e).splitlines()[0]})") from None
    if "logical_count" in arrays:
        count = check_logical(path, arrays["logical_count"])
    elif len(arrays) == 1:
        count = check_logical(path, next(iter(arrays.values())))
    else:
        raise DumpError(f"{path}: .npz must hold 'logical_count' or a single array; found {sorted(arrays)}")
    steps, num_layers, num_experts = count.shape
    phy = check_placement(path, arrays["phy2log"], num_layers, num_experts) if "phy2log" in arrays else None
    dropped = check_dropped(path, arrays["dropped_count"], (steps, num_layers)) if "dropped_count" in arrays else None
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
    return Dump(str(path), "csv", check_logical(path, count))


def read_dump(path: str | Path) -> Dump:
    """One dump file, its format chosen by suffix (.safetensors, .pt/.pth/.bin, .npy, .npz,
    .csv) or, for other names, by its first bytes."""
    p = Path(path)
    if p.is_dir():
        raise DumpError(f"{p}: is a directory, not a dump file")
    if not p.is_file():
        raise DumpError(f"{p}: no such file")
    readers = {".safetensors": _read_safetensors, ".pt": read_torch_dump, ".pth": read_torch_dump, ".bin": read_torch_dump,
               ".npy": _read_npy, ".npz": _read_npz, ".csv": _read_csv}
    reader = readers.get(p.suffix.lower())
    if reader is None:
        head = p.open("rb").read(16)
        if head.startswith(b"\x93NUMPY"):
            reader = _read_npy
        elif head.startswith(b"PK"):
            reader = read_torch_dump
        elif len(head) > 8 and head[8:9] == b"{":
            reader = _read_safetensors
        else:
            raise DumpError(f"{p}: unknown dump format (expected .safetensors, .pt, .npy, .npz or .csv)")
    return reader(p)


def read_recording(paths: list[str | Path]) -> Recording:
    """Read every dump and concatenate them in the order given (same L and E, else DumpError
    naming the file). SGLang per_pass files of several ranks of one dump are summed."""
    if not paths:
        raise DumpError("no dump files given")
    dumps = merge_rank_files([read_dump(p) for p in paths])
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
