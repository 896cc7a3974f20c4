"""Hardware as data: peak rates, bandwidths and efficiencies one cost-model prediction reads.

A ``Hardware`` is built from a plain mapping (``configs/hardware/*.yaml`` parsed by
``launch.hardware.load_hardware``, or what ``simulate calibrate`` measured), so this module does no
file I/O. Rates are per accelerator (one rank); bandwidths are one direction, bytes/s.

Efficiencies are global per hardware (never per workload): an operator's time is
``max(FLOPs / (peak x efficiency), bytes / (bandwidth x memory_efficiency))`` plus a
per-kernel overhead. Measured tables, when present, replace the peak x efficiency
product: ``gemm_rates[dtype]`` = ((rows, FLOP/s), ...) by the GEMM's row count M, and
``collectives["allreduce:N"]`` / ``["alltoall:N"]`` = ((bytes, seconds), ...) for N ranks
(the nccl-tests / commbench tables), interpolated log-log between sizes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Kinds of multi-rank instance with their own per-step overhead: tensor parallel, DP attention +
# expert parallel, data-parallel replicas without EP.
MULTI_RANK_KINDS = ("tp", "ep", "dp")
# the collectives a ``Hardware.collectives`` table may time (keys "OP:NRANKS")
COLLECTIVE_OPS = ("allreduce", "alltoall", "allgather", "reducescatter")

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                 "fp8_e4m3": "fp8", "float8": "fp8"}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16', 'fp32' -> 'float32', ...; unknown names pass through."""
    name = str(name).replace("torch.", "")
    return DTYPE_ALIASES.get(name, name)


def _table(rows: Any, what: str) -> tuple[tuple[float, float], ...]:
    out = tuple(sorted((float(x), float(y)) for x, y in rows))
    if not out or any(not (0 < x < math.inf and 0 < y < math.inf) for x, y in out):
        raise ValueError(f"{what}: need non-empty (size, value) pairs with positive finite numbers, got {rows!r}")
    return out


def _number(value: Any, key: str) -> float:
    """A hardware file's number (YAML 1.1 reads "5e-06" as a string): finite, else ValueError naming the key."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"hardware key {key}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"hardware key {key}: {value!r} is not a finite number")
    return number


def interpolate_loglog(table: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x on a sorted ((x, y), ...) table, log-log linear inside, clamped slope-preserving
    outside: below the first point y is the first y (latency floor); above the last point y
    grows linearly with x (bandwidth-bound tail)."""
    xs = [p[0] for p in table]
    if x <= xs[0]:
        return table[0][1]
    if x >= xs[-1]:
        return table[-1][1] * x / xs[-1]
    i = bisect.bisect_left(xs, x)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


@dataclass(frozen=True)
class Hardware:
    """One accelerator type and its links. See the module docstring for the time formula.

    flops: peak dense FLOP/s by dtype ("fp8", "bfloat16", "float16", "float32").
    memory_bandwidth: B/s; memory_bytes: per accelerator; gpus_per_node: ranks per node.
    intra_node_bandwidth / inter_node_bandwidth: B/s per rank, one direction (NVLink;
    the rank's NIC). *_latency_s: fixed cost of one message / collective hop.
    kernel_overhead_s: per operator call; layer_overhead_s: per decoder layer per step;
    step_overhead_s: per step (scheduler, sampling, host round trip);
    multi_rank_step_overhead_s: added per step when an instance spans more than one rank
    (sending every rank its batch and waiting for the replies, e.g. a Ray actor round trip);
    multi_rank_overheads: the same measured per kind of instance ("tp": tensor parallel,
    "ep": DP attention + expert parallel, "dp": data-parallel replicas without EP), which
    pay differently (TP's collectives in every layer, EP's dispatcher, DP's round trip
    alone); a key "tp:4" holds the kind at one rank count (four ranks share the cores and
    the wire differently from two), a plain "tp" any rank count not given its own key; a
    kind with neither falls back to multi_rank_step_overhead_s;
    seq_overhead_s / layer_seq_overhead_s: per sequence in the step, and per sequence per
    layer (host-side loops over sequences: scheduling, sampling, paged-attention gathers).
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: int
    gpus_per_node: int = 8
    intra_node_bandwidth: float = 0.0
    inter_node_bandwidth: float = 0.0
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6
    gemm_efficiency: float = 0.6
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    network_efficiency: float = 0.8
    kernel_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    multi_rank_step_overhead_s: float = 0.0
    multi_rank_overheads: dict[str, float] = field(default_factory=dict)
    seq_overhead_s: float = 0.0
    layer_seq_overhead_s: float = 0.0
    gemm_rates: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    collectives: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        if not self.flops or any(v <= 0 for v in self.flops.values()):
            raise ValueError(f"hardware {self.name!r}: flops needs positive FLOP/s per dtype, got {self.flops}")
        for name in ("memory_bandwidth", "memory_bytes", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "network_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency_s", "inter_node_latency_s",
                     "kernel_overhead_s", "layer_overhead_s", "step_overhead_s", "multi_rank_step_overhead_s",
                     "seq_overhead_s", "layer_seq_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")
        for key, seconds in self.multi_rank_overheads.items():
            kind, colon, ranks = key.partition(":")
            if kind not in MULTI_RANK_KINDS or (colon and not (ranks.isascii() and ranks.isdigit() and int(ranks) >= 2)):
                raise ValueError(f"hardware {self.name!r}: multi_rank_overheads key {key!r} must be one of "
                                 f"{', '.join(MULTI_RANK_KINDS)}, or one of them and a rank count >= 2 "
                                 "(e.g. 'tp:4')")
            if seconds < 0:
                raise ValueError(f"hardware {self.name!r}: multi_rank_overheads.{key} must be >= 0, got {seconds}")
        for key in self.collectives:
            op, _, n = key.partition(":")
            if op not in COLLECTIVE_OPS:
                raise ValueError(f"hardware {self.name!r}: collective table key {key!r}: unknown collective {op!r} "
                                 f"(known: {', '.join(COLLECTIVE_OPS)})")
            if not (n.isascii() and n.isdigit()):
                raise ValueError(f"hardware {self.name!r}: collective table key {key!r} must be 'OP:NRANKS' with "
                                 "NRANKS a rank count")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hardware:
        """Strict: unknown keys raise naming the key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown hardware key(s) {unknown}; known: {sorted(known)}")
        missing = [f.name for f in fields(cls) if f.name in ("name", "flops", "memory_bandwidth", "memory_bytes")
                   and f.name not in data]
        if missing:
            raise ValueError(f"hardware {data.get('name', '?')!r}: missing required key(s) {missing}")
        kw = dict(data)
        if not isinstance(data["flops"], dict):
            raise ValueError(f"hardware key flops: expected a mapping of dtype to FLOP/s, got {data['flops']!r}")
        kw["flops"] = {canonical_dtype(k): _number(v, f"flops.{k}") for k, v in data["flops"].items()}
        kw["gemm_rates"] = {canonical_dtype(k): _table(v, f"gemm_rates.{k}")
                            for k, v in dict(data.get("gemm_rates") or {}).items()}
        kw["collectives"] = {k: _table(v, f"collectives.{k}") for k, v in dict(data.get("collectives") or {}).items()}
        overheads = data.get("multi_rank_overheads") or {}
        if not isinstance(overheads, dict):
            raise ValueError(f"hardware key multi_rank_overheads: expected a mapping of tp / ep / dp (or tp:N ...) to seconds, "
                             f"got {overheads!r}")
        kw["multi_rank_overheads"] = {str(k): _number(v, f"multi_rank_overheads.{k}") for k, v in overheads.items()}
        for f in fields(cls):  # YAML 1.1 reads "5e-06" as a string: numbers are coerced here
            if f.name in kw and f.type in ("float", float):
                kw[f.name] = _number(kw[f.name], f.name)
        for name in ("memory_bytes", "gpus_per_node"):
            if name in kw:
                number = _number(kw[name], name)
                if not number.is_integer():
                    raise ValueError(f"hardware key {name}: {kw[name]!r} is not a whole number")
                kw[name] = int(number)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, floats) in the ``from_dict`` format."""
        d = asdict(self)
        d["gemm_rates"] = {k: [list(p) for p in v] for k, v in self.gemm_rates.items()}
        d["collectives"] = {k: [list(p) for p in v] for k, v in self.collectives.items()}
        return d

    # ---- rates ---------------------------------------------------------------------------

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; fp8 falls back to bf16 where the hardware has no fp8."""
        dtype = canonical_dtype(dtype)
        if dtype in self.flops:
            return self.flops[dtype]
        for fallback in ("bfloat16", "float16", "float32"):
            if fallback in self.flops:
                return self.flops[fallback]
        return next(iter(self.flops.values()))

    def gemm_rate(self, dtype: str, rows: float) -> float:
        """Achieved GEMM FLOP/s at ``rows`` (M) rows: the measured table, else peak x efficiency."""
        table = self.gemm_rates.get(canonical_dtype(dtype))
        if table:
            xs = [p[0] for p in table]
            if rows >= xs[-1]:
                return table[-1][1]
            return interpolate_loglog(table, max(rows, 1.0))
        return self.peak_flops(dtype) * self.gemm_efficiency

    def multi_rank_overhead(self, kinds: tuple[str, ...], ranks: int | None = None) -> float:
        """Seconds per step an instance of these kinds (a subset of ``MULTI_RANK_KINDS``; empty:
        one rank) on ``ranks`` ranks adds: the largest measured for any of them, each kind's
        figure at that rank count ("tp:4") where there is one, else its figure for any count
        ("tp"), else ``multi_rank_step_overhead_s``."""
        overheads = self.multi_rank_overheads

        def one(kind: str) -> float:
            if ranks is not None and f"{kind}:{ranks}" in overheads:
                return overheads[f"{kind}:{ranks}"]
            return overheads.get(kind, self.multi_rank_step_overhead_s)

        return max((one(k) for k in kinds), default=0.0)

    def attention_rate(self, dtype: str) -> float:
        return self.peak_flops(dtype) * self.attention_efficiency

    @property
    def effective_memory_bandwidth(self) -> float:
        return self.memory_bandwidth * self.memory_efficiency

    def link(self, inter_node: bool) -> tuple[float, float]:
        """(bytes/s achieved, latency s) of one rank's intra- or inter-node link."""
        if inter_node:
            if self.inter_node_bandwidth <= 0:
                raise ValueError(f"hardware {self.name!r} has no inter_node_bandwidth: set it to predict a layout "
                                 f"that spans more than one node")
            bw, lat = self.inter_node_bandwidth, self.inter_node_latency_s
        else:
            bw, lat = self.intra_node_bandwidth or self.memory_bandwidth, self.intra_node_latency_s
        return bw * self.network_efficiency, lat

    def collective_time(self, op: str, nranks: int, nbytes: float) -> float | None:
        """Seconds from a measured table for ``op`` on the nearest measured rank count, or None.

        nbytes is the nccl-tests ``size`` (allreduce: the vector; alltoall: one rank's send
        buffer). A table for another rank count is rescaled by the bus factor ratio."""
        tables = {int(k.partition(":")[2]): v for k, v in self.collectives.items() if k.partition(":")[0] == op}
        if not tables or nranks <= 1:
            return None
        n = min(tables, key=lambda m: (abs(m - nranks), -m))
        t = interpolate_loglog(tables[n], max(nbytes, 1.0))
        if n != nranks:
            factor = 2.0 if op == "allreduce" else 1.0
            t *= (factor * (nranks - 1) / nranks) / (factor * (n - 1) / n)
        return t
