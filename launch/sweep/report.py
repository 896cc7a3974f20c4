"""Sweep outputs: ``results.jsonl`` (the record, one row per run), ``results.csv`` and plots.

Row keys: ``key`` (canonical settings JSON, `` #r`` for repeat r > 0), ``settings``, ``repeat``, ``status`` ("ok" | "skipped" |
"error"), ``reason`` (why a point was skipped or failed), then the measured columns of
``launch.sweep.measure.summarize_run`` plus ``predicted_step_ms`` and ``prediction_error``
((predicted - measured) / measured), or ``prediction_note`` (why there is no prediction). The CSV has one column per swept key (``settings.*``)
followed by every measured column; with ``--repeats``, ``medians.csv`` holds each point's
median over its repeats (``num_repeats`` column) and the plots show those medians. Plots
(matplotlib, Agg): ``throughput.png`` (output tokens/s per point) and
``tpot_vs_throughput.png`` (TPOT p50 against throughput, and the Pareto front: the points
no other point beats on both, more throughput and lower TPOT).
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launch.sweep.grid import format_settings

RESULTS_JSONL = "results.jsonl"
RESULTS_CSV = "results.csv"
MEDIANS_CSV = "medians.csv"
THROUGHPUT_PNG = "throughput.png"
PARETO_PNG = "tpot_vs_throughput.png"

COLUMNS = (
    "output_tokens_per_s", "measured_step_ms", "measured_step_cpu_ms", "predicted_step_ms", "prediction_error",
    "prediction_error_cpu",
    "measured_step_ms_p99", "prefill_step_ms", "prefill_step_cpu_ms", "predicted_prefill_step_ms", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
    "balancedness", "drop_rate", "kv_tokens", "greedy_agreement", "num_requests", "num_output_tokens",
    "elapsed_s", "num_steps", "num_decode_steps", "mean_decode_batch", "decode_batch_per_rank_p50",
    "decode_context_mean", "predicted_balancedness", "predicted_bound", "prediction_note", "num_rebalances", "ep_size", "repeat",
)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a results.jsonl; a torn last line (a run killed mid-write) and lines that are
    no row (not a JSON object with a "key") are ignored."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("key"), str):
            rows.append(row)
    return rows


def latest_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The last row written for each point key (a rerun of a failed point supersedes it)."""
    return {row["key"]: dict(row) for row in rows}


def append_row(path: Path, row: Mapping[str, Any]) -> None:
    """Append ``row`` as one line; after a torn last line (a run killed mid-write) on a line of its own,
    so the torn one stays ignored and the new row is read back."""
    torn = False
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(("\n" if torn else "") + json.dumps(row, sort_keys=False) + "\n")
        f.flush()


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> None:
    """One line per row: ``settings.<key>`` for each swept key, then status, reason, COLUMNS."""
    extra = ["num_repeats"] if any("num_repeats" in r for r in rows) else []
    header = [f"settings.{k}" for k in keys] + ["status", "reason", *extra, *COLUMNS]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            settings = row.get("settings", {})
            w.writerow([_cell(settings.get(k)) for k in keys] + [row.get("status"), row.get("reason") or ""]
                       + [_cell(row.get(c)) for c in (*extra, *COLUMNS)])


def median_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per point over its "ok" repeats: the median of every numeric column, plus
    ``num_repeats`` (``--repeats``: compare points by these, not by single runs)."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row.get("status") == "ok":
            groups.setdefault(json.dumps(row["settings"], sort_keys=True), []).append(row)
    out = []
    for group in groups.values():
        merged: dict[str, Any] = {"settings": group[0]["settings"], "status": "ok", "num_repeats": len(group)}
        for col in COLUMNS:
            values = [r[col] for r in group if isinstance(r.get(col), int | float) and not isinstance(r[col], bool)]
            merged[col] = statistics.median(values) if values else group[0].get(col)
        out.append(merged)
    return out


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of (throughput, tpot) points no other point beats on both (more throughput,
    lower TPOT; ties on both count as not beaten), in order of rising throughput."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 <= y) and (x2 > x or y2 < y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def write_plots(out_dir: Path, rows: Sequence[Mapping[str, Any]]) -> list[Path]:
    """Both PNGs from the "ok" rows; returns the files written (none without ok rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and r.get("output_tokens_per_s") is not None]
    if not ok:
        return []
    labels = [format_settings(r["settings"]) for r in ok]
    tput = [float(r["output_tokens_per_s"]) for r in ok]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(ok) + 2), 4.5))
    ax.bar(range(len(ok)), tput, color="#4878a8")
    ax.set_xticks(range(len(ok)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput per sweep point")
    fig.tight_layout()
    written = [out_dir / THROUGHPUT_PNG]
    fig.savefig(written[0], dpi=120)
    plt.close(fig)

    pts = [(float(r["output_tokens_per_s"]), float(r["tpot_ms_p50"])) for r in ok if r.get("tpot_ms_p50") is not None]
    lab = [labels[i] for i, r in enumerate(ok) if r.get("tpot_ms_p50") is not None]
    if pts:
        front = pareto_front(pts)
        fig, ax = plt.subplots(figsize=(7, 5))
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="#999999", label="point")
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "o-", color="#c0392b", label="Pareto front")
        for (x, y), text in zip(pts, lab):
            ax.annotate(text, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("TPOT p50 (ms)")
        ax.set_title("TPOT vs throughput")
        ax.legend()
        fig.tight_layout()
        written.append(out_dir / PARETO_PNG)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
