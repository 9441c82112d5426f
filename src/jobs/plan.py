"""What a job will do, decided before any work starts: go on with a run (``resume=``, a requeued job's own
checkpoint, or the unfinished run of this config and code that left one), train a logged run's config again
(``rerun=``), skip a config that already has a FINISHED run (``skip_finished``; by default one trained by this code)
or whose unfinished run a live process trains, or train; the config validated against this machine. One frozen
:class:`Plan`."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from omegaconf import DictConfig, OmegaConf

from src import caches
from src.config import Config
from src.data.files import content_params, split_sizes
from src.errors import UsageError
from src.execution import Execution, validate
from src.jobs.rerun import rerun_config
from src.jobs.resume import Resume, explicit, requeued, resumable
from src.parallel.dist import Rank
from src.parallel.launch import job_device
from src.perf.autobatch import check_fits, check_one_sample, derived_batch, fit_batch, predicted_batch
from src.perf.startup import StartupClock
from src.tracking.identity import code_fingerprint, config_hash, flatten, run_name
from src.tracking.store import ensure_store, finished_run, store_exists, tracking_uri
from src.training import checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    cfg: Config
    execution: Execution  # how its steps execute here: resolved once, read by every part
    params: dict[str, str]  # the flattened config: the run's params, and what its config_hash is taken of
    stored: dict[str, Any]  # the resolved config, saved with each checkpoint
    overrides: list[str]
    run_name: str  # the overrides that change results; a rerun's: the name of the run it repeats
    job_dir: Path  # this job's Hydra folder
    output_dir: Path  # where the run's files go: the resumed run's folder, else the job's
    log_file: Path
    multirun: bool
    job_num: int
    resume: Resume | None = None
    rerun_of: str | None = None
    finished: mlflow.entities.Run | None = None  # skip_finished found this run: train nothing
    busy: str | None = None  # a live process trains an unfinished run of this config (its id): train nothing

    def on(self, gpus: tuple[int, ...]) -> Plan:
        """The plan of a job holding ``gpus`` (:func:`~src.parallel.launch.job_gpus`): it plans its batch and trains its
        first rank on the first."""
        return dataclasses.replace(self, execution=self.execution.on(job_device(self.execution.device, gpus)))

    @property
    def config_hash(self) -> str:
        return config_hash(self.params)

    @property
    def tracking_uri(self) -> str:
        return tracking_uri(self.cfg)

    def run_params(self, cfg: Config, world: int) -> dict[str, str]:
        """The params of a run training ``cfg`` (this plan's config, resolve_batch) on ``world`` ranks."""
        return {
            **self.params,
            "batch_size": str(cfg.batch_size),
            "accumulate": str(cfg.accumulate),
            "effective_batch_size": str(cfg.batch_size * cfg.accumulate * world),
            "world_size": str(world),
        }


def plan_job(cfg: DictConfig, hydra_cfg: DictConfig, external: Rank | None = None) -> Plan:
    """Raises :class:`UsageError` for anything that cannot work, before any work starts; writes nothing.
    ``external``: the rank torchrun / SLURM started this process as; a rank > 0 takes the run to go on with from
    rank 0, not from the store."""
    follower = external is not None and not external.is_main
    job_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    caches.check_folder()
    asked = cfg.resume  # resume=<run> (the run's config, below, says null)
    cfg, resume = resume_point(cfg, job_dir, overrides)
    rerun_of, name = cfg.rerun, None
    if rerun_of:
        cfg, name = rerun_config(cfg, overrides, tracking_uri(cfg))
    typed, execution = validate(cfg, external, resume.threads if resume else None)
    if not (rerun_of or resume) and isinstance(typed.batch_size, int) and typed.effective_batch_size is not None:
        raise UsageError(  # it trained batch_size x accumulate x ranks under another config hash
            f"effective_batch_size={typed.effective_batch_size}: batch_size={typed.batch_size} ignores it (only "
            "batch_size=auto or derived reads it): drop it, or set batch_size=derived"
        )
    params = flatten(cfg) | content_params(typed.data)
    hashed = config_hash(params)
    finished, busy = None, None
    if typed.skip_finished and not rerun_of:
        finished = skipped_for(typed, hashed, overrides)
        if finished and asked:
            raise UsageError(
                f"resume={asked}: run {finished.info.run_id} already FINISHED with this config, so resuming run "
                f"{resume.run_id} would train it twice: rerun={finished.info.run_id} trains it again, or "
                f"skip_finished=false resumes anyway"
            )
        if not (finished or resume or follower) and store_exists(tracking_uri(typed)):
            resume, busy = resumable(ensure_store(tracking_uri(typed)), typed, hashed)
    if not (finished or busy or resume) and (job_dir / checkpoint.BEST_FILE).exists():
        raise UsageError(
            f"{job_dir} holds the tested weights of an earlier run ({checkpoint.BEST_FILE}), which a new run there "
            f"would overwrite: give this job another folder (hydra.run.dir, or hydra.sweep.dir with -m)"
        )
    return Plan(
        cfg=typed,
        execution=execution,
        params=params,
        stored=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        overrides=overrides,
        run_name=name or run_name(overrides, hashed),
        job_dir=job_dir,
        output_dir=resume.folder if resume else job_dir,
        log_file=job_dir / f"{hydra_cfg.job.name}.log",
        multirun=hydra_cfg.mode.name == "MULTIRUN",
        job_num=OmegaConf.select(hydra_cfg, "job.num", default=0),
        resume=resume,
        rerun_of=rerun_of,
        finished=finished,
        busy=busy,
    )


def skipped_for(cfg: Config, hashed: str, overrides: list[str]) -> mlflow.entities.Run | None:
    """The FINISHED run with this config (``skip_finished=config``) that was trained by this code
    (``skip_finished=true``, the ``code_fingerprint`` tag; a run logged without one counts as other code). A run of
    other code is named in one line, and the job trains again."""
    fingerprint = code_fingerprint()
    done = finished_run(tracking_uri(cfg), cfg.mlflow.experiment, hashed, fingerprint)
    logged = done.data.tags.get("code_fingerprint", "none") if done else None
    if done is None or cfg.skip_finished == "config" or logged == fingerprint:
        return done
    log.info(
        "running %s again: run %s FINISHED with this config but other code (code_fingerprint %s -> %s); "
        "skip_finished=config would skip it",
        run_name(overrides, hashed),
        done.info.run_id,
        logged,
        fingerprint,
    )
    return None


def resume_point(cfg: DictConfig, job_dir: Path, overrides: list[str]) -> tuple[DictConfig, Resume | None]:
    """The run to go on with, and its config: ``resume=<folder | run id>``, or the unfinished run whose checkpoint
    this job's own folder holds (a job requeued by SLURM / submitit)."""
    if not cfg.resume and not (job_dir / checkpoint.FILE).is_file():
        return cfg, None
    if not cfg.resume:
        return cfg, requeued(cfg, job_dir, tracking_uri(cfg))
    return explicit(cfg, overrides, tracking_uri(cfg))


def save_job_config(stored: dict[str, Any], job_dir: Path) -> None:
    """The config a job trains (a rerun's or a resumed run's), where its ``.hydra/config.yaml`` artifact says."""
    if (hydra_dir := job_dir / ".hydra").is_dir():
        OmegaConf.save(OmegaConf.create(stored), hydra_dir / "config.yaml")


def resolve_batch(plan: Plan, world: int, probe: bool = True, memory: bool = True) -> tuple[Config, dict[str, str]]:
    """The config at the micro-batch and accumulation it trains with, and tags saying how they were chosen: as the
    resumed run trained, else ``batch_size=auto`` (predicted, then probed; ``probe=False``:
    predicted only, no tags), ``derived``, or as given. Refused where the batch exceeds the training split, or (on a
    CPU, or past ``mem_budget_mb``) a batch not chosen by the prediction is predicted past the memory free; not for
    memory where not ``memory`` (a dry run lists whether each job fits instead: an auto that fits nothing at its
    smallest micro-batch)."""
    cfg, resume = plan.cfg, plan.resume
    if resume:
        if resume.world != world:
            raise UsageError(
                f"resume: run {resume.run_id} trained on {resume.world} ranks, this job has {world}: "
                f"resume it with {resume.world} (parallel.nproc, or the launcher's tasks/GPUs)"
            )
        chosen, tags = dataclasses.replace(cfg, batch_size=resume.batch_size, accumulate=resume.accumulate), {}
    elif cfg.batch_size == "auto":
        execution = plan.execution
        if probe:
            chosen, tags = fit_batch(cfg, execution, world)
        else:
            chosen, tags = predicted_batch(cfg, execution, world, refuse=memory), {}
    else:
        chosen, tags = derived_batch(cfg, world) if cfg.batch_size == "derived" else cfg, {}
    check_split_sizes(chosen, world)
    check_one_sample(chosen)
    if memory and (resume or cfg.batch_size != "auto"):
        check_fits(chosen, plan.execution)
    return chosen, tags


def check_split_sizes(cfg: Config, world: int) -> None:
    need = cfg.batch_size * cfg.accumulate * world
    have = split_sizes(cfg.data)["train"]
    if need > have:
        raise UsageError(
            f"batch_size x accumulate x ranks = {need} exceeds the {have} training samples of "
            f"{cfg.data.name}: lower batch_size or accumulate"
        )


@dataclass(frozen=True)
class Job:
    """What every rank of one job needs, picklable for spawned ranks."""

    cfg: Config
    execution: Execution  # the job's: a rank trains on its own device (run_rank)
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
            execution=plan.execution,
            run_id=run_id,
            tracking_uri=plan.tracking_uri,
            output_dir=plan.output_dir,
            log_file=plan.log_file,
            gpus=gpus,
            resume_from=resume.path if resume else None,
            checkpoint_meta=meta,
            startup=startup,
        )
