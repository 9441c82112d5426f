"""The MLflow store: where it is, that it answers, and what it already holds."""

from __future__ import annotations

import functools
import logging
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import ExperimentTag

from src.errors import UsageError

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACKING_URI = f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"
EXPERIMENT_KIND, TRAINING = "mlflow.experimentKind", "custom_model_development"  # the UI opens on training runs
ARTIFACTS_FOLDER = "mlartifacts"  # beside an SQLite store, as `mlflow server` keeps ./mlartifacts beside its own


def tracking_uri(cfg: Any) -> str:
    return cfg.mlflow.tracking_uri or DEFAULT_TRACKING_URI


def ensure_store(uri: str) -> mlflow.MlflowClient:
    """Check the store answers, creating a fresh SQLite database now (once, before any job starts)."""
    reachable(uri)
    client = mlflow.MlflowClient(uri)
    try:
        client.search_experiments(max_results=1)
    except Exception as err:  # any store failure is the user's URI to fix
        raise UsageError(
            f"mlflow.tracking_uri={uri} cannot be used ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}): fix or change mlflow.tracking_uri"
        ) from None
    return client


def check_store(uri: str) -> None:
    """What :func:`ensure_store` checks, creating nothing (a dry run): an SQLite database not created yet stays so,
    only its folder is checked."""
    if store_exists(uri):
        ensure_store(uri)
    else:
        reachable(uri)


def reachable(uri: str) -> None:
    """A server that answers ``/health``; an SQLite database's folder that exists."""
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=10).close()
        except OSError as err:
            raise UsageError(
                f"mlflow.tracking_uri={uri} is unreachable ({err}): start the server "
                f"(mlflow server) or set mlflow.tracking_uri to a reachable store"
            ) from None
    elif uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir():
            raise UsageError(
                f"mlflow.tracking_uri={uri}: folder {folder} does not exist: create it "
                f"or set mlflow.tracking_uri to another store"
            )


def artifact_root(uri: str) -> str | None:
    """Where an SQLite store's new experiments keep their artifacts: ``<store's folder>/mlartifacts`` (the folder
    ``mlflow server`` uses by default), as an absolute file URI, whatever the working directory; None for other
    stores (their server decides)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / ARTIFACTS_FOLDER).as_uri()


def experiment_id(client: mlflow.MlflowClient, name: str) -> str:
    """The id of experiment ``name``, tagged ``mlflow.experimentKind=custom_model_development`` (MLflow's UI then
    opens it on its training runs, not its GenAI overview); created if missing, in an SQLite store with its
    artifacts in ``<artifact_root>/<experiment id>``. One that keeps them under the working directory is used as it
    is, with a warning."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        warn_if_under_cwd(experiment.name, experiment.artifact_location)
        if experiment.tags.get(EXPERIMENT_KIND) != TRAINING:
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND, TRAINING)
        return experiment.experiment_id
    root = artifact_root(client.tracking_uri)
    tags = {EXPERIMENT_KIND: TRAINING}
    if root is None:
        return client.create_experiment(name, tags=tags)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore  # what the client opens an SQLite store with

    return SqlAlchemyStore(client.tracking_uri, root).create_experiment(
        name, tags=[ExperimentTag(k, v) for k, v in tags.items()]
    )


@functools.cache
def warn_if_under_cwd(name: str, location: str) -> None:
    """Warn once per experiment and location when the artifacts of ``name`` go under the working directory."""
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme not in ("", "file"):
        return
    cwd = Path.cwd().resolve()
    if Path(urllib.parse.unquote(parsed.path)).resolve().is_relative_to(cwd):
        log.warning(
            "experiment %s keeps its artifacts in %s, under the working directory %s: run from another folder, "
            "or set mlflow.experiment to a new experiment (its artifacts go beside the store)",
            name,
            location,
            cwd,
        )


def store_exists(uri: str) -> bool:
    """False only for an SQLite store whose database file is not there yet (opening it would create it)."""
    return not uri.startswith("sqlite:///") or Path(uri.removeprefix("sqlite:///")).exists()


def finished_run(uri: str, experiment: str, hashed: str, fingerprint: str) -> mlflow.entities.Run | None:
    """The latest FINISHED run of ``experiment`` tagged ``config_hash=hashed``: the latest with
    ``code_fingerprint=fingerprint`` when there is one, else the latest of any code; a store not created yet has
    none."""
    done = finished_runs(uri, experiment, f"tags.config_hash = '{hashed}'")
    return next((run for run in done if run.data.tags.get("code_fingerprint") == fingerprint), next(iter(done), None))


def finished_runs(uri: str, experiment: str, filter_string: str) -> list[mlflow.entities.Run]:
    """The FINISHED runs of ``experiment`` that match ``filter_string``, latest first (at most 1000, one page); none
    in a store not created yet, which stays so."""
    if not store_exists(uri):
        return []
    client = ensure_store(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return client.search_runs(
        [found.experiment_id],
        order_by=["attributes.end_time DESC"],
        filter_string=f"{filter_string} and attributes.status = 'FINISHED'",
    )


def best_metric(client: mlflow.MlflowClient, run_id: str, key: str) -> float:
    """The highest value ``key`` reached in the run (the value itself for a metric logged once)."""
    return max(metric.value for metric in client.get_metric_history(run_id, key))


def search_all(client: mlflow.MlflowClient, experiment_id: str, filter_string: str = "") -> list[mlflow.entities.Run]:
    """Every run of the experiment that ``filter_string`` selects, page by page."""
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string, max_results=1000, page_token=token)
        runs += page
        token = page.token
        if not token:
            return runs
