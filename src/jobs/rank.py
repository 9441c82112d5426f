"""One rank of a job: process group, seeding, the Trainer and its hooks, resumed state, fit; the main rank
checkpoints and reports (:mod:`src.jobs.reporting`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging

import torch

from src.data.loaders import load_splits
from src.execution import Execution
from src.jobs.plan import Job
from src.jobs.reporting import MainReporter, Reporter
from src.parallel import dist
from src.parallel.preemption import Preempted, Preemption
from src.parallel.ranks import data_parallel_width, seed_everything
from src.perf.autobatch import cap_to_budget
from src.perf.startup import StartupClock
from src.tracking.system_metrics import system_metrics
from src.training import checkpoint
from src.training.build import build_trainer
from src.training.metrics import load_libraries
from src.training.trainer import Diverged, Hooks

log = logging.getLogger(__name__)


def placed(job: Job, local_rank: int) -> Execution:
    """``job``'s execution on the GPU this process trains on (the job's first, else ``local_rank``), made the current
    device and capped to ``mem_budget_mb``; on the CPU as it is."""
    execution = job.execution
    if execution.device.type == "cuda":
        execution = execution.on(torch.device("cuda", job.gpus[0] if job.gpus else local_rank))
        torch.cuda.set_device(execution.device)
        cap_to_budget(job.cfg, execution.device)
    return execution


def run_rank(
    job: Job, rank: dist.Rank, store_address: str | None = None, preemption: Preemption | None = None
) -> dict[str, float]:
    """One rank's whole training. Raises :class:`Preempted` on every rank when ``preemption`` stopped it."""
    execution = placed(job, rank.local_rank)
    if rank.world > 1:
        dist.init_process_group(job.cfg, execution.backend, rank, store_address)
        # rank 0's: the config, execution and checkpoint it resolved, its run
        shared = [(job.cfg, job.execution, job.resume_from, job.run_id)]
        torch.distributed.broadcast_object_list(shared, src=0)
        cfg, execution_of_rank0, resume_from, run_id = shared[0]
        job = dataclasses.replace(job, cfg=cfg, execution=execution_of_rank0, resume_from=resume_from, run_id=run_id)
        execution = execution_of_rank0.on(execution.device)
    preemption = preemption or Preemption()
    if rank.world > 1:
        preemption.stop_together()
    try:
        return train_rank(job, rank, execution, preemption)
    finally:
        if rank.world > 1:
            torch.distributed.destroy_process_group()


def train_rank(job: Job, rank: dist.Rank, execution: Execution, preemption: Preemption) -> dict[str, float]:
    """One rank's training on ``execution`` (the job's, on this rank's device)."""
    cfg, clock, device = job.cfg, job.startup or StartupClock.begin(), execution.device
    clock.mark("launch")
    if rank.is_main:  # evaluation's libraries, before the memory baseline: in every job's alike, not the first's peak
        load_libraries()
        clock.imported()
    seed_everything(cfg, execution.threads)
    log.info("rank %d/%d on %s with %d threads", rank.rank, rank.world, device, execution.threads)
    world = rank.world * data_parallel_width(cfg, job.gpus)
    reporter = MainReporter(job, execution, world) if rank.is_main else Reporter()
    hooks = Hooks(
        checkpoint_to=job.output_dir / checkpoint.FILE if rank.is_main else None,
        checkpoint_meta={**job.checkpoint_meta, "threads": execution.threads},  # a resumed run keeps them
        preemption=preemption,
        epoch_metrics=reporter.epoch_metrics,
    )
    clock.mark("probes")
    splits = load_splits(cfg.data)
    clock.mark("data")
    trainer = build_trainer(cfg, execution, rank, job.gpus, hooks, splits)
    clock.mark("model")
    reporter.started(trainer, splits)
    if job.resume_from:
        trainer.load_state_dict(checkpoint.load(job.resume_from))
        log.info("resumed from %s at epoch %d step %d", job.resume_from, trainer.epoch + 1, trainer.step)
        reporter.resumed(trainer)
    clock.mark("mlflow")
    reporter.startup(clock, trainer.epoch)
    try:
        resumed = job.resume_from is not None
        with system_metrics(cfg, job.run_id, job.tracking_uri, resumed, node=rank.node, monitors=rank.local_rank == 0):
            final = trainer.fit(reporter.log_metrics, reporter.log_tested)
    except torch.OutOfMemoryError:
        (job.output_dir / f"oom_rank{rank.rank}.json").write_text(json.dumps(trainer.memory.peak()))
        raise
    except Diverged as err:  # a spawned rank's error reaches the job's process as a traceback's text
        (job.output_dir / f"diverged_rank{rank.rank}.txt").write_text(str(err))
        raise
    reporter.finished(trainer, final)
    return final


def spawned_rank(index: int, job: Job, world: int, store_address: str) -> None:
    """Entry of a rank spawned by the job: log like the job does, then :func:`run_rank`."""
    handlers = [logging.StreamHandler(), logging.FileHandler(job.log_file)] if index == 0 else [logging.StreamHandler()]
    logging.basicConfig(
        level=logging.INFO if index == 0 else logging.WARNING,
        handlers=handlers,
        format=f"[%(asctime)s][rank{index}][%(name)s][%(levelname)s] - %(message)s",
    )
    preemption = Preemption()
    with preemption.installed(), contextlib.suppress(Preempted):  # rank 0 checkpointed: exit 0, the job sees it
        run_rank(job, dist.Rank(index, world, index), store_address, preemption)
