"""What a report says, built without writing a file: the runs analysed once (:func:`analyse`), the report's sections
(texts and tables, :func:`report_sections`) and its pages (:func:`markdown_page`, :func:`html_page`).

:mod:`src.report.writer` writes the figures, the CSVs and these pages into the report's folder.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pandas as pd

from src.report.analysis import (
    AUC,
    CONTENDED,
    DTYPE,
    EFFECTS,
    MEMORY,
    MIN_TIMED_STEPS,
    PROVENANCE,
    SEED,
    SET_ASIDE,
    STEPS_TIMED,
    THROUGHPUT,
    aggregate,
    as_override,
    comparison,
    left_out,
    paired_effects,
    pareto_front,
    summarize_effects,
    superseded,
    swept_columns,
    unfit_for_speed,
    verdict_text,
)
from src.report.runs import METRICS, Selection, datasets_table, param_columns

THROUGHPUT_FIGURE, EFFECTS_FIGURE = "throughput_memory.png", "paired_effects.png"  # the figures' files
DEFINITIONS = (
    "`val/acc`, `val/auc`: at the epoch whose weights were tested (`best_epoch`, by `select_by`); "
    "`perf/samples_per_s`: the median over epochs (`perf/samples_per_s_median`); `mem/peak_mb`: the run's peak; "
    "`test/*`, `mem/predicted_mb`: as logged."
)
PRECISION = "`precision`: the dtype trained in (tag `amp.dtype`; `amp=true` on a CPU without bf16 trains in float32)."
CONTENDED_RUNS = (
    "`contended`: how many of its runs other processes shared the machine with (their samples/s count here, not in "
    "the speed verdicts below)."
)
TIMING = (
    "`perf/steps_timed`: optimizer steps timed, warm-up excluded (- for runs logged before it was); `contended`: "
    "other processes shared the CPU or GPU while the run trained (tag `perf.contended=true`)."
)
WHY_UNFIT = {  # unfit_for_speed's flags: why runs' samples/s cannot be compared
    "contended": "were contended (other processes shared the CPU or GPU: tag `perf.contended=true`)",
    "few_steps": f"timed fewer than {MIN_TIMED_STEPS} optimizer steps (a smoke run: `epochs=1 limit_batches=2`)",
}


@dataclass(frozen=True)
class Section:
    title: str
    text: str
    table: pd.DataFrame | None = None
    image: str | None = None


@dataclass(frozen=True)
class Analysis:
    """A runs frame as the report reads it: every run (``runs``, flagged :data:`SET_ASIDE` where a later FINISHED
    run of its configuration counts instead), the ``finished`` runs counted and the ``not_finished`` ones, the
    ``swept`` params (``keys``: less the seed), the ``configurations`` (means over seeds) and their Pareto ``front``,
    the ``pairs`` of runs and the ``effects`` judged on them, and whether the precision is shown."""

    runs: pd.DataFrame
    finished: pd.DataFrame
    not_finished: pd.DataFrame
    swept: list[str]
    keys: list[str]
    configurations: pd.DataFrame
    front: np.ndarray
    pairs: pd.DataFrame
    effects: pd.DataFrame
    precision: bool


def analyse(frame: pd.DataFrame, margins: Mapping[str, float]) -> Analysis:
    """The :class:`Analysis` of a :func:`~src.report.runs.run_frame`, effects judged against ``margins``
    (``margin``, ``speed_margin``, ``memory_margin``)."""
    runs = frame.assign(**{SET_ASIDE: superseded(frame)})
    finished = runs[(runs["status"] == "FINISHED") & ~runs[SET_ASIDE]].reset_index(drop=True)
    swept = swept_columns(runs[param_columns(runs)])
    keys = [k for k in swept if k != SEED]
    configurations = aggregate(finished, keys, METRICS)
    pairs = paired_effects(finished, swept)
    return Analysis(
        runs=runs,
        finished=finished,
        not_finished=runs[runs["status"] != "FINISHED"].reset_index(drop=True),
        swept=swept,
        keys=keys,
        configurations=configurations,
        front=pareto_front(configurations[THROUGHPUT], configurations[MEMORY], configurations[AUC]),
        pairs=pairs,
        effects=summarize_effects(pairs, margins),
        precision=precision_shown(finished, keys),
    )


# --- cells and tables ----------------------------------------------------------------------------------------


def metric_text(metric: str, value: float, like: float | None = None) -> str:
    """``value`` with the decimals ``metric`` takes (for ``like``'s size: a std takes its mean's)."""
    if pd.isna(value):
        return "-"
    size = abs(value if like is None else like)
    if metric.endswith(("acc", "auc")):
        return f"{value:.3f}"
    whole = metric.endswith("_mb") or metric == STEPS_TIMED or size >= 100
    return f"{value:.{0 if whole else 1 if size >= 10 else 2}f}"


def shown_params(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    return frame[keys].apply(lambda column: column.map(as_override))


def precision_shown(runs: pd.DataFrame, keys: list[str]) -> bool:
    """Whether to show :data:`DTYPE`: some run recorded it, and it varies or ``amp`` is swept."""
    dtypes = set(runs[DTYPE]) - {""}
    return bool(dtypes) and (len(dtypes) > 1 or "amp" in keys)


def configurations_table(table: pd.DataFrame, keys: list[str], front, precision: bool) -> pd.DataFrame:
    """Swept values, the ``precision`` used (if shown), ``n``, the ``contended`` runs (when any is), each metric as
    ``mean ± std`` (std when n > 1) and the Pareto mark."""
    shown_table = shown_params(table, keys)
    if precision:
        shown_table["precision"] = table[DTYPE].replace("", "-")
    shown_table["n"] = table["n"]
    if table[CONTENDED].any():
        shown_table["contended"] = table[CONTENDED]
    for metric in METRICS:
        shown_table[metric] = [
            metric_text(metric, mean) + (f" ± {metric_text(metric, std, mean)}" if n > 1 and not pd.isna(std) else "")
            for mean, std, n in zip(table[metric], table[f"{metric} std"], table["n"], strict=True)
        ]
    shown_table["Pareto"] = ["yes" if on else "" for on in front]
    return shown_table


def interval_text(effect_row, effect) -> str:
    """``×1.39 [×1.20, ×1.61]``; ``-`` when not judged."""
    mean, lo, hi = (effect.text(getattr(effect_row, column)) for column in (effect.mean, effect.lo, effect.hi))
    return "-" if mean == lo == hi == "-" else f"{mean} [{lo}, {hi}]"


def effects_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per comparison: ``pairs``, those left out of speed (when any is) and each effect's interval and verdict."""
    rows = list(summary.itertuples())
    table = pd.DataFrame(
        {
            "comparison": [comparison(e.param, e.value, e.baseline) for e in rows],
            "pairs": summary["pairs"],
        }
    )
    if (summary["speed_pairs"] < summary["pairs"]).any():
        table["pairs left out of speed"] = [left_out(e) for e in rows]
    for effect in EFFECTS:
        table[f"{effect.label} [95% CI]"] = [interval_text(e, effect) for e in rows]
        table[f"{effect.label} verdict"] = [verdict_text(e, effect) for e in rows]
    return table


def runs_table(frame: pd.DataFrame, keys: list[str], metrics: list[str], precision: bool = False) -> pd.DataFrame:
    table = pd.concat([frame["run_id"].str[:8], frame["status"], shown_params(frame, keys)], axis=1)
    if precision:
        table["precision"] = frame[DTYPE].replace("", "-")
    for metric in metrics:
        table[metric] = [metric_text(metric, v) for v in frame[metric]]
    return table


# --- texts -----------------------------------------------------------------------------------------------------


def speed_note(finished: pd.DataFrame) -> str:
    """When no finished run's samples/s can be compared (:func:`unfit_for_speed`): that, and why; else ``""``."""
    unfit = unfit_for_speed(finished)
    if unfit.empty or not unfit.any(axis=1).all():
        return ""
    why = [f"{unfit[flag].sum()} {text}" for flag, text in WHY_UNFIT.items() if unfit[flag].any()]
    return (
        f"Speed cannot be judged: of {len(finished)} finished runs, {' and '.join(why)}; "
        "their samples/s are no basis for comparison."
    )


def effects_text(margins: Mapping[str, float]) -> str:
    """How the Paired effects section compares and judges, with the margins it used."""
    speed, memory, auc = (margins[key] for key in ("speed_margin", "memory_margin", "margin"))
    return (
        "Each switch against its baseline value, over the pairs of finished runs equal in every other swept "
        "parameter (seed included; each new seed adds one pair per combination of the others): samples/s and peak "
        "memory as geometric-mean ratios with their 95% Student-t interval (taken on the log ratios), test AUC as the "
        "mean difference with its 95% Student-t interval. "
        f"Speed against a margin of {speed:g} (config key `speed_margin`): `faster` when the whole interval lies "
        f"above ×{1 + speed:.3g}, `slower` when it lies below ×{1 / (1 + speed):.3g}, `no difference` when it lies "
        f"within, else `inconclusive`; peak memory alike against {memory:g} (`memory_margin`): `more memory`, "
        f"`less memory`, `no difference`. Test AUC against a margin of {auc:g} AUC (`margin`): `no loss` when the "
        f"whole interval lies above -{auc:g}, `loss` when it lies below, else `inconclusive`. An `inconclusive` "
        "verdict gives the pairs that would likely settle it if mean and spread held. A pair is left out of speed "
        "(not of memory or test AUC) when either run was contended (tag `perf.contended=true`) or timed fewer than "
        f"{MIN_TIMED_STEPS} optimizer steps; a comparison left with none reads `cannot judge speed`."
    )


def set_aside_note(set_aside: int) -> str:
    """One line on the older runs of configurations run again that the tables leave out; ``""`` when none."""
    if not set_aside:
        return ""
    return (
        f"Set aside: {set_aside} older FINISHED run{'s' if set_aside > 1 else ''} of configurations run again (same "
        "`config_hash` tag, seed included): each configuration counts once, by its latest FINISHED run; `runs.csv` "
        "lists every run (column `set_aside`)."
    )


def mixed_note(finished: pd.DataFrame) -> str:
    """One line on the :data:`PROVENANCE` tags the finished runs counted differ in (a sweep resumed after an edit of
    the code, or spread over machines): their pairs measure that difference too; ``""`` when none does."""
    mixed = [
        f"`{tag}` " + ", ".join(f"{value or 'untagged'} ({n} run{'s' * (n > 1)})" for value, n in counts.items())
        for tag in PROVENANCE
        if len(counts := finished[tag].value_counts().sort_index()) > 1
    ]
    if not mixed:
        return ""
    return (
        f"Not like for like: the finished runs differ in {'; '.join(mixed)}. A pair of runs that differ in these "
        "measures that difference as well as its switch."
    )


def not_drawn(count: int, what: str) -> str:
    """`` Not drawn: 2 <what> ...`` for a figure that left values out; ``""`` when none."""
    return f" Not drawn: {count} {what} (missing, infinite, negative, or a ratio not above 0)." if count else ""


# --- sections ----------------------------------------------------------------------------------------------------


def opening_sections(analysis: Analysis, selection: Selection, uri: str, written: datetime) -> list[Section]:
    """What the report covers (counts, selection, store, swept params, when ``written``), then each note that
    applies: older runs set aside, speed that cannot be judged, runs that are not like for like."""
    swept, parent = analysis.swept, selection.parent_id
    notes = (
        set_aside_note(int(analysis.runs[SET_ASIDE].sum())),
        speed_note(analysis.finished),
        mixed_note(analysis.finished),
    )
    return [
        Section(
            "",
            f"Finished runs: {len(analysis.finished)}, not finished: {len(analysis.not_finished)}, of "
            f"{selection.label} in {uri}{f' (parent run {parent})' if parent else ''}; swept: "
            f"{', '.join(f'`{k}`' for k in swept) or 'nothing'}; written {written:%Y-%m-%d %H:%M}.",
        ),
        *(Section("", note) for note in notes if note),
    ]


def configurations_section(analysis: Analysis, undrawn: int) -> Section:
    """The configurations (means over seeds when the seed is swept) with their Pareto mark, and their figure;
    ``undrawn``: the configurations the figure left out."""
    seeds = f"mean ± std over seeds (n runs); {DEFINITIONS}" if SEED in analysis.swept else DEFINITIONS
    contended = analysis.configurations[CONTENDED].any()
    return Section(
        "Configurations",
        f"{seeds} Pareto: no other configuration is at least as fast (samples/s), as "
        f"small (peak memory) and as accurate (test AUC; a missing one counts as worst), "
        f"and better in one of the three.{f' {PRECISION}' if analysis.precision else ''}"
        f"{f' {CONTENDED_RUNS}' if contended else ''}{not_drawn(undrawn, 'configurations')}",
        configurations_table(analysis.configurations, analysis.keys, analysis.front, analysis.precision),
        THROUGHPUT_FIGURE,
    )


def effects_section(analysis: Analysis, margins: Mapping[str, float], undrawn: int) -> Section:
    """Each switch's effects and verdicts against ``margins``, and their figure (``undrawn``: the values of pairs it
    left out); one line when no pair was found."""
    if analysis.effects.empty:
        return Section("Paired effects", "No two finished runs differ in only one swept parameter.")
    text = effects_text(margins) + not_drawn(undrawn, "values of pairs")
    return Section("Paired effects", text, effects_table(analysis.effects), EFFECTS_FIGURE)


def datasets_section(selection: Selection) -> Section:
    return Section(
        "Datasets",
        "The files the runs trained and were tested on, as each run's MLflow dataset inputs record them "
        "(digest: the file's MD5).",
        datasets_table(selection.runs),
    )


def finished_section(analysis: Analysis) -> Section:
    """One row per finished run counted: its swept params, metrics, steps timed and whether it was contended."""
    finished, precision = analysis.finished, analysis.precision
    table = runs_table(finished, analysis.swept, [*METRICS, STEPS_TIMED], precision)
    table["contended"] = np.where(finished[CONTENDED], "yes", "")
    return Section("Finished runs", f"{DEFINITIONS}{f' {PRECISION}' if precision else ''} {TIMING}", table)


def not_finished_sections(analysis: Analysis) -> list[Section]:
    """The runs that did not finish, with the memory they logged; none when every run finished."""
    if not len(analysis.not_finished):
        return []
    return [
        Section(
            "Not finished",
            "Failed, killed or still running; memory as far as logged.",
            runs_table(analysis.not_finished, analysis.swept, [MEMORY, "mem/predicted_mb"]),
        )
    ]


def report_sections(
    analysis: Analysis,
    selection: Selection,
    uri: str,
    margins: Mapping[str, float],
    undrawn: Mapping[str, int],
    written: datetime,
) -> list[Section]:
    """The report's sections in order; ``undrawn``: the values each figure drawn left out, by its file name."""
    return [
        *opening_sections(analysis, selection, uri, written),
        configurations_section(analysis, undrawn[THROUGHPUT_FIGURE]),
        effects_section(analysis, margins, undrawn.get(EFFECTS_FIGURE, 0)),
        datasets_section(selection),
        finished_section(analysis),
        *not_finished_sections(analysis),
    ]


# --- pages -------------------------------------------------------------------------------------------------------


def markdown_table(table: pd.DataFrame) -> str:
    def row(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join(
        [row(table.columns), row(["---"] * len(table.columns)), *(row(r) for r in table.itertuples(index=False))]
    )


def markdown_page(title: str, sections: list[Section]) -> str:
    """``report.md``: the figures linked by their file names."""
    parts = [f"# {title}"]
    for s in sections:
        parts += [f"## {s.title}", s.text] if s.title else [s.text]
        parts += [markdown_table(s.table)] if s.table is not None else []
        parts += [f"![{s.title}]({s.image})"] if s.image else []
    return "\n\n".join(parts) + "\n"


def html_page(title: str, sections: list[Section], images: Mapping[str, bytes]) -> str:
    """``report.html``, one self-contained page: the figures (``images``: PNG bytes by file name) are embedded, so it
    reads the same in the MLflow UI."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    for s in sections:
        body += [f"<h2>{html.escape(s.title)}</h2>"] if s.title else []
        body.append(f"<p>{html.escape(s.text).replace('`', '')}</p>")
        body += [s.table.to_html(index=False, border=0)] if s.table is not None else []
        if s.image:
            data = base64.b64encode(images[s.image]).decode()
            body.append(f'<img alt="{html.escape(s.title)}" src="data:image/png;base64,{data}" style="max-width:100%">')
    style = (
        "body{font-family:sans-serif;margin:2em;max-width:1400px} table{border-collapse:collapse;margin:1em 0}"
        "th,td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right;white-space:nowrap}"
        "th{background:#f3f3f3}"
    )
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
