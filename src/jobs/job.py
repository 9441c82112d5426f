"""One job of ``python -m src.train``: plan -> start run -> launch -> outcome; in a sweep, its stop record first.

The job owns the MLflow run: it exists before any rank starts and is closed FINISHED, FAILED or KILLED by the
job whatever the ranks do. Under torchrun or a multi-task SLURM job the ranks are already there; rank 0 owns it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src.atomic import uninterrupted
from src.config import Config, ParallelMode
from src.data.files import ensure_file
from src.folders import held, holder, never_release
from src.jobs import dry_run, fuse, outcome
from src.jobs.plan import Job, Plan, plan_job, resolve_batch, save_job_config
from src.jobs.rank import run_rank, spawned_rank
from src.jobs.resume import earlier_twin, reopen
from src.jobs.slurm import in_slurm_job, run_tags
from src.jobs.stop_record import failure, read_stop, signalled, write_stop
from src.parallel import dist
from src.parallel.launch import job_gpus, spawn_ranks
from src.parallel.preemption import Preempted, PreemptedExit, Preemption, ended_with_parent, requeue_signal
from src.parallel.ranks import job_world
from src.perf.startup import StartupClock
from src.tracking.identity import code_fingerprint
from src.tracking.runs import RunLogger, environment_tags, user_tags
from src.tracking.store import best_metric, check_usable, ensure_store
from src.tracking.sweep import fail_parent_run, job_parent_id
from src.tracking.ui import log_links

log = logging.getLogger(__name__)

FOLDER_IN_USE = "wait for it to end, or give this job another folder (hydra.run.dir, or hydra.sweep.dir with -m)"
RESUMED_IN_USE = "it trains the run to resume now: wait for it to end"


def train_job(cfg: DictConfig, clock: StartupClock, preemption: Preemption) -> float:
    """The job, through :func:`in_sweep` in a multirun."""
    if HydraConfig.get().mode is RunMode.MULTIRUN:
        return in_sweep(cfg, lambda: run_job(cfg, clock, preemption), preemption)
    return run_job(cfg, clock, preemption)


def run_job(cfg: DictConfig, clock: StartupClock, preemption: Preemption) -> float:
    started = dist.external_rank() if cfg.parallel.mode is ParallelMode.ddp else None  # rank > 0 follows rank 0
    plan = fuse.alone(plan_job(cfg, HydraConfig.get(), started), HydraConfig.get())  # why it trains unfused
    clock.mark("config")
    external = dist.external_rank() if plan.cfg.parallel.mode is ParallelMode.ddp else None
    if plan.cfg.dry_run:
        return dry_run.report(plan, external)
    if plan.finished or plan.busy:
        return outcome.skip(plan)
    if external is not None and not external.is_main:  # torchrun / SLURM rank > 0: train, log nothing
        try:
            run_rank(Job.from_plan(plan, plan.cfg), external, preemption=preemption)
        except Preempted:
            raise PreemptedExit(preemption.exit_code) from None
        return float("nan")
    with held(plan.output_dir, "job", RESUMED_IN_USE if plan.resume else FOLDER_IN_USE):
        return run_attempts(plan, external, clock, preemption)


def run_attempts(plan: Plan, external: dist.Rank | None, clock: StartupClock, preemption: Preemption) -> float:
    """The job's MLflow run and its ranks, in the job's folder (held): attempts until one ends."""
    if plan.rerun_of or (plan.resume and plan.resume.folder != plan.job_dir):
        save_job_config(plan.stored, plan.job_dir)  # the artifact says what this run trains
    check_usable(plan.tracking_uri)  # a store that cannot be used refused now; a fresh one created once the batch fits
    ensure_file(plan.cfg.data)
    clock.mark("data")
    ddp = plan.cfg.parallel.mode is ParallelMode.ddp
    with job_gpus(HydraConfig.get(), plan.execution.device) as gpus:
        plan = plan.on(gpus)
        world = job_world(plan.cfg, gpus, external)
        first, tags = resolve_batch(plan, world)
        clock.mark("batch_size")
        client = ensure_store(plan.tracking_uri)
        clock.mark("mlflow")
        resume = plan.resume
        never_release(plan.job_dir, plan.output_dir)  # the run's from here: kept whatever ends it
        for attempt in outcome.attempts(first):
            outcome.stop_before_run(preemption)
            run = None
            try:
                with uninterrupted("opening its run"):  # a second Ctrl-C inside would leave the run RUNNING
                    run = reopen(client, resume) if resume else start_run(plan, attempt, world, client, tags)
                if slurm_tags := run_tags():  # the SLURM job that trains it, started again how many times
                    run.set_tags(slurm_tags)
                clock.mark("mlflow")
                if not resume and "retry_of" not in tags and planned_twice(plan, client, run.run_id):
                    return float("nan")
                job = Job.from_plan(plan, attempt, run.run_id, world, gpus, resume, clock)
                log.info("MLflow run %s in %s; output %s", run.run_id, plan.tracking_uri, plan.output_dir)
                final = (
                    spawn_ranks(spawned_rank, job, world, preemption)
                    if ddp and external is None
                    else run_rank(job, external or dist.Rank(), preemption=preemption)
                )
                outcome.log_outputs(run, plan.output_dir, plan.job_dir)
                break
            except Preempted as stop:
                outcome.stop_preempted(run, stop, preemption)
            except BaseException as error:
                if run is None:  # the store failed to open it
                    raise
                if not outcome.failed(run, attempt, plan, error):  # out of memory or diverged in a sweep: it goes on
                    return float("nan")
                resume, tags = None, {**tags, "retry_of": run.run_id}  # out of memory: half the micro-batch
        outcome.finish(run, plan.output_dir, plan.cfg.checkpoint.keep, preemption)
    log.info("test/acc=%.4f test/auc=%.4f in %.1f s", final["test/acc"], final["test/auc"], final["time/total_s"])
    if not plan.multirun:  # a sweep's links come at its end
        log_links(plan.tracking_uri, client.get_run(run.run_id).info.experiment_id, [run.run_id])
    return best_metric(client, run.run_id, plan.cfg.objective)


def planned_twice(plan: Plan, client, run_id: str) -> bool:
    """Whether another command planned this config at the same time and its run started first
    (:func:`earlier_twin`): this job's new run is deleted, nothing trained twice. Never for a run that
    ``skip_finished=false`` or ``rerun=`` asks for."""
    if not plan.cfg.skip_finished or plan.rerun_of or not (twin := earlier_twin(client, plan.cfg, run_id)):
        return False
    client.set_terminated(run_id, "KILLED")
    client.delete_run(run_id)
    outcome.list_on_parent(client, plan, twin)
    log.info(
        "run %s of this config started just before this job's run %s (two commands planned it at once): "
        "this job trains nothing, its run deleted",
        twin,
        run_id,
    )
    return True


def start_run(plan: Plan, cfg: Config, world: int, client, tags: dict[str, str]) -> RunLogger:
    """The job's MLflow run (a child of the sweep's parent run in a multirun): params, identity and environment."""
    tags = {
        "config_hash": plan.config_hash,
        "code_fingerprint": code_fingerprint(),
        "overrides": " ".join(plan.overrides),
        "output_dir": str(plan.output_dir.resolve()),
        **({"rerun_of": plan.rerun_of} if plan.rerun_of else {}),
        **tags,
        **environment_tags(),
        **user_tags(cfg.tags),
    }
    return RunLogger.start(
        client, cfg.mlflow.experiment, plan.run_name, plan.run_params(cfg, world), tags, parent_id=job_parent_id()
    )


def in_sweep(cfg: DictConfig, run: Callable[[], float], preemption: Preemption) -> float:
    """Run one job of a sweep (``run``), or none once the sweep is stopping; returns NaN rather than raise."""
    hydra_cfg = HydraConfig.get()
    sweep_dir, num = Path(hydra_cfg.sweep.dir), hydra_cfg.job.num
    if (stop := read_stop(sweep_dir)) is not None:
        log.warning("job %d not started: %s", num, stop.reason)
        return math.nan
    try:
        with ended_with_parent(holder(sweep_dir)):
            result = run()
    except PreemptedExit:
        if not stops_alone(preemption):
            write_stop(sweep_dir, signalled(preemption.signum or signal.SIGTERM))
        elif preemption.refused is None:  # no result: SLURM or submitit starts the job again (it resumes), or the
            raise  # main process reports how SLURM ended it
        return math.nan  # or not requeued by submitit: its run KILLED, resumable; the main process reports it
    except KeyboardInterrupt:
        write_stop(sweep_dir, signalled(signal.SIGINT))
        return math.nan
    except BaseException as error:  # any failure stops the sweep; the main process reports it
        write_stop(sweep_dir, failure(num, hydra_cfg, error))
        with contextlib.suppress(Exception):
            fail_parent_run(cfg)
        return math.nan
    if preemption.requested and not stops_alone(preemption):  # came after this job's training: no other job starts
        write_stop(sweep_dir, signalled(preemption.signum))
    return result


def stops_alone(preemption: Preemption) -> bool:
    """Whether the signal that stopped this job of a sweep stops it alone, not the sweep: SLURM's (a requeue, a
    preemption, ``scancel``, the time limit), or submitit's requeue signal that submitit took back (it requeues the
    job, which resumes by itself)."""
    requeued = preemption.signum is not None and preemption.signum == requeue_signal() and preemption.refused is None
    return in_slurm_job() or requeued
