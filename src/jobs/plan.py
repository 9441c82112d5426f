"""What a job will do, decided before any work starts: go on with a run (``resume=``, or a requeued job's own
checkpoint), train a logged run's config again (``rerun=``), skip a config that already has a FINISHED run
(``skip_finished``; by default one trained by this code), or train; the config validated against this machine. One
frozen :class:`Plan`."""

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
from src.errors import UsageError
from src.jobs import resume as resumption
from src.jobs.rerun import rerun_config
from src.perf.autobatch import derived_batch, fit_batch, predicted_batch
from src.resolve import validate
from src.tracking.identity import code_fingerprint, config_hash, flatten, run_name
from src.tracking.store import ensure_store, finished_run, tracking_uri
from src.training import checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    cfg: Config
    device: torch.device
    params: dict[str, str]  # the flattened config: the run's params, and what its config_hash is taken of
    stored: dict[str, Any]  # the resolved config, saved with each checkpoint
    overrides: list[str]
    job_dir: Path  # this job's Hydra folder
    output_dir: Path  # where the run's files go: the resumed run's folder, else the job's
    log_file: Path
    multirun: bool
    job_num: int
    resume: resumption.Resume | None = None
    rerun_of: str | None = None
    finished: mlflow.entities.Run | None = None  # skip_finished found this run: train nothing

    @property
    def config_hash(self) -> str:
        return config_hash(self.params)

    @property
    def run_name(self) -> str:
        return run_name(self.overrides, self.config_hash)

    @property
    def tracking_uri(self) -> str:
        return tracking_uri(self.cfg)

    def run_params(self, cfg: Config, world: int) -> dict[str, str]:
        """The params of a run training ``cfg`` (this plan's config, sized) on ``world`` ranks."""
        return {
            **self.params,
            "batch_size": str(cfg.batch_size),
            "accumulate": str(cfg.accumulate),
            "effective_batch_size": str(cfg.batch_size * cfg.accumulate * world),
            "world_size": str(world),
        }


def plan_job(cfg: DictConfig, hydra_cfg: DictConfig) -> Plan:
    """Raises :class:`UsageError` for anything that cannot work, before any work starts."""
    job_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    cfg, resume = resume_point(cfg, job_dir, overrides)
    if rerun_of := cfg.rerun:
        cfg = rerun_config(cfg, overrides, ensure_store(tracking_uri(cfg)))
        save_job_config(cfg, job_dir)  # the artifact says what this run trained
    typed, device = validate(cfg)
    params = flatten(cfg)
    finished = (
        skipped_for(typed, config_hash(params), overrides) if typed.skip_finished and not (rerun_of or resume) else None
    )
    return Plan(
        typed,
        device,
        params,
        OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        overrides,
        job_dir,
        resume.folder if resume else job_dir,
        job_dir / f"{hydra_cfg.job.name}.log",
        hydra_cfg.mode.name == "MULTIRUN",
        OmegaConf.select(hydra_cfg, "job.num", default=0),
        resume,
        rerun_of,
        finished,
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


def resume_point(cfg: DictConfig, job_dir: Path, overrides: list[str]) -> tuple[DictConfig, resumption.Resume | None]:
    """The run to go on with, and its config: ``resume=<folder | run id>``, or the unfinished run whose checkpoint
    this job's own folder holds (a job requeued by SLURM / submitit)."""
    if not cfg.resume and not (job_dir / checkpoint.FILE).is_file():
        return cfg, None
    client = ensure_store(tracking_uri(cfg))
    if not cfg.resume:
        return cfg, resumption.requeued(cfg, job_dir, client)
    cfg, resume = resumption.explicit(cfg, overrides, client)
    save_job_config(cfg, job_dir)  # the artifact says what this run trains
    return cfg, resume


def save_job_config(cfg: DictConfig, job_dir: Path) -> None:
    if (hydra_dir := job_dir / ".hydra").is_dir():
        OmegaConf.save(cfg, hydra_dir / "config.yaml")


def sized(plan: Plan, world: int, probe: bool = True) -> tuple[Config, dict[str, str]]:
    """The config at the micro-batch and accumulation it trains with, and tags saying how they were chosen: as the
    resumed run trained, else ``batch_size=auto`` (predicted, then probed; ``probe=False``: predicted only, no tags),
    ``derived``, or as given."""
    cfg, resume = plan.cfg, plan.resume
    if resume:
        if resume.world != world:
            raise UsageError(
                f"resume: run {resume.run_id} trained on {resume.world} ranks, this job has {world}: "
                f"resume it with {resume.world} (parallel.nproc, or the launcher's tasks/GPUs)"
            )
        return dataclasses.replace(cfg, batch_size=resume.batch_size, accumulate=resume.accumulate), {}
    if cfg.batch_size == "auto":
        return fit_batch(cfg, plan.device, world) if probe else (predicted_batch(cfg, plan.device, world), {})
    if cfg.batch_size == "derived":
        return derived_batch(cfg, world), {}
    return cfg, {}
