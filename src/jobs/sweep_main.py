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

import mlflow
import torch
from omegaconf import DictConfig, open_dict

from src.config import Device
from src.data.files import check_file, ensure_file
from src.folders import held
from src.jobs.plan import plan_job, resolve_batch
from src.jobs.stop_record import STOP_FILE, Stop, read_stop, signalled, write_stop
from src.jobs.sweep_checks import SweepJob, grid, handed_at_once
from src.parallel import machine_share, mps
from src.parallel.launch import launcher_jobs
from src.parallel.preemption import SignalWatcher
from src.parallel.ranks import job_world
from src.tracking.store import check_store, ensure_store, store_exists, tracking_uri, usable_experiment
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
    for job in jobs:
        with job.named():
            check_plan(job, dry=config.dry_run, trial=not grid(config))
    sharing = mps.sharing(config.gpu_share, at_once, gpus)
    if config.dry_run:
        return None
    kept.enter_context(held(sweep_dir, "sweep", "wait for it to end, or give this one hydra.sweep.dir"))
    client = ensure_store(uri)
    kept.enter_context(mps.shared(sharing, sweep_dir / MPS_DIR))
    (sweep_dir / STOP_FILE).unlink(missing_ok=True)  # an earlier sweep's, in a folder given again
    return SweepMain(config, client, sweep_dir, kept)


def check_plan(job: SweepJob, dry: bool, trial: bool = False) -> None:
    """Plan the job as it will plan itself and check its data, downloading or generating it unless ``dry``. A
    ``trial`` (the fixed config of a sweeper that picks its trials: Optuna) is planned in no trial's folder: the
    folder of its number holds what an earlier trial there left (its ``best.pt``, its checkpoint), and each trial
    plans its own folder when it runs."""
    hydra_cfg = job.hydra
    if trial:
        hydra_cfg = copy.deepcopy(job.hydra)
        with open_dict(hydra_cfg):
            hydra_cfg.runtime.output_dir = str(Path(job.hydra.sweep.dir).resolve() / FIXED_CONFIG_DIR)
    with quiet():
        plan = plan_job(job.task, hydra_cfg)
    if plan.finished or plan.busy:
        return
    (check_file if dry else ensure_file)(plan.cfg.data)
    if plan.cfg.batch_size != "auto" or plan.resume:  # auto: the job's probe checks it
        gpus = tuple(range(torch.cuda.device_count())) if plan.execution.device.type == "cuda" else ()
        world = job_world(plan.cfg, gpus)
        resolve_batch(plan, world, probe=False)  # it refuses a batch past the split or the memory


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
        atexit.register(self.close)

    def stopped(self, signum: int) -> None:
        log.warning(
            "received %s: running jobs checkpoint at their next step and stop, no other job starts (a second Ctrl-C "
            "stops them at once)",
            signal.Signals(signum).name,
        )
        write_stop(self.sweep_dir, signalled(signum))

    def close(self, complete: bool = False) -> Stop | None:
        """Stop taking signals, close the parent run, let the folder go; the sweep's stop record, if any."""
        self.watcher.close()
        stop = read_stop(self.sweep_dir)
        close_parent(self.parent, complete and stop is None, stopped=stop is not None and stop.error is None)
        self.kept.close()
        return stop

    def end(self) -> None:
        """The sweep's end: exit 0, ``128 + signal`` after a stop signal, or 2 / 1 with the failed job's line."""
        atexit.unregister(self.close)
        stop = self.close(complete=True)
        if stop is None:
            return
        if stop.error is not None:
            print(f"error: {stop.error}", file=sys.stderr)
        else:
            log.warning(
                "%s: finished jobs are kept, stopped ones are resumable: the same command again resumes the sweep",
                stop.reason,
            )
        sys.exit(stop.code)
