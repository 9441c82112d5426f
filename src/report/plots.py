"""The report's figures (matplotlib, Agg): throughput against peak memory, and the paired effect of each switch."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend)
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from src.report.analysis import (  # noqa: E402
    AUC,
    AUC_EFFECT,
    EFFECTS,
    LEFT_OUT,
    MEMORY,
    MEMORY_EFFECT,
    SPEED_EFFECT,
    THROUGHPUT,
    as_override,
    comparison,
    short_name,
    verdict_text,
)

ANNOTATE_ALL_UP_TO = 12  # more configurations than this: only the Pareto front is labelled
DPI = 150


def config_label(row: pd.Series, keys: list[str]) -> str:
    """``amp=true, batch_size=8`` (one line per key beyond two)."""
    parts = [f"{short_name(k)}={as_override(str(row[k]))}" for k in keys]
    return (", " if len(parts) <= 2 else "\n").join(parts)


def drawable(values: np.ndarray, log: bool = False) -> np.ndarray:
    """Mask of the values an axis can place: finite, and above 0 on a log axis."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(values) & (values > 0 if log else True)


def throughput_memory(table: pd.DataFrame, keys: list[str], front: np.ndarray, title: str, path: Path) -> int:
    """Samples/s against peak MiB per configuration (means over seeds, std as error bars), coloured by test
    AUC, the Pareto front over all three (``front``) ringed: a staircase through speed and memory alone would
    leave out accurate configurations that are slower or larger. Configurations without a finite, non-negative
    samples/s and peak memory are left out; returns how many."""
    fig, ax = plt.subplots(figsize=(9, 6.5), layout="constrained")
    ax.set(
        xlabel="peak memory, mem/peak_mb (MiB)",
        ylabel="training throughput, perf/samples_per_s (samples/s)",
        title=title,
    )
    x, y = (table[column].to_numpy(float) for column in (MEMORY, THROUGHPUT))
    drawn = drawable(x) & drawable(y) & (x >= 0) & (y >= 0)
    table, front = table[drawn].reset_index(drop=True), front[drawn]
    x, y, auc = (table[column].to_numpy(float) for column in (MEMORY, THROUGHPUT, AUC))
    several = bool((table["n"] > 1).any())
    if several:
        ax.errorbar(
            x,
            y,
            xerr=table[f"{MEMORY} std"].fillna(0),
            yerr=table[f"{THROUGHPUT} std"].fillna(0),
            fmt="none",
            ecolor="0.65",
            elinewidth=1,
            capsize=3,
            zorder=1,
        )
    finite = auc[drawable(auc)]
    points = ax.scatter(
        x,
        y,
        c=auc,
        cmap="viridis",
        s=70,
        edgecolors="black",
        linewidths=0.5,
        zorder=3,
        vmin=finite.min() if finite.size else 0,
        vmax=finite.max() if finite.size else 1,
    )
    fig.colorbar(points, ax=ax, label="test AUC (mean over seeds)" if several else "test AUC")
    ax.scatter(x[front], y[front], s=220, facecolors="none", edgecolors="crimson", linewidths=1.5, zorder=4)
    ax.margins(x=0.2, y=0.2)
    for limits, set_limits in ((ax.get_xlim(), ax.set_xlim), (ax.get_ylim(), ax.set_ylim)):
        set_limits(max(limits[0], -0.03 * limits[1]), limits[1])  # from 0 (a little below: markers at 0 show)
    ax.grid(alpha=0.3)
    seeds = f"mean over {table['n'].max()} seeds, bars: std" if several else "one run each"
    fig.legend(
        handles=[
            Line2D(
                [],
                [],
                marker="o",
                linestyle="none",
                color="0.5",
                markeredgecolor="black",
                label=f"configuration ({seeds})",
            ),
            Line2D(
                [],
                [],
                marker="o",
                linestyle="none",
                color="crimson",
                markerfacecolor="none",
                markersize=12,
                label="Pareto front: no other configuration is at least as fast, "
                "as small and as accurate (test AUC), and better in one",
            ),
        ],
        loc="outside lower center",
        ncol=1,
        fontsize=9,
    )
    labelled = [*np.flatnonzero(front), *(np.flatnonzero(~front) if len(table) <= ANNOTATE_ALL_UP_TO else [])]
    place_labels(ax, x, y, {i: config_label(table.iloc[i], keys) for i in labelled})
    fig.savefig(path, dpi=DPI, format="png")  # path: a temporary name
    plt.close(fig)
    return int((~drawn).sum())


# Label offsets tried in turn (points from the marker; alignment), nearest first.
OFFSETS = [
    (dx * r, dy * r, ha, va)
    for r in (1, 2.5, 4.5)
    for dx, dy, ha, va in (
        (10, 6, "left", "bottom"),
        (10, -6, "left", "top"),
        (-10, 6, "right", "bottom"),
        (-10, -6, "right", "top"),
        (12, 0, "left", "center"),
        (-12, 0, "right", "center"),
        (0, 11, "center", "bottom"),
        (0, -11, "center", "top"),
    )
]


def overlap(a: Bbox, b: Bbox) -> float:
    return max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))


def place_labels(ax: plt.Axes, xs: np.ndarray, ys: np.ndarray, texts: dict[int, str]) -> None:
    """Label points ``texts`` (index: text), in that order, each at the first offset where it covers no
    other marker and no earlier label and stays inside the axes, else where it covers least."""
    fig = ax.figure
    fig.canvas.draw()  # settle the layout: the boxes below are in display pixels
    renderer, inside = fig.canvas.get_renderer(), ax.get_window_extent()
    radius = 9 * fig.dpi / 72
    markers = [
        Bbox.from_extents(px - radius, py - radius, px + radius, py + radius)
        for px, py in ax.transData.transform(np.column_stack([xs, ys]))
    ]
    labels: list[Bbox] = []
    for i, text in texts.items():
        taken, best = [*markers[:i], *markers[i + 1 :], *labels], None
        for dx, dy, ha, va in OFFSETS:
            label = ax.annotate(
                text,
                (xs[i], ys[i]),
                xytext=(dx, dy),
                textcoords="offset points",
                ha=ha,
                va=va,
                fontsize=8,
                zorder=5,
                arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.6},
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8},
            )
            label.set_in_layout(False)
            box = label.get_window_extent(renderer)
            cost = sum(overlap(box, t) for t in taken) + box.width * box.height - overlap(box, inside)
            if best is not None and cost >= best[0]:
                label.remove()
                continue
            if best is not None:
                best[1].remove()
            best = (cost, label, box)
            if cost == 0:
                break
        labels.append(best[2])


# (effect, x label, reference value, the effect's value as shown on the axis, log scale)
PANELS = (
    (SPEED_EFFECT, "training samples/s: value / baseline (ratio, log scale)", 1.0, lambda r: r, True),
    (MEMORY_EFFECT, "peak memory: change from baseline (%)", 0.0, lambda r: (r - 1) * 100, False),
    (AUC_EFFECT, "test AUC: value - baseline (AUC, 0 to 1)", 0.0, lambda d: d, False),
)
CI_COLOR, MARGIN_COLOR = "crimson", "darkorange"


def paired_effects(found: pd.DataFrame, summary: pd.DataFrame, title: str, path: Path) -> int:
    """One row per comparison (``amp=true vs false``), three panels (samples/s ratio, memory change, AUC
    difference): a bar at the mean over pairs (geometric for ratios) with its 95% interval, a dot per pair of runs
    (hollow: left out of speed), the margin (the band of ``no difference`` for ratios, the line at ``-margin`` for
    AUC) and, at the right, the verdicts. Values no axis can place (:func:`drawable`: missing, infinite, a ratio
    not above 0) are left out; returns how many pairs' values were."""
    comparisons = list(summary[["param", "value", "baseline"]].itertuples(index=False))
    rows = np.arange(len(comparisons))
    fig, axes = plt.subplots(1, 3, figsize=(16, 1.8 + 0.85 * len(rows)), sharey=True, layout="constrained")
    left_out = 0
    for ax, (effect, xlabel, reference, axis_value, log) in zip(axes, PANELS, strict=True):
        means, lo, hi = (
            shown(axis_value(summary[c].to_numpy(float)), log) for c in (effect.mean, effect.lo, effect.hi)
        )
        ax.barh(rows, means - reference, left=reference, height=0.5, color="tab:blue", alpha=0.45)
        ax.errorbar(
            means, rows, xerr=[means - lo, hi - means], fmt="none", ecolor=CI_COLOR, elinewidth=1.5, capsize=5, zorder=3
        )
        low, high = axis_value(np.array(effect.edges(summary[effect.margin].iloc[0])))
        if low == high:
            ax.axvline(low, color=MARGIN_COLOR, linestyle="--", linewidth=1.5)
        else:
            ax.axvspan(low, high, color=MARGIN_COLOR, alpha=0.15, linewidth=0)
        for row, key in enumerate(comparisons):
            dots = found[
                (found["param"] == key.param) & (found["value"] == key.value) & (found["baseline"] == key.baseline)
            ]
            x = axis_value(dots[effect.pair].to_numpy(float))
            left_out += int((~drawable(x, log)).sum())
            x = shown(x, log)
            left = dots[list(LEFT_OUT)].any(axis=1).to_numpy() if effect.timed else np.zeros(len(dots), bool)
            ax.plot(x[~left], np.full((~left).sum(), row), "o", color="black", markersize=4)
            ax.plot(x[left], np.full(left.sum(), row), "o", color="0.5", markerfacecolor="none", markersize=4)
            if np.isfinite(means[row]):
                right = means[row] >= reference
                ax.annotate(
                    effect.text(summary[effect.mean].iloc[row]),
                    (means[row], row),
                    xytext=(3 if right else -3, 11),
                    textcoords="offset points",
                    ha="left" if right else "right",
                    fontsize=8,
                    bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
                )
        ax.axvline(reference, color="0.3", linewidth=1)
        if log:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"×{v:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.xaxis.set_major_locator(ticker.LogLocator(base=2))
        ax.set_xlabel(xlabel)
        ax.margins(x=0.2)
        ax.grid(axis="x", alpha=0.3)
    verdicts = axes[2].secondary_yaxis("right")
    verdicts.set_yticks(
        rows,
        ["\n".join(f"{e.label}: {verdict_text(row, e)}" for e in EFFECTS) for row in summary.itertuples()],
        fontsize=8,
    )
    verdicts.tick_params(length=0)
    axes[0].set_yticks(
        rows,
        [
            f"{comparison(*key)}\n({n} pair{'s' if n > 1 else ''})"
            for key, n in zip(comparisons, summary["pairs"], strict=True)
        ],
    )
    axes[0].set_ylim(len(rows) - 0.4, -0.6)
    fig.legend(handles=legend(summary), loc="outside lower center", ncol=3, fontsize=9)
    fig.suptitle(title)
    fig.savefig(path, dpi=DPI, format="png")  # path: a temporary name
    plt.close(fig)
    return left_out


def shown(values: np.ndarray, log: bool) -> np.ndarray:
    """``values`` with those no axis can place (:func:`drawable`) as NaN, which matplotlib leaves out."""
    return np.where(drawable(values, log), values, np.nan)


def legend(summary: pd.DataFrame) -> list:
    """The paired-effects figure's legend, with the margins ``summary`` was judged against."""
    speed, memory, auc = (summary[e.margin].iloc[0] for e in EFFECTS)
    return [
        plt.Rectangle((0, 0), 1, 1, color="tab:blue", alpha=0.45, label="mean over pairs (geometric for ratios)"),
        Line2D([], [], marker="|", color=CI_COLOR, markersize=8, label="95% interval of the mean"),
        Line2D([], [], marker="o", linestyle="none", color="black", markersize=4, label="one pair of runs"),
        Line2D(
            [],
            [],
            marker="o",
            linestyle="none",
            color="0.5",
            markerfacecolor="none",
            markersize=4,
            label="a pair left out of speed (contended, or too few timed steps)",
        ),
        plt.Rectangle(
            (0, 0),
            1,
            1,
            color=MARGIN_COLOR,
            alpha=0.15,
            label=f"no difference: ratio in [1/(1 + margin), 1 + margin] (speed {speed:g}, memory {memory:g})",
        ),
        Line2D(
            [],
            [],
            color=MARGIN_COLOR,
            linestyle="--",
            label=f"-margin ({-auc:+g} AUC): no loss when the interval is right of it",
        ),
    ]
