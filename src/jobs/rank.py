"""One rank of a job: process group, seeding, the Trainer and its hooks, resumed state, fit; the main rank
checkpoints and reports (:mod:`src.jobs.reporting`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from src.config import Config
from src.data import load_splits
from src.jobs.plan import Plan
from src.jobs.reporting import MainReporter, Reporter
from src.jobs.resume import Resume
from src.parallel import dist
from src.parallel.preemption import Preempted, Preemption
from src.parallel.ranks import data_parallel_width, seed_everything
from src.perf.startup import StartupClock
from src.tracking.system_metrics import system_metrics
from src.training import checkpoint
from src.training.build import build_trainer
from src.training.metrics import load_libraries
from src.training.trainer import Diverged, Hooks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What every rank of one job needs, picklable for spawned ranks."""

    cfg: Config
    device_type: str
    run_id: str | None
    tracking_uri: str
    output_dir: Path
    log_file: Path
    gpus: tuple[int, ...] = ()  # devices of an in-process rank; spawned ranks use cuda:<local rank>
    resume_from: Path | None = None  # the checkpoint every rank loads before training
    checkpoint_meta: dict = dataclasses.field(default_factory=dict)  # saved with each checkpoint (run id, config)
    startup: StartupClock | None = None  # the job's start-up so far; the main rank logs it at the first step

    @classmethod
    def from_plan(
        cls,
        plan: Plan,
        cfg: Config,
        run_id: str | None = None,
        world: int = 1,
        gpus: tuple[int, ...] = (),
        resume: Resume | None = None,
        startup: StartupClock | None = None,
    ) -> Job:
        """The job of ``plan`` training ``cfg`` into run ``run_id`` on ``world`` ranks."""
        meta = {
            "run_id": run_id,
            "config": plan.stored,
            "batch_size": cfg.batch_size,
            "accumulate": cfg.accumulate,
            "world": world,
        }
        return cls(
            cfg=cfg,
            device_type=plan.device.type,
            run_id=run_id,
            tracking_uri=plan.tracking_uri,
            output_dir=plan.output_dir,
            log_file=plan.log_file,
            gpus=gpus,
            resume_from=resume.path if resume else None,
            checkpoint_meta=meta,
            startup=startup,
        )


def run_rank(
    job: Job, rank: dist.Rank, store_address: str | None = None, preemption: Preemption | None = None
) -> dict[str, float]:
    """One rank's whole training. Raises :class:`Preempted` on every rank when ``preemption`` stopped it."""
    index = job.gpus[0] if job.gpus else rank.local_rank
    device = torch.device("cuda", index) if job.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if rank.world > 1:
        dist.init_process_group(job.cfg, device, rank, store_address)
        shared = [(job.cfg, job.resume_from, job.run_id)]  # rank 0's: the config and checkpoint it resolved, its run
        torch.distributed.broadcast_object_list(shared, src=0)
        job = dataclasses.replace(job, cfg=shared[0][0], resume_from=shared[0][1], run_id=shared[0][2])
    try:
        return train_rank(job, rank, device, preemption or Preemption())
    finally:
        if rank.world > 1:
            torch.distributed.destroy_process_group()


def train_rank(job: Job, rank: dist.Rank, device: torch.device, preemption: Preemption) -> dict[str, float]:
    cfg, clock = job.cfg, job.startup or StartupClock.begin()
    clock.mark("launch")
    if rank.is_main:  # evaluation's libraries, before the memory baseline: in every job's alike, not the first's peak
        load_libraries()
        clock.imported()
    threads = seed_everything(cfg, ranks_on_node=int(os.environ.get("LOCAL_WORLD_SIZE", rank.world)))
    log.info("rank %d/%d on %s with %d threads", rank.rank, rank.world, device, threads)
    world = rank.world * data_parallel_width(cfg, job.gpus)
    reporter = MainReporter(job, device, world) if rank.is_main else Reporter()
    hooks = Hooks(
        checkpoint_to=job.output_dir / checkpoint.FILE if rank.is_main else None,
        checkpoint_meta={**job.checkpoint_meta, "threads": threads},  # a resumed run keeps them: resume.Resume
        preemption=preemption,
        epoch_metrics=reporter.epoch_metrics,
    )
    clock.mark("probes")
    splits = load_splits(cfg.data)
    clock.mark("data")
    trainer = build_trainer(cfg, device, rank, job.gpus, hooks, splits)
    clock.mark("model")
    reporter.started(trainer, threads, splits)
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
