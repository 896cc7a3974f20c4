"""Collective benchmark in the nccl-tests format, plus EP dispatch and MoE-layer benchmarks.

``python -m launch commbench allreduce -b 8 -e 32M -f 2 -n 20 -w 5 -np 4`` spawns ``-np``
ranks (gloo on CPU, nccl with one GPU per rank when CUDA is present) and prints the
nccl-tests table. Definitions follow nccl-tests: ``size`` is the full buffer (allreduce:
the vector; allgather: the gathered output; reducescatter: the input; alltoall: one
rank's send buffer), algbw = size / time (GB/s = 1e9 B/s), busbw = algbw x 2(n-1)/n for
allreduce and x (n-1)/n for the others. time is the slowest rank's mean per iteration.

torch has no out-of-place all_reduce: its out-of-place column is copy-into-recv-buffer +
all_reduce, the in-place column all_reduce alone. torch's all_to_all_single cannot alias
its buffers (gloo corrupts them), so alltoall's in-place column is N/A.

``--transport shm`` sends each size that fits the runtime's shared-memory segment (1 MiB a rank,
``parallel.shm_allreduce``) through it, as the decoder layers and dispatchers do on one host, and
larger ones through gloo; a footer says which went which way. Its all-gather, reduce-scatter and
all-to-all return new tensors, so their in-place columns are N/A.

``--dispatch`` and ``--moe-layer`` run ``parallel.bench.dispatch``.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from parallel.bench.ranks import current_device, spawn, time_op
from parallel.shm_allreduce import ShmAllReduce, shm_allreduce_wanted

OPS = ("alltoall", "allreduce", "allgather", "reducescatter")
DTYPES = {"float": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16,
          "float16": torch.float16, "double": torch.float64, "int32": torch.int32, "int": torch.int32}
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Timing:
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None  # None: not checked (-c 0)


@dataclass(frozen=True)
class Row:
    size: int
    count: int
    type: str
    redop: str
    root: int
    out_of_place: Timing
    in_place: Timing | None  # None: not supported (N/A)
    transport: str = "gloo"  # "shm": through the shared-memory segment (--transport shm); else the backend


def parse_size(text: str) -> int:
    """'8' -> 8, '32M' -> 33554432, '1K' / '1KB' / '2g' accepted."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)[Bb]?\s*", text)
    if not m:
        raise ValueError(f"bad size {text!r}: expected an integer with an optional K, M or G suffix")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def bus_factor(op: str, nranks: int) -> float:
    """busbw / algbw, as nccl-tests defines it."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    return 2 * (nranks - 1) / nranks if op == "allreduce" else (nranks - 1) / nranks


def compute_sizes(op: str, min_bytes: int, max_bytes: int, factor: int, elem: int, nranks: int) -> list[int]:
    """Element counts for sizes min_bytes, x factor, ... <= max_bytes. Ops that split the buffer
    over ranks round the count down to a multiple of nranks (at least nranks); duplicates go."""
    if min_bytes < 1:
        raise ValueError(f"need -b >= 1 byte, got {min_bytes}")
    if max_bytes < min_bytes:
        raise ValueError(f"need -e >= -b, got -b {min_bytes} and -e {max_bytes} bytes")
    if factor < 2:
        raise ValueError(f"need -f >= 2, got {factor}")
    counts, size = [], min_bytes
    while size <= max_bytes:
        count = max(size // elem, 1)
        if op != "allreduce":
            count = max(count // nranks * nranks, nranks)
        if count not in counts:
            counts.append(count)
        size *= factor
    return counts


def _pattern(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in bf16 even after summing over 64 ranks)."""
    return ((torch.arange(n, device=current_device()) + seed) % 3 + 1).to(dtype)


def _buffers(op: str, count: int, rank: int, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, expected output) for one check of ``op`` on this rank."""
    chunk = count // world
    if op == "allreduce":
        return _pattern(count, rank, dtype), sum(_pattern(count, r, dtype).double() for r in range(world)).to(dtype)
    if op == "allgather":
        return _pattern(chunk, 7 * rank, dtype), torch.cat([_pattern(chunk, 7 * r, dtype) for r in range(world)])
    if op == "reducescatter":
        full = sum(_pattern(count, r, dtype).double() for r in range(world)).to(dtype)
        return _pattern(count, rank, dtype), full[rank * chunk : (rank + 1) * chunk]
    send = torch.cat([_pattern(chunk, rank * world + d, dtype) for d in range(world)])
    return send, torch.cat([_pattern(chunk, s * world + rank, dtype) for s in range(world)])


def _ops(op: str, count: int, rank: int, world: int, dtype: torch.dtype):
    """(out-of-place callable, in-place callable or None, function returning the result)."""
    inp, _ = _buffers(op, count, rank, world, dtype)
    chunk = count // world
    if op == "allreduce":
        recv = torch.empty_like(inp)
        return (lambda: (recv.copy_(inp), dist.all_reduce(recv)), lambda: dist.all_reduce(recv), recv)
    if op == "allgather":
        recv = torch.empty(count, dtype=dtype, device=inp.device)
        mine = recv[rank * chunk : (rank + 1) * chunk]
        return (lambda: dist.all_gather_single(recv, inp), lambda: dist.all_gather_single(recv, mine), recv)
    if op == "reducescatter":
        recv = torch.empty(chunk, dtype=dtype, device=inp.device)
        whole = inp.clone()
        return (lambda: dist.reduce_scatter_single(recv, inp),
                lambda: dist.reduce_scatter_single(whole[rank * chunk : (rank + 1) * chunk], whole), recv)
    recv = torch.empty_like(inp)
    return (lambda: dist.all_to_all_single(recv, inp), None, recv)


def _shm_op(op: str, shm: ShmAllReduce, inp: torch.Tensor, rank: int, world: int) -> Callable[[], torch.Tensor] | None:
    """The call that runs ``op`` on this rank's input through ``shm``, returning the result as the
    backend's op leaves it, or None where the input does not fit (every rank decides alike: one size)."""
    chunk = inp.numel() // world
    if op == "allreduce":
        return (lambda: shm.all_reduce(inp.clone())) if shm.applies(inp) else None
    if op == "allgather":
        return (lambda: shm.all_gather(inp).view(-1)) if shm.fits(inp) else None
    if op == "reducescatter":
        return (lambda: shm.reduce_scatter(inp, rank * chunk, (rank + 1) * chunk)) if shm.applies(inp) else None
    rows = inp.view(world, chunk)
    if not shm.fits(rows):
        return None
    return lambda: shm.all_to_all_v(rows, [1] * world)[0].view(-1)


def _shm_ops(op: str, shm: ShmAllReduce, count: int, rank: int, world: int, dtype: torch.dtype):
    """``_ops``' triple through ``shm``, or None where the size does not fit it."""
    inp, _ = _buffers(op, count, rank, world, dtype)
    call = _shm_op(op, shm, inp, rank, world)
    if call is None:
        return None
    if op == "allreduce":  # in place as the layers call it; out of place: a copy first, as _ops'
        recv = torch.empty_like(inp)
        return (lambda: (recv.copy_(inp), shm.all_reduce(recv)), lambda: shm.all_reduce(recv), recv)
    return call, None, None


def _check(op: str, count: int, rank: int, world: int, dtype: torch.dtype, in_place: bool,
           shm: ShmAllReduce | None = None) -> int:
    """Run ``op`` once on fresh data and count wrong elements, summed over ranks."""
    inp, want = _buffers(op, count, rank, world, dtype)
    chunk = count // world
    call = _shm_op(op, shm, inp, rank, world) if shm is not None else None
    if call is not None:
        got = call()
    elif op == "allreduce":
        got = inp.clone()
        dist.all_reduce(got)
    elif op == "allgather":
        got = torch.zeros(count, dtype=dtype, device=inp.device)
        if in_place:
            got[rank * chunk : (rank + 1) * chunk] = inp
        dist.all_gather_single(got, got[rank * chunk : (rank + 1) * chunk] if in_place else inp)
    elif op == "reducescatter":
        whole = inp.clone()
        got = whole[rank * chunk : (rank + 1) * chunk] if in_place else torch.empty(chunk, dtype=dtype,
                                                                                    device=inp.device)
        dist.reduce_scatter_single(got, whole)
    else:
        got = torch.empty_like(inp)
        dist.all_to_all_single(got, inp)
    wrong = torch.tensor([int((got != want).sum())], dtype=torch.int64, device=inp.device)
    dist.all_reduce(wrong)
    return int(wrong.item())


def _timing(op: str, seconds: float, size: int, world: int, wrong: int | None) -> Timing:
    algbw = size / seconds / 1e9 if seconds > 0 else 0.0
    return Timing(seconds * 1e6, algbw, algbw * bus_factor(op, world), wrong)


def run_collective(rank: int, world: int, op: str, counts: list[int], dtype_name: str, warmup: int,
                   iters: int, check: bool, transport: str = "gloo") -> list[Row]:
    """One rank's part of the table (rank 0's result is printed). ``transport`` "shm": the sizes that
    fit the runtime's shared-memory segment go through it (``_shm_ops``), the rest through gloo;
    "auto": the same where the segment can be made (as the runtime's groups), else the backend alone."""
    dtype = DTYPES[dtype_name]
    elem = torch.empty((), dtype=dtype).element_size()
    redop = "sum" if op in ("allreduce", "reducescatter") else "none"
    shm = None
    if transport in ("shm", "auto"):  # collective: every rank gets the segment, or none does
        shm = ShmAllReduce.for_group(dist.group.WORLD)
        if shm is None and transport == "shm":
            raise RuntimeError("--transport shm: the shared-memory segment could not be set up (see the warning)")
    rows = []
    for count in counts:
        ops = _shm_ops(op, shm, count, rank, world, dtype) if shm is not None else None
        via = "shm" if ops is not None else "nccl" if torch.cuda.is_available() else "gloo"
        oop, ip, _ = ops if ops is not None else _ops(op, count, rank, world, dtype)
        t_oop = time_op(oop, warmup, iters)
        w_oop = _check(op, count, rank, world, dtype, False, shm) if check else None
        in_place = None
        if ip is not None:
            t_ip = time_op(ip, warmup, iters)
            w_ip = _check(op, count, rank, world, dtype, True, shm) if check else None
            in_place = _timing(op, t_ip, count * elem, world, w_ip)
        rows.append(Row(count * elem, count, dtype_name, redop, -1,
                        _timing(op, t_oop, count * elem, world, w_oop), in_place, via))
    return rows


def format_table(op: str, rows: list[Row], world: int, backend: str) -> str:
    """nccl-tests style table with the average bus bandwidth footer."""
    lines = [f"# {op} on {world} ranks ({backend})",
             f"#{'':<58}{'out-of-place':>22}{'':<10}{'in-place':>22}",
             f"#{'size':>11}{'count':>13}{'type':>10}{'redop':>8}{'root':>8}"
             f"{'time':>9}{'algbw':>8}{'busbw':>8}{'#wrong':>7}{'time':>9}{'algbw':>8}{'busbw':>8}{'#wrong':>7}",
             f"#{'(B)':>11}{'(elements)':>13}{'':>26}{'(us)':>9}{'(GB/s)':>8}{'(GB/s)':>8}{'':>7}"
             f"{'(us)':>9}{'(GB/s)':>8}{'(GB/s)':>8}"]

    def cols(t: Timing | None) -> str:
        if t is None:
            return f"{'N/A':>9}{'N/A':>8}{'N/A':>8}{'N/A':>7}"
        wrong = "N/A" if t.wrong is None else str(t.wrong)
        return f"{t.time_us:>9.1f}{t.algbw:>8.2f}{t.busbw:>8.2f}{wrong:>7}"

    for r in rows:
        lines.append(f" {r.size:>11}{r.count:>13}{r.type:>10}{r.redop:>8}{r.root:>8}"
                     f"{cols(r.out_of_place)}{cols(r.in_place)}")
    busbws = [t.busbw for r in rows for t in (r.out_of_place, r.in_place) if t is not None]
    wrong = sum(t.wrong or 0 for r in rows for t in (r.out_of_place, r.in_place) if t is not None)
    through = [r.size for r in rows if r.transport == "shm"]
    if through:
        lines.append(f"# Through shared memory: sizes {min(through)}-{max(through)} B; "
                     f"{len(rows) - len(through)} larger size(s) through {backend}")
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth : {sum(busbws) / max(len(busbws), 1):.4f}")
    return "\n".join(lines)


# Flags one mode reads and the others would ignore: left unset (None) in the parser so that a value the
# user gave to a mode that does not read it is refused (``mode_flag_problem``), then given these defaults.
COLLECTIVE_DEFAULTS = {"minbytes": "8", "maxbytes": "32M", "stepfactor": 2, "datatype": "float", "check": 1,
                       "transport": "gloo"}
EP_DEFAULTS = {"backend": "alltoall", "tokens": 2048, "hidden": 1024, "topk": 6, "experts": 64}
MOE_LAYER_DEFAULTS = {"inter": 256, "ranks": "1,2,4"}
NPROCS_DEFAULT = 4
_FLAG_NAMES = {"minbytes": "-b", "maxbytes": "-e", "stepfactor": "-f", "datatype": "-d", "check": "-c",
               "backend": "--backend", "tokens": "--tokens", "hidden": "--hidden", "topk": "--topk",
               "experts": "--experts", "inter": "--inter", "ranks": "--ranks", "nprocs": "-np",
               "transport": "--transport"}


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line, ``commbench: error: MESSAGE``, exit status 2 (as the flag checks'),
    without argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"commbench: error: {message} (`python -m launch commbench --help` lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="commbench", description=__doc__.split("\n\n")[0])
    p.add_argument("op", nargs="?", choices=OPS, help="collective to time (not with --dispatch/--moe-layer)")
    p.add_argument("-b", "--minbytes", default=None, help="smallest size, e.g. 8, 1K (default 8)")
    p.add_argument("-e", "--maxbytes", default=None, help="largest size, e.g. 32M (default 32M)")
    p.add_argument("-f", "--stepfactor", type=int, default=None, help="size multiplication factor (default 2)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-np", "--nprocs", type=int, default=None,
                   help=f"ranks to spawn (default {NPROCS_DEFAULT}; --moe-layer's are --ranks)")
    p.add_argument("-d", "--datatype", default=None, choices=sorted(DTYPES), help="(default float)")
    p.add_argument("-c", "--check", type=int, default=None, choices=(0, 1), help="check results (default 1)")
    p.add_argument("-J", "--output_file", default=None, help="write results as JSON here")
    p.add_argument("--transport", default=None, choices=("gloo", "shm"),
                   help="collectives: shm sends the sizes that fit the runtime's shared-memory segment (1 MiB "
                        "a rank) through it, as the layers do on one host, the rest through gloo (default gloo)")
    p.add_argument("--dispatch", action="store_true", help="time EP dispatch+combine vs raw all_to_all_single")
    p.add_argument("--moe-layer", action="store_true", help="EP MoE layer tokens/s at each of --ranks")
    p.add_argument("--backend", default=None, choices=("alltoall", "allgather"),
                   help="dispatcher for --dispatch / --moe-layer (default alltoall)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 2048)")
    p.add_argument("--hidden", type=int, default=None, help="(default 1024)")
    p.add_argument("--topk", type=int, default=None, help="(default 6)")
    p.add_argument("--experts", type=int, default=None, help="(default 64)")
    p.add_argument("--inter", type=int, default=None, help="expert intermediate size (--moe-layer; default 256)")
    p.add_argument("--ranks", default=None, help="rank counts for --moe-layer (default 1,2,4)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per rank (0: cores / ranks)")
    return p


def mode_flag_problem(args: argparse.Namespace) -> str | None:
    """One line naming a flag the chosen mode (a collective, ``--dispatch`` or ``--moe-layer``) would
    ignore, or None; then fills every unset flag with its default. Run on freshly parsed flags."""
    if args.dispatch and args.moe_layer:
        return "--dispatch and --moe-layer are two benchmarks: run one at a time"
    if args.dispatch or args.moe_layer:
        mode = "--dispatch" if args.dispatch else "--moe-layer"
        unread = dict(COLLECTIVE_DEFAULTS) | ({"nprocs": None} if args.moe_layer else dict(MOE_LAYER_DEFAULTS))
        if args.op is not None:
            return f"{mode} times no collective: drop {args.op!r} (or run `commbench {args.op}` without {mode})"
    else:
        mode, unread = "a collective", dict(EP_DEFAULTS) | dict(MOE_LAYER_DEFAULTS)
    given = [_FLAG_NAMES[name] for name in unread if getattr(args, name) is not None]
    if given:
        return f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to {mode}"
    for name, value in {**COLLECTIVE_DEFAULTS, **EP_DEFAULTS, **MOE_LAYER_DEFAULTS, "nprocs": NPROCS_DEFAULT}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return None


def check_args(args: argparse.Namespace, output_problem: Callable[[str], str | None] | None = None) -> str | None:
    """What is wrong with the flags (one line naming the flag), or None: checked before any rank starts."""
    for flag, value, least in (("-np", args.nprocs, 1), ("-n", args.iters, 1), ("-w", args.warmup_iters, 0),
                               ("--threads", args.threads, 0)):
        if value < least:
            return f"{flag} must be >= {least}, got {value}"
    moe_layer_only = args.moe_layer and not args.dispatch  # its rank counts are --ranks, not -np
    if not moe_layer_only and torch.cuda.is_available() and args.nprocs > torch.cuda.device_count():
        return f"-np {args.nprocs} exceeds the {torch.cuda.device_count()} visible GPUs (one per rank)"
    if args.output_file is not None and output_problem is not None:
        problem = output_problem(args.output_file)
        if problem is not None:
            return f"-J/--output_file: {problem}"
    if args.dispatch or args.moe_layer:
        return _check_ep_args(args)
    if args.transport == "shm" and (torch.cuda.is_available() or not shm_allreduce_wanted()):
        return ("--transport shm needs gloo ranks on x86-64 Linux with /dev/shm and MOE_SHM_ALLREDUCE not 0 "
                "(the runtime's shared-memory collectives)")
    return None


def _check_ep_args(args: argparse.Namespace) -> str | None:
    """The --dispatch / --moe-layer sizes (one line naming the flags), or None."""
    for flag, value in (("--tokens", args.tokens), ("--hidden", args.hidden), ("--experts", args.experts),
                        ("--topk", args.topk), ("--inter", args.inter)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.topk > args.experts:
        return f"--topk {args.topk} exceeds --experts {args.experts} (each token picks distinct experts)"
    if args.dispatch:  # run() takes --dispatch over --moe-layer
        if args.experts % args.nprocs:
            return (f"--experts {args.experts} must be divisible by -np {args.nprocs} "
                    "(each rank hosts the same number of experts)")
        return None
    if args.experts < 2:
        return f"--moe-layer needs --experts >= 2 (its DeepSeek-V3 router sums each group's top-2), got {args.experts}"
    from parallel.bench.dispatch import moe_layer_config, parse_ranks

    try:
        most = max(parse_ranks(args.ranks, args.experts))
    except ValueError as e:
        return str(e)
    if torch.cuda.is_available() and most > torch.cuda.device_count():
        return f"--ranks {args.ranks}: {most} ranks exceed the {torch.cuda.device_count()} visible GPUs (one per rank)"
    try:
        moe_layer_config({"tokens": args.tokens, "hidden": args.hidden, "topk": args.topk,
                          "experts": args.experts, "inter": args.inter})
    except ValueError as e:
        return f"--moe-layer with --experts {args.experts} --topk {args.topk}: {e}"
    return None


def main(argv: list[str], output_problem: Callable[[str], str | None] | None = None) -> int:
    """The benchmark's entry (``python -m launch commbench ...`` calls it through
    ``launch.bench.commbench``). Returns the exit status (2: bad flags, one line). output_problem:
    what is wrong with writing -J's path (None: nothing), checked with the flags, before any rank."""
    args = build_parser().parse_args(argv)
    problem = mode_flag_problem(args) or check_args(args, output_problem)
    if problem is None and not (args.dispatch or args.moe_layer):
        if args.op is None:
            problem = ("name a collective (alltoall, allreduce, allgather, reducescatter), "
                       "or pass --dispatch / --moe-layer")
        else:
            try:
                elem = torch.empty((), dtype=DTYPES[args.datatype]).element_size()
                counts = compute_sizes(args.op, _size_flag("-b", args.minbytes), _size_flag("-e", args.maxbytes),
                                       args.stepfactor, elem, args.nprocs)
            except ValueError as e:
                problem = str(e)
    if problem is None:
        problem = memory_problem(args, counts[-1] * elem if not (args.dispatch or args.moe_layer) else 0)
    if problem is not None:
        print(f"commbench: error: {problem}", file=sys.stderr)
        return 2
    if args.dispatch or args.moe_layer:
        from parallel.bench import dispatch as dispatchbench

        report = dispatchbench.run(args, functools.partial(spawn, threads=args.threads))
        print(report["text"])
        return _write_json(args.output_file, report["json"])
    rows = spawn(run_collective, args.nprocs, args.op, counts, args.datatype, args.warmup_iters, args.iters,
                 bool(args.check), args.transport, threads=args.threads)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    print(format_table(args.op, rows, args.nprocs, backend))
    busbws = [t.busbw for r in rows for t in (r.out_of_place, r.in_place) if t is not None]
    written = _write_json(args.output_file, {"op": args.op, "nranks": args.nprocs, "backend": backend,
                                             "transport": args.transport,
                                             "datatype": args.datatype, "rows": [asdict(r) for r in rows],
                                             "avg_busbw": sum(busbws) / max(len(busbws), 1)})
    wrong = sum(t.wrong or 0 for r in rows for t in (r.out_of_place, r.in_place) if t is not None)
    return 1 if wrong or written else 0


def memory_problem(args: argparse.Namespace, max_bytes: int, available: int | None = None) -> str | None:
    """Why the run cannot fit in this machine's memory (one line naming the flags), or None: a lower
    bound of what the ranks allocate together against MemAvailable (``available``: that figure,
    read from /proc/meminfo when None; no check where there is none). Collectives: each rank's
    input and output of the largest size (-e). --dispatch / --moe-layer: each rank's tokens' bf16
    rows, sent once per routed copy and received back (K + 1 rows per token)."""
    from moe.kv_cache import available_memory_bytes

    available = available_memory_bytes() if available is None else available
    if available is None:
        return None
    if args.dispatch or args.moe_layer:
        from parallel.bench.dispatch import parse_ranks

        ranks = args.nprocs if args.dispatch else max(parse_ranks(args.ranks, args.experts))
        need = ranks * args.tokens * args.hidden * 2 * (args.topk + 1)
        what = f"--tokens {args.tokens} x --hidden {args.hidden} x (--topk {args.topk} + 1) bf16 rows on {ranks} rank(s)"
    else:
        need = 2 * max_bytes * args.nprocs
        what = f"-e {args.maxbytes}: input and output of {max_bytes:,} bytes on each of -np {args.nprocs} ranks"
    if need > available:
        return f"{what} need at least {need / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB available"
    return None


def _size_flag(flag: str, text: str) -> int:
    """parse_size for ``flag``'s value; the ValueError names the flag."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _write_json(path: str | None, payload: dict) -> int:
    """Write ``payload`` as JSON to ``path`` (checked up front by check_args), making missing parents.
    Returns 0, or 1 after one line on stderr when the write itself fails (the table is printed)."""
    if not path:
        return 0
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
    except OSError as e:
        print(f"commbench: error: -J/--output_file: cannot write {path}: {(e.strerror or str(e)).lower()}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
