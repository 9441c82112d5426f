"""``dry_run=true``: what each job would do, one line per job on stdout, then a total; nothing trains, nothing is
logged, the MLflow store is left as it is (a missing SQLite database is not created). Each line gives the job's
action, predicted peak and estimated minutes, from finished runs or a timed step. Each job shape (its config but
:data:`SHAPELESS`, its execution and ranks) is planned once per process, its batch, peak and rate reused by every job
of that shape (:class:`Shape`). A grid sweep whose jobs would run in its main process (Hydra's basic launcher) is
listed there, from the plans its checks made (:func:`list_sweep`), launching no job; under a launcher that runs jobs
in other processes, each job lists itself and :class:`src.jobs.dry_run_total.DryRunTotal` prints the total at the
sweep's end. Line format and estimate: docs/sweeps.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from mlflow.entities import Run
from omegaconf import DictConfig

from src.atomic import atomic_path
from src.config import Config, FaultConfig, ParallelMode
from src.data.files import check_file, split_sizes
from src.execution import Execution
from src.jobs.dry_run_total import FOLDER, JobEstimate, fits_text, rounded, total
from src.jobs.plan import Plan, resolve_batch
from src.jobs.resume import Resume
from src.parallel import dist
from src.parallel.launch import job_gpus
from src.parallel.machine_share import jobs_at_once
from src.parallel.ranks import job_world, seed_everything
from src.perf.autobatch import budget_fit
from src.perf.memory_cache import predicted
from src.perf.step_timing import step_time
from src.tracking.identity import NOT_HASHED
from src.tracking.runs import host
from src.tracking.store import check_store, finished_runs
from src.training.build import build_trainer
from src.training.meters import MIN_TIMED_STEPS, synchronize
from src.training.step_graph import WARMUP_STEPS, Batch
from src.training.trainer import steps_per_epoch

log = logging.getLogger(__name__)

EVAL_COST = 1 / 3  # an evaluated sample costs a third of a trained one: a forward, where training adds a backward (~2)
RATE = "perf/samples_per_s"
MEDIAN_RATE = "perf/samples_per_s_median"  # over the timed epochs; runs logged before it have the last epoch's only
NO_EFFECT = (  # params that change neither the time per sample nor the memory a step takes
    "seed",
    "epochs",
    "limit_batches",
    "early_stop_patience",
    "select_by",
    "warmup_epochs",
    "optim.lr",
    "optim.betas",
    "sched.",
    "label_smoothing",
    "class_weights",
    "fault.",
)
NOT_SPEED = (  # params that do not change the time per sample (device and threads are compared through tags)
    *NOT_HASHED,
    *NO_EFFECT,
    "data.name",
    "data.num_classes",
    "data.task",
    "data.synthetic_samples",
    "data.labels",  # data=nifti: what the volumes are and how they were prepared, not their size
    "data.classes",
    "data.split_",
    "data.spacing",
    "data.intensity",
    "data.window_",
    "effective_batch_size",
    "mem_budget_mb",
    "oom_retry",
    "device",
    "num_threads",
)
SHAPELESS = (  # params that change neither a job's step, its memory, nor where its finished runs are looked up
    *NO_EFFECT,  # epochs but whether more than one: the best weights' copy (Placed.shape)
    *(key for key in NOT_HASHED if key not in ("mlflow.", "data.root")),  # how a job starts, what it returns
)


@dataclasses.dataclass(frozen=True)
class Rate:
    """A training rate in samples/s and its basis: a timing (``spread``: the 95% interval's half-width, relative) or
    finished runs (``runs``: their rates)."""

    per_s: float
    basis: str
    spread: float | None = None
    runs: tuple[float, ...] = ()

    def estimate(self, minutes: float) -> str:
        """The line's estimate of ``minutes`` at this rate: ``~12 min ±8% (timed 14 steps)``, ``~12 min (from 3
        finished runs, 11-13)`` (the minutes at the fastest and the slowest run), ``~12 min (from 1 finished run)``."""
        if self.spread is not None:
            return f"~{rounded(minutes)} min ±{100 * self.spread:.0f}% ({self.basis})"
        if len(self.runs) == 1:
            return f"~{rounded(minutes)} min ({self.basis})"
        low, high = (rounded(minutes * self.per_s / rate) for rate in (max(self.runs), min(self.runs)))
        return f"~{rounded(minutes)} min ({self.basis}, {low}-{high})"


@dataclasses.dataclass(frozen=True)
class Placed:
    """A job's plan on the GPUs it holds (:func:`~src.parallel.launch.job_gpus`) and its ranks."""

    plan: Plan
    gpus: tuple[int, ...]
    world: int

    @property
    def shape(self) -> tuple:
        """What sets the job's step, memory and basis of estimate apart: its params but :data:`SHAPELESS`, whether it
        trains more than one epoch, a resumed run's batch, its store, execution and ranks."""
        plan = self.plan
        params = tuple(sorted((k, v) for k, v in plan.params.items() if not k.startswith(SHAPELESS)))
        resumed = (plan.resume.batch_size, plan.resume.accumulate) if plan.resume else None
        return params, plan.cfg.epochs > 1, resumed, plan.tracking_uri, plan.execution, self.world


@dataclasses.dataclass
class Shape:
    """One job shape of this process's dry run, planned once for every job of it: the micro-batch and accumulation
    it trains with (``cfg``: its first job's config at them, checked as :func:`resolve_batch` checks but for memory),
    its predicted peak, whether that fits the memory budget (``fits``: :func:`~src.jobs.dry_run_total.fits_text`) and,
    once a job of it is to run, its training rate."""

    number: int
    first: Placed
    cfg: Config
    peak_mb: float
    fits: str = ""
    rate: Rate | None = None

    def describe(self) -> str:
        cfg, execution = self.cfg, self.first.plan.execution
        graphed = " graphed" if execution.graphed else ""
        once = ", 1 epoch" if cfg.epochs == 1 else ""  # no copy of the best weights
        return (
            f"batch_size={cfg.batch_size} accumulate={cfg.accumulate} model={cfg.model.name} data.size={cfg.data.size}"
            f" {execution.dtype_name} on {execution.device}{graphed}, {execution.threads} threads x {self.first.world}"
            f"{once}"
        )

    def training_rate(self) -> Rate:
        if self.rate is None:
            first = self.first
            self.rate = training_rate(first.plan, self.cfg, first.gpus, first.world)
        return self.rate


SHAPES: dict[tuple, Shape] = {}  # this process's job shapes, by Placed.shape
Named = Callable[[int], contextlib.AbstractContextManager]  # a job's number -> the block its errors are named in


def shapes(jobs: list[Placed], named: Named = lambda num: contextlib.nullcontext()) -> list[Shape]:
    """Each job's :class:`Shape`: those this process planned before reused, each new one planned once (its batch and
    peak; its rate where one of its jobs is to run) within ``named`` of its first job (its errors naming the job),
    with one line naming it and its jobs."""
    new: dict[tuple, list[Placed]] = {}
    for job in jobs:
        if job.shape not in SHAPES:
            new.setdefault(job.shape, []).append(job)
    for key, alike in new.items():
        first = alike[0]
        with named(first.plan.job_num):
            cfg = resolve_batch(first.plan, first.world, probe=False, memory=False)[0]  # listed, not refused
            peak = predicted(cfg, first.plan.execution).total_mb
            fits = fits_text(*budget_fit(cfg, first.plan.execution, first.world, peak))
            shape = Shape(len(SHAPES) + 1, first, cfg, peak, fits)
            if any(not job.plan.finished for job in alike):
                shape.training_rate()
        SHAPES[key] = shape
        numbers = spans([job.plan.job_num for job in alike])
        log.info("planned job shape %d (%s): jobs %s", shape.number, shape.describe(), numbers)
    return [SHAPES[job.shape] for job in jobs]


def spans(numbers: list[int]) -> str:
    """``0, 2, 4`` and ``0-199``: ``numbers`` (ascending), three or more in a row as a span."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


def estimates(jobs: list[Placed], named: Named = lambda num: contextlib.nullcontext()) -> list[JobEstimate]:
    """Each job's line: its action, and its shape's batch, peak, fit to the memory budget and rate (:func:`shapes`)."""
    listed = []
    for job, shape in zip(jobs, shapes(jobs, named), strict=True):
        plan = job.plan
        cfg = dataclasses.replace(plan.cfg, batch_size=shape.cfg.batch_size, accumulate=shape.cfg.accumulate)
        if plan.finished:
            action, minutes, estimate = f"skip: finished run {plan.finished.info.run_id}", 0.0, "0 min"
        else:
            rate = shape.training_rate()
            action = f"resume run {plan.resume.run_id}" if plan.resume else "run"
            minutes = job_seconds(cfg, job.world, rate.per_s, plan.resume) / 60
            estimate = rate.estimate(minutes)
        step = "graphed" if plan.execution.graphed else "eager"
        listed.append(
            JobEstimate(
                plan.job_num, plan.run_name, action, cfg.batch_size, shape.peak_mb, minutes, estimate, step, shape.fits
            )
        )
    return listed


def placed(plan: Plan, gpus: tuple[int, ...], external: dist.Rank | None = None) -> Placed:
    plan = plan.on(gpus)
    return Placed(plan, gpus, job_world(plan.cfg, gpus, external))


def report(plan: Plan, external: dist.Rank | None) -> float:
    """Print the job's line (and, outside a multirun, the total) after the checks a real job makes before it trains
    (a job to skip makes none), creating no run and no store; a torchrun / SLURM rank other than 0 prints nothing.
    Returns NaN: no objective."""
    if external is not None and not external.is_main:
        return math.nan
    if not plan.finished:
        check_store(plan.tracking_uri)
        check_file(plan.cfg.data)
    with job_gpus(HydraConfig.get(), plan.execution.device) as gpus:
        (listed,) = estimates([placed(plan, gpus, external)])
    print(listed.line(), flush=True)
    if plan.multirun:
        with atomic_path(Path(HydraConfig.get().sweep.dir, FOLDER, f"{plan.job_num}.json")) as partial:
            partial.write_text(json.dumps(dataclasses.asdict(listed)))
    else:
        print(total([listed]), flush=True)
    return math.nan


def lists_here(config: DictConfig) -> bool:
    """Whether a dry sweep is listed in its main process (:func:`list_sweep`): a grid sweep (every job known before
    any runs) whose launcher would run its jobs in this process, one after another (Hydra's basic launcher)."""
    launcher = str(config.hydra.launcher._target_)
    return (
        config.dry_run
        and config.hydra.sweeper._target_.endswith(".BasicSweeper")
        and launcher.endswith(".BasicLauncher")
    )


def list_sweep(
    hydra_cfg: DictConfig, plans: list[Plan], named: dict[int, Callable[[], contextlib.AbstractContextManager]]
) -> None:
    """Print each job's line, then the total, from the plans the sweep's checks made (:func:`lists_here`; the store
    and each job's data checked there): each job composed and planned once, not again by the launcher, and each
    shape planned once, its errors named by ``named`` of its first job."""
    with contextlib.ExitStack() as holding:
        jobs = [placed(plan, holding.enter_context(job_gpus(hydra_cfg, plan.execution.device))) for plan in plans]
        listed = estimates(jobs, lambda num: named[num]())
    for job in listed:
        print(job.line(), flush=True)
    print(total(listed, jobs_at_once()), flush=True)


def comparable(run: Run) -> bool:
    """Whether a finished run's speed is a basis: not contended, and enough steps timed (runs logged before these
    were recorded count)."""
    steps = run.data.metrics.get("perf/steps_timed", MIN_TIMED_STEPS)
    return run.data.tags.get("perf.contended") != "true" and steps >= MIN_TIMED_STEPS


def training_rate(plan: Plan, cfg: Config, gpus: tuple[int, ...], world: int) -> Rate:
    """Training samples/s of ``cfg`` on ``world`` ranks: from the finished runs with the same speed-relevant params on
    this host, device type and thread count, else from its shape's step time (cached, or timed now), the step as
    the run's execution takes it (eager or graphed, in its compute dtype)."""
    execution = plan.execution
    threads = execution.threads
    speed = {k: v for k, v in plan.run_params(cfg, world).items() if not k.startswith(NOT_SPEED)}
    found = finished_runs(
        plan.tracking_uri,
        cfg.mlflow.experiment,
        f"params.`model.name` = '{cfg.model.name}' and tags.host = '{host()}'",
    )
    rates = [
        run.data.metrics.get(MEDIAN_RATE, run.data.metrics[RATE])
        for run in found
        if RATE in run.data.metrics
        and comparable(run)
        and run.data.tags.get("device", "").split(":")[0] == execution.device.type
        and run.data.tags.get("num_threads") == str(threads)
        and all(run.data.params.get(key) == value for key, value in speed.items())
    ]
    if rates:
        basis = f"from {len(rates)} finished run{'s' if len(rates) > 1 else ''}"
        return Rate(statistics.median(rates), basis, runs=tuple(rates))
    shape = {k: v for k, v in speed.items() if k not in ("amp", "amp_dtype")} | {"precision": str(execution.dtype)}
    if execution.graphed:
        shape["step"] = "graphed"
    timing = step_time(shape, execution.device, threads, lambda: one_step(cfg, execution, gpus, world))
    basis = f"timed {timing.steps} steps{', machine busy' if timing.busy else ''}"
    return Rate(cfg.batch_size * cfg.accumulate * world / timing.seconds, basis, spread=timing.spread)


def one_step(cfg: Config, execution: Execution, gpus: tuple[int, ...], world: int) -> Callable[[], float]:
    """A function timing one optimizer step of ``cfg`` per call, in seconds, as ``execution`` runs it; with its threads
    and determinism (``seed_everything``); DDP and DP: one device's step. Eager: one micro-step (a random batch of its
    shape, augmented, forward and backward) and one optimizer step, each timed to the device's end, as ``accumulate``
    x the micro-step + the optimizer step. Graphed: the replayed step, after its eager warm-up and capture."""
    seed_everything(cfg, execution.threads)
    timed = dataclasses.replace(cfg, epochs=1, warmup_epochs=0, class_weights=False, fault=FaultConfig())
    data, device = cfg.data, execution.device
    n = cfg.batch_size * (1 if cfg.parallel.mode is ParallelMode.ddp else world)  # parallel=dp: a batch spans GPUs
    images = torch.randint(0, 256, (n, data.in_channels, *[data.size] * 3), dtype=torch.uint8)
    labels = torch.arange(n) % data.num_classes
    trainer = build_trainer(timed, execution, gpus=gpus, splits={"train": (images, labels)})
    micro_steps = itertools.count()

    def batches() -> list[Batch]:
        return [trainer.train_batch((images, labels), 0, next(micro_steps)) for _ in range(cfg.accumulate)]

    def graphed() -> float:
        start = time.perf_counter()
        trainer.train_step(batches())
        synchronize(device)
        return time.perf_counter() - start

    def eager() -> float:
        start = time.perf_counter()
        trainer.micro_step(*trainer.train_batch((images, labels), 0, next(micro_steps)))
        synchronize(device)
        middle = time.perf_counter()
        trainer.optimizer_step()
        synchronize(device)
        return cfg.accumulate * (middle - start) + time.perf_counter() - middle

    if trainer.step_graph is None:
        return eager
    for _ in range(WARMUP_STEPS + 1):  # the eager warm-up steps and the capture: not the step a run repeats
        graphed()
    return graphed


def job_seconds(cfg: Config, world: int, rate: float, resume: Resume | None = None) -> float:
    """Seconds to train and evaluate ``cfg`` on ``world`` ranks (what is left of it after ``resume``'s checkpoint) at
    ``rate`` training samples/s: each evaluated sample costs :data:`EVAL_COST` of a trained one; with DDP rank 0
    evaluates alone."""
    ddp = cfg.parallel.mode is ParallelMode.ddp
    sizes = split_sizes(cfg.data)
    batches = sizes["train"] // (cfg.batch_size * world)  # a DDP rank's shard: n // world (loaders.SeededPermutation)
    steps = steps_per_epoch(cfg, batches)
    done_epochs, done_steps = (resume.epoch, resume.step) if resume else (0, 0)
    trained = ((cfg.epochs - done_epochs) * steps - done_steps) * cfg.batch_size * cfg.accumulate * world
    eval_batch = cfg.batch_size * (1 if ddp else world)

    def evaluated(split: str) -> int:
        return sizes[split] if cfg.limit_batches is None else min(sizes[split], cfg.limit_batches * eval_batch)

    evaluated_samples = (cfg.epochs - done_epochs) * evaluated("val") + evaluated("test")
    return trained / rate + EVAL_COST * evaluated_samples / (rate / world if ddp else rate)
