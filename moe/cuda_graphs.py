"""CUDA graphs of the decode step: the model forward recorded once per shape, then replayed.

On a GPU the op-by-op forward is bound by the host: a decode step of the small DeepSeek-style
checkpoint launches ~1,800 kernels, 24-44 ms of Python and launch work for 0.05-0.25 ms of GPU
bytes (docs/benchmarks.md, H200). A CUDA graph records those launches once and replays them as one.

Shapes are fixed per graph, so a step is padded to a bucket: B sequences to the next of
``batch_buckets`` (1, 2, 4, 8, then multiples of 8, as vLLM captures), and the block-table width to
the next power of two (at least ``MIN_BLOCKS``) of the step's longest context. Padded rows decode
token 0 at position 0 into the scratch block (a KV block the allocator never hands out, context 1:
they attend to their own entry), count nothing in the MoE layers' slot load (``MoELayer.count_rows``)
and are cut before lm_head (which runs after the replay: one GEMM, and no [Bb, V] logits buffer
held per graph); padded table columns point at the scratch block and are masked by each
sequence's context length, as the eager path masks its own padding. Every row's values are its own:
the layers are row-wise except attention, which reads only the row's own sequence.

Graphs are captured on first use of a bucket (a warm-up forward on a side stream, then the capture,
all rows padding), share one memory pool, and are dropped when the model's parameters, buffers or
cache pools move (``moe.plan_watch`` announces it; their addresses are compared then). Inputs reach
the GPU in one asynchronous copy from pinned memory per step.

``DecodeGraphs`` takes a ``backend``: ``CudaGraphBackend`` on CUDA; ``EagerBackend`` re-runs the
recorded callable on the same static buffers (CPU tests of the padding and buffer logic, which
is everything but the recording).

Shape letters: B sequences, Bb its bucket, NB blocks per sequence (bucketed), S block size, V vocab.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moe import plan_watch
from moe.experts import library_grouped_mm
from moe.kv_cache import AttentionMetadata, PagedKVCache

log = logging.getLogger(__name__)

MIN_BLOCKS = 4  # the narrowest block-table bucket
WARMUP_RUNS = 2  # eager forwards on the side stream before the first capture (lazy inits, library handles)
# A bucket is recorded on its CAPTURE_AFTER-th step; until then its steps run eagerly. Serving with
# requests arriving over time walks the batch size through many buckets, most of them for a step or
# two: recording each on first use (two warm-up forwards and a capture each, ~100 buckets) held an
# H200 server at 16 requests/s to 4.5 requests/s and a 41 s median TTFT (docs/benchmarks.md).
CAPTURE_AFTER = 8


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for, up to ``max_batch``: 1, 2, 4, 8, 16, 24, ... (multiples
    of 8), the last one ``max_batch`` itself when it is not on the ladder."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    ladder = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return ladder + [max_batch]


def blocks_bucket(blocks: int, max_blocks: int) -> int:
    """The block-table width a step whose longest sequence spans ``blocks`` blocks runs at: the next
    power of two >= max(blocks, MIN_BLOCKS), at most ``max_blocks``."""
    if blocks > max_blocks:
        raise ValueError(f"{blocks} blocks exceed the {max_blocks} a sequence can have")
    return min(max_blocks, 1 << (max(blocks, MIN_BLOCKS) - 1).bit_length())


def not_capturable(model: torch.nn.Module) -> str | None:
    """Why ``model``'s decode forward cannot be recorded as it stands, or None when it can. A
    recording may not read the device back, and the routed experts do (their per-slot row counts)
    unless they run on PyTorch's grouped GEMM (``moe.experts.library_grouped_mm``: bf16 on CUDA with
    compute capability 8.0+), whose group offsets stay on the device."""
    for layer in model.moe_layers():
        experts = layer.experts
        w13, w2 = experts.w13, experts.w2
        if not experts.use_kernel or library_grouped_mm(w13.new_empty(1, w13.shape[-1]), w13, w2) is None:
            return (f"layer {layer.layer_id}'s routed experts ({str(w13.dtype).removeprefix('torch.')} on "
                    f"{w13.device.type}) do not run on PyTorch's grouped GEMM, so their row counts are read back")
    return None


class EagerBackend:
    """Stands in for CUDA graphs off CUDA: ``capture`` runs ``fn`` once and ``replay`` runs it again on
    the same static inputs. Tests the padding and static-buffer logic on a CPU."""

    name = "eager"

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()

        def replay() -> None:
            out.copy_(fn())

        return replay, out

    def after_copy(self) -> None:
        pass

    def before_fill(self) -> None:
        pass


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` capture and replay on ``device``, one memory pool for every graph."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._copied: torch.cuda.Event | None = None
        self._side: torch.cuda.Stream | None = None  # the warm-up and capture stream
        self._warm = False  # a capture has run (later ones warm up once)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Warm-up forwards on a side stream (two before the first capture, one after), then the
        recording. Not ``torch.cuda.graph``: its entry empties the device and pinned-host caching
        allocators for every capture, so the eager steps after it allocate everything afresh."""
        side = self._side = self._side or torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(1 if self._warm else WARMUP_RUNS):
                fn()
        self._warm = True
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            # thread_local: another thread's CUDA calls (a server's) do not invalidate this capture
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return graph.replay, out

    def after_copy(self) -> None:
        """Mark the inputs' copy from the pinned staging buffer (which the next step refills)."""
        event = self._copied = self._copied or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))

    def before_fill(self) -> None:
        """Wait until the last step's copy out of the staging buffer has run (it has, in practice:
        the step read its sampled tokens back, so this only asks)."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()


@dataclass
class _Graph:
    """One bucket's static buffers and recorded forward."""

    batch: int  # Bb
    blocks: int  # NB
    staging: torch.Tensor  # [5 Bb + Bb NB] int64 on the host (pinned on CUDA)
    inputs: torch.Tensor  # the same on the device: ids | positions | slots | context | count | tables
    replay: Callable[[], None]
    hidden: torch.Tensor  # [Bb, D] after the final norm, written by each replay


class DecodeGraphs:
    """The decode steps of ``model`` (``MoEModel``) over ``kv_cache`` as recorded graphs.

    ``scratch_block``: a block of ``kv_cache`` no sequence is ever given (padded rows write there).
    ``max_batch``: the largest batch run on a graph (larger ones run eagerly). ``max_blocks``: blocks
    one sequence can span (max_model_len / S, rounded up). ``run`` returns None for a step it does not
    serve; the caller then runs the model eagerly."""

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, *, scratch_block: int, max_batch: int,
                 max_blocks: int, backend: EagerBackend | CudaGraphBackend | None = None,
                 capture_after: int = CAPTURE_AFTER) -> None:
        if not 0 <= scratch_block < kv_cache.num_blocks:
            raise ValueError(f"scratch_block {scratch_block} is not a block of the cache ({kv_cache.num_blocks})")
        self.model, self.kv_cache = model, kv_cache
        self.scratch_block, self.block_size = scratch_block, kv_cache.block_size
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks
        self.device = next(model.parameters()).device
        self.backend = backend or (CudaGraphBackend(self.device) if self.device.type == "cuda" else EagerBackend())
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.disabled: str | None = None  # why graphs stopped being used (a failed capture), else None
        self.captures = 0
        self.capture_seconds = 0.0  # wall time spent warming up and recording, all captures
        self.capture_after = max(1, capture_after)
        self._seen: dict[tuple[int, int], int] = {}  # steps asked per bucket not yet recorded
        self._epoch = plan_watch.epoch()
        self._addresses = self._tensor_addresses()

    def bucket(self, context_lens: Sequence[int]) -> tuple[int, int] | None:
        """(Bb, NB) for a decode step of sequences with these context lengths, None when it runs
        eagerly (too many sequences, or graphs disabled)."""
        if self.disabled is not None or not context_lens or len(context_lens) > self.buckets[-1]:
            return None
        if self.kv_cache.calculate_kv_scales and not all(self.kv_cache.calibrated):
            return None  # fp8 scales still to be set from the first real entries
        batch = next(b for b in self.buckets if b >= len(context_lens))
        blocks = -(-max(context_lens) // self.block_size)
        if blocks > self.max_blocks:
            return None
        return batch, blocks_bucket(blocks, self.max_blocks)

    def run(self, input_ids: Sequence[int], positions: Sequence[int], context_lens: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """One decode step (one new token per sequence: ``input_ids``, ``positions``, ``context_lens``
        [B], ``block_tables`` B lists of block ids) on its bucket's graph. Writes the step's KV entries
        and slot load as the eager forward does. Returns logits [B, V] float32 (lm_head of the
        replay's first B rows), or None when the step is not served here."""
        key = self.bucket(context_lens)
        if key is None or len(input_ids) != len(context_lens):
            return None
        self._drop_if_moved()
        graph = self.graphs.get(key)
        if graph is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            if seen < self.capture_after:
                return None  # a bucket this step may never see again: eager (see CAPTURE_AFTER)
            graph = self._capture(*key)
            if graph is None:
                return None
        self.backend.before_fill()
        _fill(graph.staging.numpy(), graph.batch, graph.blocks, self.block_size, self.scratch_block,
              input_ids, positions, context_lens, block_tables)
        graph.inputs.copy_(graph.staging, non_blocking=True)
        self.backend.after_copy()
        graph.replay()
        return self.model.compute_logits(graph.hidden[: len(input_ids)])

    # ---- capture ---------------------------------------------------------------------

    def _capture(self, batch: int, blocks: int) -> _Graph | None:
        started = time.perf_counter()
        pinned = self.device.type == "cuda"
        size = 5 * batch + batch * blocks
        staging = torch.empty(size, dtype=torch.int64, pin_memory=pinned)
        _fill(staging.numpy(), batch, blocks, self.block_size, self.scratch_block, (), (), (), ())  # all padding
        inputs = staging.to(self.device)
        ids, pos, slots, ctx, count = inputs[: 5 * batch].view(5, batch)
        tables = inputs[5 * batch:].view(batch, blocks)
        meta = AttentionMetadata(
            query_lens=torch.ones(batch, dtype=torch.int64, device=self.device), context_lens=ctx,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int64, device=self.device), slot_mapping=slots,
            block_tables=tables, block_size=self.block_size, query_lens_list=(1,) * batch,
            # the widest context the bucket holds: what the forward sizes its gathers by
            context_lens_list=(blocks * self.block_size,) * batch, query_start_loc_list=tuple(range(batch + 1)))
        model, kv_cache = self.model, self.kv_cache
        layers = list(model.moe_layers())

        def forward() -> torch.Tensor:
            for layer in layers:
                layer.set_count_rows(count)
            try:
                return model(ids, pos, meta, kv_cache)  # [Bb, D]
            finally:
                for layer in layers:
                    layer.set_count_rows(None)

        try:
            replay, hidden = self.backend.capture(forward)
        except Exception as exc:  # a capture the runtime refuses: this process decodes eagerly from here on
            self.disabled = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            self.graphs.clear()
            log.warning("CUDA graph capture failed for batch %d x %d blocks; decoding without graphs (%s)",
                        batch, blocks, self.disabled)
            return None
        self.captures += 1
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        log.info("recorded the decode step for %d sequences x %d blocks in %.0f ms (%d graphs, %.1f s in all)",
                 batch, blocks, seconds * 1e3, len(self.graphs) + 1, self.capture_seconds)
        graph = self.graphs[(batch, blocks)] = _Graph(batch, blocks, staging, inputs, replay, hidden)
        return graph

    def _tensor_addresses(self) -> tuple[int, ...]:
        model = self.model
        return (tuple(p.data_ptr() for p in model.parameters()) + tuple(b.data_ptr() for b in model.buffers())
                + tuple(p.data_ptr() for p in self.kv_cache.pools))

    def _drop_if_moved(self) -> None:
        """Forget every graph when a parameter, buffer or pool the graphs read has a new address (a
        placement's new buffers, a reload): checked when a module announced a change."""
        epoch = plan_watch.epoch()
        if epoch == self._epoch:
            return
        self._epoch = epoch
        addresses = self._tensor_addresses()
        if addresses != self._addresses:
            self._addresses = addresses
            if self.graphs:
                log.info("model tensors moved: dropping %d CUDA graphs", len(self.graphs))
            self.graphs.clear()


def _fill(out: np.ndarray, batch: int, blocks: int, block_size: int, scratch: int, input_ids: Sequence[int],
          positions: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None:
    """A bucket's inputs into ``out`` [5 Bb + Bb NB] int64: ids, positions, cache slots, context
    lengths, slot-load counts (1 real, 0 padding), then the block tables [Bb, NB] row-major. Rows
    past the B given (and table columns past each sequence's blocks) are padding: token 0 at
    position 0 in the scratch block's first slot, context 1."""
    n = len(context_lens)
    head = out[: 5 * batch].reshape(5, batch)
    head[0, n:] = 0
    head[1, n:] = 0
    head[2, n:] = scratch * block_size
    head[3, n:] = 1
    head[4, :n] = 1
    head[4, n:] = 0
    tables = out[5 * batch:].reshape(batch, blocks)
    tables.fill(scratch)
    if n:
        head[0, :n] = input_ids
        head[1, :n] = positions
        ctx = head[3, :n]
        ctx[:] = context_lens
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = table[:blocks]
        last = ctx - 1
        head[2, :n] = tables[np.arange(n), last // block_size] * block_size + last % block_size
