"""Report a sweep's runs: tables (Markdown, HTML, CSV) and figures, logged to the sweep's parent run.

    python -m src.report sweep=<sweep folder> | parent=<parent run id> | mlflow.experiment=<name>

What it writes and how it judges each swept switch: docs/reports.md.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException

from src.atomic import atomic_path
from src.config import ReportConfig
from src.errors import UsageError
from src.folders import writable
from src.report import plots
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
from src.report.register import best_model, register
from src.report.runs import (
    METRICS,
    Selection,
    datasets_table,
    latest_sweep,
    param_columns,
    report_store,
    run_frame,
    select,
    with_tags,
)
from src.tracking.store import ensure_store, store_exists

log = logging.getLogger(__name__)


FILES = ("report.md", "report.html", "runs.csv", "effects.csv", "throughput_memory.png", "paired_effects.png")
NAME_MAX, PATH_MAX = 255, 4096  # bytes of one name in a path, and of a whole path, that Linux file systems take
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


def number(metric: str, value: float, like: float | None = None) -> str:
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
            number(metric, mean) + (f" ± {number(metric, std, mean)}" if n > 1 and not pd.isna(std) else "")
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
        table[metric] = [number(metric, v) for v in frame[metric]]
    return table


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


def markdown_table(table: pd.DataFrame) -> str:
    def row(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join(
        [row(table.columns), row(["---"] * len(table.columns)), *(row(r) for r in table.itertuples(index=False))]
    )


def render_markdown(title: str, sections: list[Section]) -> str:
    parts = [f"# {title}"]
    for s in sections:
        parts += [f"## {s.title}", s.text] if s.title else [s.text]
        parts += [markdown_table(s.table)] if s.table is not None else []
        parts += [f"![{s.title}]({s.image})"] if s.image else []
    return "\n\n".join(parts) + "\n"


def render_html(title: str, sections: list[Section], folder: Path) -> str:
    """One self-contained page: the figures are embedded, so it reads the same in the MLflow UI."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    for s in sections:
        body += [f"<h2>{html.escape(s.title)}</h2>"] if s.title else []
        body.append(f"<p>{html.escape(s.text).replace('`', '')}</p>")
        body += [s.table.to_html(index=False, border=0)] if s.table is not None else []
        if s.image:
            data = base64.b64encode((folder / s.image).read_bytes()).decode()
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


def write_report(
    frame: pd.DataFrame, selection: Selection, uri: str, out: Path, margins: Mapping[str, float]
) -> list[Path]:
    """Tables and figures of a :func:`run_frame` into ``out``, effects judged against ``margins`` (``margin``,
    ``speed_margin``, ``memory_margin``); returns the files written. Each is written whole beside its name and then
    renamed over it (:func:`atomic_path`): a report running at the same time, or a crash, leaves no file half-written,
    a link in its place is replaced rather than written through, and a full disk is one line."""
    frame = frame.assign(**{SET_ASIDE: superseded(frame)})
    finished = frame[(frame["status"] == "FINISHED") & ~frame[SET_ASIDE]].reset_index(drop=True)
    others = frame[frame["status"] != "FINISHED"].reset_index(drop=True)
    swept = swept_columns(frame[param_columns(frame)])
    keys = [k for k in swept if k != SEED]
    table = aggregate(finished, keys, METRICS)
    front = pareto_front(table[THROUGHPUT], table[MEMORY], table[AUC])
    found = paired_effects(finished, swept)
    summary = summarize_effects(found, margins)
    precision = precision_shown(finished, keys)
    out.mkdir(parents=True, exist_ok=True)
    title = f"Report: {selection.label}"
    with atomic_path(out / "throughput_memory.png") as path:
        undrawn = plots.throughput_memory(table, keys, front, f"Throughput vs peak memory: {selection.label}", path)
    seeds = f"mean ± std over seeds (n runs); {DEFINITIONS}" if SEED in swept else DEFINITIONS
    sections = [
        Section(
            "",
            f"Finished runs: {len(finished)}, not finished: {len(others)}, of {selection.label} in {uri}"
            f"{f' (parent run {selection.parent_id})' if selection.parent_id else ''}; swept: "
            f"{', '.join(f'`{k}`' for k in swept) or 'nothing'}; written {datetime.now():%Y-%m-%d %H:%M}.",
        ),
        *([Section("", note)] if (note := set_aside_note(int(frame[SET_ASIDE].sum()))) else []),
        *([Section("", note)] if (note := speed_note(finished)) else []),
        *([Section("", note)] if (note := mixed_note(finished)) else []),
        Section(
            "Configurations",
            f"{seeds} Pareto: no other configuration is at least as fast (samples/s), as "
            f"small (peak memory) and as accurate (test AUC; a missing one counts as worst), "
            f"and better in one of the three.{f' {PRECISION}' if precision else ''}"
            f"{f' {CONTENDED_RUNS}' if table[CONTENDED].any() else ''}{not_drawn(undrawn, 'configurations')}",
            configurations_table(table, keys, front, precision),
            "throughput_memory.png",
        ),
    ]
    if summary.empty:
        (out / "paired_effects.png").unlink(missing_ok=True)  # an earlier report's
        sections.append(Section("Paired effects", "No two finished runs differ in only one swept parameter."))
    else:
        with atomic_path(out / "paired_effects.png") as path:
            undrawn = plots.paired_effects(found, summary, f"Paired effects: {selection.label}", path)
        text = effects_text(margins) + not_drawn(undrawn, "values of pairs")
        sections.append(Section("Paired effects", text, effects_table(summary), "paired_effects.png"))
    sections.append(
        Section(
            "Datasets",
            "The files the runs trained and were tested on, as each run's MLflow dataset inputs record them "
            "(digest: the file's MD5).",
            datasets_table(selection.runs),
        )
    )
    finished_table = runs_table(finished, swept, [*METRICS, STEPS_TIMED], precision)
    finished_table["contended"] = np.where(finished[CONTENDED], "yes", "")
    sections.append(
        Section("Finished runs", f"{DEFINITIONS}{f' {PRECISION}' if precision else ''} {TIMING}", finished_table)
    )
    if len(others):
        sections.append(
            Section(
                "Not finished",
                "Failed, killed or still running; memory as far as logged.",
                runs_table(others, swept, [MEMORY, "mem/predicted_mb"]),
            )
        )
    for name, rows in (("runs.csv", frame), ("effects.csv", summary)):
        with atomic_path(out / name) as path:
            rows.to_csv(path, index=False)
    for name, text in (
        ("report.md", render_markdown(title, sections)),
        ("report.html", render_html(title, sections, out)),
    ):
        with atomic_path(out / name) as path:
            path.write_text(text)
    return [out / name for name in FILES if (out / name).exists()]


def short_enough(key: str, path: str | None) -> None:
    """A :class:`UsageError` for a path the file system would refuse as too long (``ENAMETOOLONG``): a name in it
    over :data:`NAME_MAX` bytes, or all of it over :data:`PATH_MAX`."""
    if path is None:
        return
    full = Path(path).expanduser().absolute()
    if len(os.fsencode(full)) >= PATH_MAX or any(len(os.fsencode(part)) > NAME_MAX for part in full.parts):
        raise UsageError(
            f"{key}={path}: too long for the file system (a name in it over {NAME_MAX} bytes, or over {PATH_MAX} "
            f"in all): give a shorter path"
        )


def no_folder_in_the_way(out: Path) -> None:
    """A :class:`UsageError` where one of the report's files (:data:`FILES`) in ``out`` is something other than a
    file (a folder): checked before any is written, so nothing is half-written."""
    blocked = [name for name in FILES if (out / name).exists() and not (out / name).is_file()]
    if blocked:
        raise UsageError(
            f"{out / blocked[0]} is not a file, and the report writes {', '.join(blocked)} there: remove "
            f"{'it' if len(blocked) == 1 else 'them'} or give out=<another folder>"
        )


def log_report(client, run_id: str, files: list[Path], out: Path, uri: str) -> None:
    """``files`` as artifacts under ``report/`` of ``run_id``; a :class:`UsageError` (one line) where the artifact
    store refuses them: the report stays in ``out``."""
    try:
        for path in files:
            client.log_artifact(run_id, str(path), "report")
    except (OSError, MlflowException) as err:
        raise UsageError(
            f"the report was written to {out} but could not be logged to run {run_id} ({' '.join(str(err).split())}):"
            f" make the run's artifact store writable and rerun the report, or read it in {out}"
        ) from None
    log.info("logged to parent run %s under report/ in %s", run_id, uri)


def report(cfg: ReportConfig) -> Path:
    """Select, tabulate, plot, write and log; returns the output folder."""
    for key in ("sweep", "out"):
        short_enough(key, getattr(cfg, key))
    chosen = [
        f"{k}={v}"
        for k, v in (("sweep", cfg.sweep), ("parent", cfg.parent), ("mlflow.experiment", cfg.mlflow.experiment))
        if v is not None
    ]
    if not chosen:
        cfg = dataclasses.replace(cfg, sweep=str(latest_sweep()))
        log.info("no selector: the latest sweep, sweep=%s", cfg.sweep)
    elif len(chosen) > 1:
        raise UsageError(
            f"{' and '.join(chosen)}: give exactly one of sweep=<folder>, parent=<run id> or mlflow.experiment=<name>"
        )
    uri = report_store(cfg)
    if not store_exists(uri):
        raise UsageError(f"mlflow.tracking_uri={uri}: no such store: set it to the store the runs logged to")
    client = ensure_store(uri)
    selection = with_tags(select(cfg, client, uri), cfg.tags)
    out = Path(cfg.out).expanduser() if cfg.out else selection.out
    writable(
        out, f"out={out}" if cfg.out else f"the report's folder {out}", "give out=<a folder this process can write>"
    )
    no_folder_in_the_way(out)
    frame = run_frame(client, selection.runs)
    if not (frame["status"] == "FINISHED").any():
        raise UsageError(
            f"{selection.label} has no FINISHED run ({', '.join(sorted(set(frame['status'])))}): "
            f"nothing to compare; wait for the sweep or rerun its jobs"
        )
    best = best_model(frame, selection.runs, cfg.register) if cfg.register else None
    margins = {effect.margin: getattr(cfg, effect.margin) for effect in EFFECTS}
    files = write_report(frame, selection, uri, out, margins)
    log.info("report of %d runs (%s): %s", len(frame), selection.label, ", ".join(str(f) for f in files))
    if best:
        register(best, cfg.register, uri)
    if selection.parent_id:
        log_report(client, selection.parent_id, files, out, uri)
    else:
        log.info(
            "mlflow.experiment=%s selects no parent run: the report is not logged to MLflow", cfg.mlflow.experiment
        )
    return out
