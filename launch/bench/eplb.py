"""EPLB benchmark: our placement policy side by side with DeepSeek's reference.

    python -m launch bench eplb [--reference PATH] [--json FILE] [--scenario NAME ...]
    python -m launch bench eplb --series [--full] [--seed N] [--trace DUMP] (launch/bench/eplb_series.py)

For each model shape and synthetic load it reports balancedness (ours, reference and
an upper bound no placement can beat), the time to compute a placement, and, under a
drifting load, how many expert copies each side moves (cross-rank transfers of the
move plan). `--reference` points at DeepSeek's eplb.py (a file or its directory,
e.g. a checkout of deepseek-ai/EPLB); without it our re-implementation of that
algorithm (policy "deepseek") stands in, and the output says so.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from balancer import compute_move_plan, predict, rebalance_experts
from balancer.placement import compute_log2phy
from launch.bench import repeated_value_problem
from launch.config_args import FlagParser
from launch.paths import output_file_problem, write_output_file


@dataclass(frozen=True)
class Scenario:
    name: str
    num_layers: int
    num_experts: int
    num_replicas: int
    num_groups: int
    num_nodes: int
    num_gpus: int


SCENARIOS = {
    s.name: s for s in [
        Scenario("dsv3-prefill-ep32", 58, 256, 288, 8, 4, 32),
        Scenario("dsv3-decode-ep144", 58, 256, 288, 8, 18, 144),
        Scenario("mixtral-ep8", 32, 8, 16, 1, 1, 8),
        Scenario("qwen3-ep16", 48, 128, 144, 1, 2, 16),
    ]
}
LOADS = ("zipf", "lognormal", "hot-group")


def make_load(kind: str, num_layers: int, num_experts: int, rng: np.random.Generator) -> np.ndarray:
    """[L, E] float64 synthetic tokens per expert (1e6 tokens per layer)."""
    if kind == "zipf":
        ranks = np.arange(1, num_experts + 1, dtype=np.float64)
        w = np.stack([rng.permutation(ranks ** -1.0) for _ in range(num_layers)])
    elif kind == "lognormal":
        w = rng.lognormal(0.0, 1.0, size=(num_layers, num_experts))
    elif kind == "hot-group":
        w = rng.lognormal(0.0, 0.5, size=(num_layers, num_experts))
        group = max(1, num_experts // 8)
        hot = rng.integers(0, num_experts // group, size=num_layers)
        for layer, g in enumerate(hot):
            w[layer, g * group:(g + 1) * group] *= 8.0
    else:
        raise ValueError(f"unknown load {kind!r}; expected one of {LOADS}")
    return w / w.sum(1, keepdims=True) * 1e6


def balancedness_bound(load: np.ndarray, num_replicas: int, num_gpus: int, num_groups: int = 1,
                       num_nodes: int = 1) -> float:
    """Sound upper bound on overall balancedness over all placements of the policy family.

    Per layer the busiest GPU carries at least M = max of: the mean GPU load; w_e / c
    for the heaviest expert, c = min(GPUs it may use, slots it may get) (a replica
    beyond the GPUs shares a GPU with another); the least M for which
    sum_e max(1, ceil(w_e / M)) <= P (at load M every expert needs ceil(w_e / M)
    replicas). Group-limited (num_groups % num_nodes == 0, num_nodes > 1): each node
    holds E / N experts in P / N slots on R / N GPUs, and the node holding the heaviest
    group spreads it over at most R / N GPUs. Returns sum(mean) / sum(M).
    """
    num_layers, num_experts = load.shape
    hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    nodes = num_nodes if hierarchical else 1
    gpus, slots, experts = num_gpus // nodes, num_replicas // nodes, num_experts // nodes
    mean = load.sum(1) / num_gpus
    per_expert = load.max(1) / min(gpus, slots - experts + 1)
    lo, hi = np.zeros(num_layers), load.max(1) + 1e-9  # at hi every expert needs one replica
    for _ in range(60):
        mid = (lo + hi) / 2
        need = np.maximum(1, np.ceil(load / np.maximum(mid, 1e-30)[:, None])).sum(1)
        ok = need <= num_replicas
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    bounds = [mean, per_expert, lo]
    if hierarchical:
        group_load = load.reshape(num_layers, num_groups, -1).sum(-1)
        bounds.append(group_load.max(1) / gpus)
    bound = np.maximum.reduce(bounds)
    return float(mean.sum() / bound.sum())


def load_reference(path: str | None) -> tuple[Callable, str]:
    """DeepSeek's rebalance_experts from PATH (eplb.py or its folder), else our re-implementation;
    ValueError naming the problem when PATH holds no usable one."""
    if path is None:
        def ours_deepseek(w, *args):
            return rebalance_experts(w, *args, policy="deepseek")
        return ours_deepseek, "balancer policy 'deepseek' (our re-implementation; pass --reference for DeepSeek's)"
    file = Path(path)
    file = file / "eplb.py" if file.is_dir() else file
    if not file.is_file():
        raise ValueError(f"--reference {path}: no eplb.py there")
    spec = importlib.util.spec_from_file_location("deepseek_eplb_reference", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"--reference {path}: {file} is not a Python file (expected deepseek-ai/EPLB's eplb.py)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - whatever the user's file raises on import is one user error
        raise ValueError(f"--reference {path}: importing {file} failed: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not callable(getattr(module, "rebalance_experts", None)):
        raise ValueError(f"--reference {path}: {file} defines no rebalance_experts() (expected deepseek-ai/EPLB's eplb.py)")
    return _checked_reference(module.rebalance_experts, path), f"deepseek-ai/EPLB eplb.py at {file}"


class BadReferenceError(ValueError):
    """The --reference file's rebalance_experts failed or answered other than DeepSeek's does."""


def _checked_reference(fn: Callable, path: str) -> Callable:
    """fn, whose failure or answer other than DeepSeek's (phy2log [L, P] of expert ids in [0, E),
    every expert placed, ...) raises BadReferenceError naming --reference: a user's file, not our bug.
    Its answer is passed on with phy2log as an int64 tensor."""
    def call(weight: torch.Tensor, num_replicas: int, *args):
        try:
            out = fn(weight, num_replicas, *args)
        except Exception as e:  # noqa: BLE001 - whatever the user's file raises is one user error
            raise BadReferenceError(f"--reference {path}: rebalance_experts failed: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
        num_layers, num_experts = weight.shape
        phy = out[0] if isinstance(out, tuple | list) and out else out
        try:
            arr = np.asarray(phy.detach().cpu() if isinstance(phy, torch.Tensor) else phy)
        except (ValueError, TypeError):  # ragged or odd objects: not a phy2log either
            arr = np.zeros(0)
        try:
            if arr.shape != (num_layers, num_replicas) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError("not a phy2log")
            compute_log2phy(arr, num_experts)  # ids in [0, E), every expert with a slot
        except ValueError:
            raise BadReferenceError(f"--reference {path}: rebalance_experts did not return DeepSeek's (phy2log "
                                    f"[{num_layers}, {num_replicas}] of every expert id in [0, {num_experts}), "
                                    "...)") from None
        rest = tuple(out[1:]) if isinstance(out, tuple | list) else ()
        return (torch.from_numpy(arr.astype(np.int64)), *rest)
    return call



def _timed(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best * 1e3


def case_rng(seed: int, scenario: str, kind: str) -> np.random.Generator:
    """The generator of one scenario x load's loads: its own stream of ``seed``, so a row is the same
    whichever other scenarios and loads run beside it (``--scenario``, ``--load``)."""
    return np.random.default_rng([seed, list(SCENARIOS).index(scenario), LOADS.index(kind)])


def run_case(s: Scenario, kind: str, reference: Callable, rng: np.random.Generator, drift: float,
             repeats: int) -> dict:
    """One scenario x load: balancedness, milliseconds, copies moved under drift."""
    args = (s.num_replicas, s.num_groups, s.num_nodes, s.num_gpus)
    gpus_per_node = s.num_gpus // s.num_nodes
    w0 = make_load(kind, s.num_layers, s.num_experts, rng)
    w1 = w0 * rng.lognormal(0.0, drift, size=w0.shape)
    ours0, ms_ours = _timed(lambda: rebalance_experts(w0, *args)[0], repeats)
    ref0, ms_ref = _timed(lambda: reference(torch.from_numpy(w0), *args)[0], repeats)
    ours1, ms_ours_old = _timed(lambda: rebalance_experts(w1, *args, old_phy2log=ours0)[0], repeats)
    ref1 = reference(torch.from_numpy(w1), *args)[0]
    return {
        "scenario": s.name, "load": kind,
        "balancedness_ours": predict(w0, ours0, s.num_gpus).overall,
        "balancedness_reference": predict(w0, ref0, s.num_gpus).overall,
        "balancedness_bound": balancedness_bound(w0, s.num_replicas, s.num_gpus, s.num_groups, s.num_nodes),
        "ms_ours": ms_ours, "ms_ours_with_old": ms_ours_old, "ms_reference": ms_ref,
        "drift_balancedness_ours": predict(w1, ours1, s.num_gpus).overall,
        "drift_balancedness_reference": predict(w1, ref1, s.num_gpus).overall,
        "moved_ours": compute_move_plan(ours0, ours1, s.num_gpus, gpus_per_node, 1).num_copies_moved,
        "moved_reference": compute_move_plan(ref0, ref1, s.num_gpus, gpus_per_node, 1).num_copies_moved,
        "total_copies": s.num_layers * s.num_replicas,
    }


def format_table(rows: list[dict]) -> str:
    head = (f"{'scenario':<18} {'load':<10} {'bal ours':>8} {'bal ref':>8} {'bound':>6} {'ms ours':>8} "
            f"{'ms old':>7} {'ms ref':>8} {'drift ours':>10} {'drift ref':>9} {'moved ours':>10} {'moved ref':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['scenario']:<18} {r['load']:<10} {r['balancedness_ours']:8.4f} {r['balancedness_reference']:8.4f} "
            f"{r['balancedness_bound']:6.4f} {r['ms_ours']:8.1f} {r['ms_ours_with_old']:7.1f} {r['ms_reference']:8.1f} "
            f"{r['drift_balancedness_ours']:10.4f} {r['drift_balancedness_reference']:9.4f} "
            f"{r['moved_ours']:10d} {r['moved_reference']:9d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        import sys

        argv = sys.argv[1:]
    if "--series" in argv:
        from launch.bench.eplb_series import series_main

        return series_main(argv)
    parser = FlagParser(prog="python -m launch bench eplb", description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", action="store_true",
                        help="judge balancers over time on load traces instead (see --series --help)")
    parser.add_argument("--reference", metavar="PATH", help="DeepSeek's eplb.py, or the folder holding it")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="repeatable; default all")
    parser.add_argument("--load", action="append", choices=LOADS, help="repeatable; default all")
    parser.add_argument("--drift", type=float, default=0.2, help="sigma of the lognormal load perturbation")
    parser.add_argument("--repeats", type=int, default=1, help="timing repeats (best is reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.drift >= 0:  # not >=: NaN too
        parser.error(f"--drift must be >= 0, got {args.drift}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.seed < 0:  # numpy's generators take no negative seed
        parser.error(f"--seed must be >= 0, got {args.seed}")
    for flag, values in (("--scenario", args.scenario), ("--load", args.load)):
        if (problem := repeated_value_problem(flag, values)) is not None:
            parser.error(problem)
    if args.json is not None and (problem := output_file_problem(args.json)) is not None:
        parser.error(f"--json: {problem}")
    torch.set_num_threads(1)
    try:
        reference, ref_name = load_reference(args.reference)
    except ValueError as e:
        parser.error(str(e))
    try:
        rows = [run_case(SCENARIOS[name], kind, reference, case_rng(args.seed, name, kind), args.drift, args.repeats)
                for name in (args.scenario or list(SCENARIOS)) for kind in (args.load or LOADS)]
    except BadReferenceError as e:
        parser.error(str(e))
    print(f"reference: {ref_name}")
    print(f"balancedness = sum(mean GPU load) / sum(max GPU load); bound: no placement does better; "
          f"ms old: ours given old_phy2log;\ndrift: load x lognormal(0, {args.drift}), then rebalanced "
          "(ours given old_phy2log); moved = expert copies sent between ranks (move plan transfers)")
    print(format_table(rows))
    mean_ours = float(np.mean([r["balancedness_ours"] for r in rows]))
    mean_ref = float(np.mean([r["balancedness_reference"] for r in rows]))
    moved = sum(r["moved_ours"] for r in rows), sum(r["moved_reference"] for r in rows)
    share = f" ({moved[0] / moved[1]:.0%})" if moved[1] else ""  # a share of nothing is no figure
    print(f"mean balancedness ours {mean_ours:.4f} vs reference {mean_ref:.4f}; "
          f"copies moved ours {moved[0]} vs reference {moved[1]}{share}")
    if args.json:
        write_output_file(args.json, json.dumps({"reference": ref_name, "drift": args.drift, "seed": args.seed,
                                                 "scenarios": [asdict(SCENARIOS[r["scenario"]]) for r in rows],
                                                 "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
