"""Entry point: ``python -m src.train [-m] key=value ...``; per job: plan -> start run -> launch -> outcome.

The job owns the MLflow run: it exists before any rank starts and is closed FINISHED, FAILED or KILLED by the
job whatever the ranks do. Under torchrun or a multi-task SLURM job the ranks are already there; rank 0 owns it.
"""

from __future__ import annotations

import logging
import os
import sys

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from src.cli import command
from src.config import Config, ParallelMode
from src.data import ensure_file
from src.folders import held
from src.jobs import dry_run, outcome
from src.jobs.plan import Plan, plan_job, resolve_batch, save_job_config
from src.jobs.rank import Job, run_rank, spawned_rank
from src.jobs.resume import reopen
from src.jobs.sweep import in_sweep
from src.parallel import dist
from src.parallel.launch import job_gpus, spawn_ranks
from src.parallel.preemption import Preempted, PreemptedExit, Preemption
from src.parallel.ranks import job_world
from src.perf import startup
from src.perf.startup import StartupClock, job_clock
from src.resolve import check_split_sizes
from src.tracking.identity import code_fingerprint
from src.tracking.runs import RunLogger, environment_tags, user_tags
from src.tracking.store import best_metric, ensure_store
from src.tracking.sweep import job_parent_id
from src.tracking.ui import log_links

log = logging.getLogger(__name__)
startup.entry_imported()

FOLDER_IN_USE = "wait for it to end, or give this job another folder (hydra.run.dir, or hydra.sweep.dir with -m)"


def train(cfg: DictConfig) -> float:
    """Train and evaluate one job into its own MLflow run; returns its ``objective``.

    ``rerun=<id>`` trains that run's logged config again; ``resume=`` goes on with a stopped run. With
    ``skip_finished`` a config that already has a FINISHED run (same ``config_hash`` and ``code_fingerprint`` tags)
    is skipped, and one whose unfinished run left its checkpoint goes on with it. Out of memory: the run ends FAILED
    with tag ``status=oom``; with ``oom_retry`` a new run follows at half the micro-batch and twice the accumulation;
    otherwise a sweep goes on to its next job. A stop signal (SIGTERM, Ctrl-C) is honoured from the job's start.
    """
    with job_clock() as clock, Preemption().installed() as preemption:
        if HydraConfig.get().mode is RunMode.MULTIRUN:
            return in_sweep(cfg, lambda: run_job(cfg, clock, preemption), preemption)
        return run_job(cfg, clock, preemption)


def run_job(cfg: DictConfig, clock: StartupClock, preemption: Preemption) -> float:
    started = dist.external_rank() if cfg.parallel.mode is ParallelMode.ddp else None  # rank > 0 follows rank 0
    plan = plan_job(cfg, HydraConfig.get(), follower=started is not None and not started.is_main)
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
    with held(plan.output_dir, "job", FOLDER_IN_USE):
        return run_attempts(plan, external, clock, preemption)


def run_attempts(plan: Plan, external: dist.Rank | None, clock: StartupClock, preemption: Preemption) -> float:
    """The job's MLflow run and its ranks, in the job's folder (held): attempts until one ends."""
    if plan.rerun_of or (plan.resume and plan.resume.folder != plan.job_dir):
        save_job_config(plan.stored, plan.job_dir)  # the artifact says what this run trains
    client = ensure_store(plan.tracking_uri)
    clock.mark("mlflow")
    ensure_file(plan.cfg.data)
    clock.mark("data")
    ddp = plan.cfg.parallel.mode is ParallelMode.ddp
    with job_gpus(HydraConfig.get(), plan.device) as gpus:
        world = job_world(plan.cfg, gpus, external)
        first, tags = resolve_batch(plan, world)
        check_split_sizes(first, world)
        clock.mark("batch_size")
        resume = plan.resume
        for attempt in outcome.attempts(first):
            outcome.stop_before_run(preemption)
            run = reopen(client, resume) if resume else start_run(plan, attempt, world, client, tags)
            clock.mark("mlflow")
            job = Job.from_plan(plan, attempt, run.run_id, world, gpus, resume, clock)
            log.info("MLflow run %s in %s; output %s", run.run_id, plan.tracking_uri, plan.output_dir)
            try:
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
                if not outcome.failed(run, attempt, plan, error):  # out of memory or diverged in a sweep: it goes on
                    return float("nan")
                resume, tags = None, {**tags, "retry_of": run.run_id}  # out of memory: half the micro-batch
        outcome.finish(run, plan.output_dir, plan.cfg.checkpoint.keep, preemption)
    log.info("test/acc=%.4f test/auc=%.4f in %.1f s", final["test/acc"], final["test/auc"], final["time/total_s"])
    if not plan.multirun:  # a sweep's links come at its end
        log_links(plan.tracking_uri, client.get_run(run.run_id).info.experiment_id, [run.run_id])
    return best_metric(client, run.run_id, plan.cfg.objective)


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


main = command("config")(train)

if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun / SLURM rank > 0: rank 0 owns the output folder
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=stdout"]
    from src.train import main as importable_main  # launchers pickle the task by reference, not __main__'s copy

    importable_main()
