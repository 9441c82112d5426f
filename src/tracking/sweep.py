"""A sweep's parent run: opened by the sweep's main process (:class:`src.jobs.sweep.Sweep`), found by its jobs
through a file in the sweep folder, closed with a status from its jobs' runs."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import mlflow
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from mlflow.entities import Run
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig

from src.tracking.identity import code_fingerprint, run_name
from src.tracking.runs import RunLogger, close_orphan, environment_tags, user_tags
from src.tracking.store import search_all, tracking_uri
from src.tracking.ui import log_links

log = logging.getLogger(__name__)

PARENT_ID_FILE = "mlflow_parent_run_id"
RUN_ID = re.compile(r"[0-9a-f]{32}")  # what MLflow's stores name a run by (a UUID's hex)
RUNNING_SWEEPS = "tags.role = 'sweep' and attributes.status = 'RUNNING'"  # parent runs not closed
SKIPPED_TAG = "skipped."  # on a sweep's parent run: skipped.<job number> = "<overrides> -> <finished run id>"


def read_parent_id(sweep_dir: Path) -> str | None:
    """The parent run id the sweep wrote in its folder; None where there is none, or the file holds no run id (not
    one a sweep wrote: damaged, or a folder)."""
    try:
        text = (sweep_dir / PARENT_ID_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if RUN_ID.fullmatch(text) else None


def job_parent_id() -> str | None:
    """The parent run of the sweep this Hydra job belongs to; None outside a multirun."""
    hydra_cfg = HydraConfig.get()
    return read_parent_id(Path(hydra_cfg.sweep.dir)) if hydra_cfg.mode is RunMode.MULTIRUN else None


def parent_status(children: list[Run]) -> str:
    """A sweep's status from its jobs' runs: FINISHED when all finished; KILLED when some were preempted (KILLED,
    tagged ``preempted=true``) or their process killed outright (KILLED, ``status=process_gone``: resumable alike)
    and none failed otherwise; else FAILED. An out-of-memory attempt that was retried (FAILED, tagged
    ``retried=true``) is no failure: its retry's run counts."""

    def marked(run: Run, status: str, tag: str) -> bool:
        return run.info.status == status and run.data.tags.get(tag) == "true"

    def gone(run: Run) -> bool:
        return run.info.status == "KILLED" and run.data.tags.get("status") == "process_gone"

    preempted = [run for run in children if marked(run, "KILLED", "preempted") or gone(run)]
    failed = [
        run
        for run in children
        if run.info.status != "FINISHED" and run not in preempted and not marked(run, "FAILED", "retried")
    ]
    return "FAILED" if failed else "KILLED" if preempted else "FINISHED"


def fail_parent_run(cfg: DictConfig) -> None:
    """A failed job of a sweep marks the sweep's parent run FAILED (its own run is already closed; it may have
    failed before it had one), which its close keeps."""
    if parent_id := job_parent_id():
        mlflow.MlflowClient(tracking_uri(cfg)).set_terminated(parent_id, "FAILED")


def open_parent(config: DictConfig, client: mlflow.MlflowClient, sweep_dir: Path) -> RunLogger:
    """The sweep's parent run, its id written to ``sweep_dir`` for the jobs to find; earlier parent runs left RUNNING
    by a sweep that died closed (:func:`close_orphan`)."""
    if experiment := client.get_experiment_by_name(config.mlflow.experiment):
        for run in search_all(client, experiment.experiment_id, RUNNING_SWEEPS):
            folder = Path(run.data.tags.get("sweep_dir", sweep_dir))  # this sweep's own: held by this process
            if close_orphan(client, run, None if folder == sweep_dir.resolve() else folder):
                log.warning("sweep run %s was RUNNING, its process gone: closed KILLED", run.info.run_id)
    parent = RunLogger.start(
        client,
        config.mlflow.experiment,
        run_name(config.hydra.overrides.task, prefix=f"sweep {sweep_dir.name}"),
        params={},
        tags={
            "sweep_dir": str(sweep_dir.resolve()),
            "overrides": " ".join(config.hydra.overrides.task),
            "role": "sweep",
            "code_fingerprint": code_fingerprint(),
            **environment_tags(),
            **user_tags(config.tags),
        },
    )
    (sweep_dir / PARENT_ID_FILE).write_text(parent.run_id)
    log.info("MLflow parent run %s (%s)", parent.run_id, client.tracking_uri)
    return parent


def close_parent(parent: RunLogger, complete: bool, stopped: bool) -> None:
    """Close with :func:`parent_status` of its jobs' runs, unless a job marked it FAILED; a sweep that did not reach
    its end is not FINISHED, one a stop signal ended is KILLED (tagged ``preempted=true``). Logs the UI's links."""
    client, run_id = parent.client, parent.run_id
    run = client.get_run(run_id)
    of_sweep = f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{run_id}'"
    children = search_all(client, run.info.experiment_id, of_sweep)
    if run.info.status != "FAILED":
        status = parent_status(children)
        if status == "FINISHED" and not complete:
            status = "KILLED" if stopped else "FAILED"
        if stopped and status == "KILLED":
            parent.set_tags({"preempted": "true"})
        parent.finish(status)
    log_links(client.tracking_uri, run.info.experiment_id, [r.info.run_id for r in children], of_sweep)
