"""Entry point: ``python -m src.train [-m] key=value ...`` trains one composed experiment per job.

The config is resolved and validated once, in the job; ranks get the typed config. The job owns the
MLflow run: it exists before any rank starts and is closed FINISHED or FAILED by the job whatever
the ranks do. Under torchrun or a multi-task SLURM job the ranks are already there; rank 0 owns it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NoReturn

import hydra
import mlflow
import torch
import torch.multiprocessing as mp
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src import checkpoint, dist
from src import config as schema
from src import resume as resumption
from src.autobatch import derived_batch, fit_batch
from src.clinical import class_names, write_eval_artifacts
from src.config import ParallelMode
from src.data import ensure_file, load_splits
from src.engine import resolve_amp_dtype, resolve_device
from src.errors import UsageError
from src.memory import predict
from src.models import MODELS
from src.preemption import EXIT_PREEMPTED, Preempted, PreemptedExit, Preemption
from src.rank_setup import build_trainer, data_parallel_width, flops_per_sample, seed_everything
from src.rerun import rerun_config
from src.tracking import (SKIPPED_TAG, RunLogger, best_metric, config_hash, ensure_store, environment_tags,
                          finished_run, flatten, read_parent_id, tracking_uri)

log = logging.getLogger(__name__)
schema.register()


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


def validate(cfg: DictConfig) -> tuple[schema.Config, torch.device]:
    """Every check that needs no data: raises ``UsageError`` before any work starts."""
    try:
        typed: schema.Config = OmegaConf.to_object(cfg)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if typed.model.name not in MODELS:
        raise UsageError(f"model.name={typed.model.name} is not a registered model: use one of {', '.join(MODELS)}")
    device = resolve_device(typed)
    resolve_amp_dtype(typed, device)
    dist.check(typed, device)
    return typed, device


def check_split_sizes(cfg: schema.Config, world: int) -> None:
    need = cfg.batch_size * cfg.accumulate * world
    have = len(load_splits(cfg.data)["train"][1])
    if need > have:
        raise UsageError(f"batch_size x accumulate x ranks = {need} exceeds the {have} training samples of "
                         f"{cfg.data.name}: lower batch_size or accumulate")


def run_rank(job: Job, rank: dist.Rank, init_method: str = "env://",
             preemption: Preemption | None = None) -> dict[str, float]:
    """One rank's whole training: process group, seeding, model, loaders, resumed state, fit; rank 0 logs to
    the run and checkpoints. Raises :class:`Preempted` on every rank when ``preemption`` stopped it."""
    index = job.gpus[0] if job.gpus else rank.local_rank
    device = torch.device("cuda", index) if job.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if rank.world > 1:
        dist.init_process_group(job.cfg, device, rank, init_method)
        shared = [(job.cfg, job.resume_from)]  # rank 0's: it resolved the config and the checkpoint to resume
        torch.distributed.broadcast_object_list(shared, src=0)
        job = dataclasses.replace(job, cfg=shared[0][0], resume_from=shared[0][1])
    cfg = job.cfg
    try:
        threads = seed_everything(cfg, ranks_on_node=int(os.environ.get("LOCAL_WORLD_SIZE", rank.world)))
        log.info("rank %d/%d on %s with %d threads", rank.rank, rank.world, device, threads)
        trainer = build_trainer(cfg, device, rank, job.gpus, flops_per_sample=flops_per_sample(cfg),
                                predicted_mb=predict(cfg, device).total_mb if rank.is_main else None,
                                checkpoint_to=job.output_dir / checkpoint.FILE if rank.is_main else None,
                                checkpoint_meta=job.checkpoint_meta, preemption=preemption)
        width = data_parallel_width(cfg, job.gpus)
        run = RunLogger(mlflow.MlflowClient(job.tracking_uri), job.run_id) if rank.is_main else None
        amp_dtype = str(resolve_amp_dtype(cfg, device)).removeprefix("torch.") if cfg.amp else "float32"
        if cfg.amp and amp_dtype == "float32" and rank.is_main:
            log.warning("amp=true: this CPU has no native bf16 (avx512_bf16/AMX), where autocast runs ~100x slower; "
                        "training in float32 (amp_dtype=bfloat16 forces it)")
        if run:
            run.set_tags({"amp.dtype": amp_dtype, "mem.source": trainer.memory.source, "device": str(device), "num_threads": str(threads),
                          "perf.peak_source": trainer.peak_source,
                          "perf.peak_tflops_per_device": f"{trainer.peak_total / rank.world / width / 1e12:.6g}"})
        log_metrics = run.log_metrics if run else lambda metrics, step: None
        if job.resume_from:
            trainer.load_state_dict(checkpoint.load(job.resume_from))
            log.info("resumed from %s at epoch %d step %d", job.resume_from, trainer.epoch + 1, trainer.step)
            if run and trainer.last_metrics:  # the checkpoint is written first: its epoch may not be logged yet
                resumption.log_missing(run, trainer.last_metrics, trainer.epoch - 1)
            if run and trainer.epoch == cfg.epochs:  # trained to the end before it stopped: the test may be logged
                log_metrics = functools.partial(resumption.log_missing, run)
        try:
            final = trainer.fit(log_metrics)
        except torch.OutOfMemoryError:
            (job.output_dir / f"oom_rank{rank.rank}.json").write_text(json.dumps(trainer.memory.peak()))
            raise
        if rank.is_main:
            write_eval_artifacts(*trainer.test_predictions, cfg.data.task,
                                 class_names(cfg.data.name, cfg.data.num_classes), job.output_dir / "eval")
            (job.output_dir / "metrics.json").write_text(json.dumps(final, indent=2))
        return final
    finally:
        if rank.world > 1:
            torch.distributed.destroy_process_group()


def spawned_rank(index: int, job: Job, world: int, init_method: str) -> None:
    """Entry of a rank spawned by the job: log like the job does, then :func:`run_rank`."""
    handlers = [logging.StreamHandler(), logging.FileHandler(job.log_file)] if index == 0 else [logging.StreamHandler()]
    logging.basicConfig(level=logging.INFO if index == 0 else logging.WARNING, handlers=handlers,
                        format=f"[%(asctime)s][rank{index}][%(name)s][%(levelname)s] - %(message)s")
    preemption = Preemption()
    with preemption.installed(), contextlib.suppress(Preempted):  # rank 0 checkpointed: exit 0, the job sees it
        run_rank(job, dist.Rank(index, world, index), init_method, preemption)


@contextlib.contextmanager
def visible_gpus(gpus: tuple[int, ...]) -> Iterator[None]:
    """Show processes started inside only ``gpus`` (indices into this process's visible GPUs)."""
    if not gpus:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] for i in gpus)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def spawn_ranks(job: Job, world: int, preemption: Preemption) -> dict[str, float]:
    """Start ``world`` ranks with the ``spawn`` method on a free port; stop signals are passed on to them.

    torch.multiprocessing watches them: when one dies the others are terminated and this raises. The
    process-wide start method is set too: a spawned child restores its parent's, and a joblib (loky)
    worker's own, ``loky``, does not exist in a fresh interpreter. Ranks that stopped on a signal exit 0
    without ``metrics.json``: this raises :class:`Preempted` then.
    """
    init_method = f"tcp://127.0.0.1:{dist.free_port()}"
    mp.set_start_method("spawn", force=True)
    metrics = job.output_dir / "metrics.json"
    metrics.unlink(missing_ok=True)
    with visible_gpus(job.gpus):
        ranks = mp.start_processes(spawned_rank, args=(dataclasses.replace(job, gpus=()), world, init_method),
                                   nprocs=world, start_method="spawn", join=False)
        preemption.forward_to(ranks.processes)
        while not ranks.join():
            pass
    if not metrics.exists():
        raise Preempted(f"the ranks stopped, checkpoint {job.output_dir / checkpoint.FILE}")
    return json.loads(metrics.read_text())


@contextlib.contextmanager
def job_gpus(hydra_cfg: DictConfig) -> Iterator[tuple[int, ...]]:
    """This job's GPUs: all visible ones, or, under a launcher running ``n_jobs`` jobs at once on this
    machine, its own share, held through a slot lock for the job's lifetime."""
    count = torch.cuda.device_count()
    n_jobs = OmegaConf.select(hydra_cfg, "launcher.n_jobs", default=1) if hydra_cfg.mode is RunMode.MULTIRUN else 1
    n_jobs = count if n_jobs == -1 else n_jobs  # joblib's -1: as many jobs as CPUs; here at most one per GPU
    if not count or n_jobs <= 1:
        yield tuple(range(count))
        return
    per_job = max(1, count // n_jobs)
    with dist.gpu_slot(Path(hydra_cfg.sweep.dir), n_jobs) as slot:
        yield tuple((slot * per_job + i) % count for i in range(per_job))


def run_name(overrides: list[str]) -> str:
    return " ".join(overrides)[:250].rstrip() or "defaults"


def read_oom(output_dir: Path) -> dict[str, float] | None:
    """The memory reached by the ranks that ran out of memory (their ``oom_rank<k>.json``), consumed."""
    records = sorted(output_dir.glob("oom_rank*.json"))
    if not records:
        return None
    peaks = [json.loads(path.read_text())["mem/peak_mb"] for path in records]
    for path in records:
        path.unlink()
    return {"mem/peak_mb": max(peaks)}


def halved(cfg: schema.Config) -> schema.Config:
    """Half the micro-batch, twice the accumulation: the same effective batch."""
    return dataclasses.replace(cfg, batch_size=cfg.batch_size // 2, accumulate=cfg.accumulate * 2)


def skip(done: mlflow.entities.Run, cfg: schema.Config, hydra_cfg: DictConfig) -> float:
    """Train nothing: log why, list the job on the sweep's parent run, return the finished run's objective."""
    overrides = list(hydra_cfg.overrides.task)
    log.info("skipping %s: run %s FINISHED with the same config", run_name(overrides), done.info.run_id)
    client = mlflow.MlflowClient(tracking_uri(cfg))
    parent_id = read_parent_id(Path(hydra_cfg.sweep.dir)) if hydra_cfg.mode is RunMode.MULTIRUN else None
    if parent_id:
        RunLogger(client, parent_id).set_tags(
            {f"{SKIPPED_TAG}{hydra_cfg.job.num}": f"{' '.join(overrides)} -> {done.info.run_id}"})
    return best_metric(client, done.info.run_id, cfg.objective)


def resume_point(cfg: DictConfig, hydra_cfg: DictConfig) -> tuple[DictConfig, resumption.Resume | None]:
    """The run to go on with, and its config: ``resume=<folder | run id>``, or the unfinished run whose checkpoint
    this job's own folder holds (a job requeued by SLURM / submitit)."""
    job_dir = Path(hydra_cfg.runtime.output_dir)
    if not cfg.resume and not (job_dir / checkpoint.FILE).is_file():
        return cfg, None
    client = ensure_store(tracking_uri(cfg))
    if not cfg.resume:
        return cfg, resumption.requeued(cfg, job_dir, client)
    cfg, resume = resumption.explicit(cfg, list(hydra_cfg.overrides.task), client)
    if (hydra_dir := job_dir / ".hydra").is_dir():
        OmegaConf.save(cfg, hydra_dir / "config.yaml")  # the artifact says what this run trains
    return cfg, resume


def stop_preempted(run: RunLogger, stop: Preempted, preemption: Preemption) -> NoReturn:
    """A stop signal was honoured and the checkpoint written: the run ends KILLED, tagged resumable; a signal
    submitit sent goes back to submitit (it requeues the job, which resumes by itself); else exit 143."""
    run.set_tags({"preempted": "true", "resume_with": f"resume={run.run_id}"})
    run.finish("KILLED")
    log.warning("preempted (%s): run %s is KILLED and resumable: python -m src.train resume=%s",
                stop, run.run_id, run.run_id)
    try:
        preemption.hand_over()
    except SystemExit as handed:  # submitit requeued the job; its exit code tells its controller so
        raise PreemptedExit(handed.code) from None
    raise PreemptedExit(EXIT_PREEMPTED)


def log_outputs(run: RunLogger, output_dir: Path, job_dir: Path) -> None:
    """The run's folder as artifacts (``.hydra/``, ``metrics.json``, the log) but not its checkpoint; a
    resuming job's own folder (its config and log) under ``resumes/<folder name>``."""
    for path in sorted(output_dir.iterdir()):
        if path.is_dir():
            run.log_artifacts(path, path.name)
        elif path.name != checkpoint.FILE:
            run.client.log_artifact(run.run_id, str(path))
    if job_dir.resolve() != output_dir.resolve():
        run.log_artifacts(job_dir, f"resumes/{job_dir.name}")


def train(cfg: DictConfig) -> float:
    """Validate, then train and evaluate one job into its own MLflow run; returns its ``objective``.

    ``rerun=<id>`` trains that run's logged config again. With ``skip_finished`` a config that already has a
    FINISHED run (same ``config_hash`` tag) is skipped. Out of memory: the run ends FAILED with tag
    ``status=oom``; with ``oom_retry`` a new run follows at half the micro-batch and twice the accumulation;
    otherwise a sweep goes on to its next job.
    """
    hydra_cfg = HydraConfig.get()
    cfg, resume = resume_point(cfg, hydra_cfg)
    rerun_of = cfg.rerun
    if rerun_of:
        cfg = rerun_config(cfg, list(hydra_cfg.overrides.task), ensure_store(tracking_uri(cfg)))
        if (hydra_dir := Path(hydra_cfg.runtime.output_dir) / ".hydra").is_dir():
            OmegaConf.save(cfg, hydra_dir / "config.yaml")  # the artifact says what this run trained
    typed, device = validate(cfg)
    hashed = config_hash(flatten(cfg))
    done = finished_run(tracking_uri(typed), typed.mlflow.experiment, hashed) if typed.skip_finished and not rerun_of \
        and not resume else None
    if done:
        return skip(done, typed, hydra_cfg)
    ddp = typed.parallel.mode is ParallelMode.ddp
    external = dist.external_rank() if ddp else None
    job_dir = Path(hydra_cfg.runtime.output_dir)
    output_dir = resume.folder if resume else job_dir
    job = Job(typed, device.type, None, tracking_uri(typed), output_dir, job_dir / f"{hydra_cfg.job.name}.log")
    preemption = Preemption()
    if external is not None and not external.is_main:  # torchrun / SLURM rank > 0: train, log nothing
        with preemption.installed():
            try:
                run_rank(job, external, preemption=preemption)
            except Preempted:
                raise PreemptedExit(EXIT_PREEMPTED) from None
        return float("nan")

    client = ensure_store(job.tracking_uri)
    ensure_file(typed.data)
    multirun = hydra_cfg.mode is RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    with job_gpus(hydra_cfg) if device.type == "cuda" else contextlib.nullcontext(()) as gpus:
        world = external.world if external else dist.world_size(typed, gpus) if ddp else data_parallel_width(typed, gpus)
        auto_tags = {}
        if resume:  # the micro-batch and accumulation it trained with, whatever chose them
            typed = dataclasses.replace(typed, batch_size=resume.batch_size, accumulate=resume.accumulate)
            if resume.world != world:
                raise UsageError(f"resume: run {resume.run_id} trained on {resume.world} ranks, this job has {world}: "
                                 f"resume it with {resume.world} (parallel.nproc, or the launcher's tasks/GPUs)")
        elif typed.batch_size == "auto":
            typed, auto_tags = fit_batch(typed, device, world)
        elif typed.batch_size == "derived":
            typed = derived_batch(typed, world)
        job = dataclasses.replace(job, cfg=typed)
        check_split_sizes(typed, world)
        retry_of = None
        while True:
            params = {**flatten(cfg), "batch_size": str(job.cfg.batch_size), "accumulate": str(job.cfg.accumulate),
                      "effective_batch_size": str(job.cfg.batch_size * job.cfg.accumulate * world),
                      "world_size": str(world)}
            run = resumption.reopen(client, resume) if resume else RunLogger.start(
                client, typed.mlflow.experiment, run_name(overrides), params,
                tags={"config_hash": hashed, "overrides": " ".join(overrides),
                      "output_dir": str(output_dir.resolve()), **({"retry_of": retry_of} if retry_of else {}),
                      **({"rerun_of": rerun_of} if rerun_of else {}),
                      **auto_tags, **environment_tags()},
                parent_id=read_parent_id(Path(hydra_cfg.sweep.dir)) if multirun else None)
            meta = {"run_id": run.run_id, "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                    "batch_size": job.cfg.batch_size, "accumulate": job.cfg.accumulate, "world": world}
            job = dataclasses.replace(job, run_id=run.run_id, gpus=gpus, resume_from=resume.path if resume else None,
                                      checkpoint_meta=meta)
            log.info("MLflow run %s in %s; output %s", run.run_id, job.tracking_uri, output_dir)
            try:
                with preemption.installed():
                    final = spawn_ranks(job, world, preemption) if ddp and external is None else \
                        run_rank(job, external or dist.Rank(), preemption=preemption)
                log_outputs(run, output_dir, job_dir)
            except Preempted as stop:
                stop_preempted(run, stop, preemption)
            except BaseException:
                oom = read_oom(output_dir)
                if oom is None:
                    run.finish("KILLED" if sys.exc_info()[0] is KeyboardInterrupt else "FAILED")
                    raise
                retry = job.cfg.oom_retry and job.cfg.batch_size > 1
                run.set_tags({"status": "oom", "retried": str(retry).lower()})
                run.log_metrics({**oom, "mem/predicted_mb": predict(job.cfg, device).total_mb}, step=0)
                run.finish("FAILED")
                message = (f"out of memory at batch_size={job.cfg.batch_size} (peak {oom['mem/peak_mb']:.0f} MiB)")
                if retry:
                    log.warning("%s: retrying with batch_size=%d accumulate=%d", message, job.cfg.batch_size // 2,
                                job.cfg.accumulate * 2)
                    job, retry_of, resume = dataclasses.replace(job, cfg=halved(job.cfg)), run.run_id, None
                    continue
                if multirun:
                    log.error("%s: run %s FAILED (status=oom); the sweep goes on", message, run.run_id)
                    return float("nan")
                raise UsageError(f"{message}: lower batch_size, or set oom_retry=true") from None
            break
    run.finish("FINISHED")
    log.info("test/acc=%.4f test/auc=%.4f in %.1f s", final["test/acc"], final["test/auc"], final["time/total_s"])
    return best_metric(client, run.run_id, typed.objective)


def fail_parent_run(cfg: DictConfig) -> None:
    """A failed job of a sweep marks the sweep's parent run FAILED (its own run is already closed)."""
    hydra_cfg = HydraConfig.get()
    parent_id = read_parent_id(Path(hydra_cfg.sweep.dir)) if hydra_cfg.mode is RunMode.MULTIRUN else None
    if parent_id:
        mlflow.MlflowClient(tracking_uri(cfg)).set_terminated(parent_id, "FAILED")


@hydra.main(config_path=str(Path(__file__).resolve().parent.parent / "conf"), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        return train(cfg)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        fail_parent_run(cfg)
        sys.exit(2)
    except PreemptedExit:  # checkpointed and resumable: the sweep has not failed
        raise
    except BaseException:
        fail_parent_run(cfg)
        raise


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun / SLURM rank > 0: rank 0 owns the output folder
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=stdout"]
    from src.train import main as importable_main  # launchers pickle the task by reference, not __main__'s copy

    importable_main()
