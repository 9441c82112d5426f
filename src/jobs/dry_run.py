"""``dry_run=true``: what each job would do, one line per job on stdout, then a total; nothing trains, nothing is
logged, the MLflow store is left as it is (a missing SQLite database is not created). Each line gives the job's
action, predicted peak and estimated minutes, from finished runs or a timed step; with ``-m``,
:class:`src.jobs.dry_run_total.DryRunTotal` prints the total at the sweep's end. Line format and estimate:
docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from mlflow.entities import Run

from src.atomic import atomic_path
from src.config import Config, FaultConfig, ParallelMode
from src.data.files import check_file, split_sizes
from src.execution import Execution
from src.jobs.dry_run_total import FOLDER, JobEstimate, rounded, total
from src.jobs.plan import Plan, resolve_batch
from src.jobs.resume import Resume
from src.parallel import dist
from src.parallel.launch import job_gpus
from src.parallel.ranks import job_world, seed_everything
from src.perf.memory_cache import predicted
from src.perf.step_timing import step_time
from src.tracking.identity import NOT_HASHED
from src.tracking.runs import host
from src.tracking.store import check_store, finished_runs
from src.training.build import build_trainer
from src.training.meters import MIN_TIMED_STEPS, synchronize
from src.training.step_graph import WARMUP_STEPS, Batch
from src.training.trainer import steps_per_epoch

EVAL_COST = 1 / 3  # an evaluated sample costs a third of a trained one: a forward, where training adds a backward (~2)
RATE = "perf/samples_per_s"
MEDIAN_RATE = "perf/samples_per_s_median"  # over the timed epochs; runs logged before it have the last epoch's only
NOT_SPEED = (  # params that do not change the time per sample (device and threads are compared through tags)
    *NOT_HASHED,
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
    "fault.",
    "device",
    "num_threads",
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
        plan = plan.on(gpus)
        world = job_world(plan.cfg, gpus, external)
        cfg = resolve_batch(plan, world, probe=False)[0]
        if plan.finished:
            action, minutes, estimate = f"skip: finished run {plan.finished.info.run_id}", 0.0, "0 min"
        else:
            rate = training_rate(plan, cfg, gpus, world)
            action = f"resume run {plan.resume.run_id}" if plan.resume else "run"
            minutes = job_seconds(cfg, world, rate.per_s, plan.resume) / 60
            estimate = rate.estimate(minutes)
        peak = predicted(cfg, plan.execution).total_mb
        step = "graphed" if plan.execution.graphed else "eager"
        listed = JobEstimate(plan.job_num, plan.run_name, action, cfg.batch_size, peak, minutes, estimate, step)
    print(listed.line(), flush=True)
    if plan.multirun:
        with atomic_path(Path(HydraConfig.get().sweep.dir, FOLDER, f"{plan.job_num}.json")) as partial:
            partial.write_text(json.dumps(dataclasses.asdict(listed)))
    else:
        print(total([listed]), flush=True)
    return math.nan


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
