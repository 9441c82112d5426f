"""A sweep's configs, checked before MLflow and the jobs' code load (Hydra loads the sweep's callback for every
command): the launcher's counts, and each job's composed config against the schema (its keys and values, as a single
run's are checked), so a wrong key or value is one ``error:`` line. Hydra's basic sweeper knows its jobs in advance; a
sweeper that picks each trial from the results before it (Optuna) has its fixed config checked. What needs the
machine, the store or the data comes next, in :mod:`src.jobs.sweep_main`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from src.errors import UsageError, exit_with, one_line
from src.models.registry import check_model
from src.parallel.machine_share import launcher_cpus
from src.schema_check import check_known_keys, check_values, composition_error, list_index_error
from src.tracking.identity import run_name

SLURM_COMMANDS = ("sbatch", "srun")  # what submitit's SLURM executor runs
LAUNCHER_MINIMA = {  # the launchers' counts (joblib, submitit) and their least value; n_jobs=-1: one job per CPU
    "n_jobs": 1,
    "timeout_min": 1,
    "nodes": 1,
    "tasks_per_node": 1,
    "cpus_per_task": 1,
    "gpus_per_node": 0,
    "mem_gb": 1,
    "array_parallelism": 1,
    "signal_delay_s": 0,
    "max_num_timeout": 0,
}
SWEEPER_MINIMA = {"n_trials": 1, "n_jobs": 1}  # Optuna's counts: fewer trials run none, and its sweep's end fails


def grid(config: DictConfig) -> bool:
    """Whether Hydra's basic sweeper runs the sweep: every job known in advance."""
    return config.hydra.sweeper._target_.endswith(".BasicSweeper")


def handed_at_once(config: DictConfig, jobs: list[SweepJob]) -> int:
    """How many jobs the sweeper hands the launcher at a time: a grid sweep's every job, Optuna's ``n_jobs`` trials."""
    return len(jobs) if grid(config) else max(1, OmegaConf.select(config, "hydra.sweeper.n_jobs", default=1) or 1)


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The overrides of each job of a grid sweep (Hydra's basic sweeper: its ``params``, then the command line's);
    a sweeper that picks each trial from the results before it (Optuna) has one known job: its fixed config."""
    task = list(config.hydra.overrides.task)
    if not grid(config):
        return [[o for o in task if "," not in o]]
    params = [f"{key}={value}" for key, value in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    try:
        (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides(params + task), None)
    except ValueError as err:  # Hydra's, on a value it parsed: range(0,3,0), an integer of 4,300 digits or more
        failing = [o for o in params + task if not splits(parser, o)]
        raise UsageError(f"{', '.join(failing) or 'a swept value'}: {str(err).partition(';')[0]}") from None
    return jobs


def splits(parser: OverridesParser, override: str) -> bool:
    """Whether Hydra's basic sweeper splits ``override`` into values without a ``ValueError``."""
    try:
        BasicSweeper.split_arguments(parser.parse_overrides([override]), None)
    except ValueError:
        return False
    return True


def check_launcher(config: DictConfig) -> None:
    """The launcher's counts (``hydra.launcher.n_jobs`` ...) within their ranges; SLURM's commands where its jobs go
    to SLURM."""
    slurm = str(OmegaConf.select(config, "hydra.launcher._target_", default="")).endswith(".SlurmLauncher")
    if slurm and (missing := [command for command in SLURM_COMMANDS if shutil.which(command) is None]):
        raise UsageError(
            f"hydra/launcher=submitit_slurm needs SLURM ({' and '.join(SLURM_COMMANDS)} on the PATH), and this "
            f"machine lacks {' and '.join(missing)}: start the sweep on a SLURM login node, or use "
            "hydra/launcher=joblib or submitit_local here"
        )
    joblib = str(OmegaConf.select(config, "hydra.launcher._target_", default="")).endswith(".JoblibLauncher")
    if joblib and (timeout := OmegaConf.select(config, "hydra.launcher.timeout", default=None)) is not None:
        raise UsageError(
            f"hydra.launcher.timeout={timeout}: joblib kills the jobs still running when it passes, mid-step, and "
            "the sweep ends in a traceback, their runs left RUNNING: leave it null (epochs and limit_batches bound a "
            "job's time)"
        )
    for key, least in LAUNCHER_MINIMA.items():
        value = OmegaConf.select(config, f"hydra.launcher.{key}", default=None)
        if value is None or (key == "n_jobs" and value == -1):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
            extra = " or -1 (one job per CPU)" if key == "n_jobs" else ""
            raise UsageError(f"hydra.launcher.{key}={value} must be a number >= {least}{extra}")


def check_sweeper(config: DictConfig) -> None:
    """A sweeper that picks its trials (Optuna): its ``n_trials`` and ``n_jobs`` whole numbers >= 1. With none, no
    trial ran and Optuna failed at the sweep's end (``ValueError: No trials are completed yet``, or a division by
    zero for ``n_jobs`` <= 0), a traceback after the parent run was made."""
    if grid(config):
        return
    for key, least in SWEEPER_MINIMA.items():
        value = OmegaConf.select(config, f"hydra.sweeper.{key}", default=None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise UsageError(f"hydra.sweeper.{key}={value} must be a whole number >= {least}")


@contextlib.contextmanager
def job_errors(num: int, name: str, overrides: list[str]) -> Iterator[None]:
    """A :class:`UsageError` or Hydra error inside as one :class:`UsageError` naming job ``num``."""
    try:
        yield
    except UsageError as err:
        raise UsageError(f"job {num} ({name}): {err}") from None
    except HydraException as err:
        raise UsageError(f"job {num} ({name}): {composition_error(err, overrides)}") from None
    except OmegaConfBaseException as err:  # an interpolation that does not resolve
        raise UsageError(f"job {num} ({name}): {one_line(err)}") from None
    except ValueError as err:  # OmegaConf's, on a list's element named, not numbered (tags.x=a)
        if (line := list_index_error(err, overrides)) is None:
            raise
        raise UsageError(f"job {num} ({name}): {line}") from None


@dataclasses.dataclass(frozen=True)
class SweepJob:
    """One job of a sweep: its number, its name in messages (the overrides that set it apart), its composed config
    without ``hydra`` (``task``) and its Hydra config."""

    num: int
    name: str
    overrides: list[str]
    task: DictConfig
    hydra: DictConfig

    def named(self) -> contextlib.AbstractContextManager[None]:
        return job_errors(self.num, self.name, self.overrides)


def checked_jobs(config: DictConfig) -> list[SweepJob]:
    """Every job of the sweep composed as Hydra will compose it, its keys, values and model checked: the first failure
    as a :class:`UsageError` naming the job."""
    check_known_keys(config, config.hydra.overrides.task)
    check_launcher(config)
    check_sweeper(config)
    loader = GlobalHydra.instance().config_loader()
    overrides_of = sweep_jobs(config)
    if not overrides_of:
        raise UsageError(
            "the sweep has no jobs: a swept key takes no value (a range() with none, a glob() that matches no "
            "option): give each swept key a value or more"
        )
    jobs = []
    for num, overrides in enumerate(overrides_of):
        name = " ".join(o for o in overrides if any(o not in other for other in overrides_of)) or run_name(overrides)
        with job_errors(num, name, overrides):
            composed = loader.load_sweep_config(config, overrides)
            with open_dict(composed):
                composed.hydra.job.num, composed.hydra.job.id = num, f"{composed.hydra.job.name}_{num}"
                sweep = composed.hydra.sweep
                composed.hydra.runtime.output_dir = str(Path(sweep.dir, str(sweep.subdir)).resolve())
            task = copy.deepcopy(composed)
            with open_dict(task):
                del task["hydra"]
            check_known_keys(task, overrides)
            check_model(check_values(task).model)
        jobs.append(SweepJob(num, name, overrides, task, composed.hydra))
    check_workers(config, handed_at_once(config, jobs))
    return jobs


def check_workers(config: DictConfig, handed: int) -> None:
    """joblib's ``n_jobs`` at most the jobs it is handed at once or this machine's CPUs: it starts that many worker
    processes (a typo's 1000 took the machine)."""
    n_jobs, cpus = OmegaConf.select(config, "hydra.launcher.n_jobs", default=None), launcher_cpus()
    if isinstance(n_jobs, int) and n_jobs > max(handed, cpus):
        raise UsageError(
            f"hydra.launcher.n_jobs={n_jobs} worker processes for {handed} jobs at a time on {cpus} CPUs: give at most "
            f"{max(handed, cpus)} (-1: one per CPU)"
        )


class CheckedJobs(Callback):
    """Hydra callback of ``-m`` in a command that trains nothing (``src.summary``, ``src.memory``): every job checked
    (:func:`checked_jobs`) before the first one prints."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            checked_jobs(config)
        except (UsageError, HydraException, OmegaConfBaseException) as err:
            exit_with(err if isinstance(err, UsageError) else one_line(err))
