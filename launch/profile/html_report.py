"""index.html of the report: one self-contained page (inline CSS, images beside it, no scripts,
no network) that opens from disk."""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING

from launch.profile.plots import Figure

if TYPE_CHECKING:
    from launch.profile.study import Analysis

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1200px;
       color: #222; line-height: 1.45; padding: 0 16px; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 19px; margin-top: 32px; border-bottom: 1px solid #ddd; }
.sub { color: #666; font-size: 13px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 10px 14px; min-width: 160px; background: #fafafa; }
.card .v { font-size: 22px; font-weight: 600; } .card .k { font-size: 12px; color: #666; }
.rec { border-left: 4px solid #4878a8; background: #f3f7fc; padding: 10px 14px; margin: 10px 0; }
code { background: #f0f0f0; padding: 1px 4px; border-radius: 3px; font-size: 13px; }
figure { margin: 18px 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #444; margin-top: 4px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; } th { background: #f4f4f4; }
td.l, th.l { text-align: left; } tr.best td { background: #eef7ee; font-weight: 600; }
nav a { margin-right: 12px; font-size: 13px; }
"""


def _e(x: object) -> str:
    return html.escape(str(x))


def _layer_name(layer: dict) -> str:
    """A summary layer entry's name: its MoE-layer index, and the model's layer id where known ("0 (L1)")."""
    return f"{layer['layer']}" + (f" (L{layer['model_layer']})" if "model_layer" in layer else "")


def _cards(a: Analysis, summary: dict) -> str:
    worst = min(summary["layers"], key=lambda x: x["balancedness"])
    time = summary["balancedness_over_time"]
    items = [(f"{a.overall:.3f}", f"overall balancedness (EP {a.num_ranks})"),
             (f"{worst['balancedness']:.3f}", f"worst layer {_layer_name(worst)}"),
             (f"{min(time['min_average'].values()):.3f}",
              f"lowest {time['window_sizes'][0]}-step average"),
             (str(summary["steps"]), f"steps, {summary['num_layers']} layers x {summary['num_experts']} experts")]
    churn = summary["hot_set_churn"]["windows"]
    if churn:
        w = min(churn, key=int)
        if churn[w]["mean_overlap"] is not None:
            items.append((f"{churn[w]['mean_overlap']:.2f}", f"top-{a.top} overlap, {w}-step windows"))
    if summary["drops"]:
        items.append((f"{int(summary['drops']['total'])}", "assignments dropped by capacity"))
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="v">{_e(v)}</div><div class="k">{_e(k)}</div></div>' for v, k in items) + "</div>"


def _recommendation(rec: dict) -> str:
    parts = []
    if rec.get("ep_basis"):
        parts.append(f"<p>{_e(rec['ep_basis'][0].upper() + rec['ep_basis'][1:])}.</p>")
    red = rec.get("num_redundant_experts")
    if red:
        parts.append(f"<p><code>--num-redundant-experts {red['value']}</code> &nbsp; {_e(red['basis'])}</p>")
    eplb = rec.get("eplb_config") or {}
    if eplb.get("window_size"):
        flag = json.dumps({"window_size": eplb["window_size"], "step_interval": eplb["step_interval"]})
        parts.append(f"<p><code>--eplb-config '{_e(flag)}'</code> &nbsp; {_e(eplb['basis'])}</p>")
    elif eplb.get("pays") is False:
        parts.append(f"<p><b>No EPLB schedule:</b> {_e(eplb['basis'])}</p>")
    elif eplb:
        parts.append(f"<p>No <code>--eplb-config</code> recommendation: {_e(eplb.get('basis', ''))}</p>")
    return '<div class="rec"><b>Recommended</b>' + "".join(parts) + "</div>"


def _layer_table(summary: dict) -> str:
    rows = []
    for x in summary["layers"]:
        hot = ", ".join(f"{i} ({s:.1%})" for i, s in zip(x["hot_experts"], x["load_share"])) or "idle (no tokens)"
        loads = x["rank_load"]
        mean = sum(loads) / len(loads) if loads else 0.0
        name = _layer_name(x)
        rows.append(f"<tr><td>{_e(name)}</td><td>{x['balancedness']:.3f}</td><td>{max(loads):.0f}</td>"
                    f"<td>{mean:.0f}</td><td class='l'>{_e(hot)}</td></tr>")
    return ("<table><tr><th>layer</th><th>balancedness</th><th>max rank load</th><th>mean rank load</th>"
            "<th class='l'>hot experts (share)</th></tr>" + "".join(rows) + "</table>")


def _what_if_table(summary: dict, rec: dict) -> str:
    pick = rec.get("num_redundant_experts") or {}
    rows = []
    for r in summary["what_if"]:
        best = r["ep"] == pick.get("ep") and r["redundant"] == pick.get("value") and r["policy"] == pick.get("policy")
        held = "" if r["held_out_balancedness"] is None else f"{r['held_out_balancedness']:.3f}"
        rows.append(f"<tr{' class=best' if best else ''}><td>{r['ep']}</td><td>{r['redundant']}</td>"
                    f"<td class='l'>{_e(r['policy'])}</td><td>{r['balancedness']:.3f}</td>"
                    f"<td>{r['no_eplb_balancedness']:.3f}</td><td>{r['gain_over_no_eplb']:.2f}x</td>"
                    f"<td>{held}</td></tr>")
    skipped = "".join(f"<li>{_e(s)}</li>" for s in summary["what_if_skipped"])
    return ("<table><tr><th>EP</th><th>redundant</th><th class='l'>policy</th><th>predicted balancedness</th>"
            "<th>no EPLB</th><th>gain</th><th>held out</th></tr>" + "".join(rows) + "</table>"
            "<p class='sub'>Predicted: the placement is fitted on the whole recording and scored on it. Held out: "
            "fitted on the first half, scored on the second (drift shows as the gap). Gain: predicted / no "
            "EPLB.</p>" + (f"<p class='sub'>Not computed:</p><ul class='sub'>{skipped}</ul>" if skipped else ""))


def _schedule_table(rec: dict) -> str:
    eplb = rec.get("eplb_config") or {}
    cands = eplb.get("candidates") or []
    if not cands:
        return ""
    rows = "".join(
        f"<tr{' class=best' if (c['window_size'], c['step_interval']) == (eplb['window_size'], eplb['step_interval']) else ''}>"
        f"<td>{c['window_size']}</td><td>{c['step_interval']}</td><td>{c['balancedness']:.3f}</td></tr>"
        for c in cands)
    verdict = "; none beats no EPLB: rebalancing does not pay on this load" if eplb.get("pays") is False else ""
    return ("<h2 id='schedule'>EPLB schedules replayed</h2><p class='sub'>Each schedule rebalances every "
            "<i>interval</i> steps from the last <i>window</i> steps and serves the next interval with that "
            f"placement; realized balancedness over steps {eplb['replayed_from_step']}-end (no EPLB: "
            f"{eplb['no_eplb_balancedness']:.3f}){verdict}.</p><table><tr><th>window_size</th><th>step_interval</th>"
            "<th>realized balancedness</th></tr>" + rows + "</table>")


def _sources(summary: dict) -> str:
    items = "".join(f"<li><code>{_e(s['path'])}</code>: {_e(s['format'])}, {s['steps']} steps, placement from "
                    f"{_e(s['placement'])}</li>" for s in summary["sources"])
    items += "".join(f"<li><code>{_e(s['path'])}</code>: skipped, {_e(s['reason'])}</li>"
                     for s in summary["skipped_sources"])
    run = summary.get("run")
    run_line = ("<p class='sub'>Run: " + ", ".join(f"{_e(k)} = {_e(v)}" for k, v in run.items()) + "</p>") if run else ""
    return f"<ul class='sub'>{items}</ul>{run_line}"


def _phase_table(phases: list[dict], top: int) -> str:
    if not phases:
        return ""
    rows = []
    for p in phases:
        hot = "; ".join(f"{x}: " + (", ".join(str(i) for i in ids[:3]) or "idle")
                        for x, ids in enumerate(p["hot_experts"]))
        overlap = "" if p["overlap_with_previous"] is None else f"{p['overlap_with_previous']:.2f}"
        rows.append(f"<tr><td class='l'>{_e(p['name'])}</td><td>{p['start']}-{p['end']}</td>"
                    f"<td>{p['balancedness']:.3f}</td><td>{overlap}</td><td class='l'>{_e(hot)}</td></tr>")
    return ("<h2 id='phases'>Workload phases</h2><table><tr><th class='l'>phase</th><th>steps</th>"
            f"<th>balancedness</th><th>top-{top} overlap with previous phase</th>"
            "<th class='l'>3 hottest experts per layer</th></tr>" + "".join(rows) + "</table>"
            "<p class='sub'>Overlap: the share of each layer's hottest experts in this phase that were also "
            "hottest in the previous one, averaged over layers (1.0: the switch did not move the load).</p>")


def render_page(a: Analysis, summary: dict, figures: list[Figure]) -> str:
    """The whole index.html as a string."""
    figs = "".join(f"<h2 id='{_e(f.file[:-4])}'>{_e(f.title)}</h2><figure><img src='{_e(f.file)}' "
                   f"alt='{_e(f.title)}'><figcaption>{_e(f.caption)}</figcaption></figure>" for f in figures)
    phases = summary["phases"]
    phase_line = _phase_table(phases, a.top)
    nav = "".join(f"<a href='#{_e(f.file[:-4])}'>{_e(f.title)}</a>" for f in figures)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(a.options.title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body>
<h1>{_e(a.options.title)}</h1>
<p class="sub">{summary['steps']} recorded steps, {summary['num_layers']} MoE layers, {summary['num_experts']}
logical experts; rank loads under the recorded placement at EP {a.num_ranks}. Files: <code>summary.json</code>
holds every number on this page.</p>
{_sources(summary)}
{_cards(a, summary)}
{_recommendation(summary['recommendation'])}
{phase_line}
<nav>{nav}<a href="#layers">Per-layer table</a><a href="#whatif">What-if table</a></nav>
{figs}
<h2 id="layers">Per layer</h2>{_layer_table(summary)}
<h2 id="whatif">What-if: EP size x redundant experts</h2>{_what_if_table(summary, summary['recommendation'])}
{_schedule_table(summary['recommendation'])}
<h2>How to read this</h2>
<p>Balancedness is mean rank load / max rank load: a layer's expert step takes as long as its busiest EP rank,
so 0.5 means half the expert compute the ranks could do in that time is idle. Hot experts with a large share and
a low balancedness are what redundant experts fix (the balancer copies them to other ranks); a hot set that
changes fast (low overlap) needs a short <code>step_interval</code>, a stable one can keep its placement long.</p>
</body></html>
"""
