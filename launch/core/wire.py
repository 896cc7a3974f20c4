"""The compact step message: one DP rank's batch as a few flat int arrays, not pickled dataclasses.

Shape letters: B sequences in the batch, T tokens in it, N block ids over all its sequences,
S sampled rows, U distinct sampling params among the sampled rows, H rows with a token history
(penalties), X history prefix tokens over them, R released sequences, Q prompt-logprob spans.

``encode_batch(BatchSpec) -> bytes`` is what the driver sends a worker each step on the fast
transport (``launch.step_channel``); ``decode_batch(bytes) -> WireBatch`` gives the worker an
object with the same read-only views ``Worker.execute`` uses from a ``BatchSpec``
(``input_ids``, ``positions``, ``query_lens``, ``context_lens``, ``block_tables``,
``logits_indices``, ``sampling_params``, ``output_indices``). Request ids and per-sequence
objects stay on the driver; ``SamplingParams`` travel once per distinct value of the fields
the sampler reads (``SAMPLER_FIELDS``): rows of greedy requests share one entry, and a row's
entry may be another request's params object with the same sampler fields.

Layout (little-endian): a 20-byte header (magic, version, dp_rank, block_size, B) then
the int32 arrays ``input_ids [T]``, ``positions [T]``, ``query_lens [B]``,
``context_lens [B]``, ``num_blocks [B]``, ``block_ids [N]``, ``sampled [S]`` (batch rows with
``do_sample``), ``output_indices [S]``, ``param_index [S]`` (into the params table), then the
optional sections (empty for plain batches): ``history [4H]`` int64 (row, seq_id,
num_prompt_tokens, prefix length per ``HistoryChunk``), ``history_prefix [X]``, ``released [R]``
int64, ``prompt_logprobs [5Q]`` (row, start, end, next_token_id, num_logprobs per
``PromptLogprobsSpan``; num_logprobs capped at 2**31 - 1, which the worker's vocabulary caps
anyway), each array prefixed by its byte length (sequence ids only grow, past 2**31 on a
long-lived server: int64), then the params table as JSON (U ``SamplingParams`` field dicts; no
pickle crosses the channel).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
from array import array
from itertools import accumulate, chain

from launch.core.batch import BatchSpec, HistoryChunk, PromptLogprobsSpan
from launch.core.sampling_params import SamplingParams

MAGIC = b"MOEB"
VERSION = 3
_HEADER = struct.Struct("<4sIiiI")  # magic, version, dp_rank, block_size, B
_LEN = struct.Struct("<Q")
_ARRAYS = ("input_ids", "positions", "query_lens", "context_lens", "num_blocks", "block_ids", "sampled",
           "output_indices", "param_index", "history", "history_prefix", "released", "prompt_logprobs")
_INT64_ARRAYS = frozenset({"history", "released"})  # they hold sequence ids
_INT32_MAX = 2**31 - 1


# The SamplingParams fields the worker uses (launch.core.sampler); the others (stop strings,
# max_tokens, ...) act on the driver only. A field the sampler reads but this tuple misses would
# let two requests that differ only in it share one entry, one sampled with the other's value.
# (stop_token_ids: min_tokens masks them; prompt_logprobs travels in its spans, not in the table.)
SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "min_tokens", "stop_token_ids", "logit_bias",
                  "allowed_token_ids", "bad_words_token_ids")
_KEYS: dict[int, tuple[SamplingParams, tuple]] = {}
_KEYS_MAX = 4096
_SWAP = sys.byteorder != "little"  # the format is little-endian on every host
if array("i").itemsize != 4:
    raise ImportError("launch.core.wire needs a 4-byte C int")


class WireError(ValueError):
    """Bytes that are not a step message of this version."""


def encode_batch(batch: BatchSpec) -> bytes:
    """One DP rank's batch as a compact message (layout in the module docstring)."""
    seqs = batch.seqs
    by_key: dict[tuple, int] = {}
    params: list[SamplingParams] = []
    sampled, out_idx, p_idx = [], [], []
    for b, s in enumerate(seqs):
        if s.do_sample:
            key = _sampler_key(s.params)
            index = by_key.setdefault(key, len(params))
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
        [v for h in batch.history for v in (h.row, h.seq_id, h.num_prompt_tokens, len(h.prefix))],
        list(chain.from_iterable(h.prefix for h in batch.history)),
        batch.released_seq_ids,
        [v for p in batch.prompt_logprobs
         for v in (p.row, p.start, p.end, p.next_token_id, min(p.num_logprobs, _INT32_MAX))],
    )
    parts = [_HEADER.pack(MAGIC, VERSION, batch.dp_rank, batch.block_size, len(seqs))]
    for name, values in zip(_ARRAYS, arrays):
        data = _to_bytes(array("q" if name in _INT64_ARRAYS else "i", values))
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    parts.append(json.dumps([dataclasses.asdict(p) for p in params], separators=(",", ":")).encode())
    return b"".join(parts)


def _to_bytes(values: array) -> bytes:
    if _SWAP:
        values.byteswap()
    return values.tobytes()


def _from_bytes(data: memoryview, typecode: str = "i") -> array:
    values = array(typecode)
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    return values


def _sampler_key(params: SamplingParams) -> tuple:
    """What the worker's sampler reads from ``params``: rows whose keys are equal share one
    table entry. Cached per object (kept alive by the cache, so its id cannot be reused)."""
    hit = _KEYS.get(id(params))
    if hit is not None and hit[0] is params:
        return hit[1]
    if len(_KEYS) >= _KEYS_MAX:
        _KEYS.clear()
    key = tuple(getattr(params, name) for name in SAMPLER_FIELDS)
    _KEYS[id(params)] = (params, key)
    return key


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
        typecode = "q" if name in _INT64_ARRAYS else "i"
        if size % array(typecode).itemsize or offset + size > len(view):
            raise WireError(f"step message truncated in {name}")
        arrays[name] = _from_bytes(view[offset:offset + size], typecode)
        offset += size
    params = _decode_params(view[offset:])
    batch = WireBatch(dp_rank, block_size, params=params, **arrays)
    if not (len(batch.query_lens_arr) == len(batch.context_lens_arr) == len(batch.num_blocks) == num_seqs):
        raise WireError(f"step message for {num_seqs} sequences has per-sequence arrays of other lengths")
    return batch


class WireBatch:
    """A decoded step message: the views of ``BatchSpec`` that a worker reads (same names,
    same values). Arrays are ``array('i')`` (int32, the ``*_arr`` names and the others); the list views are
    built on each use."""

    __slots__ = ("dp_rank", "block_size", "input_ids_arr", "positions_arr", "query_lens_arr", "context_lens_arr",
                 "num_blocks", "block_ids", "sampled", "output_indices_arr", "param_index", "params", "history",
                 "released_seq_ids", "prompt_logprobs")

    def __init__(self, dp_rank: int, block_size: int, *, input_ids: array, positions: array,
                 query_lens: array, context_lens: array, num_blocks: array, block_ids: array, sampled: array,
                 output_indices: array, param_index: array, params: tuple[SamplingParams, ...],
                 history: array, history_prefix: array, released: array, prompt_logprobs: array) -> None:
        self.dp_rank, self.block_size = dp_rank, block_size
        self.input_ids_arr, self.positions_arr = input_ids, positions
        self.query_lens_arr, self.context_lens_arr = query_lens, context_lens
        self.num_blocks, self.block_ids = num_blocks, block_ids
        self.sampled, self.output_indices_arr, self.param_index = sampled, output_indices, param_index
        self.params = params
        self.history = _history_chunks(history, history_prefix)
        self.released_seq_ids = tuple(released)
        spans = prompt_logprobs.tolist()
        if len(spans) % 5:
            raise WireError(f"step message has a prompt logprobs section of {len(spans)} ints, not 5 per span")
        self.prompt_logprobs = tuple(PromptLogprobsSpan(*spans[i:i + 5]) for i in range(0, len(spans), 5))

    @property
    def is_empty(self) -> bool:
        return len(self.query_lens_arr) == 0

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_arr)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids_arr)

    @property
    def input_ids(self) -> list[int]:
        """[T] token ids of all sequences, concatenated in batch order."""
        return self.input_ids_arr.tolist()

    @property
    def positions(self) -> list[int]:
        """[T] position of each token in its sequence."""
        return self.positions_arr.tolist()

    @property
    def query_lens(self) -> list[int]:
        """[B] tokens computed per sequence this step."""
        return self.query_lens_arr.tolist()

    @property
    def context_lens(self) -> list[int]:
        """[B] cached + new tokens per sequence after this step."""
        return self.context_lens_arr.tolist()

    @property
    def block_tables(self) -> list[list[int]]:
        """[B][blocks] block ids per sequence (ragged)."""
        flat = self.block_ids.tolist()
        ends = list(accumulate(self.num_blocks))
        return [flat[start:end] for start, end in zip([0, *ends[:-1]], ends)]

    @property
    def sample_rows(self) -> list[int]:
        """Batch rows whose last token's logits are sampled."""
        return self.sampled.tolist()

    @property
    def logits_indices(self) -> list[int]:
        """[S] index into the flat [T] tokens of each sampled row's last token."""
        ends = list(accumulate(self.query_lens_arr))
        return [ends[b] - 1 for b in self.sampled]

    @property
    def sampling_params(self) -> list[SamplingParams]:
        """[S] params of the sampled rows, in ``sample_rows`` order."""
        params = self.params
        return [params[i] for i in self.param_index.tolist()]

    @property
    def output_indices(self) -> list[int]:
        """[S] per sampled row, the index of the output token being sampled (for seeding)."""
        return self.output_indices_arr.tolist()


def _history_chunks(fields: array, prefix: array) -> tuple[HistoryChunk, ...]:
    """The ``HistoryChunk`` s of the history section: 4 ints each (the last one the length of its
    prefix, whose tokens follow one another in ``prefix``)."""
    if not fields:
        return ()
    values, tokens = fields.tolist(), prefix.tolist()
    if len(values) % 4 or sum(values[3::4]) != len(tokens):
        raise WireError("step message has a malformed history section")
    chunks, at = [], 0
    for i in range(0, len(values), 4):
        row, seq_id, num_prompt, size = values[i:i + 4]
        chunks.append(HistoryChunk(row, seq_id, num_prompt, tuple(tokens[at:at + size])))
        at += size
    return tuple(chunks)


def _decode_params(data: memoryview) -> tuple[SamplingParams, ...]:
    """The params table: a JSON list of ``SamplingParams`` field dicts (``__post_init__`` turns the
    lists back into the tuples it holds, so the round trip is exact)."""
    try:
        rows = json.loads(bytes(data))
        return tuple(SamplingParams(**row) for row in rows)
    except (ValueError, TypeError) as e:
        raise WireError(f"step message has a malformed params table ({e})") from None
