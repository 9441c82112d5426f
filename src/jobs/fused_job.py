"""A job of ``python -m src.train`` that belongs to a fused group (docs/fused.md), in Hydra's launcher model: every
job is still one call, and the group's first call trains the group.

That call holds the group's folder and trains every member still to train (:func:`run_group`), each member in its own
MLflow run as its own job would have it (its params, tags, per-epoch metrics, checkpoint, tested weights, evaluation
artifacts, in its own job folder), plus the tags naming its group; each member is marked done as it ends. The other
members' calls then train nothing: a call that finds the group held by a live process returns at once (its run is
being trained there), one that finds its member done returns that run's result. A job of no group goes to
:func:`src.jobs.job.train_job`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.config import Config
from src.data.files import ensure_file
from src.data.loaders import load_splits
from src.errors import UsageError
from src.folders import held, holder, never_release
from src.jobs import fuse, job, outcome, rank
from src.jobs.fuse import Group
from src.jobs.plan import Job, Plan, plan_job, resolve_batch, save_job_config
from src.jobs.reporting import MainReporter
from src.jobs.resume import reopen
from src.parallel.launch import job_gpus
from src.parallel.preemption import Preempted, PreemptedExit, Preemption
from src.perf.startup import StartupClock
from src.tracking.runs import RunLogger
from src.tracking.store import best_metric, check_usable, ensure_store, tracking_uri
from src.tracking.system_metrics import system_metrics
from src.training import checkpoint
from src.training.fused import build_fused
from src.training.metrics import load_libraries
from src.training.trainer import Hooks

log = logging.getLogger(__name__)

APART = "its resumed position differs from the rest of its group's"


def train_job(cfg: DictConfig, clock: StartupClock, preemption: Preemption) -> float:
    """A job of a sweep (as :func:`src.jobs.job.train_job` has it: :func:`src.jobs.job.in_sweep`, so a damaged record
    stops the sweep in one line) through :func:`run_group` where the sweep's record puts it in a fused group; a single
    run, a dry run and a job of no group as :func:`src.jobs.job.train_job` trains them."""
    hydra_cfg = HydraConfig.get()
    if cfg.dry_run or hydra_cfg.mode is not RunMode.MULTIRUN:
        return job.train_job(cfg, clock, preemption)

    def run() -> float:
        group = fuse.group_of(hydra_cfg)
        if group is None:
            return job.run_job(cfg, clock, preemption)
        return run_group(group, hydra_cfg.job.num, clock, preemption)

    return job.in_sweep(cfg, run, preemption)


def run_group(group: Group, num: int, clock: StartupClock, preemption: Preemption) -> float:
    """Job ``num``'s result: trained by the live process that holds the group (NaN, at once), done earlier (its run's
    result), or trained now with every other member still to train."""
    holding = contextlib.ExitStack()
    try:
        holding.enter_context(held(group.folder, "fused group", "it trains this job's run"))
    except UsageError:
        log.info("job %d: its run trains in fused group %s, in process %s", num, group.name, holder(group.folder))
        return math.nan
    with holding:
        ended = fuse.done(group)
        if num in ended:
            return member_result(group, num, ended[num])
        plans = {member.num: planned(group, member) for member in group.members if member.num not in ended}
        clock.mark("config")
        own = plans[num]
        result = outcome.skip(own) if own.finished or own.busy else math.nan
        trainable = [plan for plan in plans.values() if not (plan.finished or plan.busy)]
        return train_plans(group, trainable, clock, preemption).get(num, result)


def planned(group: Group, member: fuse.Member) -> Plan:
    """Member ``member`` planned as its own call would plan it; what cannot train named as that job's."""
    try:
        return plan_job(*member.configs())
    except UsageError as err:
        raise UsageError(f"job {member.num} (of fused group {group.name}): {err}") from None


def member_result(group: Group, num: int, run_id: str) -> float:
    """The result of member ``num``, which the group trained in run ``run_id``: its objective, as its job returns it."""
    member = next(member for member in group.members if member.num == num)
    cfg, _ = member.configs()
    client = ensure_store(tracking_uri(cfg))
    status = client.get_run(run_id).info.status
    log.info("job %d: trained in fused group %s as run %s (%s)", num, group.name, run_id, status)
    return best_metric(client, run_id, cfg.objective) if status == "FINISHED" else math.nan


def train_plans(group: Group, plans: Sequence[Plan], clock: StartupClock, preemption: Preemption) -> dict[int, float]:
    """Train ``plans`` (members of ``group``, in job order): those at the position most of them start at fused, any
    other one by itself (the group was made at one position; a member's run may have moved on since)."""
    cohorts: dict[tuple[int, int], list[Plan]] = {}
    for plan in plans:
        cohorts.setdefault((plan.resume.epoch, plan.resume.step) if plan.resume else (0, 0), []).append(plan)
    fused = max(cohorts.values(), key=len, default=[])
    results = {}
    for plan in (plan for cohort in cohorts.values() if cohort is not fused for plan in cohort):
        apart = dataclasses.replace(plan, execution=plan.execution.alone(APART))
        with held(apart.output_dir, "job", job.FOLDER_IN_USE):
            results[plan.job_num] = job.run_attempts(apart, None, clock, preemption)
    if fused:
        results |= train_fused(group, fused, clock, preemption)
    return results


@dataclass
class Trained:
    """A member being trained: its plan, the config it trains (its batch resolved) and its run, open until it ends."""

    plan: Plan
    cfg: Config
    run: RunLogger
    open: bool = True


def prepare_folder(plan: Plan, member: fuse.Member) -> None:
    """A member's job folder as its own call would have it: its ``.hydra/`` (the config its run trains, its Hydra
    config and overrides; where Hydra has not made the folder yet, it writes them again when that call comes), for
    the run's artifacts and reruns."""
    hydra_dir = plan.job_dir / ".hydra"
    if plan.rerun_of or (plan.resume and plan.resume.folder != plan.job_dir):
        save_job_config(plan.stored, plan.job_dir)
    if hydra_dir.is_dir():
        return
    hydra_dir.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(plan.stored), hydra_dir / "config.yaml")
    if member.hydra is not None:
        OmegaConf.save(OmegaConf.create({"hydra": member.hydra}), hydra_dir / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(plan.overrides)), hydra_dir / "overrides.yaml")


def train_fused(group: Group, plans: Sequence[Plan], clock: StartupClock, preemption: Preemption) -> dict[int, float]:
    """``plans`` trained as one stacked model, each member in its own run (created, or reopened where resumed), its
    folder held; their results by job number."""
    members_of = {member.num: member for member in group.members}
    for plan in plans:
        prepare_folder(plan, members_of[plan.job_num])
        check_usable(plan.tracking_uri)
        ensure_file(plan.cfg.data)
    clock.mark("data")
    with job_gpus(HydraConfig.get(), plans[0].execution.device) as gpus, contextlib.ExitStack() as folders:
        plans = [plan.on(gpus) for plan in plans]
        chosen = [resolve_batch(plan, 1) for plan in plans]
        clock.mark("batch_size")
        for plan in plans:
            folders.enter_context(held(plan.output_dir, "job", job.FOLDER_IN_USE))
        client = ensure_store(plans[0].tracking_uri)
        clock.mark("mlflow")
        for plan in plans:
            never_release(plan.job_dir, plan.output_dir)
        outcome.stop_before_run(preemption)
        members = []
        for plan, (cfg, tags) in zip(plans, chosen, strict=True):
            run = reopen(client, plan.resume) if plan.resume else job.start_run(plan, cfg, 1, client, tags)
            if plan.resume or not job.planned_twice(plan, client, run.run_id):
                members.append(Trained(plan, cfg, run))
        for member in members:
            member.run.set_tags(group.tags(len(members)))
        log.info(
            "fused group %s: training jobs %s as one stacked model (runs %s)",
            group.name,
            ", ".join(str(member.plan.job_num) for member in members),
            ", ".join(member.run.run_id for member in members),
        )
        return train_members(group, members, gpus, clock, preemption) if members else {}


def train_members(
    group: Group, members: list[Trained], gpus: tuple[int, ...], clock: StartupClock, preemption: Preemption
) -> dict[int, float]:
    """The members' training as one process's rank (:func:`src.jobs.rank.train_rank` for a group): each member's
    reporter, checkpoint and hooks; each member closed as it ends (:meth:`ended`)."""
    jobs = [Job.from_plan(m.plan, m.cfg, m.run.run_id, 1, gpus, m.plan.resume, clock) for m in members]
    execution = rank.placed(jobs[0], 0)  # one process: its own first GPU
    clock.mark("launch")
    load_libraries()
    clock.imported()
    reporters = [MainReporter(j, execution, 1) for j in jobs]
    hooks = [
        Hooks(
            checkpoint_to=j.output_dir / checkpoint.FILE,
            checkpoint_meta={**j.checkpoint_meta, "threads": execution.threads},
            preemption=preemption,
            epoch_metrics=reporter.epoch_metrics,
        )
        for j, reporter in zip(jobs, reporters, strict=True)
    ]
    clock.mark("probes")
    splits = load_splits(jobs[0].cfg.data)
    clock.mark("data")
    fused = build_fused([j.cfg for j in jobs], execution, hooks, splits)
    clock.mark("model")
    for reporter, trainer in zip(reporters, fused.members, strict=True):
        reporter.started(trainer, splits)
    if any(j.resume_from for j in jobs):
        fused.load_state_dicts([checkpoint.load(j.resume_from) for j in jobs])
        for reporter, trainer in zip(reporters, fused.members, strict=True):
            reporter.resumed(trainer)
    clock.mark("mlflow")
    for reporter in reporters:
        reporter.startup(clock, fused.members[0].epoch)
    results: dict[int, float] = {}

    def ended(index: int, result: dict[str, float] | BaseException) -> None:
        member, trainer, reporter = members[index], fused.members[index], reporters[index]
        member.open = False
        plan, run = member.plan, member.run
        if isinstance(result, BaseException):
            outcome.failed(run, member.cfg, plan, result)  # diverged: FAILED, status=diverged; the group goes on
            results[plan.job_num] = math.nan
        else:
            reporter.finished(trainer, result)
            outcome.log_outputs(run, plan.output_dir, plan.job_dir)
            outcome.finish(run, plan.output_dir, plan.cfg.checkpoint.keep, preemption)
            results[plan.job_num] = best_metric(run.client, run.run_id, plan.cfg.objective)
        fuse.mark_done(group, plan.job_num, run.run_id)

    try:
        with contextlib.ExitStack() as monitors:
            for j in jobs:
                resumed = j.resume_from is not None
                monitors.enter_context(system_metrics(j.cfg, j.run_id, j.tracking_uri, resumed, None, True))
            fused.fit([(reporter.log_metrics, reporter.log_tested) for reporter in reporters], ended)
    except Preempted as stop:
        stopped(members, stop, preemption)
    except KeyboardInterrupt:  # a second Ctrl-C: each open run as a job's (resumable from its last checkpoint)
        at_once(members)
    except BaseException as error:
        failed(members, error)
        raise
    return results


def stopped(members: list[Trained], stop: Preempted, preemption: Preemption) -> None:
    """A stop signal was honoured and every open member checkpointed: their runs KILLED and resumable, then the job
    ends as a stopped job does (:func:`src.jobs.outcome.handed_over`)."""
    preemption.begin("closing the stopped runs")
    still = [member for member in members if member.open]
    for member in still:
        outcome.close_resumable(member.run)
    log.warning(
        "preempted (%s): runs %s are KILLED and resumable (the same command again resumes them, fused)",
        stop,
        ", ".join(member.run.run_id for member in still),
    )
    outcome.handed_over(preemption, still[0].run if still else None)


def at_once(members: list[Trained]) -> None:
    """A second Ctrl-C: each open run KILLED and resumable from its last checkpoint, or deleted before its first
    (:func:`src.jobs.outcome.stopped_at_once`); exit 130."""
    exit_error = None
    for member in members:
        if member.open:
            try:
                outcome.stopped_at_once(member.run, member.plan.output_dir)
            except PreemptedExit as err:
                exit_error = err
    if exit_error is not None:
        raise exit_error
    raise PreemptedExit(130)


def failed(members: list[Trained], error: BaseException) -> None:
    """The group failed (out of memory, a failing store, a fault): every open run FAILED, out of memory tagged so."""
    for member in members:
        if member.open:
            with contextlib.suppress(*outcome.STORE_ERRORS):
                if isinstance(error, torch.OutOfMemoryError):
                    member.run.set_tags({"status": "oom", "retried": "false"})
                member.run.finish("FAILED")
