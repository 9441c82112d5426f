"""One MLflow run, logged in batches, and the environment tags every run carries."""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

import mlflow
import psutil
from mlflow.entities import Dataset, DatasetInput, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from src.atomic import BOOT_ID
from src.folders import in_use
from src.redaction import redact, redact_all
from src.tracking.store import PROJECT_ROOT, experiment_id

BATCH_LIMIT = 100  # MLflow's log_batch cap on params and tags per call
UNIQUE_VIOLATIONS = ("UNIQUE constraint failed", "duplicate key value", "Duplicate entry")  # SQLite, Postgres, MySQL


def environment_tags() -> dict[str, str]:
    import torch

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        commit = "unknown"
    return {
        "git_commit": commit,
        "torch_version": torch.__version__,
        "cuda_version": str(torch.version.cuda),
        **process_tags(),
    }


def user_tags(tags) -> dict[str, str]:
    """The config's ``tags`` (a list of names) as MLflow tags ``<name>=true``: ``tags.<name> = 'true'`` finds them."""
    return {str(name): "true" for name in tags}


def host() -> str:
    """This machine's name, as runs are tagged ``host``."""
    return platform.node()


def process_tags() -> dict[str, str]:
    """The process that holds a run open: its machine (``host``, ``boot_id``) and ``pid`` with its start time."""
    this = psutil.Process()
    return {"host": host(), "boot_id": boot_id(), "pid": f"{this.pid}@{this.create_time():.2f}"}


def boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


def process_gone(tags: dict[str, str]) -> bool:
    """Whether the process that :func:`process_tags` named ended: it ran on this machine since its boot, and no
    process has its pid and start time. False where that cannot be told (another machine, no tags)."""
    pid, _, started = tags.get("pid", "").partition("@")
    here = boot_id()
    if tags.get("host") != host() or here == "unknown" or tags.get("boot_id") != here or not pid.isdigit():
        return False
    try:
        return abs(psutil.Process(int(pid)).create_time() - float(started)) > 1
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, ValueError):
        return False


def close_orphan(client: mlflow.MlflowClient, run: mlflow.entities.Run, folder: Path | None) -> bool:
    """Close ``run`` KILLED, tagged ``status=process_gone``, where it is RUNNING but its process ended without closing
    it (SIGKILL, the out-of-memory killer, a power cut) and no process holds its ``folder`` (None: this process holds
    it); whether it did."""
    if run.info.status != "RUNNING" or not process_gone(run.data.tags) or (folder and in_use(folder)):
        return False
    client.set_tag(run.info.run_id, "status", "process_gone")
    client.set_terminated(run.info.run_id, "KILLED")
    return True


class RunLogger:
    """One MLflow run, logged through the client in batches (one call per epoch, not per value); its name, params and
    tags with any secret of a URI as ``***`` (:func:`src.redaction.redact`)."""

    def __init__(self, client: mlflow.MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def start(
        cls,
        client: mlflow.MlflowClient,
        experiment: str,
        name: str,
        params: dict[str, str],
        tags: dict[str, str],
        parent_id: str | None = None,
    ) -> RunLogger:
        name = redact(name)
        tags = {**tags, MLFLOW_RUN_NAME: name, **({MLFLOW_PARENT_RUN_ID: parent_id} if parent_id else {})}
        run = client.create_run(experiment_id(client, experiment), tags=redact_all(tags), run_name=name)
        logger = cls(client, run.info.run_id)
        items = [Param(k, v) for k, v in redact_all(params).items()]
        for i in range(0, len(items), BATCH_LIMIT):
            client.log_batch(logger.run_id, params=items[i : i + BATCH_LIMIT])
        return logger

    def log_metrics(
        self, metrics: dict[str, float], step: int, model_id: str | None = None, dataset: Dataset | None = None
    ) -> None:
        """One batch; every value linked to a logged model and a dataset when given."""
        now = int(time.time() * 1000)
        name, digest = (dataset.name, dataset.digest) if dataset else (None, None)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step, model_id, name, digest) for k, v in metrics.items()]
        )

    def log_inputs(self, inputs: list[DatasetInput]) -> None:
        """Link the datasets; a second try when a parallel job inserted the same dataset first.

        The store looks a dataset up, then inserts it: two jobs of one experiment doing so at once make the later
        insert break the unique (experiment, name, digest) key. The retry finds the other job's row and links it.
        """
        try:
            self.client.log_inputs(self.run_id, datasets=inputs)
        except MlflowException as e:
            if not any(sign in str(e) for sign in UNIQUE_VIOLATIONS):
                raise
            self.client.log_inputs(self.run_id, datasets=inputs)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in redact_all(tags).items()])

    def log_artifacts(self, folder: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(folder), artifact_path)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)
