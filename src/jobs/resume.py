"""Which run to continue: ``resume=<run output folder | MLflow run id>``, or a requeued job's own checkpoint.

A resumed run keeps the config it was checkpointed with (stored in the checkpoint). Next to ``resume=``
the command line may change only keys that do not change results (``mlflow.*``, ``data.root``, ...:
``src.tracking.NOT_HASHED``); ``epochs`` too is refused, since it sets the LR schedule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from omegaconf import DictConfig, OmegaConf

from src.config import Config
from src.errors import UsageError
from src.jobs.rerun import changed_keys, with_command_line
from src.tracking.identity import NOT_HASHED, flatten
from src.tracking.runs import RunLogger
from src.training import checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """A checkpointed, unfinished run: where its checkpoint is and what it trained with."""

    run_id: str
    folder: Path  # the run's output folder: checkpoints, metrics.json and artifacts go on there
    epoch: int  # the next step to train: epoch (0-based) and optimizer step within it
    step: int
    batch_size: int  # as trained (batch_size=auto / derived / an OOM retry chose it)
    accumulate: int
    world: int

    @property
    def path(self) -> Path:
        return self.folder / checkpoint.FILE

    @classmethod
    def from_state(cls, state: dict[str, Any], folder: Path) -> "Resume":
        return cls(
            state["run_id"],
            folder,
            state["epoch"],
            state["step"],
            state["batch_size"],
            state["accumulate"],
            state["world"],
        )


def result_changes(stored: DictConfig, cfg: DictConfig) -> list[str]:
    """``key=stored->new`` for every key that changes results (not ``NOT_HASHED``) and differs."""
    old, new = flatten(stored), flatten(cfg)
    return [
        f"{key}={old.get(key)}->{new.get(key)}"
        for key in sorted(old.keys() | new.keys())
        if not key.startswith(NOT_HASHED) and old.get(key) != new.get(key)
    ]


def stored_config(state: dict[str, Any]) -> DictConfig:
    return OmegaConf.merge(OmegaConf.structured(Config), state["config"])


def checkpoint_folder(value: str, client: mlflow.MlflowClient) -> Path:
    """The folder ``value`` names: a run output folder (or its checkpoint file), else the ``output_dir`` tag of
    the MLflow run ``value``."""
    path = Path(value).expanduser()
    if path.is_dir() or path.is_file():
        return path if path.is_dir() else path.parent
    try:
        folder = client.get_run(value).data.tags.get("output_dir")
    except MlflowException:
        folder = None
    if folder is None:
        raise UsageError(
            f"resume={value} is neither a folder nor a run id in {client.tracking_uri}: give the run's "
            f"output folder (it holds {checkpoint.FILE}) or its run id (and the mlflow.tracking_uri "
            f"it logged to)"
        )
    return Path(folder)


def explicit(cfg: DictConfig, overrides: list[str], client: mlflow.MlflowClient) -> tuple[DictConfig, Resume]:
    """``resume=<value>``: the checkpointed run, and its config with the command line's non-result keys."""
    value = str(cfg.resume)
    if cfg.get("rerun"):
        raise UsageError(
            f"resume={value} and rerun={cfg.rerun} cannot be combined: resume continues a run, "
            f"rerun trains a finished run's config again: drop one"
        )
    folder = checkpoint_folder(value, client)
    if not (folder / checkpoint.FILE).is_file():
        raise UsageError(
            f"resume={value}: no {checkpoint.FILE} in {folder} (the run stopped before its first "
            f"epoch ended, or is not a medsweep run folder): start the run again without resume"
        )
    state = checkpoint.load(folder / checkpoint.FILE, mmap=True)
    status = run_status(client, state["run_id"])
    if status is None:
        raise UsageError(
            f"resume={value}: run {state['run_id']} of {folder / checkpoint.FILE} is not in "
            f"{client.tracking_uri}: set mlflow.tracking_uri to the store it logged to"
        )
    if status == "FINISHED":
        raise UsageError(
            f"resume={value}: run {state['run_id']} is already FINISHED, there is nothing to resume: "
            f"rerun={state['run_id']} trains its config again"
        )
    stored, rebuilt = stored_config(state), with_command_line(stored_config(state), cfg, changed_keys(overrides))
    changes = result_changes(stored, rebuilt)
    if changes:
        raise UsageError(
            f"resume={value} would change {', '.join(changes)}: a resumed run keeps the config it was "
            f"checkpointed with (epochs too: it sets the LR schedule): drop these overrides, or start "
            f"a new run"
        )
    return rebuilt, Resume.from_state(state, folder)


def requeued(cfg: DictConfig, output_dir: Path, client: mlflow.MlflowClient) -> Resume | None:
    """The unfinished run whose checkpoint this job's own folder holds, when it has this job's config: a job
    requeued by SLURM / submitit (same config, same folder) goes on by itself."""
    path = output_dir / checkpoint.FILE
    if not path.is_file():
        return None
    state = checkpoint.load(path, mmap=True)
    status = run_status(client, state["run_id"])
    changes = result_changes(stored_config(state), cfg)
    if status in (None, "FINISHED") or changes:
        why = (
            f"run {state['run_id']} is {status or 'not in this store'}"
            if not changes
            else f"it was trained with {', '.join(changes[:3])}"
        )
        log.warning("%s holds a checkpoint this job does not resume (%s): a run this job trains replaces it", path, why)
        return None
    resume = Resume.from_state(state, output_dir)
    log.info(
        "resuming run %s from %s (epoch %d step %d): this job's folder holds its checkpoint (requeued job)",
        resume.run_id,
        path,
        resume.epoch + 1,
        resume.step,
    )
    return resume


def run_status(client: mlflow.MlflowClient, run_id: str) -> str | None:
    try:
        return client.get_run(run_id).info.status
    except MlflowException:
        return None


def reopen(client: mlflow.MlflowClient, resume: Resume) -> RunLogger:
    """Set the run back to RUNNING and count the resume in its tags."""
    run = RunLogger(client, resume.run_id)
    resumes = int(client.get_run(resume.run_id).data.tags.get("resumes", "0")) + 1
    client.update_run(resume.run_id, status="RUNNING")
    run.set_tags(
        {"preempted": "false", "resumes": str(resumes), "resumed_at": f"epoch {resume.epoch + 1} step {resume.step}"}
    )
    return run


def log_missing(run: RunLogger, metrics: dict[str, float], step: int) -> None:
    """Log the values of ``metrics`` the run lacks at ``step``: a run stopped between writing a checkpoint and
    logging what it holds gets them once, never twice."""
    client = run.client
    missing = {
        key: value
        for key, value in metrics.items()
        if all(m.step != step for m in client.get_metric_history(run.run_id, key))
    }
    if missing:
        run.log_metrics(missing, step)
