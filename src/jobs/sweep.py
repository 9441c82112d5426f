"""A sweep (``-m``): its main process's Hydra callback.

The main process (:class:`Sweep`) checks every job before the first starts: their configs first
(:mod:`src.jobs.sweep_checks`, before MLflow is imported), then their plans and data
(:mod:`src.jobs.sweep_main`, which also holds the sweep folder, starts an MPS daemon where its jobs share a GPU, opens
the parent run and takes the stop signals, passing them on to the jobs). It ends the command: exit 0, ``128 + signal``
after a stop signal, or the one ``error:`` line of a failed job. A job (:func:`src.jobs.job.in_sweep`) never raises to
the launcher (joblib would kill the jobs running beside it): a stop signal or a failure writes the sweep's stop record,
after which no job starts (:mod:`src.jobs.stop_record`), and running ones end as they would.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from src.errors import UsageError, exit_with, interruption, one_line
from src.folders import check_hydra_files, check_no_chdir, check_own_folder, writable
from src.jobs.sweep_checks import SweepJob, checked_jobs, grid

if TYPE_CHECKING:
    from src.jobs.sweep_main import SweepMain

log = logging.getLogger(__name__)


def check_job_folders(sweep_dir: Path, jobs: list[SweepJob]) -> None:
    """Each job's folder (``hydra.sweep.subdir`` in the sweep's) writable, holding only what a run writes, and apart
    from the sweep's and every other job's: neither the same folder nor one inside the other."""
    fix = "give each job a folder of its own in the sweep's (hydra.sweep.subdir, default ${hydra.job.num})"
    sweep, folders = sweep_dir.resolve(), {}
    for job in jobs:
        folder = Path(job.hydra.runtime.output_dir)
        what = f"hydra.sweep.subdir={job.hydra.sweep.subdir} (job {job.num}'s folder {folder})"
        if sweep.is_relative_to(folder):
            raise UsageError(f"{what} is or holds the sweep's folder {sweep}: {fix}")
        if folder in folders:
            raise UsageError(f"{what} is {folders[folder]}: {fix}")
        writable(folder, what)
        check_hydra_files(job.hydra, folder)
        check_own_folder(folder, what)
        folders[folder] = f"job {job.num}'s folder"
    ordered = sorted(folders, key=lambda folder: str(folder).rstrip("/") + "/")  # a folder just before those inside
    for outer, inner in zip(ordered, ordered[1:], strict=False):
        if inner.is_relative_to(outer):
            raise UsageError(f"{folders[outer]} {outer} holds {folders[inner]} {inner}: {fix}")


def told_failures() -> None:
    """Let the Optuna sweeper record a failed trial: a job that trained nothing to the end (stopped by a signal, out
    of memory, diverged, failed) returns NaN, which hydra-optuna-sweeper 1.3 then tells Optuna as ``FAIL`` with that
    value; Optuna 2.10 refuses values with ``FAIL`` (``ValueError: Values were told...``), a traceback that ended the
    sweep (exit 1) however the job ended. Told without its value the trial is a failed one, and the sweep goes on or
    stops as its jobs say. Idempotent; the main process only (where the sweeper runs)."""
    import optuna

    tell = optuna.study.Study.tell
    if getattr(tell, "told_failures", False):
        return

    def told(self, trial, values=None, state=optuna.trial.TrialState.COMPLETE):
        if state in (optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED):
            values = None
        return tell(self, trial, values, state)

    told.told_failures = True
    optuna.study.Study.tell = told


class Sweep(Callback):
    """Hydra callback of a sweep's main process; see the module's docstring."""

    main: SweepMain | None = None  # None until the sweep opens, and in a dry run

    def __getstate__(self) -> dict:
        return {}  # launchers pickle the callbacks with each job: the main process's folder lock and threads stay

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            sweep_dir = Path(config.hydra.sweep.dir)  # claimed once: the jobs' compositions copy the resolver's cache
            check_no_chdir(config)
            jobs = checked_jobs(config)
            writable(sweep_dir, f"hydra.sweep.dir={sweep_dir}")
            check_job_folders(sweep_dir, jobs)
            if not grid(config):
                told_failures()
            from src.jobs.sweep_main import open_sweep  # MLflow, the plans: once every job's config passed its checks

            self.main = open_sweep(config, jobs)
        except (UsageError, HydraException, OmegaConfBaseException) as err:  # Hydra would go on to the jobs unchecked
            exit_with(err if isinstance(err, UsageError) else one_line(err))  # the command's end releases the folder
        except Exception as err:  # a fault of the checks: Hydra warns of a callback's error, starts the jobs unchecked
            if (stop := interruption(err)) is not None:  # a library's cleanup failed over a stop that cut it
                raise stop from None
            log.exception("the sweep's checks failed")
            sys.exit(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.main is not None:
            self.main.end()
