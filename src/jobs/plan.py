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
import torch
from omegaconf import DictConfig, OmegaConf

from src.config import Config
from src.data import content_params
from src.errors import UsageError
from src.jobs.rerun import rerun_config
from src.jobs.resume import Resume, explicit, requeued, resumable
from src.parallel.ranks import ranks_on_node
from src.perf import probe_cache
from src.perf.autobatch import check_fits, check_one_sample, derived_batch, fit_batch, predicted_batch
from src.resolve import check_split_sizes, validate
from src.tracking.identity import code_fingerprint, config_hash, flatten, run_name
from src.tracking.store import ensure_store, finished_run, store_exists, tracking_uri
from src.training import checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    cfg: Config
    device: torch.device
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


def plan_job(cfg: DictConfig, hydra_cfg: DictConfig, follower: bool = False) -> Plan:
    """Raises :class:`UsageError` for anything that cannot work, before any work starts; writes nothing. A
    ``follower`` (a torchrun / SLURM rank > 0) takes the run to go on with from rank 0, not from the store."""
    job_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    probe_cache.check_folder()
    asked = cfg.resume  # resume=<run> (the run's config, below, says null)
    cfg, resume = resume_point(cfg, job_dir, overrides)
    rerun_of, name = cfg.rerun, None
    if rerun_of:
        cfg, name = rerun_config(cfg, overrides, tracking_uri(cfg))
    typed, device = validate(cfg)
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
        device=device,
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


def resolve_batch(plan: Plan, world: int, probe: bool = True) -> tuple[Config, dict[str, str]]:
    """The config at the micro-batch and accumulation it trains with, and tags saying how they were chosen: as the
    resumed run trained (its threads too), else ``batch_size=auto`` (predicted, then probed; ``probe=False``:
    predicted only, no tags), ``derived``, or as given. Refused where the batch exceeds the training split, or (on a
    CPU) a batch not chosen by the prediction is predicted past the memory free."""
    cfg, resume = plan.cfg, plan.resume
    if resume:
        if resume.world != world:
            raise UsageError(
                f"resume: run {resume.run_id} trained on {resume.world} ranks, this job has {world}: "
                f"resume it with {resume.world} (parallel.nproc, or the launcher's tasks/GPUs)"
            )
        chosen = dataclasses.replace(
            cfg,
            batch_size=resume.batch_size,
            accumulate=resume.accumulate,
            num_threads=cfg.num_threads or resume.threads,  # results change with the thread count
        )
        tags = {}
    elif cfg.batch_size == "auto":
        chosen, tags = fit_batch(cfg, plan.device, world) if probe else (predicted_batch(cfg, plan.device, world), {})
    else:
        chosen, tags = derived_batch(cfg, world) if cfg.batch_size == "derived" else cfg, {}
    check_split_sizes(chosen, world)
    check_one_sample(chosen)
    if resume or cfg.batch_size != "auto":
        check_fits(chosen, plan.device, ranks_on_node(chosen, world))
    return chosen, tags
