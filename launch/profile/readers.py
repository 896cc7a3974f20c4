"""Readers for expert-distribution dumps, all into one ``Recording``.

Formats (chosen by file suffix, then by content):

- this project's safetensors dump (``/dump_expert_distribution_record``, ``profile run``):
  ``logical_count [S, L, E]``; optionally the placement in force ``phy2log [L, P]`` (+
  ``log2phy``, ``logcnt``, ``num_gpus`` = EP size), ``physical_count [S, L, P]`` (exact
  per-slot counts) and ``dropped_count [S, L]`` (capacity drops); metadata ``phases`` (JSON),
  ``n_group`` and ``moe_layer_ids`` (JSON list of L model layer ids).
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

A file without a known suffix is sniffed: ``.npy`` magic, a zip (``.npz`` when its members
are ``*.npy``, else ``torch.save``), safetensors' JSON header, a CSV's ``step,layer,...`` header.

``torch.load`` runs with ``weights_only=True`` and the result is checked to hold only
tensors, dicts, lists/tuples, strings and numbers. Every problem raises ``DumpError`` with a
one-line message naming the file; a dump without steps raises ``EmptyDumpError``, which
``read_recording`` skips when other dumps hold steps.
"""

from __future__ import annotations

import csv
import json
import zipfile
from pathlib import Path

import numpy as np

from launch.profile.dumps import (
    META_MOE_LAYERS,
    META_N_GROUP,
    Dump,
    DumpError,
    EmptyDumpError,
    Recording,
    check_counts,
    check_dropped,
    check_logical,
    check_placement,
)
from launch.profile.sglang_dumps import merge_rank_files, missing_ranks_problem, read_torch_dump

__all__ = ["DUMP_SUFFIXES", "Dump", "DumpError", "EmptyDumpError", "Recording", "read_dump", "read_recording"]

# A CSV step or layer id at or above this is not an exact integer in float64.
MAX_CSV_ID = 2**53
NPY_MAGIC = b"\x93NUMPY"


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
        gpus = np.asarray(tensors["num_gpus"])
        if gpus.size != 1 or not np.issubdtype(gpus.dtype, np.integer):
            raise DumpError(f"{path}: num_gpus must be one integer, got {gpus.dtype} of shape {list(gpus.shape)}")
        ranks = int(gpus.reshape(-1)[0])
        if ranks <= 0 or (phy is not None and phy.shape[1] % ranks):
            raise DumpError(f"{path}: num_gpus={ranks} does not divide the placement's slots")
    dropped = check_dropped(path, tensors["dropped_count"], count) if "dropped_count" in tensors else None
    n_group, model_layers = _model_meta(path, meta, num_layers)
    return Dump(str(path), "moe-serve", count, physical, phy, ranks, dropped, _phases(path, meta, steps),
                n_group=n_group, model_layers=model_layers)


def _model_meta(path: Path, meta: dict[str, str], num_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """(n_group, model layer ids) from the metadata ``n_group`` and ``moe_layer_ids``; None for
    what the dump does not record (dumps written before they were added)."""
    n_group = None
    if META_N_GROUP in meta:
        try:
            n_group = int(meta[META_N_GROUP])
        except ValueError:
            n_group = 0
        if n_group < 1:
            raise DumpError(f"{path}: metadata 'n_group' must be a positive integer, got {meta[META_N_GROUP]!r:.40}")
    layers = None
    if META_MOE_LAYERS in meta:
        try:
            items = json.loads(meta[META_MOE_LAYERS])
        except ValueError:
            items = None
        if (not isinstance(items, list) or len(items) != num_layers
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items)):
            raise DumpError(f"{path}: metadata 'moe_layer_ids' must be a JSON list of {num_layers} layer ids")
        layers = tuple(items)
    return n_group, layers


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
    with path.open("rb") as f:
        head = f.read(len(NPY_MAGIC))
    if not NPY_MAGIC.startswith(head):  # else numpy takes it for a pickle and suggests loading it unsafely
        raise DumpError(f"{path}: not a .npy file (it does not start with NumPy's header)")
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
    dropped = check_dropped(path, arrays["dropped_count"], count) if "dropped_count" in arrays else None
    return Dump(str(path), "npz", count, phy2log=phy, dropped=dropped)


def _csv_rows(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, cells) of every non-blank row; a UTF-8 BOM (Excel's "CSV UTF-8") is dropped."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            rows = [(reader.line_num, r) for r in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DumpError(f"{path}: not a readable CSV file ({e})") from None
    return [(n, r) for n, r in rows if any(c.strip() for c in r)]


def _first_bad_key(step: np.ndarray, layer: np.ndarray, num_layers: int) -> tuple[int, int, str] | None:
    """(step, layer, "missing" | "repeated") of the first (step, layer) pair in step-major order
    that does not occur exactly once; None when every pair does. Never allocates [S, L]."""
    pairs, counts = np.unique(np.stack([step, layer], 1), axis=0, return_counts=True)
    candidates = []
    if (counts > 1).any():
        s, x = pairs[np.argmax(counts > 1)]
        candidates.append((int(s), int(x), "repeated"))
    k = np.arange(pairs.shape[0])
    gaps = np.flatnonzero((pairs[:, 0] != k // num_layers) | (pairs[:, 1] != k % num_layers))
    missing = int(gaps[0]) if gaps.size else pairs.shape[0]
    steps = int(step.max()) + 1
    if missing < steps * num_layers:
        candidates.append((missing // num_layers, missing % num_layers, "missing"))
    return min(candidates) if candidates else None


def _read_csv(path: Path) -> Dump:
    rows = _csv_rows(path)
    if len(rows) < 2:
        raise DumpError(f"{path}: CSV needs a header 'step,layer,e0,...' and at least one row")
    header = [c.strip() for c in rows[0][1]]
    if header[:2] != ["step", "layer"] or len(header) < 3:
        raise DumpError(f"{path}: CSV header must start 'step,layer' followed by one column per expert, "
                        f"got {','.join(header[:4])}...")
    num_experts = len(header) - 2
    for line, r in rows[1:]:
        if len(r) != num_experts + 2:
            raise DumpError(f"{path}: line {line} has {len(r)} columns, the header has {num_experts + 2}")
    data = np.empty((len(rows) - 1, num_experts + 2), dtype=np.float64)
    for i, (line, r) in enumerate(rows[1:]):
        try:
            data[i] = [float(c) for c in r]
        except ValueError:
            raise DumpError(f"{path}: line {line} holds a value that is not a number") from None
    keys = data[:, :2]
    if (keys < 0).any() or (keys != np.round(keys)).any() or (keys >= MAX_CSV_ID).any():
        raise DumpError(f"{path}: step and layer must be non-negative integers (below 2**53)")
    step, layer = keys[:, 0].astype(np.int64), keys[:, 1].astype(np.int64)
    steps, num_layers = int(step.max()) + 1, int(layer.max()) + 1
    # Checked before the [S, L, E] array is allocated: a stray huge step id is a missing row, not a MemoryError.
    if (bad := _first_bad_key(step, layer, num_layers)) is not None:
        s, x, what = bad
        raise DumpError(f"{path}: row for step {s}, layer {x} is {what} (every step x layer needs exactly one row)")
    count = np.zeros((steps, num_layers, num_experts), dtype=np.float64)
    count[step, layer] = data[:, 2:]
    return Dump(str(path), "csv", check_logical(path, count))


# The reader of each known suffix; a file of another name is sniffed by its first bytes (read_dump).
_READERS = {".safetensors": _read_safetensors, ".pt": read_torch_dump, ".pth": read_torch_dump,
            ".bin": read_torch_dump, ".npy": _read_npy, ".npz": _read_npz, ".csv": _read_csv}
DUMP_SUFFIXES = tuple(_READERS)


def read_dump(path: str | Path) -> Dump:
    """One dump file, its format chosen by suffix (.safetensors, .pt/.pth/.bin, .npy, .npz,
    .csv) or, for other names, by its first bytes."""
    p = Path(path)
    if p.is_dir():
        raise DumpError(f"{p}: is a directory, not a dump file")
    if not p.is_file():
        raise DumpError(f"{p}: no such file")
    reader = _READERS.get(p.suffix.lower())
    if reader is None:
        with p.open("rb") as f:
            head = f.read(16)
        if head.startswith(NPY_MAGIC):
            reader = _read_npy
        elif head.startswith(b"PK"):
            reader = _read_npz if _is_npz(p) else read_torch_dump
        elif len(head) > 8 and head[8:9] == b"{":
            reader = _read_safetensors
        elif head.removeprefix(b"\xef\xbb\xbf").lstrip().lower().startswith(b"step"):
            reader = _read_csv  # the header every CSV dump starts with (after an Excel BOM)
        else:
            raise DumpError(f"{p}: unknown dump format (expected .safetensors, .pt, .npy, .npz or .csv)")
    return reader(p)


def _is_npz(path: Path) -> bool:
    """A zip whose members are all ``*.npy`` (numpy's .npz); torch.save's zip holds ``<name>/data.pkl``."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return bool(names) and all(n.endswith(".npy") for n in names)


def read_recording(paths: list[str | Path]) -> Recording:
    """Read every dump and concatenate them in the order given (same L and E, else DumpError
    naming the file). SGLang per_pass files of several ranks of one dump are summed; a rank's
    file missing from them is a DumpError naming the rank (``missing_ranks_problem``). Of
    several dumps, those without steps are skipped (``Recording.skipped``); a single empty
    dump, or only empty ones, is a DumpError."""
    if not paths:
        raise DumpError("no dump files given")
    read, skipped = [], []
    for p in paths:
        try:
            read.append(read_dump(p))
        except EmptyDumpError as e:
            if len(paths) == 1:
                raise
            skipped.append((str(p), str(e).removeprefix(f"{p}: ")))
    if not read:
        raise DumpError(f"none of the {len(paths)} dumps given holds a recorded step: "
                        + ", ".join(p for p, _ in skipped))
    dumps = merge_rank_files(read)
    for d in dumps:
        if (problem := missing_ranks_problem(d)) is not None:
            raise DumpError(problem)
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
    return Recording(tuple(dumps), count, dropped, tuple(skipped))
