"""Analyse a ``Recording`` and write the report folder: ``summary.json``, PNGs, ``index.html``.

``summary.json`` keys (issue 10): ``layers`` (per MoE layer in order: ``layer``,
``balancedness``, ``hot_experts`` = the 5 most loaded logical ids most loaded first,
``load_share`` of each, plus ``rank_load`` and ``idle``), ``overall_balancedness`` (sum of
means / sum of maxes), ``what_if`` (rows of ``ep``, ``redundant``, ``policy``,
``balancedness``, ``no_eplb_balancedness``, ``gain_over_no_eplb``, ``held_out_balancedness``),
``steps``, ``num_layers``, ``num_experts``; and ``recorded_ep``, ``sources``, ``phases``,
``balancedness_over_time``, ``hot_set_churn``, ``drops``, ``recommendation``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from launch.profile import analysis as an
from launch.profile.readers import Recording
from launch.profile.whatif import (
    WhatIfRow,
    compute_what_if,
    default_ep_sizes,
    recommend_eplb_config,
    recommend_redundant,
    rows_as_dicts,
)

MAX_SERIES = 20000


@dataclass(frozen=True)
class ReportOptions:
    """ep_sizes / redundant: what-if grid (None: defaults); recorded_ep: EP size of the
    recorded placement when the dumps do not say (None: the first EP size); num_groups /
    num_nodes: hierarchical placement (None groups: num_nodes groups); model_layers: model
    layer id of each MoE layer, when known; extra: run facts shown in the report."""

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
    """Run every analysis; DumpError for an EP size that does not divide the experts."""
    count = recording.logical_count
    steps, num_layers, num_experts = count.shape
    ep_sizes = options.ep_sizes or default_ep_sizes(num_experts)
    an.check_ep_sizes(ep_sizes, num_experts)
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
    rec_ep = num_ranks if any(r.ep == num_ranks for r in rows) else ep_sizes[0]
    redundant = recommend_redundant(rows, rec_ep)
    mean_churn = {w: float(np.nanmean(o)) for w, o in churn.items() if o.size and not np.isnan(o).all()}
    eplb = recommend_eplb_config(count, rec_ep, redundant["value"] if redundant else 0, mean_churn,
                                 progress=options.progress)
    return Analysis(recording, options, num_ranks, rank_load, layer_bal, overall, an.step_balancedness(rank_load),
                    hot_ids, hot_share, top, churn, an.drift_layer(count, drift_window, top), drift_window, rows,
                    skipped, ep_sizes, {"num_redundant_experts": redundant, "eplb_config": eplb})


def _layers(a: Analysis) -> list[dict]:
    total = a.rank_load.sum(0)
    count = a.recording.logical_count.sum(0)
    out = []
    for x in range(a.recording.num_layers):
        entry = {"layer": x, "balancedness": float(a.layer_bal[x]),
                 "hot_experts": [int(i) for i in a.hot_ids[x]],
                 "load_share": [float(s) for s in a.hot_share[x]],
                 "tokens": float(count[x].sum()), "rank_load": [float(v) for v in total[x]],
                 "idle": bool(count[x].sum() == 0)}
        if a.options.model_layers and len(a.options.model_layers) == a.recording.num_layers:
            entry["model_layer"] = int(a.options.model_layers[x])
        out.append(entry)
    return out


def _over_time(a: Analysis) -> dict:
    windows = an.windows_to_show(a.recording.num_steps)
    out: dict = {"window_sizes": windows, "definition": "per step: sum over layers of mean rank load / sum of "
                 "max rank load; window averages are trailing means of it (SGLang's last_N_average_balancedness)"}
    out["last_average"] = {str(w): float(an.trailing_mean(a.step_bal, w)[-1]) for w in windows}
    out["min_average"] = {str(w): float(an.trailing_mean(a.step_bal, w)[min(w, a.step_bal.size) - 1:].min())
                          for w in windows}
    if a.step_bal.size <= MAX_SERIES:
        out["per_step"] = [round(float(v), 5) for v in a.step_bal]
    return out


def _churn(a: Analysis) -> dict:
    out = {"top": a.top, "chance_overlap": a.top / a.recording.num_experts, "drift_layer": a.drift_layer,
           "windows": {}}
    for w, overlap in a.churn.items():
        per_window = np.nanmean(np.where(np.isnan(overlap), np.nan, overlap), axis=1) if overlap.size else overlap
        out["windows"][str(w)] = {
            "mean_overlap": an.finite(float(np.nanmean(overlap))) if overlap.size else None,
            "overlap": [an.finite(float(v)) for v in np.atleast_1d(per_window)] if overlap.size else []}
    return out


def _drops(a: Analysis) -> dict | None:
    rec = a.recording
    if rec.dropped is None:
        return None
    total, fraction = an.drops_per_layer(rec.dropped, rec.logical_count)
    return {"total": float(total.sum()), "per_layer": [float(v) for v in total],
            "fraction_per_layer": [float(v) for v in fraction]}


def summary_of(a: Analysis) -> dict:
    """The summary.json document (plain JSON types)."""
    rec = a.recording
    return {
        "steps": rec.num_steps, "num_layers": rec.num_layers, "num_experts": rec.num_experts,
        "recorded_ep": a.num_ranks, "overall_balancedness": a.overall, "layers": _layers(a),
        "what_if": rows_as_dicts(a.what_if), "what_if_skipped": a.skipped,
        "balancedness_over_time": _over_time(a), "hot_set_churn": _churn(a), "drops": _drops(a),
        "recommendation": a.recommendation,
        "phases": [{"name": n, "start": s, "end": e} for n, s, e in rec.phases],
        "sources": [{"path": d.path, "format": d.format, "steps": d.num_steps,
                     "placement": "physical counts" if d.physical_count is not None
                     else "phy2log (even split over copies)" if d.phy2log is not None else "identity"}
                    for d in rec.dumps],
        **({"run": a.options.extra} if a.options.extra else {}),
    }


def write_report(recording: Recording, out_dir: str | Path, options: ReportOptions | None = None) -> Path:
    """Analyse, then write summary.json, the PNGs and index.html into out_dir; returns index.html."""
    from launch.profile.html_report import render_page
    from launch.profile.plots import draw_all

    options = options or ReportOptions()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    a = analyze(recording, options)
    summary = summary_of(a)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    figures = draw_all(a, out, progress=options.progress)
    page = out / "index.html"
    page.write_text(render_page(a, summary, figures), encoding="utf-8")
    return page
