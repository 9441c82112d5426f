"""A dry run's listing (:mod:`src.jobs.dry_run`): one job's line, and the total a dry multirun prints at its end. It
imports neither torch nor MLflow: Hydra loads its callback for every command."""

from __future__ import annotations

import dataclasses
import heapq
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.errors import UsageError, exit_with
from src.parallel.machine_share import jobs_at_once

FOLDER = "dry_run"  # in the sweep folder: one <job>.json per job


@dataclasses.dataclass(frozen=True)
class JobEstimate:
    """One job of a dry run: ``action`` is ``run``, ``resume run <id>`` or ``skip: finished run <id>``; ``estimate``
    the line's text for its ``minutes`` (``0 min`` for a skip); ``step`` the step predicted and timed, ``eager`` or
    ``graphed``; ``fits`` whether its micro-batch fits the memory budget (:func:`fits_text`)."""

    job: int
    name: str
    action: str
    batch_size: int
    peak_mb: float
    minutes: float
    estimate: str
    step: str = "eager"
    fits: str = ""

    @property
    def runs(self) -> bool:
        return not self.action.startswith("skip")

    def line(self) -> str:
        peak = f"peak {self.peak_mb:.0f} MiB at batch {self.batch_size}{', graphed' if self.step == 'graphed' else ''}"
        fits = f" | {self.fits}" if self.fits else ""
        return f"job {self.job}: {self.name} | {self.action} | {peak}{fits} | {self.estimate}"


def fits_text(budget_mb: float, largest: int | None) -> str:
    """``fits 24 GiB: yes``, ``fits 24 GiB: no: fits at batch 8`` (``largest``, the largest micro-batch predicted to
    fit) or ``fits 24 GiB: no batch fits`` (``largest`` 0); ``largest`` None: it fits."""
    budget = f"{budget_mb / 1024:.3g} GiB" if budget_mb >= 1024 else f"{budget_mb:.3g} MiB"
    if largest is None:
        return f"fits {budget}: yes"
    return f"fits {budget}: no: fits at batch {largest}" if largest else f"fits {budget}: no batch fits"


def rounded(minutes: float) -> str:
    return f"{minutes:.0f}" if minutes >= 10 else f"{minutes:.2g}"


def total(listed: list[JobEstimate], at_once: int = 1) -> str:
    """The total line: jobs to run and to skip, their estimated minutes, the largest predicted peak of those to run;
    with ``at_once`` jobs at a time on this machine, the minutes until the last ends and the peaks together."""
    running = [job for job in listed if job.runs]
    peak = max((job.peak_mb for job in running), default=0.0)
    line = (
        f"total: {len(running)} to run, {len(listed) - len(running)} to skip | "
        f"~{rounded(sum(job.minutes for job in running))} min | largest peak {peak:.0f} MiB"
    )
    if at_once <= 1:
        return line
    together = sum(sorted((job.peak_mb for job in running), reverse=True)[:at_once])
    span = rounded(makespan([job.minutes for job in running], at_once))
    return f"{line} | {at_once} at once: ~{span} min, peaks up to {together:.0f} MiB together"


def makespan(minutes: list[float], workers: int) -> float:
    """When the last of the jobs ends, each started in turn on the first of ``workers`` to be free (as joblib
    dispatches them)."""
    free = [0.0] * workers
    for length in minutes:
        heapq.heapreplace(free, free[0] + length)
    return max(free)


def folder(config: DictConfig) -> Path:
    return Path(config.hydra.sweep.dir, FOLDER)


class DryRunTotal(Callback):
    """Hydra callback: a dry multirun's total line, from the figures its jobs left in ``<sweep dir>/dry_run/``
    (those of an earlier dry run in the same folder are removed first). Only a sweep whose jobs are known before any
    runs can be listed: Hydra's basic sweeper's; a sweeper that picks each trial from the results before it (Optuna)
    is refused before anything starts."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not config.dry_run:
            return
        if not (sweeper := config.hydra.sweeper._target_).endswith(".BasicSweeper"):
            exit_with(
                UsageError(
                    f"dry_run=true lists the jobs of a grid sweep, known before any runs; {sweeper} picks each trial "
                    f"from the results of those before it: drop dry_run (finished trials are skipped)"
                )
            )
        for stale in folder(config).glob("*.json"):
            stale.unlink()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.dry_run:
            files = sorted(folder(config).glob("*.json"), key=lambda path: int(path.stem))
            listed = [JobEstimate(**json.loads(path.read_text())) for path in files]
            print(total(listed, jobs_at_once()), flush=True)
