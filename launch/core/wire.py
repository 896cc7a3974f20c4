"""The compact step message: one DP rank's batch as a few flat int arrays, not pickled dataclasses.

Shape letters: B sequences in the batch, T tokens in it, N block ids over all its sequences,
S sampled rows, U distinct sampling params among the sampled rows.

``encode_batch(BatchSpec) -> bytes`` is what the driver sends a worker each step on the fast
transport (``launch.step_channel``); ``decode_batch(bytes) -> WireBatch`` gives the worker an
object with the same read-only views ``Worker.execute`` uses from a ``BatchSpec``
(``input_ids``, ``positions``, ``query_lens``, ``context_lens``, ``block_tables``,
``logits_indices``, ``sampling_params``, ``output_indices``). Request ids and per-sequence
objects stay on the driver; ``SamplingParams`` travel once per distinct object in the batch
(all sequences of a request, and usually all requests of a benchmark, share one).

Layout (numpy, little-endian): a 20-byte header (magic, version, dp_rank, block_size, B) then
the int32 arrays ``input_ids [T]``, ``positions [T]``, ``query_lens [B]``,
``context_lens [B]``, ``num_blocks [B]``, ``block_ids [N]``, ``sampled [S]`` (batch rows with
``do_sample``), ``output_indices [S]``, ``param_index [S]`` (into the params table), each
prefixed by its length, then the pickled params table (tuple of U ``SamplingParams``).
"""

from __future__ import annotations

import pickle
import struct
from itertools import chain

import numpy as np

from launch.core.batch import BatchSpec
from launch.core.sampling_params import SamplingParams

MAGIC = b"MOEB"
VERSION = 1
_HEADER = struct.Struct("<4sIiiI")  # magic, version, dp_rank, block_size, B
_LEN = struct.Struct("<Q")
_ARRAYS = ("input_ids", "positions", "query_lens", "context_lens", "num_blocks", "block_ids", "sampled",
           "output_indices", "param_index")


class WireError(ValueError):
    """Bytes that are not a step message of this version."""


def encode_batch(batch: BatchSpec) -> bytes:
    """One DP rank's batch as a compact message (layout in the module docstring)."""
    seqs = batch.seqs
    by_id: dict[int, int] = {}
    by_value: dict[SamplingParams, int] = {}
    params: list[SamplingParams] = []
    sampled, out_idx, p_idx = [], [], []
    for b, s in enumerate(seqs):
        if s.do_sample:
            index = by_id.get(id(s.params))
            if index is None:  # equal params of different requests share one entry
                index = by_id[id(s.params)] = by_value.setdefault(s.params, len(params))
                if index == len(params):
                    params.append(s.params)
            sampled.append(b)
            out_idx.append(s.num_output_tokens)
            p_idx.append(index)
    arrays = (
        list(chain.from_iterable(s.token_ids for s in seqs)),
        list(chain.from_iterable(s.positions for s in seqs)),
        [len(s.token_ids) for s in seqs],
        [s.num_computed_tokens + len(s.token_ids) for s in seqs],
        [len(s.block_ids) for s in seqs],
        list(chain.from_iterable(s.block_ids for s in seqs)),
        sampled, out_idx, p_idx,
    )
    parts = [_HEADER.pack(MAGIC, VERSION, batch.dp_rank, batch.block_size, len(seqs))]
    for values in arrays:
        data = np.asarray(values, dtype="<i4").tobytes()
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    parts.append(pickle.dumps(tuple(params), protocol=pickle.HIGHEST_PROTOCOL))
    return b"".join(parts)


def decode_batch(data: bytes | bytearray | memoryview) -> WireBatch:
    """The batch ``encode_batch`` wrote; WireError on anything else."""
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise WireError(f"step message of {len(view)} bytes is shorter than its header")
    magic, version, dp_rank, block_size, num_seqs = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise WireError(f"not a step message of version {VERSION} (magic {bytes(magic)!r}, version {version})")
    offset = _HEADER.size
    arrays = {}
    for name in _ARRAYS:
        if offset + _LEN.size > len(view):
            raise WireError(f"step message truncated before {name}")
        (size,) = _LEN.unpack_from(view, offset)
        offset += _LEN.size
        if size % 4 or offset + size > len(view):
            raise WireError(f"step message truncated in {name}")
        arrays[name] = np.frombuffer(view[offset:offset + size], dtype="<i4")
        offset += size
    params = pickle.loads(view[offset:])
    batch = WireBatch(dp_rank, block_size, params=params, **arrays)
    if not (len(batch.query_lens_np) == len(batch.context_lens_np) == len(batch.num_blocks) == num_seqs):
        raise WireError(f"step message for {num_seqs} sequences has per-sequence arrays of other lengths")
    return batch


class WireBatch:
    """A decoded step message: the views of ``BatchSpec`` that a worker reads (same names,
    same values). Arrays are int32 numpy; the list views are built on first use."""

    __slots__ = ("dp_rank", "block_size", "input_ids_np", "positions_np", "query_lens_np", "context_lens_np",
                 "num_blocks", "block_ids", "sampled", "output_indices_np", "param_index", "params")

    def __init__(self, dp_rank: int, block_size: int, *, input_ids: np.ndarray, positions: np.ndarray,
                 query_lens: np.ndarray, context_lens: np.ndarray, num_blocks: np.ndarray,
                 block_ids: np.ndarray, sampled: np.ndarray, output_indices: np.ndarray,
                 param_index: np.ndarray, params: tuple[SamplingParams, ...]) -> None:
        self.dp_rank, self.block_size = dp_rank, block_size
        self.input_ids_np, self.positions_np = input_ids, positions
        self.query_lens_np, self.context_lens_np = query_lens, context_lens
        self.num_blocks, self.block_ids = num_blocks, block_ids
        self.sampled, self.output_indices_np, self.param_index = sampled, output_indices, param_index
        self.params = params

    @property
    def is_empty(self) -> bool:
        return len(self.query_lens_np) == 0

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_np)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids_np)

    @property
    def input_ids(self) -> list[int]:
        """[T] token ids of all sequences, concatenated in batch order."""
        return self.input_ids_np.tolist()

    @property
    def positions(self) -> list[int]:
        """[T] position of each token in its sequence."""
        return self.positions_np.tolist()

    @property
    def query_lens(self) -> list[int]:
        """[B] tokens computed per sequence this step."""
        return self.query_lens_np.tolist()

    @property
    def context_lens(self) -> list[int]:
        """[B] cached + new tokens per sequence after this step."""
        return self.context_lens_np.tolist()

    @property
    def block_tables(self) -> list[list[int]]:
        """[B][blocks] block ids per sequence (ragged)."""
        flat = self.block_ids.tolist()
        ends = np.cumsum(self.num_blocks).tolist()
        return [flat[start:end] for start, end in zip([0] + ends[:-1], ends)]

    @property
    def sample_rows(self) -> list[int]:
        """Batch rows whose last token's logits are sampled."""
        return self.sampled.tolist()

    @property
    def logits_indices(self) -> list[int]:
        """[S] index into the flat [T] tokens of each sampled row's last token."""
        if not len(self.sampled):
            return []
        ends = np.cumsum(self.query_lens_np) - 1
        return ends[self.sampled].tolist()

    @property
    def sampling_params(self) -> list[SamplingParams]:
        """[S] params of the sampled rows, in ``sample_rows`` order."""
        params = self.params
        return [params[i] for i in self.param_index.tolist()]

    @property
    def output_indices(self) -> list[int]:
        """[S] per sampled row, the index of the output token being sampled (for seeding)."""
        return self.output_indices_np.tolist()
