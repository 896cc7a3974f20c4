"""One rank of the runtime: its model shard, KV pool, dispatcher and routing statistics.

A plain class: tests build it in-process, ``launch/cluster.py`` wraps it with
``ray.remote`` at spawn time. Every method is a thin shell: the driver decides
(batches, placements, move plans) and every worker executes the same decision.

Shape legend: T tokens in this rank's batch, B sequences, L MoE layers, P physical slots.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from launch.core import BatchSpec, SampledTokens, Sampler
from launch.core.sampler import rank_seed
from launch.core.token_history import TokenHistory, gather_logprobs, prompt_logprob_positions
from moe import plan_watch
from moe.capacity import CapacityConfig
from moe.config import ModelConfig
from moe.cpu_gemm import native_gemv, use_native_gemv
from moe.cuda_graphs import DecodeGraphs, not_capturable
from moe.kv_cache import AttentionMetadata, PagedKVCache, copy_to_device
from moe.loader import load_weights
from moe.model import MoEModel

log = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
KEEP_FREED_MEMORY_ENV = "MOE_MALLOC_KEEP"


def keep_freed_heap_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse in this process: large blocks from the
    heap instead of their own mmap (``M_MMAP_MAX`` 0) and no trimming of the heap's top.

    Otherwise every large activation of a step (a prefill's expert rows, GEMM outputs) goes back
    to the kernel when freed and comes back as fresh pages the kernel zeroes on first touch: in
    ``bench throughput``'s offline run (a 3,303-token prefill step, then 93 decode steps) on a
    KVM guest that was ~475k page faults and ~2.5 s of system time, against ~75k and ~1.7 s with
    this (the prefill step 9.6-10.3 s against 9.2-9.7 s). The memory a step peaked at stays
    mapped, as with tcmalloc/jemalloc, which CPU serving guides preload for the same reason.
    Linux with glibc only; ``MOE_MALLOC_KEEP=0`` leaves malloc as it is. Returns whether the
    settings applied.
    """
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def node_host() -> str:
    """This node's address as the cluster sees it (Ray's node IP inside a Ray worker)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return os.environ.get("MASTER_ADDR") or "127.0.0.1"


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build its shard (picklable; identical on every rank).

    phy2log: initial placement [L, P] int64 (None = identity, no redundant slots).
    capacity: the typed capacity settings (dropless by default); the MoE layers enforce the
    "local" scope, the dispatcher the "global" one.
    pin_cpu: pin this rank's process to one CPU (its index among the node's ranks, modulo
    the CPUs it may use) and one torch thread; ``shutdown`` undoes it.
    cudagraph_max_batch: on a CUDA device, decode steps of up to this many sequences replay CUDA
    graphs (``moe.cuda_graphs``; 0: never); max_model_len sizes their block tables (None: the
    model's max_position_embeddings).
    eos_token_ids: the model's EOS ids (the driver's), which ``min_tokens`` masks.
    """

    model_path: str
    dtype: str = "bfloat16"
    tp: int = 1
    dp: int = 1
    ep: int | None = None
    num_nodes: int = 1
    all2all_backend: str = "alltoall"
    num_kv_blocks: int = 256
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    phy2log: torch.Tensor | None = None
    capacity: CapacityConfig = CapacityConfig()
    seed: int = 0
    dist_timeout_s: float = 300.0
    num_threads: int | None = None
    migration_method: str = "p2p"
    pin_cpu: bool = False
    cudagraph_max_batch: int = 0
    max_model_len: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


@dataclass
class StepResult:
    """A rank's reply to one step. sampled: None on ranks that do not report tokens
    (tp_rank > 0). slot_load: [L, P] int64 assignments per slot this step (tp_rank 0 only).
    capacity: per MoE layer (dropped, rerouted) this step: local-scope decisions (made on
    the whole batch, identical across a TP group) from tp_rank 0 only, plus this rank's own
    share of global-scope drops (each TP rank dispatches its own slice: the driver sums them).
    seconds / cpu_seconds: wall and process CPU time of the step on this rank (the Ray
    executor reports the slowest rank of the DP group in cpu_seconds: the step's critical
    path in CPU time, which other people's load on a shared machine moves far less)."""

    sampled: SampledTokens | None
    slot_load: torch.Tensor | None = None
    capacity: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    # seconds, cpu_seconds, has sampled, has logprobs, has prompt logprobs, S, L, P (-1: no load)
    _HEAD = struct.Struct("<ddBBBqqq")

    def to_bytes(self) -> bytes:
        """The reply on the fast step transport: a header, token ids [S], capacity [L, 2] and
        slot load [L, P] as int64, then the logprobs as JSON (rows of [rank, [token id, logprob]
        pairs], or null) when any row asked for them, then the prompt logprobs as JSON (per span, per
        position [rank, its pairs]) when the batch scored prompt positions."""
        sampled = self.sampled
        ids = np.asarray(sampled.token_ids if sampled is not None else [], dtype="<i8")
        capacity = np.asarray(self.capacity, dtype="<i8").reshape(-1, 2)
        load = None if self.slot_load is None else self.slot_load.numpy().astype("<i8", copy=False)
        if load is not None and (load.ndim != 2 or load.shape[0] != len(capacity)):
            raise ValueError(f"slot load of shape {load.shape} with capacity counters for {len(capacity)} layers")
        logprobs = sampled.logprobs if sampled is not None else None
        prompt = sampled.prompt_logprobs if sampled is not None else None
        parts = [self._HEAD.pack(self.seconds, self.cpu_seconds, sampled is not None, logprobs is not None,
                                 prompt is not None, len(ids), len(capacity), -1 if load is None else load.shape[1]),
                 ids.tobytes(), capacity.tobytes()]
        if load is not None:
            parts.append(load.tobytes())
        if logprobs is not None:
            ranks = sampled.logprob_ranks or [None] * len(logprobs)
            parts.append(json.dumps([None if row is None else [rank, list(row.items())]
                                     for row, rank in zip(logprobs, ranks)]).encode())
        if prompt is not None:
            ranks = sampled.prompt_logprob_ranks or [[None] * len(span) for span in prompt]
            # after the logprobs' JSON: a newline (which json.dumps never writes) splits the two
            parts.append(b"\n" + json.dumps([[[rank, list(entry.items())] for entry, rank in zip(span, span_ranks)]
                                             for span, span_ranks in zip(prompt, ranks)]).encode())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray) -> StepResult:
        """What ``to_bytes`` wrote (slot_load as an int64 tensor [L, P])."""
        (seconds, cpu_seconds, has_sampled, has_logprobs, has_prompt, num_ids, num_layers,
         num_slots) = cls._HEAD.unpack_from(data, 0)
        offset = cls._HEAD.size
        ids = np.frombuffer(data, dtype="<i8", count=num_ids, offset=offset)
        offset += 8 * num_ids
        capacity = np.frombuffer(data, dtype="<i8", count=2 * num_layers, offset=offset).reshape(num_layers, 2)
        offset += 16 * num_layers
        load = None
        if num_slots >= 0:
            count = num_layers * num_slots
            load = torch.from_numpy(np.frombuffer(data, dtype="<i8", count=count, offset=offset)
                                    .reshape(num_layers, num_slots).copy())
            offset += 8 * count
        tail = bytes(memoryview(data)[offset:])
        logprobs_json, _, prompt_json = tail.partition(b"\n") if has_prompt else (tail, b"", b"")
        logprobs, ranks = _decode_logprobs(logprobs_json) if has_logprobs else (None, None)
        prompt, prompt_ranks = _decode_prompt_logprobs(prompt_json) if has_prompt else (None, None)
        sampled = SampledTokens(token_ids=ids.tolist(), logprobs=logprobs, prompt_logprobs=prompt,
                                logprob_ranks=ranks, prompt_logprob_ranks=prompt_ranks) if has_sampled else None
        return cls(sampled, load, [(a, b) for a, b in capacity.tolist()], seconds, cpu_seconds)


def _decode_logprobs(data: bytes) -> tuple[list[dict[int, float] | None], list[int | None]]:
    """Per sampled row {token id: logprob} (insertion order kept: the sampled token first), or None;
    and per row the sampled token's rank (None beside a None row)."""
    rows = json.loads(data)
    return ([None if row is None else {int(t): float(lp) for t, lp in row[1]} for row in rows],
            [None if row is None else row[0] for row in rows])


def _decode_prompt_logprobs(data: bytes) -> tuple[list[list[dict[int, float]]], list[list[int]]]:
    """Per prompt span, per position {token id: logprob} (the scored prompt token first), and the
    scored token's rank."""
    spans = json.loads(data)
    return ([[{int(t): float(lp) for t, lp in entry[1]} for entry in span] for span in spans],
            [[entry[0] for entry in span] for span in spans])


class Worker:
    """One rank: ``Worker(spec, rank)`` is cheap; ``setup(init_method)`` joins the process
    groups, builds and loads the shard; then ``execute`` once per step."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self._place(spec, rank)
        self.groups = None
        self._where = "setup"  # the collective this rank is in or about to enter (error messages)
        self._model_steps = 0  # non-empty steps run, counted up to 2 (see keep_freed_heap_memory)
        # (plan_watch.epoch(), MoE layers, their slot_load buffers) as of that epoch: see _moe_counters
        self._counters_of: tuple[int, tuple[Any, ...], list[torch.Tensor]] | None = None
        self._unpinned: tuple[set[int], int] | None = None
        if spec.pin_cpu:
            self._unpinned = pin_to_cpu(rank % (spec.world_size // max(spec.num_nodes, 1)))

    def _place(self, spec: WorkerSpec, rank: int) -> None:
        from parallel.layout import Layout

        self.spec, self.rank = spec, rank
        self.layout = Layout(tp=spec.tp, dp=spec.dp, ep=spec.ep, num_nodes=spec.num_nodes)
        self.coords = self.layout.coords(rank)

    def process_id(self) -> int:
        """This rank's pid; answering at all means the actor is up."""
        return os.getpid()

    def rendezvous_address(self, host: str | None = None) -> str:
        """A tcp:// init method on this rank's node (called on rank 0 only): a free port on
        ``host`` (default MASTER_ADDR, else this host's address). Rank 0's store listens
        on that address only (``parallel.groups.create_rendezvous_store``)."""
        import socket

        from parallel.groups import free_port

        host = host or os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        return f"tcp://{host}:{free_port(host)}"

    def setup(self, init_method: str | None = None) -> dict[str, Any]:
        """Join the process groups (world > 1), build the model shard, load it, allocate KV."""
        from parallel.dispatch import build_dispatcher

        spec, rank = self.spec, self.rank
        if spec.world_size > 1:
            from parallel.groups import build_process_groups, init_distributed

            init_distributed(rank, spec.world_size, init_method=init_method, timeout=spec.dist_timeout_s)
            self.groups = build_process_groups(self.layout, rank, timeout=spec.dist_timeout_s)
        self.config = ModelConfig.from_hf(spec.model_path)
        self.dtype = DTYPES[spec.dtype]
        self.phy2log = self._initial_phy2log()
        backend = spec.all2all_backend if self.layout.ep_size > 1 else "local"
        global_cap = spec.capacity if spec.capacity.is_global else None
        dispatcher = build_dispatcher(backend, self.groups, self.layout, global_capacity=global_cap)
        self.model = MoEModel(
            self.config, dtype=self.dtype, local_slots=self._local_slots(), dispatcher=dispatcher,
            tp_group=self.groups.tp if self.groups else None, tp_rank=self.coords.tp_rank, tp_size=spec.tp,
            capacity=spec.capacity, tp_shm=self.groups.tp_shm if self.groups else None,
        )
        for i, layer in enumerate(self.model.moe_layers()):
            layer.set_placement(self.phy2log[i], self.layout.ep_size, self.coords.ep_rank)
        # strict: a tensor nothing reads is an UnexpectedTensorError before the first write, as in vLLM
        self.load_report = load_weights(self.model, spec.model_path, dtype=self.dtype)
        for layer in self.model.moe_layers():
            layer.experts.set_quantization(spec.quantization)
        self.model.shard_for_tp()
        # CPU here; on a GPU node the shard lives on this rank's device (nccl groups).
        self.device = self.groups.device if self.groups else torch.device(
            "cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model.to(self.device)
        if self.device.type == "cpu":
            from moe import kernels

            kernels.is_available()  # load (or build) the CPU expert kernel now, not inside a step's collective
        graphs = self._cuda_graphs_apply()
        # with graphs, one more block than the scheduler hands out: padded rows write there
        self.kv_cache = PagedKVCache(self.config, spec.num_kv_blocks + graphs, spec.block_size, self.dtype,
                                     spec.kv_cache_dtype, tp_size=spec.tp, device=self.device)
        self.decode_graphs: DecodeGraphs | None = None
        if graphs:
            max_len = spec.max_model_len or self.config.max_position_embeddings
            self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, scratch_block=spec.num_kv_blocks,
                                              max_batch=spec.cudagraph_max_batch,
                                              max_blocks=-(-max_len // spec.block_size))
        self.sampler = Sampler(seed=rank_seed(spec.seed, self.coords.dp_rank), eos_token_ids=spec.eos_token_ids)
        self.token_history = TokenHistory(self.config.vocab_size, self.device)  # rows with penalties
        self.one_row_gemv = use_native_gemv(self.dtype, self.device)
        if spec.world_size > 1:
            self._track_collectives()
        return self.ping()

    def _cuda_graphs_apply(self) -> bool:
        """Whether decode steps run on CUDA graphs here: graphs asked for, and none of
        ``_graphs_refused``'s reasons (logged once when graphs were asked for but cannot run)."""
        if self.spec.cudagraph_max_batch <= 0:
            return False
        why = self._graphs_refused() or not_capturable(self.model)
        if why is not None:  # asked for (--cuda-graphs) and not taken: said where the user sees it
            log.warning("decoding without CUDA graphs: %s", why)
        return why is None

    def _graphs_refused(self) -> str | None:
        """Why this rank's decode steps cannot be recorded, or None: they need a CUDA device, a
        single rank (no collective inside a recorded forward), dropless experts (no capacity step reads counts
        back), full attention, unquantized experts (int8 ones run on a dequantized copy that is
        remade when they change)."""
        spec = self.spec
        if self.device.type != "cuda":
            return f"the model runs on {self.device.type}, not on a CUDA device"
        if spec.world_size > 1 or self.layout.ep_size > 1:
            return (f"{spec.world_size} ranks (tp {spec.tp}, dp {spec.dp}, ep {self.layout.ep_size}): graphs run on "
                    "a single rank")
        if spec.capacity.enabled:
            return "capacity-factor enforcement reads the expert counts back in every step"
        if self.config.sliding_window is not None:
            return "sliding-window attention"
        if spec.quantization is not None:
            return f"{spec.quantization} experts"
        return None

    def _track_collectives(self) -> None:
        """Label each layer's collective before it is entered, so a failure can name it."""
        ep = f"all_to_all over the EP group ({self.layout.ep_size} ranks)"
        for layer in self.model.model.layers:
            i = layer.layer_id
            self._label(layer.self_attn, f"layer {i} attention all_reduce over the TP group")
            self._label(layer.mlp, f"layer {i} MoE dispatch/combine {ep}" if hasattr(layer.mlp, "experts")
                        else f"layer {i} MLP all_reduce over the TP group")

    def _label(self, module: torch.nn.Module, where: str) -> None:
        def hook(*_: Any) -> None:
            self._where = where

        module.register_forward_pre_hook(hook)

    def _collective_error(self, exc: BaseException) -> BaseException:
        """A failed or timed-out collective as ``CollectiveError`` naming rank and collective
        (other errors unchanged)."""
        import torch.distributed as dist

        from launch.recovery import CollectiveError, PeerGoneError

        text = str(exc)
        if not (isinstance(exc, dist.DistError) or any(k in text for k in ("gloo", "Timed out", "Connection",
                                                                          "NCCL", "timed out"))):
            return exc
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
        if "imed out" in text:
            what = (f"did not complete within parallel.collective_timeout_s={self.spec.dist_timeout_s:g}s "
                    "(a peer rank stalled or died)")
            return CollectiveError(f"rank {self.rank}: {self._where} {what} [{first[:200]}]")
        return PeerGoneError(f"rank {self.rank}: {self._where} failed: a peer rank went away [{first[:200]}]")

    # ---- placement -------------------------------------------------------------------

    def _initial_phy2log(self) -> torch.Tensor:
        num_moe = len(self.config.moe_layer_ids)
        if self.spec.phy2log is None:
            return torch.arange(self.config.num_experts).repeat(num_moe, 1)
        phy2log = torch.as_tensor(self.spec.phy2log, dtype=torch.int64)
        if phy2log.dim() != 2 or phy2log.shape[0] != num_moe:
            raise ValueError(f"placement phy2log has shape {tuple(phy2log.shape)}, expected [{num_moe}, P] "
                             f"for {num_moe} MoE layers")
        self.layout.num_local_slots(phy2log.shape[1])  # raises when P does not split over ep
        return phy2log

    def _local_slots(self) -> dict[int, list[int]]:
        slots = self.layout.local_slots(self.coords.ep_rank, self.phy2log.shape[1])
        return {layer_id: self.phy2log[i, slots.start:slots.stop].tolist()
                for i, layer_id in enumerate(self.config.moe_layer_ids)}

    # ---- steps -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: BatchSpec, collect_load: bool = True) -> StepResult:
        """Run one step on this rank's batch (possibly empty: then only the MoE collectives
        run, so every EP rank enters every collective). A collective that fails or times
        out raises ``CollectiveError`` naming this rank and the collective."""
        try:
            return self._execute(batch, collect_load)
        except RuntimeError as exc:
            error = self._collective_error(exc)
            if error is exc:
                raise
            raise error from None

    def _execute(self, batch: BatchSpec, collect_load: bool) -> StepResult:
        started, cpu_started = time.perf_counter(), time.process_time()
        if not batch.is_empty and self._model_steps < 2:
            self._model_steps += 1
            if self._model_steps == 2:
                # from the second step on, after the weights, their packed copies (made in the
                # first step) and the KV cache got their own mappings: temporaries reuse memory
                keep_freed_heap_memory()
        sampled = None
        report = self.coords.tp_rank == 0
        if batch.is_empty:
            self._run_collectives_only()
        else:
            self._record_history(batch)
            rows = batch.logits_indices  # strictly increasing: all T of them is every row (decode steps)
            hidden = None
            # [B, V] float32, or None: not a graph step (a step scoring prompt positions needs every row's hidden)
            logits = None if batch.prompt_logprobs else self._graph_logits(batch)
            if logits is None:
                logits, hidden = self._eager_logits(batch, rows)
            sampled = self._sample(batch, logits) if rows else SampledTokens()
            if batch.prompt_logprobs and report:
                sampled.prompt_logprobs, sampled.prompt_logprob_ranks = self._prompt_logprobs(batch, hidden)
        load, capacity = self._read_counters(collect_load and report, report)
        if batch.is_empty:
            sampled = SampledTokens()
        return StepResult(sampled if report else None, load, capacity, time.perf_counter() - started,
                          time.process_time() - cpu_started)

    def _record_history(self, batch: BatchSpec) -> None:
        """Keep the token history of the rows with penalties (``TokenHistory``), after dropping the
        sequences the driver released."""
        if batch.released_seq_ids:
            self.token_history.release(batch.released_seq_ids)
        if batch.history:
            self.token_history.record(batch.history, batch.input_ids, batch.query_lens, batch.context_lens)

    def _sample(self, batch: BatchSpec, logits: torch.Tensor) -> SampledTokens:
        """logits: [S, V] float32 of the sampled rows -> their tokens (and logprobs when asked)."""
        params = batch.sampling_params
        seq_ids = None
        if batch.history:  # the sampled rows' sequences, for those with a penalty
            seq_of_row = {chunk.row: chunk.seq_id for chunk in batch.history}
            seq_ids = [seq_of_row.get(b, -1) for b in batch.sample_rows]
        out = self.sampler(logits, params, batch.output_indices, seq_ids=seq_ids, history=self.token_history)
        return out.to_sampled_tokens(params)

    # rows of a prompt's logits scored at once: [PROMPT_LOGPROBS_ROWS, V] float32 at a time
    PROMPT_LOGPROBS_ROWS = 512

    def _prompt_logprobs(self, batch: BatchSpec,
                         hidden: torch.Tensor) -> tuple[list[list[dict[int, float]]], list[list[int]]]:
        """hidden: [T, D] of the step. Per ``PromptLogprobsSpan`` the raw logprob entries of its
        positions and the scored tokens' ranks (``launch.core.token_history.gather_logprobs``)."""
        spans = batch.prompt_logprobs
        flat, targets = prompt_logprob_positions(spans, batch.input_ids, batch.query_lens, batch.context_lens)
        counts = [n for span in spans for n in [span.num_logprobs] * (span.end - span.start)]
        index = torch.tensor(flat, dtype=torch.int64, device=hidden.device)
        target = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
        entries, ranks = [], []
        for at in range(0, len(flat), self.PROMPT_LOGPROBS_ROWS):
            part = slice(at, at + self.PROMPT_LOGPROBS_ROWS)
            logits = self.model.compute_logits(hidden.index_select(0, index[part]))  # [<= rows, V]
            part_entries, part_ranks = gather_logprobs(logits, target[part], counts[part])
            entries.extend(part_entries)
            ranks.extend(part_ranks)
        out, out_ranks, at = [], [], 0
        for span in spans:
            out.append(entries[at:at + span.end - span.start])
            out_ranks.append(ranks[at:at + span.end - span.start])
            at += span.end - span.start
        return out, out_ranks

    def _graph_logits(self, batch: BatchSpec) -> torch.Tensor | None:
        """A decode step (one new token per sequence) on a CUDA graph: logits [S, V] float32 of the
        sampled rows; None when graphs are off here or the step is not one they serve."""
        graphs = self.decode_graphs
        if graphs is None or batch.num_tokens != batch.num_seqs:
            return None
        logits = graphs.run(batch.input_ids, batch.positions, batch.context_lens, batch.block_tables)  # [B, V]
        rows = batch.sample_rows
        if logits is None or len(rows) == batch.num_seqs:
            return logits
        # a one-token prefill chunk short of its prompt's end (one token of budget left) samples nothing
        # through pinned memory: a pageable copy to the GPU would wait for the replay to finish
        (index,) = copy_to_device([torch.tensor(rows, dtype=torch.int64)], logits.device)
        return logits.index_select(0, index)

    def _eager_logits(self, batch: BatchSpec, rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The step's forward op by op. Returns logits [len(rows), V] float32 of the sampled rows
        (None when no row samples: a mid-prompt prefill chunk) and the hidden states [T, D]."""
        meta = AttentionMetadata.build(batch.query_lens, batch.context_lens, batch.block_tables,
                                       self.spec.block_size, device=self.device)
        pick = bool(rows) and len(rows) != len(batch.input_ids)  # some rows sample, not all (prefill chunks)
        # ids, positions and the sampling rows' index [R] (when picked) in one copy
        on_host = [torch.tensor(batch.input_ids, dtype=torch.int64), torch.tensor(batch.positions, dtype=torch.int64)]
        ids, pos, *picked = copy_to_device(on_host + ([torch.tensor(rows, dtype=torch.int64)] if pick else []),
                                           self.device)
        # one token: every weight GEMM has one row, where the native GEMV streams the weights
        # faster than oneDNN (B=1 decode step on the small checkpoint: 33 -> 28 ms)
        with native_gemv(self.one_row_gemv and len(batch.input_ids) == 1):
            hidden = self.model(ids, pos, meta, self.kv_cache)  # [T, D]
            if not rows:
                return None, hidden
            return self.model.compute_logits(hidden.index_select(0, picked[0]) if pick else hidden), hidden

    def _run_collectives_only(self) -> None:
        # An idle DP rank: no attention, but each MoE layer's dispatch is a collective over
        # the EP group, in layer order, exactly as a non-empty forward would enter it.
        d, k = self.config.hidden_size, self.config.num_experts_per_tok
        x = torch.empty(0, d, dtype=self.dtype, device=self.device)
        ids = torch.empty(0, k, dtype=torch.int64, device=self.device)
        w = torch.empty(0, k, dtype=torch.float32, device=self.device)
        for layer in self.model.moe_layers():
            self._where = f"layer {layer.layer_id} MoE dispatch/combine over the EP group (idle rank)"
            layer.dispatcher.dispatch_combine(x, ids, w, layer.experts, layer.layer_id)

    def _read_counters(self, collect_load: bool, count_local: bool) -> tuple[torch.Tensor | None,
                                                                              list[tuple[int, int]]]:
        layers, loads = self._moe_counters()
        load = torch.stack(loads).cpu() if collect_load and loads else None
        if loads:
            torch._foreach_zero_(loads)  # one op for every layer (a batch-1 step reads them every step)
        if not self.spec.capacity.enabled:  # dropless: no layer or dispatcher drops or reroutes
            return load, [(0, 0)] * len(layers)
        capacity = []
        for layer in layers:
            dropped, rerouted = (layer.counters["dropped"], layer.counters["rerouted"]) if count_local else (0, 0)
            stats = getattr(layer.dispatcher, "capacity_stats", {}).get(layer.layer_id)
            if stats is not None:
                dropped += int(stats.dropped)
                rerouted += int(getattr(stats, "rerouted", 0))
                layer.dispatcher.capacity_stats.pop(layer.layer_id, None)
            capacity.append((dropped, rerouted))
            layer.counters["dropped"] = layer.counters["rerouted"] = 0
        return load, capacity

    def _moe_counters(self) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
        """The MoE layers and their slot_load buffers [P] int64, kept while no module announced a
        change (``moe.plan_watch``: a placement assigns new buffers, a new layer registers its own).
        Walking the model for them every step cost ~0.1 ms of a ~6 ms batch-1 step (cold objects)."""
        epoch = plan_watch.epoch()
        kept = self._counters_of
        if kept is None or kept[0] != epoch:
            layers = tuple(self.model.moe_layers())
            kept = self._counters_of = (epoch, layers, [layer.slot_load for layer in layers])
        return kept[1], kept[2]

    # ---- rebalancing -----------------------------------------------------------------

    def apply_move_plan(self, plan: Any, new_phy2log: torch.Tensor) -> dict[str, int]:
        """Move expert weights per ``plan`` (identical on every rank), then switch placement."""
        from parallel.migration import apply_move_plan

        layers = list(self.model.moe_layers())
        names = [f"model.layers.{layer.layer_id}.mlp.experts" for layer in layers]
        self._where = "expert migration (isend/irecv over the EP group)"
        try:
            result = apply_move_plan(
                plan, [layer.experts for layer in layers], new_phy2log, self.coords.ep_rank,
                self.groups.ep if self.groups else None, method=self.spec.migration_method,
                checkpoint=self.spec.model_path, module_names=names,
            )
        except RuntimeError as exc:
            error = self._collective_error(exc)
            if error is exc:
                raise
            raise error from None
        for i, layer in enumerate(layers):
            layer.set_placement(new_phy2log[i], self.layout.ep_size, self.coords.ep_rank)
        self.phy2log = new_phy2log.clone()
        return {"received": result.num_received, "sent": result.num_sent, "local": result.num_local_copies,
                "bytes": result.bytes_received}

    # ---- introspection ---------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        """Where this rank lives (for error messages and node-major checks)."""
        return {"rank": self.rank, "pid": os.getpid(), "coords": self.coords.__dict__,
                "local_experts": self._local_slots(), "cpus": sorted(os.sched_getaffinity(0)),
                "num_threads": torch.get_num_threads()}

    def expert_fingerprint(self) -> list[list[float]]:
        """Per MoE layer, per local slot, a checksum of its weights (tests check migrations)."""
        return [[float(layer.experts.w13[s].float().sum() + layer.experts.w2[s].float().sum())
                 for s in range(layer.experts.num_local_slots)] for layer in self.model.moe_layers()]

    # ---- fast step transport (launch.step_channel) --------------------------------------

    def open_step_channel(self, host: str | None = None) -> tuple[str, int, bytes]:
        """Listen for the driver's step connection on ``host`` (default: this node's address);
        returns (host, port, token) for ``StepClient``. Steps then arrive as
        ``launch.core.wire`` messages and run ``execute`` on the channel's thread."""
        from launch.step_channel import StepServer

        self.close_step_channel()
        self._step_server = StepServer(self._serve_step, host or node_host())
        return self._step_server.address

    def _serve_step(self, payload: bytearray) -> bytes:
        from launch.core.wire import decode_batch

        if self.device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(self.device)
        batch = decode_batch(memoryview(payload)[1:])
        return self.execute(batch, bool(payload[0])).to_bytes()

    def close_step_channel(self) -> None:
        server = self.__dict__.pop("_step_server", None)
        if server is not None:
            server.close()

    def reset(self, spec: WorkerSpec, rank: int | None = None) -> None:
        """After a peer's fault: leave the (broken) process groups and drop the shard and KV
        cache; ``setup`` then builds everything again from ``spec`` as ``rank`` (default: the
        same rank; another one when the group shrinks to its survivors or grows back)."""
        import torch.distributed as dist

        self.close_step_channel()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._place(spec, self.rank if rank is None else rank)
        if spec.pin_cpu:  # a new rank index may mean another core; undo to the state before the first pin
            before = pin_to_cpu(self.rank % (spec.world_size // max(spec.num_nodes, 1)))
            self._unpinned = self._unpinned or before
        self.groups, self._where = None, "setup"
        for name in ("model", "kv_cache"):
            self.__dict__.pop(name, None)

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.close_step_channel()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._unpinned is not None:
            cpus, threads = self._unpinned
            _set_process_affinity(cpus)
            torch.set_num_threads(threads)
            self._unpinned = None


def pin_to_cpu(index: int) -> tuple[set[int], int]:
    """Pin every thread of this process to the ``index``-th CPU it may use (modulo their
    count) and torch to one thread. Returns (the CPUs and torch threads before), to undo."""
    allowed = sorted(os.sched_getaffinity(0))
    before = (set(allowed), torch.get_num_threads())
    torch.set_num_threads(1)
    _set_process_affinity({allowed[index % len(allowed)]})
    return before


def _set_process_affinity(cpus: set[int]) -> None:
    # sched_setaffinity(0) moves only the calling thread; move every thread that exists
    # (Ray's and gloo's included), and threads started later inherit the mask.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that exited meanwhile
            pass
