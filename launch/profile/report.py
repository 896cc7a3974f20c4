"""Analyse a ``Recording`` and write the report folder: ``summary.json``, PNGs, ``index.html``.

``summary.json`` keys (issue 10): ``layers`` (per MoE layer in order: ``layer``,
``balancedness``, ``hot_experts`` = the 5 most loaded logical ids most loaded first (none
for an idle layer), ``load_share`` of each, plus ``rank_load`` and ``idle``),
``overall_balancedness`` (sum of means / sum of maxes), ``what_if`` (rows of ``ep``,
``redundant``, ``policy``, ``balancedness``, ``no_eplb_balancedness``, ``gain_over_no_eplb``,
``held_out_balancedness``), ``steps``, ``num_layers``, ``num_experts``; and ``recorded_ep``,
``sources``, ``skipped_sources`` (empty dumps left out), ``phases``,
``balancedness_over_time``, ``hot_set_churn``, ``drops``, ``recommendation`` (``ep`` and
``ep_basis``: the EP size it is for and why; ``num_redundant_experts``; ``eplb_config``, with
``pays`` false and no window when no replayed schedule beats no EPLB).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from launch.profile import analysis as an
from launch.profile.readers import Recording
from launch.profile.study import Analysis, ReportOptions, analyze
from launch.profile.whatif import rows_as_dicts

MAX_SERIES = 20000


def _layers(a: Analysis) -> list[dict]:
    total = a.rank_load.sum(0)
    count = a.recording.logical_count.sum(0)
    out = []
    for x in range(a.recording.num_layers):
        idle = bool(count[x].sum() == 0)  # no tokens: no expert is hot
        entry = {"layer": x, "balancedness": float(a.layer_bal[x]),
                 "hot_experts": [] if idle else [int(i) for i in a.hot_ids[x]],
                 "load_share": [] if idle else [float(s) for s in a.hot_share[x]],
                 "tokens": float(count[x].sum()), "rank_load": [float(v) for v in total[x]],
                 "idle": idle}
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
        per_window = an.mean_over(overlap, axis=1)
        out["windows"][str(w)] = {
            "mean_overlap": an.finite(float(an.mean_over(overlap.reshape(-1), axis=0))) if overlap.size else None,
            "overlap": [an.finite(float(v)) for v in per_window]}
    return out


def _drops(a: Analysis) -> dict | None:
    rec = a.recording
    if rec.dropped is None:
        return None
    total, fraction = an.drops_per_layer(rec.dropped, rec.logical_count)
    return {"total": float(total.sum()), "per_layer": [float(v) for v in total],
            "fraction_per_layer": [float(v) for v in fraction]}


def _phases(a: Analysis) -> list[dict]:
    """Per workload phase: its balancedness, hot experts per layer, and how much of its hot set
    (top ``a.top`` per layer) the previous phase shared: the switch in numbers."""
    out, prev = [], None
    for name, start, end in a.recording.phases:
        count = a.recording.logical_count[start:end].sum(0)
        ids, share = an.hot_experts(count)
        top = np.argsort(-count, axis=1, kind="stable")[:, : a.top]
        idle = count.sum(1) == 0
        entry = {"name": name, "start": start, "end": end,
                 "balancedness": an.layer_balancedness(a.rank_load[start:end].sum(0))[1],
                 "hot_experts": [[] if i else r for i, r in zip(idle, ids.tolist())],
                 "load_share": [[] if i else r for i, r in zip(idle, share.tolist())],
                 "overlap_with_previous": None}
        if prev is not None and end > start:
            shared = [len(set(t) & set(p)) / a.top for t, p in zip(top.tolist(), prev.tolist())]
            entry["overlap_with_previous"] = float(np.mean(shared))
        out.append(entry)
        prev = top if end > start else prev
    return out


def summary_of(a: Analysis) -> dict:
    """The summary.json document (plain JSON types)."""
    rec = a.recording
    return {
        "steps": rec.num_steps, "num_layers": rec.num_layers, "num_experts": rec.num_experts,
        "recorded_ep": a.num_ranks, "overall_balancedness": a.overall, "layers": _layers(a),
        "what_if": rows_as_dicts(a.what_if), "what_if_skipped": a.skipped,
        "balancedness_over_time": _over_time(a), "hot_set_churn": _churn(a), "drops": _drops(a),
        "recommendation": a.recommendation,
        "phases": _phases(a),
        "sources": [{"path": d.path, "format": d.format, "steps": d.num_steps,
                     "placement": "physical counts" if d.physical_count is not None
                     else "phy2log (even split over copies)" if d.phy2log is not None else "identity"}
                    for d in rec.dumps],
        "skipped_sources": [{"path": p, "reason": why} for p, why in rec.skipped],
        **({"run": a.options.extra} if a.options.extra else {}),
    }


def write_report(recording: Recording, out_dir: str | Path, options: ReportOptions | None = None) -> Path:
    """Analyse, then write summary.json, the PNGs and index.html into out_dir; returns index.html."""
    from launch.profile.html_report import render_page
    from launch.profile.plots import draw_all

    options = options or ReportOptions()
    a = analyze(recording, options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summary_of(a)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    figures = draw_all(a, out, progress=options.progress)
    page = out / "index.html"
    page.write_text(render_page(a, summary, figures), encoding="utf-8")
    return page
