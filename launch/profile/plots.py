"""The report's figures (matplotlib, Agg backend), one PNG each, written beside index.html."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from launch.profile import analysis as an  # noqa: E402

if TYPE_CHECKING:
    from launch.profile.study import Analysis

DPI = 110
PHASE_COLORS = ("#e8eef8", "#fbeee0", "#e6f4ea", "#f6e6f0", "#f2f2dc")


@dataclass(frozen=True)
class Figure:
    """file: PNG name in the report folder; title and caption for the page."""

    file: str
    title: str
    caption: str


def _layer_labels(a: Analysis) -> list[str]:
    ids = a.options.model_layers
    if ids and len(ids) == a.recording.num_layers:
        return [f"{x} (L{m})" for x, m in enumerate(ids)]
    return [str(x) for x in range(a.recording.num_layers)]


def _phases(ax, a: Analysis, scale: float = 1.0) -> None:
    """Shade and name each workload phase on a time axis (x in steps / scale)."""
    for i, (name, start, end) in enumerate(a.recording.phases):
        ax.axvspan(start / scale, end / scale, color=PHASE_COLORS[i % len(PHASE_COLORS)], zorder=0)
        ax.axvline(start / scale, color="#555555", lw=0.8, ls="--", zorder=1)
        ax.text((start + end) / 2 / scale, 1.0, name, transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=9, color="#333333")


def _save(fig, out: Path, name: str) -> None:
    fig.tight_layout()
    fig.savefig(out / name, dpi=DPI)
    plt.close(fig)


def _tall(num_layers: int) -> float:
    return float(min(16.0, max(3.0, 1.6 + 0.28 * num_layers)))


def load_heatmap(a: Analysis, out: Path) -> Figure:
    load = a.recording.logical_count.sum(0)
    mean = load.mean(1, keepdims=True)
    ratio = load / np.where(mean > 0, mean, 1.0)
    fig, ax = plt.subplots(figsize=(11, _tall(a.recording.num_layers)))
    im = ax.imshow(ratio, aspect="auto", cmap="magma", interpolation="nearest", vmin=0)
    ax.set_xlabel("logical expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(ratio)), _layer_labels(a), fontsize=8 if len(ratio) < 40 else 5)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="tokens / layer mean (1 = uniform)")
    ax.set_title(f"Expert load over {a.recording.num_steps} steps")
    _save(fig, out, "load_heatmap.png")
    return Figure("load_heatmap.png", "Load per layer and expert",
                  "Tokens routed to each logical expert over the whole recording, as a multiple of the layer's "
                  "mean expert load. Bright cells are hot experts; a uniform router gives one flat color.")


def rank_heatmap(a: Analysis, out: Path) -> Figure:
    load = a.rank_load.sum(0)
    mean = load.mean(1, keepdims=True)
    ratio = load / np.where(mean > 0, mean, 1.0)
    num_layers, num_ranks = ratio.shape
    fig, ax = plt.subplots(figsize=(min(11, 5.5 + 0.6 * num_ranks), _tall(num_layers)))
    im = ax.imshow(ratio, aspect="auto", cmap="RdYlBu_r", interpolation="nearest", vmin=0,
                   vmax=max(2.0, float(ratio.max())))
    if num_layers * num_ranks <= 400:
        for (y, x), v in np.ndenumerate(ratio):
            ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(num_ranks))
    ax.set_xlabel("EP rank")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(num_layers), _layer_labels(a), fontsize=8 if num_layers < 40 else 5)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="rank load / mean rank load")
    ax.set_title(f"Rank load under the recorded placement (EP {a.num_ranks})")
    _save(fig, out, "rank_load.png")
    return Figure("rank_load.png", "Load per layer and EP rank",
                  f"Tokens each of the {a.num_ranks} EP ranks processed per layer, under the placement in force "
                  "when recorded, relative to the layer's mean. A layer's step waits for its busiest rank "
                  "(the largest number in its row).")


def layer_balancedness(a: Analysis, out: Path) -> Figure:
    num_layers = a.recording.num_layers
    fig, ax = plt.subplots(figsize=(max(6, min(14, 2 + 0.3 * num_layers)), 3.6))
    ax.bar(range(num_layers), a.layer_bal, color="#4878a8")
    ax.axhline(a.overall, color="#c44e52", ls="--", label=f"overall {a.overall:.3f}")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("mean / max rank load")
    ax.set_xticks(range(num_layers), _layer_labels(a), rotation=90 if num_layers > 16 else 0,
                  fontsize=8 if num_layers < 40 else 5)
    ax.legend(loc="lower right")
    ax.set_title(f"Balancedness per layer (EP {a.num_ranks}, whole recording)")
    _save(fig, out, "balancedness_layers.png")
    return Figure("balancedness_layers.png", "Balancedness per layer",
                  "Mean rank load / max rank load of each MoE layer over the whole recording (1.0 = every rank "
                  "equally busy); the dashed line is the overall figure, sum of means / sum of maxes.")


def balancedness_time(a: Analysis, out: Path) -> Figure:
    steps = np.arange(1, a.step_bal.size + 1)
    fig, ax = plt.subplots(figsize=(11, 3.8))
    _phases(ax, a)
    # a recording of one step is one point: a marker, or the line draws nothing
    ax.plot(steps, a.step_bal, color="#999999", lw=0.5, alpha=0.6, label="per step",
            marker="o" if a.step_bal.size == 1 else None)
    for w, color in zip(an.windows_to_show(a.recording.num_steps), ("#4878a8", "#55a868", "#c44e52")):
        ax.plot(steps, an.trailing_mean(a.step_bal, w), color=color, lw=1.6, label=f"last {w} steps")
    ax.set_ylim(0, 1.05)
    ax.set_xlim(0, a.step_bal.size if a.step_bal.size > 1 else 2)  # one step: its point in the middle
    ax.set_xlabel("step (forward pass)")
    ax.set_ylabel("balancedness")
    ax.legend(loc="lower right", fontsize=8, ncol=4)
    ax.set_title("Balancedness over time (trailing averages over 10 / 100 / 1000 steps)", pad=16)
    _save(fig, out, "balancedness_time.png")
    return Figure("balancedness_time.png", "Balancedness over time",
                  "Each step's balancedness (sum over layers of mean / max rank load) and its trailing averages "
                  "over the last 10, 100 and 1000 steps, as SGLang logs them. Shaded bands are workload phases.")


def hot_experts(a: Analysis, out: Path) -> Figure:
    num_layers, num = a.hot_share.shape
    fig, ax = plt.subplots(figsize=(11, _tall(num_layers)))
    left = np.zeros(num_layers)
    colors = plt.get_cmap("tab10")
    for k in range(num):
        share = a.hot_share[:, k]
        ax.barh(range(num_layers), share, left=left, color=colors(k), edgecolor="white",
                label=f"#{k + 1} hottest")
        for y in range(num_layers):
            if share[y] > 0.035:
                ax.text(left[y] + share[y] / 2, y, str(a.hot_ids[y, k]), ha="center", va="center", fontsize=7,
                        color="white")
        left += share
    ax.barh(range(num_layers), 1 - left, left=left, color="#dddddd", label="other experts")
    uniform = num / a.recording.num_experts
    ax.axvline(uniform, color="black", ls=":", lw=1, label=f"uniform share of {num} experts")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.set_yticks(range(num_layers), _layer_labels(a), fontsize=8 if num_layers < 40 else 5)
    ax.set_xlabel("share of the layer's tokens")
    ax.set_ylabel("MoE layer")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=num + 2, fontsize=8)
    _save(fig, out, "hot_experts.png")
    return Figure("hot_experts.png", "Hot experts per layer",
                  f"The {num} most loaded logical experts of each layer (ids in the bars) and their share of its "
                  f"tokens; the dotted line is what {num} experts would carry under uniform routing.")


def expert_share_time(a: Analysis, out: Path) -> Figure:
    layer = a.drift_layer
    count = a.recording.logical_count[:, layer]
    window = max(1, round(a.recording.num_steps / 80))
    loads = an.window_loads(count, window)
    total = loads.sum(1, keepdims=True)
    share = loads / np.where(total > 0, total, 1.0)
    fig, ax = plt.subplots(figsize=(11, max(3.0, min(8.0, 1.5 + 0.12 * a.recording.num_experts))))
    im = ax.imshow(share.T, aspect="auto", cmap="viridis", interpolation="nearest", origin="lower",
                   extent=(0, loads.shape[0] * window, -0.5, a.recording.num_experts - 0.5))
    for name, start, _ in a.recording.phases:
        ax.axvline(start, color="white", lw=1.2, ls="--")
        ax.text(start, a.recording.num_experts - 0.5, f" {name}", color="white", va="top", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("logical expert")
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="share of the layer's tokens")
    ax.set_title(f"Layer {_layer_labels(a)[layer]}: expert shares over time ({window}-step windows)")
    _save(fig, out, "expert_share_time.png")
    return Figure("expert_share_time.png", "Where the load moves",
                  f"Layer {_layer_labels(a)[layer]} (the layer whose hot set changes most): each expert's share of "
                  f"the layer's tokens in consecutive {window}-step windows. A change of workload shows as a "
                  "vertical break where other experts light up.")


def churn(a: Analysis, out: Path) -> Figure | None:
    if not a.churn or all(o.size == 0 for o in a.churn.values()):
        return None
    fig, ax = plt.subplots(figsize=(11, 3.6))
    _phases(ax, a)
    for (w, overlap), color in zip(sorted(a.churn.items()), ("#4878a8", "#55a868", "#c44e52", "#8172b2")):
        if overlap.size == 0:
            continue
        x = (np.arange(overlap.shape[0]) + 1) * w
        ax.plot(x, an.mean_over(overlap, axis=1), marker="o" if overlap.shape[0] < 60 else None, ms=3, color=color,
                label=f"{w}-step windows")
    ax.axhline(a.top / a.recording.num_experts, color="black", ls=":", lw=1, label="chance")
    ax.set_ylim(0, 1.05)
    ax.set_xlim(0, a.recording.num_steps)
    ax.set_xlabel("step (start of the window)")
    ax.set_ylabel(f"top-{a.top} overlap")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"How fast the hot set changes: top-{a.top} experts shared with the previous window", pad=16)
    _save(fig, out, "hot_set_churn.png")
    return Figure("hot_set_churn.png", "Hot-set churn",
                  f"For consecutive windows, the fraction of a window's {a.top} most loaded experts that were also "
                  "among the previous window's, averaged over layers. 1.0 means the hot set stays put (a placement "
                  "keeps working); near the dotted chance line it moves as fast as it can.")


def drops(a: Analysis, out: Path) -> Figure | None:
    rec = a.recording
    if rec.dropped is None:
        return None
    total, fraction = an.drops_per_layer(rec.dropped, rec.logical_count)
    fig, ax = plt.subplots(figsize=(max(7, min(14, 2 + 0.3 * rec.num_layers)), 3.4))
    ax.bar(range(rec.num_layers), 100 * fraction, color="#c44e52")
    ax.set_xticks(range(rec.num_layers), _layer_labels(a), rotation=90 if rec.num_layers > 16 else 0, fontsize=8)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("% of assignments dropped")
    ax.set_title(f"Capacity drops: {int(total.sum())} token-expert assignments", fontsize=11)
    _save(fig, out, "drops.png")
    return Figure("drops.png", "Capacity drops per layer",
                  "Token-expert assignments dropped by the expert capacity factor, as a share of those routed.")


def what_if(a: Analysis, out: Path) -> Figure | None:
    if not a.what_if:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2))
    colors = plt.get_cmap("tab10")
    for i, ep in enumerate(sorted({r.ep for r in a.what_if})):
        for policy, style in (("global", "-"), ("hierarchical", "--")):
            rows = sorted((r for r in a.what_if if r.ep == ep and r.policy == policy), key=lambda r: r.redundant)
            if rows:
                ax.plot([r.redundant for r in rows], [r.balancedness for r in rows], style, marker="o", ms=4,
                        color=colors(i), label=f"EP {ep} {policy}")
        base = next(r.no_eplb_balancedness for r in a.what_if if r.ep == ep)
        ax.scatter([0], [base], marker="x", s=50, color=colors(i), zorder=3)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("redundant experts per layer")
    ax.set_ylabel("predicted balancedness")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.set_title("What-if: EPLB placement from this recording (x = no EPLB)")
    _save(fig, out, "what_if.png")
    return Figure("what_if.png", "What redundant experts and EP size would buy",
                  "Predicted balancedness of the balancer's placement (fitted on the whole recording) per EP size "
                  "and redundant-expert count; solid global, dashed hierarchical; x marks the same EP size with no "
                  "EPLB (identity placement).")


def draw_all(a: Analysis, out: Path, progress: bool = True) -> list[Figure]:
    """Draw every figure that has data; returns them in page order."""
    makers = (load_heatmap, rank_heatmap, layer_balancedness, balancedness_time, hot_experts, expert_share_time,
              churn, drops, what_if)
    figures = []
    for make in tqdm(makers, desc="drawing figures", unit="figure", disable=not progress):
        fig = make(a, out)
        if fig is not None:
            figures.append(fig)
    return figures
