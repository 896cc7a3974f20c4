"""``python -m launch simulate calibrate --out FILE``: measure this machine for the cost model.

Writes the ``configs/hardware`` format (``parallel.costmodel.Hardware``):

- GEMM rates by row count (the engine's own linear layer, K = N = 1024: the CPU kernel or
  PyTorch's GEMM, whichever the engine runs at that row count) per dtype; the peak FLOP/s is
  the best of them; the per-call overhead of a near-empty GEMM;
- decode attention FLOP/s (as a fraction of the peak) and large-copy memory bandwidth; when the
  engine is timed, the memory bandwidth is instead the rate of reading the engine model's weights
  (its working set: a last-level cache that holds them reads faster than DRAM);
- gloo collectives through commbench (``allreduce``, ``alltoall``, ``allgather`` tables on
  ``--nprocs`` ranks, one rank per process with ``--threads`` threads each; the sizes the layers
  send through shared memory on one host, ``parallel.shm_allreduce``, timed that way), and any
  nccl-tests output given with ``--nccl-table FILE`` (``all_to_all_perf``, ``all_reduce_perf``);
- the engine's fixed costs: in-process decode steps of ``--model`` (default a tiny
  DeepSeek-V3 checkpoint) at its depth and one layer less, at 1, 4 and 8 sequences, the
  operator model fed the expert load those steps routed; what it does not explain is fit as
  per-step, per-layer, per-sequence and per-sequence-per-layer overheads (least squares, each >= 0);
- with ``--ray-ranks N [N ...]``, what an N-rank instance on Ray adds per step over the operator
  model, for each kind of instance: TP, EP (DP attention + expert parallel) and DP replicas without
  EP (the driver/actor round trip, TP's per-layer host work around its collectives, EP's
  dispatcher): wall time, or with ``--clock cpu`` the slowest rank's CPU time per step (a sweep's
  ``measured_step_cpu_ms``). Each rank count is timed apart ("tp:2", "tp:4": four ranks share the
  cores and the wire otherwise than two); the widest count's figures also stand for any other.

On a GPU cluster, ``--base h100 --nccl-table all_to_all_perf.txt:alltoall:16 ...`` writes the
shipped hardware with the measured link tables added instead (nothing measured here: the
measurement flags, ``--threads`` to ``--ray-ranks``, are refused with it). A table's ``OP`` is one of
``parallel.costmodel.hardware.COLLECTIVE_OPS``; ``FILE::NRANKS`` takes it from the table's header.

The memory per rank is the engine's CPU default (``DEFAULT_CPU_MEMORY``), so KV capacity
predictions match what the engine sizes on this machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from launch.config_args import FlagParser
from launch.core.kv_sizing import parse_memory
from launch.engine import DEFAULT_CPU_MEMORY
from launch.hardware import load_hardware, save_hardware
from launch.paths import output_file_problem
from moe.config import ModelConfig
from moe.loading.checkpoint import resolve_checkpoint_files
from moe.loading.errors import NoWeightsError
from parallel.costmodel import Deployment, Hardware, build_rank_load, decode_work, predict_phase
from parallel.costmodel.hardware import COLLECTIVE_OPS, MULTI_RANK_KINDS
from parallel.costmodel.memory import weight_bytes_per_rank
from parallel.costmodel.microbench import DTYPES as GEMM_DTYPES
from parallel.costmodel.microbench import (
    measure_attention_rate,
    measure_call_overhead,
    measure_copy_bandwidth,
    measure_gemm_rates,
    measure_read_bandwidth,
    nccl_table_op,
    parse_nccl_table,
)

ENGINE_BATCHES = (1, 4, 8)
# The smallest working set the engine model's weight reads are measured over (a model smaller than
# this still reads its activations, KV and packed copies beside its weights).
WORKING_SET_MIN_BYTES = 32 * 2**20


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run_collectives(rank: int, world: int, plan: list[tuple[str, list[int]]], repeats: int) -> dict[str, list]:
    from parallel.bench.commbench import run_collective

    out = {}
    for op, counts in plan:  # "auto": the sizes the layers send through shared memory on one host, that way
        runs = [run_collective(rank, world, op, counts, "float32", 3, 10, False, "auto") for _ in range(repeats)]
        out[op] = [(rows[0].size, min(r.out_of_place.time_us for r in rows) * 1e-6) for rows in zip(*runs)]
    return out


def monotone(table: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A larger message never takes less time than a smaller one: each time becomes the
    minimum over itself and every larger size (noise on a shared machine breaks the order)."""
    out, best = [], float("inf")
    for size, seconds in sorted(table, reverse=True):
        best = min(best, seconds)
        out.append((size, best))
    return out[::-1]


def measure_collectives(nprocs: int, threads: int, ops: tuple[str, ...] = ("allreduce", "alltoall", "allgather"),
                        max_bytes: int = 4 << 20, repeats: int = 3) -> dict[str, list[tuple[float, float]]]:
    """{"OP:N": ((bytes, seconds), ...)} from commbench on ``nprocs`` spawned gloo ranks: the
    best of ``repeats`` runs per size, made monotone in size."""
    from parallel.bench.commbench import compute_sizes
    from parallel.bench.ranks import spawn

    plan = [(op, compute_sizes(op, 64, max_bytes, 4, 4, nprocs)) for op in ops]
    rows = spawn(_run_collectives, nprocs, plan, repeats, threads=threads)
    return {f"{op}:{nprocs}": monotone([(float(size), t) for size, t in rows[op]]) for op in ops}


def read_nccl_tables(specs: list[str]) -> dict[str, list[tuple[float, float]]]:
    """``FILE`` or ``FILE:OP:NRANKS`` -> tables; the op and rank count come from the header
    when not given."""
    tables = {}
    for spec in specs:
        path, _, rest = spec.partition(":")
        try:
            text = Path(path).read_text()
        except UnicodeDecodeError:
            raise ValueError(f"--nccl-table {path}: not UTF-8 text") from None
        except OSError as e:
            raise ValueError(f"--nccl-table {path}: {e.strerror or e}") from None
        op, n = nccl_table_op(text)
        if rest:
            given, _, ranks = rest.partition(":")
            if given and given not in COLLECTIVE_OPS:
                raise ValueError(f"--nccl-table {spec}: unknown collective {given!r}; known: "
                                 f"{', '.join(COLLECTIVE_OPS)}")
            op = given or op  # FILE::NRANKS: the collective from the table's header
            if ranks:
                if not (ranks.strip().isascii() and ranks.strip().isdigit()) or int(ranks) < 2:
                    raise ValueError(f"--nccl-table {spec}: NRANKS must be an integer >= 2, got {ranks!r}")
                n = int(ranks)
        if not op or not n:
            raise ValueError(f"{path}: cannot tell the collective and rank count from the table; "
                             f"pass {path}:OP:NRANKS (e.g. {path}:alltoall:8)")
        try:
            tables[f"{op}:{n}"] = parse_nccl_table(text)
        except ValueError as e:
            raise ValueError(f"--nccl-table {path}: {e}") from None
    return tables


class _StepRecorder:
    """Wraps an executor to see each step's batches (which steps are pure decode)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.last = None

    def execute(self, output, collect_load):  # noqa: ANN001, ANN201 (executor protocol)
        self.last = output
        return self.inner.execute(output, collect_load)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def time_decode_steps(engine: object, batch: int, context: int, steps: int, warmup: int,
                      clock: str = "wall") -> list[float]:
    """Seconds (``clock``: wall, this process's CPU time, or ``worker_cpu``: the slowest rank's CPU
    time in the step, ``engine.counters.worker_cpu_seconds_total``) of ``steps`` engine steps in
    which all ``batch`` sequences (over every DP rank) decode one token each, after ``warmup``."""
    import random

    from launch.core import SamplingParams
    from parallel.costmodel.microbench import CLOCKS

    recorder = _StepRecorder(engine.executor)
    engine.executor = recorder
    rng = random.Random(batch)
    vocab = [t for t in range(engine.model_config.vocab_size) if t not in engine.eos_token_ids]
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + context + 8, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(engine.next_request_id(), [rng.choice(vocab) for _ in range(context)], params)
    counters = engine.counters  # worker_cpu: the slowest rank's CPU time in the step, as the sweep measures it
    now = (lambda: counters.worker_cpu_seconds_total) if clock == "worker_cpu" else CLOCKS[clock]
    timed, seen = [], 0
    for _ in range(steps + warmup + 4 * (batch * context // 16 + 8)):
        start = now()
        engine.step()
        wall = now() - start
        batches = recorder.last.batches
        if sum(b.num_seqs for b in batches) == batch and all(b.num_tokens == b.num_seqs for b in batches):
            seen += 1
            if seen > warmup:
                timed.append(wall)
        if len(timed) == steps:
            return timed
    raise RuntimeError(f"only {len(timed)} of {steps} steps decoded all {batch} sequences")


def multi_rank_layout(kind: str, ranks: int) -> tuple[dict[str, object], dict[str, int]]:
    """(the runtime config's ``parallel`` section, ``Deployment`` fields) of a ``ranks``-rank
    instance of ``kind`` (``MULTI_RANK_KINDS``: "tp", "ep" = DP attention + expert parallel, "dp"
    = replicas without EP); "one" for a single rank."""
    if kind == "tp":
        return {"tensor_parallel_size": ranks}, {"tp": ranks}
    if kind == "ep":
        return {"data_parallel_size": ranks, "enable_expert_parallel": True}, {"dp": ranks, "ep": ranks}
    if kind == "dp":
        return {"data_parallel_size": ranks}, {"dp": ranks}
    if kind == "one":
        return {}, {}
    raise ValueError(f"unknown multi-rank kind {kind!r}; expected one of {', '.join(MULTI_RANK_KINDS)}")


def _engine_step_seconds(model_dir: Path, batch: int, dtype: str, steps: int = 16, kind: str = "one",
                         ranks: int = 1, clock: str = "wall") -> tuple[float, np.ndarray | None]:
    """(median seconds of a decode step of ``batch`` sequences on a ``ranks``-rank instance of
    ``kind`` (``multi_rank_layout``), the [L_moe, E] tokens per logical expert the engine routed in
    its steps, None without MoE layers or routed tokens): the load the operator model is fed, so a
    model whose routers favour a few experts (a skewed tiny checkpoint) is modelled reading the
    experts its steps touch, not all of them."""
    from launch.config import RuntimeConfig
    from launch.engine import LLMEngine

    parallel, _ = multi_rank_layout(kind, ranks)
    # CPU-time calibrations stand for ranks of one thread on their own cores, as a sweep pins them
    parallel = {**parallel, "enable_cpu_pinning": clock == "cpu" and ranks > 1}
    cfg = RuntimeConfig.from_dict({"model": str(model_dir), "engine": {
        "dtype": dtype, "max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 256,
        "block_size": 16, "num_kv_blocks": 128}, "parallel": parallel})
    engine = LLMEngine(cfg)
    try:
        # ranks on Ray actors: their CPU time, not this driver's (which only waits for them)
        step_clock = "worker_cpu" if clock == "cpu" and ranks > 1 else clock
        seconds = statistics.median(time_decode_steps(engine, batch, 16, steps, 3, step_clock))
        load = None
        if engine.eplb is not None and engine.eplb.stats.num_steps:
            load = engine.eplb.stats.logical_load(engine.eplb.placement.phy2log).numpy().astype(np.float64)
        return seconds, load if load is not None and load.sum() else None
    finally:
        engine.shutdown()


def check_engine_model(model: str) -> None:
    """ValueError naming what ``--model`` lacks to time engine steps on: a checkpoint directory
    with a config.json this runtime reads and its *.safetensors weights (checked before measuring)."""
    path = Path(model)
    if not path.is_dir():
        what = "is a file" if path.is_file() else "does not exist"
        raise ValueError(f"--model {model} {what}: expected a checkpoint directory (config.json and *.safetensors), "
                         "e.g. one `python -m launch make-tiny` wrote")
    try:
        # the weights the engine would load (an index's shards, no pickles), each header readable
        for file in resolve_checkpoint_files(path).files:
            try:
                with safe_open(str(file), framework="pt"):
                    pass
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        ModelConfig.from_hf(path)
    except NoWeightsError:
        raise ValueError(f"--model {model}: no *.safetensors weights in the directory; the engine steps it times "
                         "need a checkpoint (`python -m launch make-tiny` writes one)") from None
    except (ValueError, KeyError, OSError) as e:  # the loader's errors are ValueError / FileNotFoundError
        raise ValueError(f"--model {model}: {e}") from None


def _truncated_checkpoint(src: Path, dst: Path, num_layers: int) -> Path:
    """A copy of ``src`` keeping only its first ``num_layers`` decoder layers."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        keep = {k: v for k, v in tensors.items()
                if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= num_layers)}
        save_file(keep, f, metadata={"format": "pt"})
    return dst


OVERHEAD_FIELDS = ("step_overhead_s", "layer_overhead_s", "seq_overhead_s", "layer_seq_overhead_s")


def fit_overheads(samples: list[tuple[int, int, float]]) -> dict[str, float]:
    """Least squares of unexplained seconds r = a + b L + c B + d L B over (layers L, sequences
    B, r) samples -> the four ``Hardware`` overhead fields (a, b, c, d), each >= 0 (a term
    that fits negative is dropped and the rest refit)."""
    import numpy as np

    x = np.array([[1.0, layers, seqs, layers * seqs] for layers, seqs, _ in samples])
    y = np.array([r for _, _, r in samples])
    active = list(range(4))
    coef = np.zeros(4)
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return dict(zip(OVERHEAD_FIELDS, (float(c) for c in coef)))


def engine_depths(config: ModelConfig) -> tuple[int, ...]:
    """Depths to time a checkpoint at: its own and one layer less, keeping a MoE layer."""
    n = config.num_hidden_layers
    first_moe = config.moe_layer_ids[0] if config.moe_layer_ids else 0
    return tuple(sorted({max(first_moe + 1, n - 1), n}))


# The read rate is raised in 5 % steps, up to 4x, while the operator model over-predicts a timed
# engine step by more than OVERPREDICT_TOLERANCE of it (see settle_bandwidth).
BANDWIDTH_STEP = 1.05
BANDWIDTH_MAX_FACTOR = 4.0
OVERPREDICT_TOLERANCE = 0.03


def settle_bandwidth(bandwidth: float, predict: Callable[[float], list[float]], measured: list[float]
                     ) -> float:
    """The read rate the operator model uses for the engine's own steps: ``bandwidth`` (measured by a
    read of the model's weights), raised in ``BANDWIDTH_STEP`` factors (at most ``BANDWIDTH_MAX_FACTOR``)
    until no step is predicted more than ``OVERPREDICT_TOLERANCE`` above its measured time.
    ``predict(bw)`` -> seconds per sample; ``measured``: the samples' seconds. The read benchmark
    swings with what other guests hold of a shared last-level cache (14.7 to 25 GB/s for the same
    117 MiB within an hour on the AMX box), and the engine's steps read only the experts they route
    to: a model slower than the steps it was fitted on has no overhead left to fit (all four came out
    zero) and over-predicts every point. A model faster than the steps keeps the slack as overheads."""
    bw = bandwidth
    while bw < bandwidth * BANDWIDTH_MAX_FACTOR:
        over = [p - m for p, m in zip(predict(bw), measured)]
        if all(o <= OVERPREDICT_TOLERANCE * m for o, m in zip(over, measured)):
            break
        bw *= BANDWIDTH_STEP
    return min(bw, bandwidth * BANDWIDTH_MAX_FACTOR)


def measure_engine_overheads(hw: Hardware, dtype: str, log: Callable[[str], None], clock: str = "wall",
                             model: str | None = None) -> dict[str, float]:
    """The overhead fields (``fit_overheads``): engine decode steps minus the operator model,
    on ``model`` (a checkpoint dir; default a tiny DeepSeek-V3) at two depths; and the
    ``memory_bandwidth`` the operator model used for them (the model's weights' read rate, raised
    where the steps ran faster than it allows: ``settle_bandwidth``)."""
    from launch.tiny_checkpoint import make_tiny_checkpoint

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(model) if model else make_tiny_checkpoint("deepseek_v3", Path(tmp) / "full")
        config = ModelConfig.from_hf(full)
        weights = weight_bytes_per_rank(config, Deployment(dtype=dtype))
        bandwidth = measure_read_bandwidth(max(weights, WORKING_SET_MIN_BYTES), clock=clock)
        log(f"weights of the engine's model: {weights / 2**20:.1f} MiB, read at {bandwidth / 1e9:.1f} GB/s "
            f"(large copy: {hw.memory_bandwidth / 1e9:.1f} GB/s)")
        dep = Deployment(dtype=dtype, max_num_seqs=8, max_num_batched_tokens=256, kv_capacity_tokens=2048)
        for depth in engine_depths(config):
            model_dir = _truncated_checkpoint(full, Path(tmp) / f"l{depth}", depth)
            mc = ModelConfig.from_hf(model_dir)
            for batch in ENGINE_BATCHES:
                measured, load = _engine_step_seconds(model_dir, batch, dtype, clock=clock)
                runs.append((depth, batch, measured, mc, build_rank_load(mc, dep, expert_load=load)))

    def predict(bw: float) -> list[float]:
        at = Hardware.from_dict({**hw.to_dict(), "memory_bandwidth": bw})
        return [predict_phase(mc, dep, at, load, decode_work(batch, 17), decode=True).step_ms / 1e3
                for _, batch, _, mc, load in runs]

    measured = [m for _, _, m, _, _ in runs]
    settled = settle_bandwidth(bandwidth, predict, measured)
    if settled > bandwidth:
        log(f"the engine's steps ran faster than reads at {bandwidth / 1e9:.1f} GB/s allow: modelled at "
            f"{settled / 1e9:.1f} GB/s")
    samples = []
    for (depth, batch, m, _, _), p in zip(runs, predict(settled)):
        log(f"engine decode step: {depth} layer(s), batch {batch}: {m * 1e3:.2f} ms measured, "
            f"{p * 1e3:.2f} ms from operators")
        samples.append((depth, batch, m - p))
    return {"memory_bandwidth": settled, **fit_overheads(samples)}


MULTI_RANK_REPEATS = 3


def measure_multi_rank_overheads(hw: Hardware, dtype: str, ranks: int, log: Callable[[str], None],
                                 model: str | None = None, clock: str = "wall",
                                 kinds: tuple[str, ...] = MULTI_RANK_KINDS,
                                 repeats: int = MULTI_RANK_REPEATS) -> dict[str, float]:
    """Seconds per step a ``ranks``-rank instance of ``model`` (default a tiny DeepSeek-V3) on Ray
    adds over the operator model and the single-rank overheads, per kind of instance (``kinds``
    of ``MULTI_RANK_KINDS``): the driver/actor round trip, and what each kind's host work adds
    beyond its modelled collectives (TP's in every layer, EP's dispatcher). Each kind is started
    ``repeats`` times, the kinds in turn, and its median step taken: one TP2 instance's steps
    differ from the next's by up to 1.2x on a shared box (7.3-8.6 ms), however many steps are
    timed. A kind the model cannot be split by (TP over heads that do not divide) is logged and
    left out."""
    from launch.tiny_checkpoint import make_tiny_checkpoint

    batch = 2 * ranks
    steps: dict[str, list[float]] = {kind: [] for kind in kinds}  # a kind that cannot be built leaves it
    loads: dict[str, np.ndarray | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(model) if model else make_tiny_checkpoint("deepseek_v3", Path(tmp) / "full")
        mc = ModelConfig.from_hf(model_dir)
        for _ in range(max(1, repeats)):
            for kind in [k for k in kinds if k in steps]:
                try:
                    measured, load = _engine_step_seconds(model_dir, batch, dtype, kind=kind, ranks=ranks,
                                                          clock=clock)
                except ValueError as e:
                    log(f"{kind.upper()}{ranks} not timed: {e}")
                    del steps[kind]
                    continue
                steps[kind].append(measured)
                loads.setdefault(kind, load)
    out: dict[str, float] = {}
    what = "the slowest rank's CPU time" if clock == "cpu" else "wall"
    for kind, times in steps.items():
        dep = Deployment(**multi_rank_layout(kind, ranks)[1], dtype=dtype, max_num_seqs=8,
                         max_num_batched_tokens=256, kv_capacity_tokens=2048)
        rank_load = build_rank_load(mc, dep, expert_load=loads[kind])
        modelled = predict_phase(mc, dep, hw, rank_load, decode_work(batch // dep.dp, 17), decode=True).step_ms / 1e3
        measured = statistics.median(times)
        log(f"engine decode step, {kind.upper()}{ranks} on Ray, batch {batch}: "
            f"{' / '.join(f'{t * 1e3:.2f}' for t in times)} ms measured ({what}; median {measured * 1e3:.2f}), "
            f"{modelled * 1e3:.2f} ms modelled without the round trip")
        out[kind] = max(0.0, measured - modelled)
    return out


def oversubscribed_note(nprocs: int, threads: int, cpus: int | None = None) -> str | None:
    """A note when ``nprocs`` ranks of ``threads`` threads are more than this machine's ``cpus``
    (default: the CPUs this process may run on): their collectives' wall time then includes waiting
    for a core, which the engine steps' CPU time leaves out (docs/layouts.md, "Each rank count timed
    apart"). None when they fit."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nprocs * threads <= cpus:
        return None
    return (f"note: --nprocs {nprocs} x {threads} thread(s) is more than this machine's {cpus} CPUs: the {nprocs}-rank "
            "collective tables include waiting for a core, and multi-rank points of that many ranks are predicted "
            "high; a count that fits the cores, rescaled, predicts them better")


def with_multi_rank_overheads(hw: Hardware, dtype: str, rank_counts: Sequence[int], log: Callable[[str], None],
                              model: str | None = None, clock: str = "wall") -> Hardware:
    """``hw`` with what each kind of multi-rank instance adds per step at each of ``rank_counts``
    (those above one; ``measure_multi_rank_overheads``): keys "tp:2", "tp:4" ..., and a plain "tp"
    with the widest count that timed the kind, which stands for any count not timed;
    ``multi_rank_step_overhead_s`` is the largest plain figure (a kind never timed, an older reader)."""
    counts = sorted({n for n in rank_counts if n > 1})
    extra: dict[str, float] = {}
    for ranks in counts:  # the widest last: its figures are also each kind's for any other count
        for kind, seconds in measure_multi_rank_overheads(hw, dtype, ranks, log, model, clock).items():
            extra[f"{kind}:{ranks}"] = extra[kind] = seconds
    if not extra:
        log(f"note: no {' or '.join(map(str, counts))}-rank instance of the model could be built (above); "
            "multi-rank layouts are predicted without a per-step overhead")
    else:
        log("multi-rank step overhead (ms): " + ", ".join(
            f"{kind.upper()}{ranks} {v * 1e3:.2f}" for (kind, _, ranks), v in
            ((k.partition(":"), v) for k, v in extra.items() if ":" in k)))
    widest = {k: v for k, v in extra.items() if ":" not in k}
    return Hardware.from_dict({**hw.to_dict(), "multi_rank_overheads": extra,
                               "multi_rank_step_overhead_s": max(widest.values(), default=0.0)})


def with_link_tables(base: Hardware, tables: dict[str, list[tuple[float, float]]], source: str) -> Hardware:
    """``base`` (e.g. the shipped h100) with measured collective tables added (replacing any
    of the same op and rank count): what a GPU cluster's nccl-tests runs know better than
    the datasheet."""
    if not tables:
        raise ValueError("--base needs at least one --nccl-table to add")
    merged = {**base.to_dict()["collectives"], **{k: [list(p) for p in v] for k, v in tables.items()}}
    note = f"{base.source}; collectives from {source}" if base.source else f"collectives from {source}"
    return Hardware.from_dict({**base.to_dict(), "collectives": merged, "source": note})


def calibrate(*, threads: int = 1, nprocs: tuple[int, ...] = (2,), dtypes: tuple[str, ...] = ("float32", "bfloat16"),
              nccl_tables: tuple[str, ...] = (), measure_engine: bool = True, engine_dtype: str = "float32",
              ray_ranks: int | Sequence[int] = 0, clock: str = "wall", model: str | None = None,
              log: Callable[[str], None] = print) -> Hardware:
    """Measure this machine (see the module docstring) with ``threads`` torch threads per rank.
    clock "cpu": compute and engine steps timed in CPU time (see ``microbench``); the
    collectives and the Ray round trip stay wall-clock (waiting is their cost)."""
    if clock == "cpu" and threads != 1:
        raise ValueError("--clock cpu needs --threads 1 (CPU time adds up over threads)")
    if torch.cuda.is_available():
        log("note: calibrate measures this machine's CPU ranks; for GPUs use --base NAME with nccl-tests tables")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gemm = {dt: measure_gemm_rates(dt, clock=clock) for dt in dtypes}
        flops = {dt: max(rate for _, rate in table) for dt, table in gemm.items()}
        attention = measure_attention_rate(dtypes[0], clock=clock)
        overhead = measure_call_overhead(dtypes[0], clock=clock)
        bandwidth = measure_copy_bandwidth(clock=clock)
        log(f"GEMM peak: {', '.join(f'{dt} {f / 1e9:.1f} GFLOP/s' for dt, f in flops.items())}; "
            f"attention {attention / 1e9:.1f} GFLOP/s; copy {bandwidth / 1e9:.1f} GB/s; call {overhead * 1e6:.1f} us")
        collectives: dict[str, list[tuple[float, float]]] = {}
        for n in nprocs:
            if (note := oversubscribed_note(n, threads)) is not None:
                log(note)
            collectives.update(measure_collectives(n, threads))
        collectives.update(read_nccl_tables(list(nccl_tables)))
        link = 0.0
        for key, table in collectives.items():
            if key.startswith("alltoall"):
                size, seconds = table[-1]
                link = max(link, size / seconds)
        hw = Hardware(
            name="local-cpu", source=f"simulate calibrate: {cpu_model()}, {threads} thread(s) per rank, {clock} clock",
            flops=flops, memory_bandwidth=bandwidth, memory_bytes=parse_memory(DEFAULT_CPU_MEMORY),
            gpus_per_node=os.cpu_count() or 1, intra_node_bandwidth=link or bandwidth,
            inter_node_bandwidth=link or bandwidth, intra_node_latency_s=0.0, inter_node_latency_s=0.0,
            gemm_efficiency=1.0, attention_efficiency=min(1.0, attention / flops[dtypes[0]]),
            memory_efficiency=1.0, network_efficiency=1.0, kernel_overhead_s=overhead,
            gemm_rates={dt: tuple(t) for dt, t in gemm.items()},
            collectives={k: tuple(v) for k, v in collectives.items()},
        )
        if measure_engine:
            fitted = measure_engine_overheads(hw, engine_dtype, log, clock, model)
            hw = Hardware.from_dict({**hw.to_dict(), **fitted})
            log("engine overheads (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in fitted.items()
                                                        if k in OVERHEAD_FIELDS))
        counts = (ray_ranks,) if isinstance(ray_ranks, int) else tuple(ray_ranks)
        if any(n > 1 for n in counts):
            hw = with_multi_rank_overheads(hw, engine_dtype, counts, log, model, clock)
        return hw
    finally:
        torch.set_num_threads(previous)


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m launch simulate calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where to write the hardware YAML (or .json)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank while measuring (default 1)")
    p.add_argument("--nprocs", default=None,
                   help="rank counts for the gloo collectives, e.g. 2,4 ('' for none; default 2)")
    p.add_argument("--dtypes", default=None, help="GEMM dtypes to time (default float32,bfloat16)")
    p.add_argument("--nccl-table", action="append", default=[], metavar="FILE[:OP:NRANKS]",
                   help="nccl-tests output (all_to_all_perf / all_reduce_perf, or commbench's) to include")
    p.add_argument("--base", default=None,
                   help="start from this hardware (h100, a file) and only add the --nccl-table tables: a GPU "
                        "cluster's measured links on top of the datasheet; nothing is measured here")
    p.add_argument("--no-engine", action="store_true", help="skip the engine overhead measurement")
    p.add_argument("--engine-dtype", default=None, choices=("float32", "bfloat16"), help="default float32")
    p.add_argument("--model", default=None,
                   help="checkpoint dir to time the engine overheads on (default: a tiny DeepSeek-V3); use the model "
                        "the predictions are for")
    p.add_argument("--clock", choices=("wall", "cpu"), default=None,
                   help="cpu: time compute and engine steps in CPU time (steady on a shared machine; --threads 1)")
    p.add_argument("--ray-ranks", type=int, nargs="+", default=None, metavar="N",
                   help="also time TP, EP and DP instances of each of these many Ray ranks for what each adds per "
                        "step (0: skip)")
    return p


# What --base leaves unmeasured: these flags would have no effect with it (flag, attribute).
MEASUREMENT_FLAGS = (("--threads", "threads"), ("--nprocs", "nprocs"), ("--dtypes", "dtypes"),
                     ("--no-engine", "no_engine"), ("--engine-dtype", "engine_dtype"), ("--model", "model"),
                     ("--clock", "clock"), ("--ray-ranks", "ray_ranks"))
MEASUREMENT_DEFAULTS = {"threads": 1, "nprocs": "2", "dtypes": "float32,bfloat16", "engine_dtype": "float32",
                        "clock": "wall", "ray_ranks": [0]}


def _check_base_flags(args: argparse.Namespace) -> None:
    """ValueError naming a measurement flag given with --base (which measures nothing), then the
    measurement flags' defaults filled in."""
    if args.base:
        for flag, name in MEASUREMENT_FLAGS:
            if getattr(args, name) not in (None, False):
                raise ValueError(f"{flag} has no effect with --base, which measures nothing here (it adds the "
                                 "--nccl-table tables to that hardware): drop one of them")
    for name, value in MEASUREMENT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_base_flags(args)
        parts = [n.strip() for n in args.nprocs.split(",") if n.strip()]
        if not all(n.isascii() and n.isdigit() for n in parts):
            raise ValueError(f"--nprocs takes comma-separated integers, got {args.nprocs!r}")
        nprocs = tuple(int(n) for n in parts)
        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        if any(n < 2 for n in nprocs):
            raise ValueError(f"--nprocs values must be >= 2, got {args.nprocs}")
        if not dtypes:
            raise ValueError("--dtypes names no dtype")
        if unknown := [d for d in dtypes if d not in GEMM_DTYPES]:
            raise ValueError(f"--dtypes: unknown dtype(s) {unknown}; expected a comma-separated list of "
                             f"{', '.join(GEMM_DTYPES)}")
        if bad := [n for n in args.ray_ranks if n < 0 or n == 1]:
            raise ValueError(f"--ray-ranks must be 0 (skip) or >= 2, got {bad[0]}")
        if args.model is not None and args.no_engine:
            raise ValueError("--model times the engine's steps, which --no-engine skips: drop one of them")
        if args.model is not None:
            check_engine_model(args.model)
        read_nccl_tables(args.nccl_table)  # every table readable before anything is measured
        if (problem := output_file_problem(args.out)) is not None:
            raise ValueError(f"--out: {problem}")  # now, not after the measurements
        if args.base:
            hw = with_link_tables(load_hardware(args.base), read_nccl_tables(args.nccl_table),
                                  ", ".join(args.nccl_table))
            save_hardware(hw, args.out)
            print(f"wrote {args.out}")
            return 0
        hw = calibrate(threads=args.threads, nprocs=nprocs, dtypes=dtypes, nccl_tables=tuple(args.nccl_table),
                       measure_engine=not args.no_engine, engine_dtype=args.engine_dtype, ray_ranks=args.ray_ranks,
                       clock=args.clock, model=args.model)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: simulate calibrate: {e}", file=sys.stderr)
        return 2
    save_hardware(hw, args.out)
    print(f"wrote {args.out}")
    return 0
