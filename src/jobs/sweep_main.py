"""A sweep's main process once every job's config passed its checks (:class:`src.jobs.sweep.Sweep`): each job
planned as it will plan itself (resume, rerun, skip), its data checked (downloaded or generated once, here) and its
split sizes; then the sweep folder held, an MPS daemon where its jobs share a GPU (:mod:`src.parallel.mps`), the
parent run opened and stop signals taken."""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import mlflow
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from src.config import Device
from src.data.files import check_file, ensure_file
from src.folders import CHECKPOINT_FILE, held
from src.jobs import dry_run, fuse
from src.jobs.plan import Plan, plan_job, resolve_batch
from src.jobs.stop_record import STOP_FILE, Stop, read_stop, signalled, write_stop
from src.jobs.sweep_checks import SweepJob, grid, handed_at_once
from src.jobs.sweep_workers import local_jobs_killed_stop_the_sweep, workers_killed_stop_the_sweep
from src.parallel import machine_share, mps
from src.parallel.launch import launcher_jobs
from src.parallel.preemption import SignalWatcher
from src.parallel.ranks import job_world
from src.redaction import redact
from src.tracking.runs import close_orphan
from src.tracking.store import (
    STORE_ERRORS,
    check_store,
    ensure_store,
    innermost_reason,
    redacted,
    search_all,
    store_exists,
    tracking_uri,
    usable_experiment,
)
from src.tracking.sweep import close_parent, open_parent

log = logging.getLogger(__name__)

MPS_DIR = ".mps"  # in the sweep folder: the pipes and log of an MPS daemon started for the sweep (gpu_share)

FIXED_CONFIG_DIR = ".fixed-config"  # in the sweep folder, never made: where an Optuna sweep's fixed config is planned


def open_sweep(config: DictConfig, jobs: list[SweepJob]) -> SweepMain | None:
    """Check the store and plan every job (a :class:`UsageError` naming the job before any starts), then open the
    sweep; None for a dry run, which holds and opens nothing."""
    sweep_dir, uri = Path(config.hydra.sweep.dir), tracking_uri(config)
    check_store(uri)
    if store_exists(uri):  # before the folder is held (skip_finished=false plans no store search)
        usable_experiment(ensure_store(uri), config.mlflow.experiment)
    gpus = torch.cuda.device_count() if config.device is not Device.cpu else 0
    at_once = launcher_jobs(config.hydra, handed_at_once(config, jobs))
    kept = contextlib.ExitStack()
    atexit.register(kept.close)  # an exit before the parent run opens lets the folder and MPS go too
    kept.enter_context(machine_share.shared(at_once))  # before the plans: each job checks its share of the memory
    listed_here = dry_run.lists_here(config)  # the listing plans each job shape's batch once, not each job's
    plans = []
    for job in jobs:
        with job.named():
            plans.append(check_plan(job, dry=config.dry_run, trial=not grid(config), batch=not listed_here))
    sharing = mps.sharing(config.gpu_share, at_once, gpus)
    if listed_here:
        dry_run.list_sweep(config.hydra, plans, {job.num: job.named for job in jobs})
        sys.exit(0)  # listed: the launcher would compose and plan every job again to list it
    if config.dry_run:
        return None
    kept.enter_context(held(sweep_dir, "sweep", "wait for it to end, or give this one hydra.sweep.dir"))
    client = ensure_store(uri)
    kept.enter_context(mps.shared(sharing, sweep_dir / MPS_DIR))
    (sweep_dir / STOP_FILE).unlink(missing_ok=True)  # an earlier sweep's, in a folder given again
    if grid(config):  # the jobs that train fused, in groups every job reads (docs/fused.md)
        fuse.write_record(
            sweep_dir, jobs, {j.num: p for j, p in zip(jobs, plans, strict=True) if not (p.finished or p.busy)}
        )
    else:
        fuse.forget(sweep_dir)
    return SweepMain(config, client, sweep_dir, kept)


def check_plan(job: SweepJob, dry: bool, trial: bool = False, batch: bool = True) -> Plan:
    """Plan the job as it will plan itself and check its data, downloading or generating it unless ``dry``, and its
    batch unless not ``batch`` (a dry run's listing checks it with each job shape's); its plan. A ``trial`` (the fixed
    config of a sweeper that picks its trials: Optuna) is planned in no trial's folder: the folder of its number
    holds what an earlier trial there left (its ``best.pt``, its checkpoint), and each trial plans its own folder
    when it runs."""
    hydra_cfg = job.hydra
    if trial:
        hydra_cfg = copy.deepcopy(job.hydra)
        with open_dict(hydra_cfg):
            hydra_cfg.runtime.output_dir = str(Path(job.hydra.sweep.dir).resolve() / FIXED_CONFIG_DIR)
    with quiet():
        plan = plan_job(job.task, hydra_cfg)
    if plan.finished or plan.busy:
        return plan
    (check_file if dry else ensure_file)(plan.cfg.data)
    if batch and (plan.cfg.batch_size != "auto" or plan.resume):  # auto: the job's probe checks it
        gpus = tuple(range(torch.cuda.device_count())) if plan.execution.device.type == "cuda" else ()
        world = job_world(plan.cfg, gpus)
        resolve_batch(plan, world, probe=False, memory=not dry)  # it refuses a batch past the split or the memory
        # (a dry run lists whether each job fits instead)
    return plan


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Planning a job's check logs only errors: the job logs its plan when it runs."""
    jobs = logging.getLogger("src.jobs")
    before = jobs.level
    jobs.setLevel(logging.ERROR)
    try:
        yield
    finally:
        jobs.setLevel(before)


class SweepMain:
    """An open sweep: its folder (and MPS daemon) held in ``kept``, a watcher of stop signals, its parent run."""

    def __init__(self, config: DictConfig, client: mlflow.MlflowClient, sweep_dir: Path, kept: contextlib.ExitStack):
        self.sweep_dir, self.kept = sweep_dir, kept
        self.watcher = SignalWatcher(self.stopped)
        self.watcher.start()
        self.parent = open_parent(config, client, sweep_dir)
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
        if "joblib" in launcher:
            kept.enter_context(workers_killed_stop_the_sweep(sweep_dir, self.worker_killed))
        elif launcher.endswith("submitit_launcher.LocalLauncher"):
            kept.enter_context(local_jobs_killed_stop_the_sweep(sweep_dir, self.local_job_killed))
        atexit.register(self.close)

    def worker_killed(self, signum: int) -> NoReturn:
        """One of joblib's workers died of ``signum`` (:mod:`src.jobs.sweep_workers`): the others stopped."""
        self.job_killed(signum, "the other running jobs checkpointed and stopped")

    def local_job_killed(self, signum: int) -> NoReturn:
        """A submitit_local job's process died of ``signum``: the others trained on to their end."""
        self.job_killed(signum, "the other jobs ran to their end")

    def job_killed(self, signum: int, others: str) -> NoReturn:
        """A job's process died of ``signum``, what became of the other jobs said in ``others``: its run closed KILLED
        (``status=process_gone``), the stop recorded (unless one stands) and the command ended with one line naming
        it."""
        client, name = self.parent.client, signal.Signals(signum).name
        experiment = client.get_run(self.parent.run_id).info.experiment_id
        of_sweep = f"tags.`mlflow.parentRunId` = '{self.parent.run_id}' and attributes.status = 'RUNNING'"
        lost = [run for run in search_all(client, experiment, of_sweep) if close_orphan(client, run, None)]
        whose = "; ".join(
            f"job run {run.info.run_name} ({run.info.run_id}) is KILLED (status=process_gone), "
            + ("resumable from its last checkpoint" if has_checkpoint(run) else "with no checkpoint to resume")
            for run in lost
        )
        write_stop(self.sweep_dir, Stop(f"a job's process was killed ({name})", 128 + signum))
        self.end(
            f"a job's process was killed ({name}): {whose or 'it ran no job'}; {others}: the same command again "
            "resumes the sweep"
        )

    def stopped(self, signum: int) -> None:
        log.warning(
            "received %s: running jobs checkpoint at their next step and stop, no other job starts (a second Ctrl-C "
            "stops them at once)",
            signal.Signals(signum).name,
        )
        write_stop(self.sweep_dir, signalled(signum))

    def close(self, complete: bool = False) -> Stop | None:
        """Close the parent run and let the folder go (a stop signal meanwhile is only said: it would start a second
        stop), then stop taking signals; the sweep's stop record, if any."""
        self.watcher.ending = True
        stop = read_stop(self.sweep_dir)
        try:
            close_parent(self.parent, complete and stop is None, stopped=stop is not None and stop.error is None)
        except STORE_ERRORS as broken:  # the store went away too: the next sweep into it closes the parent run
            stop = self.unclosed(stop, innermost_reason(broken))
        self.kept.close()
        self.watcher.close()
        return stop

    def unclosed(self, stop: Stop | None, reason: str) -> Stop:
        """The sweep's stop where its parent run could not be closed (``reason``): the failed job's, said with a
        warning of the parent; else, the jobs having ended, one line of its own, exit 2 (it ended 0 with Hydra's
        warning of the callback's error)."""
        parent, store = self.parent.run_id, redacted(self.parent.client.tracking_uri)
        log.warning("parent run %s stays RUNNING (%s): the next sweep into %s closes it", parent, reason, store)
        if stop is not None:
            return stop
        error = (
            f"the MLflow store {store} failed ({reason}) as the sweep ended: its jobs' runs are as they ended, its "
            f"parent run {parent} stays RUNNING until the same command again, once the store is back, closes it"
        )
        return Stop("the MLflow store failed", 2, error)

    def end(self, error: str | None = None) -> None:
        """The sweep's end: exit 0, ``128 + signal`` after a stop signal (with ``error``'s line, if given), or 2 / 1
        with the failed job's line."""
        atexit.unregister(self.close)
        stop = self.close(complete=True)
        if stop is None:
            return
        if (error := error or stop.error) is not None:
            print(f"error: {redact(error)}", file=sys.stderr)
        else:
            log.warning(
                "%s: finished jobs are kept, stopped ones are resumable: the same command again resumes the sweep",
                stop.reason,
            )
        sys.exit(stop.code)


def has_checkpoint(run: mlflow.entities.Run) -> bool:
    folder = run.data.tags.get("output_dir")
    return folder is not None and (Path(folder) / CHECKPOINT_FILE).is_file()
