"""``python -m launch profile report DUMP... --out DIR`` and ``profile run --model DIR --workload W --out DIR``.

Bad input (unreadable or mismatched dumps, a pickle with code in it, an EP size that does not
divide the experts, an unknown workload) prints one line ``error: ...`` and exits 2. Of several
dumps, the empty ones are skipped with one ``warning: ...`` line; only empty ones is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from launch.config_args import FlagParser
from launch.paths import output_dir_problem
from launch.workloads import SHIPPED_MODEL

EXIT_BAD_INPUT = 2


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def add_report_args(parser: argparse.ArgumentParser) -> None:
    """--out and the what-if flags shared by both commands."""
    parser.add_argument("--out", required=True, help="report folder (index.html, summary.json, PNGs)")
    g = parser.add_argument_group("what-if")
    g.add_argument("--ep", type=_positive, nargs="+", default=None, metavar="N",
                   help="EP sizes for the what-if table (default: the powers of two up to 64 that divide E, "
                        "or E itself when none does)")
    g.add_argument("--redundant", type=_non_negative, nargs="+", default=None, metavar="N",
                   help="redundant experts per layer, at most 3 x E (default: 0 and 1, 2, 4 per rank, "
                        "at most E)")
    g.add_argument("--recorded-ep", type=_positive, default=None, metavar="N",
                   help="EP size of the recorded run when the dump does not say (default: the first --ep)")
    g.add_argument("--hierarchical-nodes", type=_positive, default=None,  # None: not given (study: 2)
                   help="nodes for the hierarchical what-if placement (default 2)")
    g.add_argument("--num-groups", type=_positive, default=None,
                   help="expert groups for hierarchical placement (default: the model's n_group, else --hierarchical-nodes)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def report_main(argv: list[str]) -> int:
    """``profile report DUMP [DUMP ...] --out DIR [--ep N ...] [--redundant N ...]``."""
    parser = FlagParser(
        prog="python -m launch profile report",
        description="Expert-load report from expert-distribution dumps: this project's .safetensors, SGLang's "
                    "stat / per_pass .pt (torch.save), or [steps, L, E] counts as .npy / .npz / .csv. Several "
                    "dumps are concatenated in the order given.")
    parser.add_argument("dumps", nargs="+", metavar="DUMP")
    add_report_args(parser)
    args = parser.parse_args(argv)
    if (problem := output_dir_problem(args.out)) is not None:
        parser.error(f"--out: {problem}")
    from launch.profile.analysis import check_ep_sizes
    from launch.profile.readers import DumpError, read_recording
    from launch.profile.report import write_report
    from launch.profile.study import options_from_args
    from launch.profile.whatif import default_ep_sizes

    try:
        recording = read_recording(args.dumps)
        if recording.skipped:
            print(f"warning: skipped {len(recording.skipped)} dump(s) with no recorded steps: "
                  + ", ".join(path for path, _ in recording.skipped), file=sys.stderr)
        ep_sizes = args.ep or default_ep_sizes(recording.num_experts)
        check_ep_sizes(ep_sizes, recording.num_experts)  # as the report would, before the check below
        if (problem := hierarchical_flags_problem(args, recording.num_experts, recording.num_groups,
                                                  ep_sizes)) is not None:
            raise DumpError(problem)
        page = write_report(recording, args.out, options_from_args(args))
    except DumpError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    warn_if_no_what_if(page.parent / "summary.json")
    print(f"report: {page}")
    return 0


def warn_if_no_what_if(summary_path: Path) -> None:
    """One ``warning: ...`` line on stderr when the what-if grid drew no point (every EP size x
    redundant count asked for was skipped), naming the first reason."""
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    if not summary["what_if"] and summary["what_if_skipped"]:
        print(f"warning: the what-if table is empty: {len(summary['what_if_skipped'])} point(s) skipped, e.g. "
              f"{summary['what_if_skipped'][0]}", file=sys.stderr)


def run_main(argv: list[str]) -> int:
    """``profile run [--model DIR] [layout flags] --workload NAME|FILE [--steps N] --out DIR``; the model
    defaults to the shipped trained checkpoint."""
    from launch.config_args import add_runtime_args

    parser = FlagParser(
        prog="python -m launch profile run",
        description="Run the engine over a workload with expert-distribution recording on, dump it, and write "
                    "the expert-load report. Workload phases joined by '+' (prose+code) run one after the other.")
    add_runtime_args(parser, server=False)
    parser.add_argument("--workload", required=True, metavar="NAME|FILE",
                        help="shipped workload name, a .jsonl/.txt file, or phases joined by '+'")
    parser.add_argument("--steps", type=_positive, default=None,
                        help="engine steps to record, split evenly over the phases (prompts repeat as needed); "
                             "default: every prompt once")
    parser.add_argument("--max-tokens", type=_positive, default=32, help="tokens generated per prompt (default 32)")
    add_report_args(parser)
    args = parser.parse_args(argv)
    if (problem := output_dir_problem(args.out)) is not None:
        parser.error(f"--out: {problem}")
    if not args.model and not args.config:
        args.model = str(SHIPPED_MODEL)  # the trained tiny DeepSeek-V3: its routing means something
    from launch.config_schema import ConfigError
    from launch.profile.readers import DumpError
    from launch.profile.runner import ProfileRunError, run_and_report

    if (problem := what_if_sizes_problem(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        page = run_and_report(args)
    except (ConfigError, DumpError, ProfileRunError, FileNotFoundError) as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    warn_if_no_what_if(page.parent / "summary.json")
    print(f"report: {page}")
    return 0


def what_if_sizes_problem(args: argparse.Namespace) -> str | None:
    """``--ep`` / ``--recorded-ep`` sizes that do not divide the model's experts, ``--redundant``
    counts past ``whatif.max_redundant``, or ``--num-groups`` / ``--hierarchical-nodes`` that no EP
    size can take (``hierarchical_flags_problem``): one line naming the flag, checked before the run
    rather than by the report after it; None when they do, or when the model's config cannot be
    read (``run_and_report`` reports that in its own words)."""
    if all(getattr(args, flag) is None for flag in ("ep", "recorded_ep", "redundant", "num_groups",
                                                    "hierarchical_nodes")):
        return None
    from launch.config_args import runtime_config_from_args
    from launch.profile.whatif import default_ep_sizes, redundant_problem
    from moe.config import ModelConfig

    try:
        config = runtime_config_from_args(args)
        model = ModelConfig.from_hf(config.check_model_path())
    except (ValueError, OSError):  # ConfigError is a ValueError
        return None
    num_experts = model.num_experts
    for flag, sizes in (("--ep", args.ep or []), ("--recorded-ep", [args.recorded_ep] if args.recorded_ep else [])):
        for ep in sizes:
            if num_experts % ep:
                return (f"{flag} {ep} does not divide the {num_experts} experts of {config.model} "
                        "(each EP rank holds the same number)")
    if (problem := redundant_problem(args.redundant, num_experts)) is not None:
        return problem
    # the groups the run's dump will record (``Recording.num_groups``): n_group above 1 that divides E
    n_group = model.n_group if model.n_group and model.n_group > 1 and num_experts % model.n_group == 0 else None
    return hierarchical_flags_problem(args, num_experts, n_group, args.ep or default_ep_sizes(num_experts))


def hierarchical_flags_problem(args: argparse.Namespace, num_experts: int, model_groups: int | None,
                               ep_sizes: list[int]) -> str | None:
    """``--num-groups`` / ``--hierarchical-nodes`` given on the command line that leave the hierarchical
    what-if nothing to place, at any EP size of the grid (one line naming the flags and why), as
    ``--ep`` sizes that cannot apply are errors. None when some EP size takes them, or when neither
    flag was given: the defaults that do not fit a model skip quietly (summary.json's
    ``what_if_skipped``, as do EP sizes the nodes do not divide while others are drawn). Groups as
    ``study.analyze`` takes them: --num-groups, else the model's (``model_groups``), else one per node."""
    if args.num_groups is None and args.hierarchical_nodes is None:
        return None
    from launch.profile.study import ReportOptions

    nodes = ReportOptions.num_nodes if args.hierarchical_nodes is None else args.hierarchical_nodes
    groups = args.num_groups or model_groups or nodes
    source = "" if args.num_groups else " (the model's n_group)" if model_groups else \
        " (--num-groups defaults to one group per node)"
    if nodes <= 1:
        reason = "it needs more than one node"
    elif num_experts % groups:
        reason = f"the {num_experts} experts do not form {groups} groups{source}"
    elif groups % nodes:
        reason = f"{groups} expert groups{source} do not split over {nodes} nodes"
    elif all(ep % nodes for ep in ep_sizes):
        reason = f"no EP size of the what-if ({', '.join(map(str, ep_sizes))}) splits over {nodes} nodes"
    else:
        return None
    given = " ".join(f"{flag} {value}" for flag, value in (("--num-groups", args.num_groups),
                                                          ("--hierarchical-nodes", args.hierarchical_nodes))
                     if value is not None)
    return f"{given}: the hierarchical what-if cannot apply: {reason}"
