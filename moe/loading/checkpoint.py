"""An opened safetensors checkpoint: one file, or shards listed by an index.

Accepted layouts (``path`` may be the directory or the file itself):

- ``model.safetensors`` (single file);
- ``model.safetensors.index.json`` whose ``weight_map`` maps tensor name -> shard file;
- a directory of ``*.safetensors`` without an index and without ``model.safetensors``
  (every file is read; a tensor name found in two files is an error).

Pickle-based weight files (``pytorch_model.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``)
are refused and never unpickled: unpickling runs arbitrary code.

Each shard is opened exactly once (``safe_open``, memory-mapped); headers are
validated up front, so a corrupt or truncated shard fails before any weight moves.
Tensors are read lazily, whole or one index along dim 0 (one expert of a fused
``[E, ...]`` tensor), so a rank never materialises what it does not host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from moe.loading.errors import CheckpointFormatError, CheckpointNotFoundError, NoWeightsError

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")  # model-00001-of-00004.safetensors
CONFIG_NAME = "config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_REFUSE_PICKLE = (
    "{what} is a pickle-based weight file; it is refused (unpickling can run arbitrary code). "
    "Convert the checkpoint to safetensors first, e.g. `model.save_pretrained(out_dir, "
    "safe_serialization=True)` in a trusted environment."
)


@dataclass(frozen=True)
class TensorInfo:
    """Header facts of one checkpoint tensor (no data read)."""

    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code: "F32", "BF16", "F16", "F8_E4M3", ...


def _refuse_pickles(files: list[Path]) -> None:
    if files:
        names = ", ".join(str(f) for f in files)
        raise CheckpointFormatError(_REFUSE_PICKLE.format(what=names))


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{path}: cannot read {what} as JSON: {exc}") from exc


def _files_from_index(index_path: Path) -> tuple[list[Path], dict[str, Path]]:
    """Returns (shard files in index order, tensor name -> shard path) and checks every shard exists."""
    index = _read_json(index_path, "the safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointFormatError(f"{index_path}: index has no 'weight_map' object of tensor name -> shard file")
    by_key: dict[str, Path] = {}
    files: dict[Path, str] = {}
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(".safetensors") or Path(shard).name != shard:
            raise CheckpointFormatError(
                f"{index_path}: tensor {key!r} maps to {shard!r}, not a .safetensors file name in the index's directory"
            )
        shard_path = index_path.parent / shard
        files.setdefault(shard_path, key)
        by_key[key] = shard_path
    for shard_path, first_key in files.items():
        if not shard_path.is_file():
            raise CheckpointNotFoundError(
                f"{index_path}: shard {shard_path.name!r} (holding e.g. {first_key!r}) does not exist in {index_path.parent}"
            )
    return list(files), by_key


def _check_shard_set(directory: Path, files: list[Path]) -> None:
    """Without an index, shards named ``STEM-0000i-of-0000N.safetensors`` must all be there:
    CheckpointNotFoundError naming the first missing one (else its tensors would be reported
    missing one by one, with no word of the shard)."""
    series: dict[tuple[str, str, int], set[int]] = {}  # (stem, "0000N", digits of i) -> the i present
    for f in files:
        m = _SHARD_RE.match(f.name)
        if m:
            series.setdefault((m["stem"], m["n"], len(m["i"])), set()).add(int(m["i"]))
    for (stem, n, width), present in series.items():
        missing = [i for i in range(1, int(n) + 1) if i not in present]
        if missing:
            name = f"{stem}-{missing[0]:0{width}d}-of-{n}.safetensors"
            raise CheckpointNotFoundError(
                f"{directory}: shard {name!r} does not exist ({len(present)} of {int(n)} shards of {stem!r} "
                f"here, and no {INDEX_NAME})"
            )


@dataclass(frozen=True)
class CheckpointFiles:
    """Where a checkpoint's weights are: its directory, shard files, and the index if any."""

    root: Path
    files: list[Path]
    index: Path | None = None
    weight_map: dict[str, Path] | None = None  # tensor name -> shard, from the index


def resolve_checkpoint_files(path: str | Path) -> CheckpointFiles:
    """Find the safetensors files of a checkpoint.

    Raises CheckpointNotFoundError / CheckpointFormatError naming the path.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"checkpoint path {p} does not exist")
    if p.is_file():
        if p.name.endswith(".safetensors.index.json"):
            files, by_key = _files_from_index(p)
            return CheckpointFiles(p.parent, files, p, by_key)
        if p.suffix == ".safetensors":
            return CheckpointFiles(p.parent, [p])
        if p.suffix in PICKLE_SUFFIXES:
            _refuse_pickles([p])
        raise CheckpointFormatError(f"{p}: not a safetensors file or a model.safetensors.index.json")
    indexes = [p / INDEX_NAME] if (p / INDEX_NAME).is_file() else sorted(p.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointFormatError(f"{p}: several safetensors indexes ({[i.name for i in indexes]}); pass one")
    if indexes:
        files, by_key = _files_from_index(indexes[0])
        return CheckpointFiles(p, files, indexes[0], by_key)
    # model.safetensors alone wins over stray files (e.g. Mistral's consolidated.safetensors).
    files = [p / "model.safetensors"] if (p / "model.safetensors").is_file() else sorted(p.glob("*.safetensors"))
    if files:
        _check_shard_set(p, files)
        return CheckpointFiles(p, files)
    _refuse_pickles(sorted(f for f in p.iterdir() if f.suffix in PICKLE_SUFFIXES))
    raise NoWeightsError(
        f"{p}: no safetensors weights found (expected model.safetensors or {INDEX_NAME})"
    )


class Checkpoint:
    """Open handles on every shard of one checkpoint plus its config.json (``{}`` if absent).

    Use as a context manager (or call ``close``). ``num_reads`` / ``num_bytes_read`` count
    what was actually read.
    """

    def __init__(self, path: str | Path) -> None:
        found = resolve_checkpoint_files(path)
        self.root, self.files, self.index = found.root, found.files, found.index
        config_path = self.root / CONFIG_NAME
        self.config: dict[str, Any] = _read_json(config_path, "config.json") if config_path.is_file() else {}
        if not isinstance(self.config, dict):
            raise CheckpointFormatError(f"{config_path}: config.json is not a JSON object")
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}
        self._key_file: dict[str, Path] = {}
        self.num_reads = 0
        self.num_bytes_read = 0
        try:
            self._open_all(found.weight_map)
        except BaseException:
            self.close()
            raise

    def _open_all(self, index_map: dict[str, Path] | None) -> None:
        for file in self.files:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            except (SafetensorError, OSError) as exc:
                raise CheckpointFormatError(f"{file}: corrupt or truncated safetensors file: {exc}") from exc
            self._handles[file] = handle
            for key in handle.keys():
                if key in self._key_file:
                    indexed = (index_map or {}).get(key)
                    if indexed not in (self._key_file[key], file):  # no index, or one naming neither copy
                        raise CheckpointFormatError(
                            f"tensor {key!r} appears in both {self._key_file[key]} and {file}"
                        )
                    # the index decides (transformers reads the shard it names): the other copy is stale
                    log.warning("tensor %r is in both %s and %s: reading %s, which %s names", key,
                                self._key_file[key].name, file.name, indexed.name, self.index.name)
                    self._key_file[key] = indexed
                    continue
                self._key_file[key] = file
        for key, file in (index_map or {}).items():
            if self._key_file.get(key) != file:
                raise CheckpointFormatError(
                    f"{self.index}: index places {key!r} in {file.name}, but that shard does not hold it"
                )

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release every shard's memory map."""
        self._stack.close()
        self._handles.clear()

    def keys(self) -> list[str]:
        """All tensor names, over every shard."""
        return list(self._key_file)

    def __contains__(self, key: str) -> bool:
        return key in self._key_file

    def file_of(self, key: str) -> Path:
        """The shard holding ``key`` (KeyError if absent)."""
        return self._key_file[key]

    def info(self, key: str) -> TensorInfo:
        """Shape and dtype from the header; reads no data."""
        file = self._key_file[key]
        try:
            sl = self._handles[file].get_slice(key)
            return TensorInfo(key, file, tuple(sl.get_shape()), sl.get_dtype())
        except SafetensorError as exc:
            raise CheckpointFormatError(f"{file}: cannot read header of tensor {key!r}: {exc}") from exc

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """The tensor ``key``, or only ``key[index]`` (one row along dim 0, read lazily)."""
        file = self._key_file[key]
        handle = self._handles[file]
        try:
            tensor = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        except (SafetensorError, OSError, ValueError) as exc:
            where = key if index is None else f"{key}[{index}]"
            raise CheckpointFormatError(f"{file}: cannot read tensor {where}: {exc}") from exc
        self.num_reads += 1
        self.num_bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def expected_scale_shape(weight_shape: tuple[int, ...], block_size: tuple[int, int] | None) -> tuple[int, ...]:
    """The ``*_scale_inv`` shape of an fp8 tensor: [..., ceil(out / rows), ceil(in / cols)] for
    ``weight_shape`` [..., out, in] (leading dims: the experts of a fused tensor), [..., 1, 1] per
    tensor (block_size None)."""
    *lead, out, inp = weight_shape
    rows, cols = block_size if block_size is not None else (out, inp)
    return (*lead, -(-out // max(rows, 1)), -(-inp // max(cols, 1)))


def dequantize_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``weight.float() * scale_inv``, each scale over its block, in float32, returned in ``dtype``.

    weight: [out, in] float8_e4m3fn. scale_inv: [ceil(out / rows), ceil(in / cols)] (the last
    blocks partial), or for block_size None one scale ([1, 1], [1] or a scalar).
    Returns: [out, in] in ``dtype``, bit for bit ``(weight.float() * expanded_scale_inv).to(dtype)``.
    The products are made one block row at a time, so the only float32 temporary is one block row
    (not the whole tensor and its scales expanded: ~1 GB for DeepSeek-V3's largest weight).
    """
    out, inp = weight.shape
    scale = scale_inv.float()
    result = torch.empty(out, inp, dtype=dtype)
    if block_size is None:
        rows, cols, scale = max(out, 1), inp, scale.reshape(1, 1)
    else:
        rows, cols = block_size
    for b, r0 in enumerate(range(0, out, rows)):
        r1 = min(out, r0 + rows)
        row_scale = scale[b].repeat_interleave(cols)[:inp] if block_size is not None else scale[0]
        result[r0:r1] = weight[r0:r1].float() * row_scale
    return result
