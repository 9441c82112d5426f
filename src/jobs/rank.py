"""One rank of a job: process group, seeding, the Trainer and its hooks, resumed state, fit; rank 0 logs to the
job's MLflow run, checkpoints, and writes the evaluation artifacts, the tested weights (``best.pt``) and
``metrics.json``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from src import config as schema
from src.data import load_splits, npz_path, to_input
from src.jobs import resume as resumption
from src.jobs.plan import Plan
from src.jobs.resume import Resume
from src.parallel import dist
from src.parallel.launch import METRICS_FILE
from src.parallel.preemption import Preempted, Preemption
from src.parallel.ranks import data_parallel_width, seed_everything
from src.perf.memory import predicted_memory_metrics
from src.perf.startup import StartupClock
from src.resolve import resolve_amp_dtype
from src.tracking.datasets import dataset_inputs
from src.tracking.logged_model import log_model
from src.tracking.runs import RunLogger
from src.tracking.store import ensure_store
from src.tracking.system_metrics import system_metrics
from src.training import checkpoint
from src.training.build import build_trainer
from src.training.meters import MIN_TIMED_STEPS
from src.training.metrics import class_names, write_eval_artifacts
from src.training.mfu import Mfu
from src.training.trainer import Hooks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What every rank of one job needs, picklable for spawned ranks."""

    cfg: schema.Config
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
    def of(
        cls,
        plan: Plan,
        cfg: schema.Config,
        run_id: str | None = None,
        world: int = 1,
        gpus: tuple[int, ...] = (),
        resume: Resume | None = None,
        startup: StartupClock | None = None,
    ) -> "Job":
        """The job of ``plan`` training ``cfg`` into run ``run_id`` on ``world`` ranks."""
        meta = {
            "run_id": run_id,
            "config": plan.stored,
            "batch_size": cfg.batch_size,
            "accumulate": cfg.accumulate,
            "world": world,
        }
        return cls(
            cfg,
            plan.device.type,
            run_id,
            plan.tracking_uri,
            plan.output_dir,
            plan.log_file,
            gpus,
            resume.path if resume else None,
            meta,
            startup,
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
    threads = seed_everything(cfg, ranks_on_node=int(os.environ.get("LOCAL_WORLD_SIZE", rank.world)))
    log.info("rank %d/%d on %s with %d threads", rank.rank, rank.world, device, threads)
    mfu = Mfu.of(cfg, device, rank.world * data_parallel_width(cfg, job.gpus)) if rank.is_main else None
    extras = (predicted_memory_metrics(cfg, device), mfu) if rank.is_main else ()  # only rank 0's are logged
    hooks = Hooks(
        checkpoint_to=job.output_dir / checkpoint.FILE if rank.is_main else None,
        checkpoint_meta=job.checkpoint_meta,
        preemption=preemption,
        epoch_metrics=extras,
    )
    clock.mark("probes")
    splits = load_splits(cfg.data)
    clock.mark("data")
    trainer = build_trainer(cfg, device, rank, job.gpus, hooks, splits)
    clock.mark("model")
    run = RunLogger(ensure_store(job.tracking_uri), job.run_id) if rank.is_main else None
    amp_dtype = str(resolve_amp_dtype(cfg, device)).removeprefix("torch.") if cfg.amp else "float32"
    if cfg.amp and amp_dtype == "float32" and rank.is_main:
        log.warning(
            "amp=true: this CPU has no native bf16 (avx512_bf16/AMX), where autocast runs ~100x slower; "
            "training in float32 (amp_dtype=bfloat16 forces it)"
        )
    if run:
        run.set_tags(
            {
                "amp.dtype": amp_dtype,
                "mem.source": trainer.memory.source,
                "device": str(device),
                "num_threads": str(threads),
                **mfu.tags(),
            }
        )
        mfu.on_new_peak = lambda peak: run.set_tags(mfu.tags())
    log_metrics = run.log_metrics if run else lambda metrics, step: None
    log_tested = None  # fit's test metrics: with the test set (and the logged model) linked
    if job.resume_from:
        trainer.load_state_dict(checkpoint.load(job.resume_from))
        log.info("resumed from %s at epoch %d step %d", job.resume_from, trainer.epoch + 1, trainer.step)
        if run and trainer.last_metrics:  # the checkpoint is written first: its epoch may not be logged yet
            resumption.log_missing(run, trainer.last_metrics, trainer.epoch - 1)
        if run and trainer.epoch == cfg.epochs:  # trained to the end before it stopped: the test may be logged
            log_metrics = log_tested = functools.partial(resumption.log_missing, run)
    if run:
        inputs = dataset_inputs(cfg.data, npz_path(cfg.data), splits)
        if not job.resume_from:
            run.log_inputs(inputs)
        log_tested = log_tested or functools.partial(tested, run, trainer, splits, inputs[-1].dataset)
    clock.mark("mlflow")
    if run:
        run.log_metrics(clock.metrics(), step=trainer.epoch)
        log.info("start-up %.1f s (%s)", clock.metrics()["time/startup_s"], clock.summary())
    try:
        with system_metrics(cfg, rank, job.run_id, job.tracking_uri, resumed=job.resume_from is not None):
            final = trainer.fit(log_metrics, log_tested)
    except torch.OutOfMemoryError:
        (job.output_dir / f"oom_rank{rank.rank}.json").write_text(json.dumps(trainer.memory.peak()))
        raise
    if rank.is_main:
        write_eval_artifacts(
            *trainer.test_predictions,
            cfg.data.task,
            class_names(cfg.data.name, cfg.data.num_classes),
            job.output_dir / "eval",
        )
        checkpoint.save_weights(trainer.best_state, job.output_dir / checkpoint.BEST_FILE)
        (job.output_dir / METRICS_FILE).write_text(json.dumps(final, indent=2))
        tag_speed_basis(run, trainer, final)
    return final


def tag_speed_basis(run: RunLogger, trainer, final: dict[str, float]) -> None:
    """Tag ``perf.contended`` and say when the run timed too few steps, or was contended, for its speed to compare."""
    run.set_tags({"perf.contended": str(trainer.contended).lower()})
    steps = final.get("perf/steps_timed", 0)
    if steps < MIN_TIMED_STEPS:
        log.warning(
            "only %d steps timed (fewer than %d): this run's speed is no basis for comparison", steps, MIN_TIMED_STEPS
        )
    if trainer.contended:
        log.warning(
            "other processes shared the machine while this run trained (perf/others_cpu): its speed is "
            "no basis for comparison; the run is tagged perf.contended=true"
        )


def tested(run: RunLogger, trainer, splits: dict, test_set, metrics: dict[str, float], step: int) -> None:
    """Log the test metrics, linked to the test split's dataset and, with ``mlflow.log_model``, to the tested
    weights logged first as the run's MLflow model."""
    model_id = None
    if trainer.cfg.mlflow.log_model:
        model_id = log_model(run, trainer.evaluated, to_input(splits["test"][0][:2]), step)
        log.info("logged the tested weights as MLflow model %s (models:/%s)", model_id, model_id)
    test = {key: value for key, value in metrics.items() if key.startswith("test/")}
    run.log_metrics(test, step, model_id, test_set)
    run.log_metrics({key: value for key, value in metrics.items() if key not in test}, step, model_id)


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
