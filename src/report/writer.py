"""Report a sweep's runs: tables (Markdown, HTML, CSV) and figures, logged to the sweep's parent run.

    python -m src.report sweep=<sweep folder> | parent=<parent run id> | mlflow.experiment=<name>

:func:`report` selects the runs, writes the report's files (:func:`write_report`: the figures, the CSVs, then the
pages :mod:`src.report.sections` builds) and logs them. What it writes and how it judges each swept switch:
docs/reports.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import pandas as pd
from mlflow.exceptions import MlflowException

from src.atomic import atomic_path
from src.config import ReportConfig
from src.errors import UsageError
from src.folders import writable
from src.redaction import as_given, redact
from src.report import plots
from src.report.analysis import EFFECTS
from src.report.register import best_model, register
from src.report.runs import Selection, latest_sweep, report_store, run_frame, select, with_tags
from src.report.sections import (
    EFFECTS_FIGURE,
    THROUGHPUT_FIGURE,
    Analysis,
    Section,
    analyse,
    html_page,
    markdown_page,
    report_sections,
)
from src.spreadsheet import write_csv
from src.tracking.store import ensure_store, store_exists

log = logging.getLogger(__name__)


FILES = ("report.md", "report.html", "runs.csv", "effects.csv", THROUGHPUT_FIGURE, EFFECTS_FIGURE)
NAME_MAX, PATH_MAX = 255, 4096  # bytes of one name in a path, and of a whole path, that Linux file systems take


def write_report(
    frame: pd.DataFrame, selection: Selection, uri: str, out: Path, margins: Mapping[str, float]
) -> list[Path]:
    """Tables and figures of a :func:`run_frame` into ``out``, effects judged against ``margins`` (``margin``,
    ``speed_margin``, ``memory_margin``); returns the files written. Each is written whole beside its name and then
    renamed over it (:func:`atomic_path`): a report running at the same time, or a crash, leaves no file half-written,
    a link in its place is replaced rather than written through, and a full disk is one line."""
    analysis = analyse(frame, margins)
    out.mkdir(parents=True, exist_ok=True)
    undrawn = write_figures(analysis, selection.label, out)
    sections = report_sections(analysis, selection, as_given(uri), margins, undrawn, datetime.now())
    write_tables(analysis, out)
    write_pages(f"Report: {selection.label}", sections, out)
    return [out / name for name in FILES if (out / name).exists()]


def write_figures(analysis: Analysis, label: str, out: Path) -> dict[str, int]:
    """The throughput-memory figure and, when a pair of runs was found, the paired-effects one (else an earlier
    report's is removed); returns how many values each figure written left out, by its file name."""
    undrawn = {}
    with atomic_path(out / THROUGHPUT_FIGURE) as path:
        undrawn[THROUGHPUT_FIGURE] = plots.throughput_memory(
            analysis.configurations, analysis.keys, analysis.front, f"Throughput vs peak memory: {label}", path
        )
    if analysis.effects.empty:
        (out / EFFECTS_FIGURE).unlink(missing_ok=True)  # an earlier report's
    else:
        with atomic_path(out / EFFECTS_FIGURE) as path:
            undrawn[EFFECTS_FIGURE] = plots.paired_effects(
                analysis.pairs, analysis.effects, f"Paired effects: {label}", path
            )
    return undrawn


def write_tables(analysis: Analysis, out: Path) -> None:
    """``runs.csv`` (every run, the set-aside ones flagged) and ``effects.csv`` (one row per comparison), no cell a
    spreadsheet formula (:func:`write_csv`)."""
    for name, rows in (("runs.csv", analysis.runs), ("effects.csv", analysis.effects)):
        with atomic_path(out / name) as path:
            write_csv(rows, path)


def write_pages(title: str, sections: list[Section], out: Path) -> None:
    """``report.md`` and ``report.html``, the figures the sections show read from ``out``; a secret of a URI in a
    run's params (a run logged before they were concealed) as ``***``."""
    images = {s.image: (out / s.image).read_bytes() for s in sections if s.image}
    for name, text in (
        ("report.md", markdown_page(title, sections)),
        ("report.html", html_page(title, sections, images)),
    ):
        with atomic_path(out / name) as path:
            path.write_text(redact(text))


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
