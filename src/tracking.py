"""MLflow: the store, one child run per job under one parent run per sweep, batched logging."""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402  (after the telemetry switch)
from hydra.experimental.callback import Callback  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from src.errors import UsageError  # noqa: E402

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACKING_URI = f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"
PARENT_ID_FILE = "mlflow_parent_run_id"
NOT_HASHED = ("mlflow.", "data.root", "data.download", "data.url", "log_every",  # where it logs, caches data
              "skip_finished", "rerun", "resume", "objective")  # how a job is started and what it returns
SKIPPED_TAG = "skipped."  # on a sweep's parent run: skipped.<job number> = "<overrides> -> <finished run id>"
BATCH_LIMIT = 100  # MLflow's log_batch cap on params and tags per call


def tracking_uri(cfg: Any) -> str:
    return cfg.mlflow.tracking_uri or DEFAULT_TRACKING_URI


def ensure_store(uri: str) -> mlflow.MlflowClient:
    """Check the store answers, creating a fresh SQLite database now (once, before any job starts)."""
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=10).close()
        except OSError as err:
            raise UsageError(f"mlflow.tracking_uri={uri} is unreachable ({err}): start the server "
                             f"(mlflow server) or set mlflow.tracking_uri to a reachable store") from None
    elif uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir():
            raise UsageError(f"mlflow.tracking_uri={uri}: folder {folder} does not exist: create it "
                             f"or set mlflow.tracking_uri to another store")
    client = mlflow.MlflowClient(uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as err:  # any store failure is the user's URI to fix
        raise UsageError(f"mlflow.tracking_uri={uri} cannot be used ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}): fix or change mlflow.tracking_uri") from None
    return client


def experiment_id(client: mlflow.MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def flatten(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as ``{"model.name": "densenet121", ...}`` (enums by value)."""
    def walk(node: Any, prefix: str) -> dict[str, str]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        return {prefix[:-1]: str(node)}

    return walk(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "")


def config_hash(params: dict[str, str]) -> str:
    """A short hash of what determines a run's results (not where it logs or caches data)."""
    kept = {k: v for k, v in params.items() if not k.startswith(NOT_HASHED)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def store_exists(uri: str) -> bool:
    """False only for an SQLite store whose database file is not there yet (opening it would create it)."""
    return not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).exists()


def finished_run(uri: str, experiment: str, hashed: str) -> mlflow.entities.Run | None:
    """The latest FINISHED run of ``experiment`` tagged ``config_hash=hashed``; a store not created yet has none."""
    if not store_exists(uri):
        return None
    client = ensure_store(uri)
    found = client.get_experiment_by_name(experiment)
    done = client.search_runs([found.experiment_id], max_results=1, order_by=["attributes.end_time DESC"],
                              filter_string=f"tags.config_hash = '{hashed}' and attributes.status = 'FINISHED'"
                              ) if found else []
    return done[0] if done else None


def best_metric(client: mlflow.MlflowClient, run_id: str, key: str) -> float:
    """The highest value ``key`` reached in the run (the value itself for a metric logged once)."""
    return max(metric.value for metric in client.get_metric_history(run_id, key))


def environment_tags() -> dict[str, str]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {"git_commit": commit, "torch_version": torch.__version__,
            "cuda_version": str(torch.version.cuda), "host": platform.node()}


class RunLogger:
    """One MLflow run, logged through the client in batches (one call per epoch, not per value)."""

    def __init__(self, client: mlflow.MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def start(cls, client: mlflow.MlflowClient, experiment: str, name: str, params: dict[str, str],
              tags: dict[str, str], parent_id: str | None = None) -> "RunLogger":
        tags = {**tags, MLFLOW_RUN_NAME: name, **({MLFLOW_PARENT_RUN_ID: parent_id} if parent_id else {})}
        run = client.create_run(experiment_id(client, experiment), tags=tags, run_name=name)
        logger = cls(client, run.info.run_id)
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), BATCH_LIMIT):
            client.log_batch(logger.run_id, params=items[i:i + BATCH_LIMIT])
        return logger

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def log_artifacts(self, folder: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(folder), artifact_path)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


def read_parent_id(sweep_dir: Path) -> str | None:
    path = sweep_dir / PARENT_ID_FILE
    return path.read_text().strip() if path.exists() else None


class SweepParentRun(Callback):
    """Hydra callback: one parent MLflow run per multirun, closed whatever happens to the jobs.

    Hydra skips ``on_multirun_end`` when a job raises, so an ``atexit`` hook closes the parent FAILED
    then; a job that fails also marks it FAILED itself (its process may be a launcher's worker).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        uri = tracking_uri(config)
        try:
            client = ensure_store(uri)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        sweep_dir = Path(config.hydra.sweep.dir)
        overrides = " ".join(config.hydra.overrides.task)
        name = f"sweep {sweep_dir.name} {overrides}"[:250].rstrip()
        self.parent = RunLogger.start(client, config.mlflow.experiment, name,
                                      params={}, tags={"sweep_dir": str(sweep_dir.resolve()), "overrides": overrides,
                                                       "role": "sweep", **environment_tags()})
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PARENT_ID_FILE).write_text(self.parent.run_id)
        atexit.register(self._close, "FAILED")
        log.info("MLflow parent run %s (%s)", self.parent.run_id, uri)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self._close)
        children = self.parent.client.search_runs(
            [self.parent.client.get_run(self.parent.run_id).info.experiment_id],
            filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{self.parent.run_id}'")
        failed = any(run.info.status != "FINISHED" and run.data.tags.get("retried") != "true" for run in children)
        self._close("FAILED" if failed else "FINISHED")

    def _close(self, status: str) -> None:
        if self.parent.client.get_run(self.parent.run_id).info.status == "RUNNING" or status == "FAILED":
            self.parent.finish(status)
