"""Every job of a sweep checked before the first starts, whatever the launcher: each job planned as it will plan
itself (its config, keys, resume, rerun, skip), its data checked (and downloaded or generated, once, in the sweep's
main process), its split sizes, and the launcher's counts. Hydra's basic sweeper knows its jobs in advance; a sweeper
that picks each trial from the results before it (Optuna) has its fixed config checked."""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path
from typing import Any

import torch
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from src.data import check_file, ensure_file
from src.errors import UsageError
from src.jobs.plan import plan_job, resolve_batch
from src.parallel.ranks import job_world
from src.resolve import check_split_sizes
from src.schema_check import check_known_keys, composition_error

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


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The overrides of each job of a grid sweep (Hydra's basic sweeper: its ``params``, then the command line's);
    a sweeper that picks each trial from the results before it (Optuna) has one known job: its fixed config."""
    task = list(config.hydra.overrides.task)
    if not config.hydra.sweeper._target_.endswith(".BasicSweeper"):
        return [[o for o in task if "," not in o]]
    params = [f"{key}={value}" for key, value in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides(params + task), None)
    return jobs


def check_jobs(config: DictConfig, dry: bool) -> None:
    """Plan every job as it will plan itself (its config, keys, resume, rerun, skip) and check its data, downloading
    or generating it unless ``dry``: a :class:`UsageError` naming the job before any job starts."""
    check_launcher(config)
    loader = GlobalHydra.instance().config_loader()
    jobs = sweep_jobs(config)
    for num, overrides in enumerate(jobs):
        name = " ".join(o for o in overrides if any(o not in other for other in jobs)) or " ".join(overrides)
        try:
            job = loader.load_sweep_config(config, overrides)
            with open_dict(job):
                job.hydra.job.num, job.hydra.job.id = num, f"{job.hydra.job.name}_{num}"
                job.hydra.runtime.output_dir = str(Path(job.hydra.sweep.dir, str(job.hydra.sweep.subdir)).resolve())
            task = copy.deepcopy(job)
            with open_dict(task):
                del task["hydra"]
            check_known_keys(task, overrides)
            check_job(task, job.hydra, dry)
        except UsageError as err:
            raise UsageError(f"job {num} ({name}): {err}") from None
        except HydraException as err:
            raise UsageError(f"job {num} ({name}): {composition_error(err, overrides)}") from None


def check_job(task: DictConfig, hydra_cfg: DictConfig, dry: bool) -> None:
    with quiet():
        plan = plan_job(task, hydra_cfg)
    if plan.finished or plan.busy:
        return
    (check_file if dry else ensure_file)(plan.cfg.data)
    if plan.cfg.batch_size != "auto" or plan.resume:  # auto: the job's probe checks it
        gpus = tuple(range(torch.cuda.device_count())) if plan.device.type == "cuda" else ()
        world = job_world(plan.cfg, gpus)
        check_split_sizes(resolve_batch(plan, world, probe=False)[0], world)


def check_launcher(config: DictConfig) -> None:
    """The launcher's counts (``hydra.launcher.n_jobs`` ...) within their ranges."""
    for key, least in LAUNCHER_MINIMA.items():
        value = OmegaConf.select(config, f"hydra.launcher.{key}", default=None)
        if value is None or (key == "n_jobs" and value == -1):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
            extra = " or -1 (one job per CPU)" if key == "n_jobs" else ""
            raise UsageError(f"hydra.launcher.{key}={value} must be a number >= {least}{extra}")


@contextlib.contextmanager
def quiet() -> Any:
    """Planning a job's check logs only errors: the job logs its plan when it runs."""
    jobs = logging.getLogger("src.jobs")
    before = jobs.level
    jobs.setLevel(logging.ERROR)
    try:
        yield
    finally:
        jobs.setLevel(before)
