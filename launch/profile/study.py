"""One profiling study: the options (``ReportOptions``) and every analysis of a recording
(``Analysis``, built by ``analyze``) that the summary, plots and page read.

Shape legend: S steps, L layers, E experts, R ranks.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

import numpy as np

from launch.profile import analysis as an
from launch.profile.readers import DumpError, Recording
from launch.profile.whatif import (
    WhatIfRow,
    compute_what_if,
    default_ep_sizes,
    recommend_eplb_config,
    recommend_redundant,
    redundant_problem,
)


@dataclass(frozen=True)
class ReportOptions:
    """ep_sizes / redundant: what-if grid (None: defaults); recorded_ep: EP size of the
    recorded placement when the dumps do not say (None: the first EP size); num_groups /
    num_nodes: hierarchical placement (None groups: the model's n_group the dumps record,
    else num_nodes groups); model_layers: model layer id of each MoE layer (None: what the
    dumps record, if anything); extra: run facts shown in the report."""

    ep_sizes: list[int] | None = None
    redundant: list[int] | None = None
    recorded_ep: int | None = None
    num_groups: int | None = None
    num_nodes: int = 2
    model_layers: list[int] | None = None
    title: str = "Expert load profile"
    extra: dict = field(default_factory=dict)
    progress: bool = True


@dataclass
class Analysis:
    """Everything the plots, page and summary read. Shapes: S steps, L layers, E experts, R ranks."""

    recording: Recording
    options: ReportOptions
    num_ranks: int
    rank_load: np.ndarray  # [S, L, R]
    layer_bal: np.ndarray  # [L]
    overall: float
    step_bal: np.ndarray  # [S]
    hot_ids: np.ndarray  # [L, n]
    hot_share: np.ndarray  # [L, n]
    top: int
    churn: dict[int, np.ndarray]  # window -> [W - 1, L]
    drift_layer: int
    drift_window: int
    what_if: list[WhatIfRow]
    skipped: list[str]
    ep_sizes: list[int]
    recommendation: dict


def analyze(recording: Recording, options: ReportOptions) -> Analysis:
    """Run every analysis; DumpError for an EP size that does not divide the experts or a
    redundant count past ``whatif.max_redundant``. ``Analysis.options`` has num_groups and
    model_layers filled from the dumps where unset. The recommendation is made at the recorded
    EP size when it is among the what-if EP sizes, else at the first of them; its ``ep`` and
    ``ep_basis`` say which and why."""
    options = replace(options, num_groups=options.num_groups or recording.num_groups,
                      model_layers=options.model_layers or recording.model_layers)
    count = recording.logical_count
    steps, num_layers, num_experts = count.shape
    ep_sizes = list(dict.fromkeys(options.ep_sizes or default_ep_sizes(num_experts)))  # repeats drawn once
    an.check_ep_sizes(ep_sizes, num_experts)
    if (problem := redundant_problem(options.redundant, num_experts)) is not None:
        raise DumpError(problem)
    num_ranks = an.recorded_num_ranks(recording, options.recorded_ep or ep_sizes[0])
    rank_load = an.recording_rank_load(recording, num_ranks)
    layer_bal, overall = an.layer_balancedness(rank_load.sum(0))
    hot_ids, hot_share = an.hot_experts(count.sum(0))
    top = an.default_top(num_experts)
    churn = {w: an.hot_set_churn(count, w, top) for w in an.churn_windows(steps)}
    drift_window = min(churn) if churn else max(1, steps)
    groups = options.num_groups or options.num_nodes
    rows, skipped = compute_what_if(count, ep_sizes, options.redundant, num_groups=groups,
                                    num_nodes=options.num_nodes, progress=options.progress)
    rec_ep, ep_basis = recommendation_ep(num_ranks, ep_sizes, num_experts,
                                         recorded=bool(options.recorded_ep) or an.recorded_num_ranks(recording, None) > 1)
    redundant = recommend_redundant(rows, rec_ep)
    mean_churn = {w: float(an.mean_over(o.reshape(-1), axis=0)) for w, o in churn.items()
                  if o.size and not np.isnan(o).all()}
    eplb = recommend_eplb_config(count, rec_ep, redundant["value"] if redundant else 0, mean_churn,
                                 progress=options.progress)
    return Analysis(recording, options, num_ranks, rank_load, layer_bal, overall, an.step_balancedness(rank_load),
                    hot_ids, hot_share, top, churn, an.drift_layer(count, drift_window, top), drift_window, rows,
                    skipped, ep_sizes, {"ep": rec_ep, "ep_basis": ep_basis, "num_redundant_experts": redundant,
                                        "eplb_config": eplb})


def recommendation_ep(num_ranks: int, ep_sizes: list[int], num_experts: int, recorded: bool = True
                      ) -> tuple[int, str]:
    """(EP size the recommendation is for, the phrase saying why): the analysed one (``num_ranks``)
    when it is among the what-if EP sizes, else the first of them (--ep). ``recorded``: whether the
    dumps (or --recorded-ep) said that size (a one-rank run, or a dump with no placement, says none:
    it is analysed at the first --ep)."""
    if num_ranks in ep_sizes:
        if not recorded:
            return num_ranks, (f"for EP {num_ranks}, the first --ep, which the recording is analysed at: it ran "
                               "without expert parallelism (one rank, or tensor / data parallel ranks without EP), "
                               "or its dumps name no EP size (--recorded-ep names one)")
        return num_ranks, f"for EP {num_ranks}, the recorded EP size"
    hint = f" (add --ep {num_ranks} for one at it)" if num_experts % num_ranks == 0 else ""
    return ep_sizes[0], (f"for EP {ep_sizes[0]}, the first what-if EP size: the recording ran at EP {num_ranks}, "
                         f"which is not among the what-if EP sizes{hint}")


def options_from_args(args: argparse.Namespace, **extra) -> ReportOptions:
    """ReportOptions from the what-if flags both commands share (``commands.add_report_args``)."""
    nodes = ReportOptions.num_nodes if args.hierarchical_nodes is None else args.hierarchical_nodes  # None: not given
    return ReportOptions(ep_sizes=args.ep, redundant=args.redundant, recorded_ep=args.recorded_ep,
                         num_groups=args.num_groups, num_nodes=nodes, progress=not args.no_progress, **extra)
