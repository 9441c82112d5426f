"""Which run to continue: ``resume=<run output folder | MLflow run id>``, a requeued job's own checkpoint, or the
unfinished run of the same config and code that a command run again finds.

A resumed run keeps the config it was checkpointed with (stored in the checkpoint). Next to ``resume=``
the command line may change only keys that do not change results (``mlflow.*``, ``data.root``, ...:
``src.tracking.NOT_HASHED``); ``epochs`` too is refused, since it sets the LR schedule.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from src.config import Config
from src.config.bounded import bounded_tree
from src.errors import UsageError
from src.folders import in_use
from src.jobs.rerun import changed_keys, with_command_line
from src.tracking.identity import NOT_HASHED, code_fingerprint, flatten
from src.tracking.runs import RunLogger, close_orphan, process_tags
from src.tracking.store import find_run, redacted
from src.tracking.sweep import job_parent_id
from src.training import checkpoint

log = logging.getLogger(__name__)


STATE_KEYS = ("run_id", "epoch", "step", "batch_size", "accumulate", "world", "threads", "config")
NOT_RESUMED = ("oom", "diverged")  # status tags of FAILED runs that would fail the same way again


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
    threads: int | None = None  # each rank's CPU threads as trained (None: not recorded, before 2026-11-27)

    @property
    def path(self) -> Path:
        return self.folder / checkpoint.FILE

    @classmethod
    def from_state(cls, state: dict[str, Any], folder: Path) -> Resume:
        if missing := sorted(set(STATE_KEYS) - state.keys()):
            raise checkpoint.Unreadable(
                f"{folder / checkpoint.FILE} is not a medsweep checkpoint (it lacks {', '.join(missing)})"
            )
        return cls(
            state["run_id"],
            folder,
            state["epoch"],
            state["step"],
            state["batch_size"],
            state["accumulate"],
            state["world"],
            state["threads"],
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
    """The config a checkpoint (``state``) was written with, typed by today's schema; a :class:`UsageError` saying
    why where it no longer fits (a key removed since, a value out of today's range), or where it is past the limits of
    an untrusted config (:func:`bounded_tree`: a pickled alias bomb would have hung OmegaConf)."""
    config = bounded_tree(state["config"], "was checkpointed with a config that")
    try:
        stored = OmegaConf.merge(OmegaConf.structured(Config), config)
        OmegaConf.to_object(stored)
    except (OmegaConfBaseException, ValueError) as err:
        raise UsageError(
            f"was checkpointed with a config that does not fit today's schema ({str(err).strip().splitlines()[0]}): "
            "check out its git_commit tag to resume it"
        ) from None
    return stored


def checkpoint_folder(value: str, uri: str) -> Path:
    """The folder ``value`` names: a run output folder (or its checkpoint file), else the ``output_dir`` tag of
    the MLflow run ``value`` in the store at ``uri``."""
    path = Path(value).expanduser()
    if path.is_dir() or path.is_file():
        return path if path.is_dir() else path.parent
    run = find_run(uri, value)
    folder = run.data.tags.get("output_dir") if run else None
    if folder is None:
        raise UsageError(
            f"resume={value} is neither a folder nor a run id in {redacted(uri)}: give the run's "
            f"output folder (it holds {checkpoint.FILE}) or its run id (and the mlflow.tracking_uri "
            f"it logged to)"
        )
    return Path(folder)


def explicit(cfg: DictConfig, overrides: list[str], uri: str) -> tuple[DictConfig, Resume]:
    """``resume=<value>``: the checkpointed run (in the store at ``uri``), and its config with the command line's
    non-result keys."""
    value = str(cfg.resume)
    if cfg.get("rerun"):
        raise UsageError(
            f"resume={value} and rerun={cfg.rerun} cannot be combined: resume continues a run, "
            f"rerun trains a finished run's config again: drop one"
        )
    folder = checkpoint_folder(value, uri)
    if not (folder / checkpoint.FILE).is_file():
        if run_status(uri, value) == "FINISHED":  # its checkpoint deleted (checkpoint.keep=last)
            raise UsageError(
                f"resume={value}: run {value} is already FINISHED, there is nothing to resume: rerun={value} trains "
                f"its config again"
            )
        raise UsageError(
            f"resume={value}: no {checkpoint.FILE} in {folder} (the run stopped before its first "
            f"epoch ended, or is not a medsweep run folder): start the run again without resume"
        )
    try:
        state = checkpoint.load(folder / checkpoint.FILE, mmap=True)
        resume = Resume.from_state(state, folder)
    except checkpoint.Unreadable as err:
        raise UsageError(f"resume={value}: {err}: the run cannot go on from it; start a new run") from None
    if why := not_in_store(uri, state["run_id"]):
        raise UsageError(f"resume={value}: run {state['run_id']} of {folder / checkpoint.FILE} {why}")
    if run_status(uri, state["run_id"]) == "FINISHED":
        raise UsageError(
            f"resume={value}: run {state['run_id']} is already FINISHED, there is nothing to resume: "
            f"rerun={state['run_id']} trains its config again"
        )
    try:
        stored = stored_config(state)
    except UsageError as err:
        raise UsageError(f"resume={value}: run {state['run_id']} {err}") from None
    rebuilt = with_command_line(copy.deepcopy(stored), cfg, changed_keys(overrides))
    changes = result_changes(stored, rebuilt)
    if changes:
        raise UsageError(
            f"resume={value} would change {', '.join(changes)}: a resumed run keeps the config it was "
            f"checkpointed with (epochs too: it sets the LR schedule): drop these overrides, or start "
            f"a new run"
        )
    return rebuilt, resume


def requeued(cfg: DictConfig, output_dir: Path, uri: str) -> Resume | None:
    """The unfinished run whose checkpoint this job's own folder holds, when it has this job's config: a job
    requeued by SLURM / submitit (same config, same folder) goes on by itself."""
    path = output_dir / checkpoint.FILE
    if not path.is_file():
        return None
    try:
        state = checkpoint.load(path, mmap=True)
        resume = Resume.from_state(state, output_dir)
    except checkpoint.Unreadable as err:
        log.warning("%s: a run this job trains replaces it", err)
        return None
    try:
        why = not_in_store(uri, state["run_id"])
        if why is None and (changes := result_changes(stored_config(state), cfg)):
            why = f"was trained with {', '.join(changes[:3])}: resume it alone (resume={output_dir})"
    except UsageError as err:
        why = str(err)
    if why:
        raise UsageError(
            f"{path} holds the checkpoint of run {resume.run_id}, which a new run in this folder would overwrite; the "
            f"run {why}, or give this job another folder (hydra.run.dir, or hydra.sweep.dir with -m)"
        )
    if run_status(uri, resume.run_id) == "FINISHED":
        log.warning("%s holds the checkpoint of FINISHED run %s: a new run replaces it", path, resume.run_id)
        return None
    log.info(
        "resuming run %s from %s (epoch %d step %d): this job's folder holds its checkpoint (requeued job)",
        resume.run_id,
        path,
        resume.epoch + 1,
        resume.step,
    )
    return resume


def resumable(client: mlflow.MlflowClient, cfg: Config, hashed: str) -> tuple[Resume | None, str | None]:
    """The latest unfinished run of this config (``config_hash`` tag ``hashed``) and this code that can go on: its
    folder holds its checkpoint and no live process holds the folder. Else ``(None, <run id>)`` when a live process
    trains such a run now, or ``(None, None)``. Each other unfinished run that left a checkpoint is named in a line,
    with why it is not resumed."""
    experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
    if experiment is None:
        return None, None
    unfinished = client.search_runs(
        [experiment.experiment_id],
        f"tags.config_hash = '{hashed}' and attributes.status != 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    for run in unfinished:
        folder = Path(run.data.tags.get("output_dir", ""))
        if not run.data.tags.get("output_dir"):
            continue
        if in_use(folder):  # checkpointed or not yet: a second command of the same sweep must not train it again
            log.info(
                "run %s of this config is training now (%s is in use): this job trains nothing", run.info.run_id, folder
            )
            return None, run.info.run_id
        if close_orphan(client, run, folder):
            log.warning("run %s of this config was RUNNING, its process gone: closed KILLED", run.info.run_id)
        if not (folder / checkpoint.FILE).is_file():
            continue
        try:
            resume = Resume.from_state(checkpoint.load(folder / checkpoint.FILE, mmap=True), folder)
            why = not_resumed(run, resume)
        except checkpoint.Unreadable as err:
            resume, why = None, str(err)
        if why is None:
            log.info(
                "resuming run %s (%s) of this config from %s (epoch %d step %d): skip_finished=false trains a new run",
                run.info.run_id,
                run.info.status,
                folder / checkpoint.FILE,
                resume.epoch + 1,
                resume.step,
            )
            return resume, None
        size = (folder / checkpoint.FILE).stat().st_size / 1e6
        log.warning(
            "run %s (%s) of this config left %s (%.0f MB), not resumed: %s; delete it when it is of no use",
            run.info.run_id,
            run.info.status,
            folder / checkpoint.FILE,
            size,
            why,
        )
    return None, None


def earlier_twin(client: mlflow.MlflowClient, cfg: Config, run_id: str) -> str | None:
    """A run of this new run's config started before it (ties: the smaller id) that a live process trains, or that
    FINISHED as ``skip_finished`` would skip: two commands planned the config at once, each finding no run of it. The
    later run goes; the earlier one's id. A run that had this run's folder is no twin: this process holds it."""
    mine = client.get_run(run_id)
    hashed, fingerprint = mine.data.tags["config_hash"], mine.data.tags["code_fingerprint"]
    for other in client.search_runs([mine.info.experiment_id], f"tags.config_hash = '{hashed}'"):
        if (other.info.start_time, other.info.run_id) >= (mine.info.start_time, run_id):
            continue
        folder = other.data.tags.get("output_dir")
        if other.info.status == "FINISHED":
            if cfg.skip_finished == "config" or other.data.tags.get("code_fingerprint") == fingerprint:
                return other.info.run_id
        elif folder and folder != mine.data.tags["output_dir"] and in_use(Path(folder)):
            return other.info.run_id
    return None


def not_resumed(run: mlflow.entities.Run, resume: Resume) -> str | None:
    """Why an unfinished run of this config does not go on from ``resume`` (its checkpoint), or None."""
    if resume.run_id != run.info.run_id:
        return f"the checkpoint is run {resume.run_id}'s"
    if (status := run.data.tags.get("status")) in NOT_RESUMED:
        return f"it ended status={status}, and would again"
    if (logged := run.data.tags.get("code_fingerprint")) != code_fingerprint():
        return f"other code trained it ({logged} -> {code_fingerprint()}); resume={run.info.run_id} goes on anyway"
    return None


def not_in_store(uri: str, run_id: str) -> str | None:
    """Why a checkpoint's run cannot go on in the store at ``uri`` (not there, or deleted), with the fix; None where
    it can."""
    run = find_run(uri, run_id)
    if run is None:
        return f"is not in {redacted(uri)}: set mlflow.tracking_uri to the store it logged to"
    if run.info.lifecycle_stage == "deleted":
        return f"is deleted in {redacted(uri)}: restore it (mlflow runs restore --run-id {run_id})"
    return None


def run_status(uri: str, run_id: str) -> str | None:
    run = find_run(uri, run_id)
    return run.info.status if run else None


def reopen(client: mlflow.MlflowClient, resume: Resume) -> RunLogger:
    """Set the run back to RUNNING, count the resume in its tags (a ``status`` tag of how it failed removed), and move
    it under the parent run of the sweep that resumes it (its report covers the jobs it trained)."""
    run = RunLogger(client, resume.run_id)
    tags = client.get_run(resume.run_id).data.tags
    client.update_run(resume.run_id, status="RUNNING")
    if "status" in tags:  # how it failed before (no_space ...): no longer so
        client.delete_tag(resume.run_id, "status")
    parent = {MLFLOW_PARENT_RUN_ID: parent_id} if (parent_id := job_parent_id()) else {}
    run.set_tags(
        {
            "preempted": "false",
            "resumes": str(int(tags.get("resumes", "0")) + 1),
            "resumed_at": f"epoch {resume.epoch + 1} step {resume.step}",
            **process_tags(),
            **parent,
        }
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
