"""The runs a report covers, read from MLflow: a sweep folder's or parent run's children and the FINISHED runs its
skipped jobs named, or an experiment; each run's params, metrics and speed tags as one row (``val/*`` at the best
epoch, samples/s the median over epochs)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import yaml
from mlflow.entities import LifecycleStage, Run, ViewType
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from src.config import ReportConfig
from src.config.bounded import load_yaml
from src.errors import UsageError, first_few
from src.redaction import reveal_store
from src.report.analysis import (
    AUC,
    CONFIG_HASH,
    CONTENDED,
    DTYPE,
    MEMORY,
    PROVENANCE,
    SET_ASIDE,
    STARTED,
    STEPS_TIMED,
    THROUGHPUT,
)
from src.tracking.identity import ADDED
from src.tracking.store import search_all, tracking_uri
from src.tracking.sweep import PARENT_ID_FILE, RUN_ID, SKIPPED_TAG, read_parent_id

log = logging.getLogger(__name__)

METRICS = ["test/acc", AUC, "val/acc", "val/auc", THROUGHPUT, MEMORY, "mem/predicted_mb"]
BEST_EPOCH = ("val/auc", "val/acc")  # read at the epoch the run tested (best_epoch)
THROUGHPUT_MEDIAN = "perf/samples_per_s_median"  # the median over a run's timed epochs, logged at its end
FLOAT_MAX = np.finfo(float).max  # how MLflow's SQL stores keep an infinite metric (its sign kept)
NOT_PARAMS = ("run_id", "status", *METRICS, STEPS_TIMED, CONTENDED, DTYPE, CONFIG_HASH, STARTED, SET_ASIDE, *PROVENANCE)
FOLDER_NAME_MAX = 100  # bytes of a default folder named after an experiment: well inside any file system's 255


@dataclass(frozen=True)
class Selection:
    """The runs to report, what they are called, the parent run to log to (if any) and the default folder."""

    label: str
    runs: list[Run]
    parent_id: str | None
    out: Path


REPORTS = Path("reports")  # where reports of a parent run off this machine, or of an experiment, go by default
SWEEPS = Path("sweeps")  # where a sweep's folder goes by default (conf/config.yaml: sweeps/<date>/<time>)


def latest_sweep() -> Path:
    """The latest sweep folder under ``sweeps/`` of the working directory (by its ``<date>/<time>`` name) that holds
    its parent run's id; ``UsageError`` when there is none."""
    found = sorted(path.parent for path in SWEEPS.glob(f"*/*/{PARENT_ID_FILE}"))
    if not found:
        raise UsageError(
            f"no selector, and no sweep in {SWEEPS.resolve()}: give sweep=<folder>, parent=<run id> or "
            f"mlflow.experiment=<name>"
        )
    return found[-1]


def report_store(cfg: ReportConfig) -> str:
    """``mlflow.tracking_uri`` when given; else, for ``sweep=<folder>``, the store its jobs logged to (the folder's
    ``multirun.yaml``, which Hydra's grid sweeper writes, else a job's ``.hydra/config.yaml``: Optuna's sweeper writes
    no ``multirun.yaml``); else the default store."""
    recorded = recorded_config(Path(cfg.sweep).expanduser()) if cfg.sweep is not None else None
    if cfg.mlflow.tracking_uri is None and recorded is not None:
        try:
            uri = OmegaConf.select(load_yaml(recorded), "mlflow.tracking_uri", default=None)  # bounded: refused
        except (OSError, UnicodeDecodeError, yaml.YAMLError, OmegaConfBaseException):
            uri = None  # not a file Hydra wrote: the default store, whose check names what is missing
        if isinstance(uri, str) and uri:
            return reveal_store(uri)  # as Hydra recorded it: a secret this command concealed put back
    return tracking_uri(cfg)


def recorded_config(sweep: Path) -> Path | None:
    """The config a sweep folder records: its ``multirun.yaml``, else its first job's ``.hydra/config.yaml``."""
    jobs = sorted(sweep.glob("*/.hydra/config.yaml")) if sweep.is_dir() else []
    return next((path for path in (sweep / "multirun.yaml", *jobs) if path.is_file()), None)


def folder_name(name: str) -> str:
    """``name`` as one folder's name: path separators as ``_``, a name of dots only (``..``) as underscores, and one
    longer than :data:`FOLDER_NAME_MAX` bytes cut, with a short hash of the whole to keep names apart."""
    safe = re.sub(r"[/\\\x00]", "_", name)
    safe = "_" * len(safe) if set(safe) <= {"."} else safe
    if len(safe.encode()) <= FOLDER_NAME_MAX:
        return safe
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{safe.encode()[: FOLDER_NAME_MAX - 9].decode(errors='ignore')}-{digest}"


def parent_run(client: mlflow.MlflowClient, run_id: str, selector: str, uri: str) -> Run:
    """The sweep's parent run; a :class:`UsageError` where it is not in the store, or was deleted (with its
    experiment, say: its children are then out of every search, and the report would be logged where none sees it)."""
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise UsageError(
            f"{selector}: run {run_id} is not in {uri}: set mlflow.tracking_uri to the store the sweep logged to"
        ) from None
    if run.info.lifecycle_stage == LifecycleStage.DELETED:
        experiment = run.info.experiment_id
        restore = (
            f"mlflow experiments restore --experiment-id {experiment}: it was deleted with its experiment"
            if client.get_experiment(experiment).lifecycle_stage == LifecycleStage.DELETED
            else f"mlflow runs restore --run-id {run_id}"
        )
        raise UsageError(f"{selector}: run {run_id} was deleted from {uri}: restore it to report it ({restore})")
    return run


def warn_deleted(client: mlflow.MlflowClient, experiment_id: str, filter_string: str, what: str) -> None:
    """One warning counting the runs of ``what`` (jobs' runs, not a sweep's parent) deleted in the MLflow UI: the
    report leaves them out."""
    deleted = search_all(client, experiment_id, filter_string, ViewType.DELETED_ONLY)
    if ids := [r.info.run_id for r in deleted if r.data.tags.get("role") != "sweep"]:
        log.warning(
            "%d run(s) of %s deleted in the MLflow UI, left out: %s (mlflow runs restore --run-id <id> brings one "
            "back)",
            len(ids),
            what,
            first_few(ids),
        )


def sweep_runs(client: mlflow.MlflowClient, parent: Run) -> list[Run]:
    """The parent run's children, then the FINISHED runs its ``skipped.<job>`` tags name (a job skipped because its
    config had finished: a sweep run again, or resumed) that are not among them; one warning counts those named but
    not found FINISHED (deleted, or the tag damaged)."""
    experiment_id, run_id = parent.info.experiment_id, parent.info.run_id
    of_parent = f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{run_id}'"
    children = search_all(client, experiment_id, of_parent)
    warn_deleted(client, experiment_id, of_parent, f"sweep run {run_id}")
    named = {v.rpartition(" -> ")[2] for k, v in parent.data.tags.items() if k.startswith(SKIPPED_TAG)}
    ids = sorted(named - {r.info.run_id for r in children})
    quoted = ", ".join(f"'{i}'" for i in ids if RUN_ID.fullmatch(i))  # a damaged tag's value is no run id to quote
    skipped = (
        search_all(client, experiment_id, f"attributes.status = 'FINISHED' and attributes.run_id IN ({quoted})")
        if quoted
        else []
    )
    if len(skipped) < len(ids):
        log.warning(
            "%d of the %d runs the skipped jobs of sweep run %s name are not FINISHED runs of its experiment: left out",
            len(ids) - len(skipped),
            len(ids),
            run_id,
        )
    return children + skipped


def experiment_names(client: mlflow.MlflowClient) -> list[str]:
    """The names of the store's active experiments, sorted: every page of them."""
    names, token = [], None
    while True:
        page = client.search_experiments(page_token=token)
        names += [experiment.name for experiment in page]
        if not (token := page.token):
            return sorted(names)


def select(cfg: ReportConfig, client: mlflow.MlflowClient, uri: str) -> Selection:
    """The runs of ``sweep``, ``parent`` or ``mlflow.experiment``; ``UsageError`` naming a bad one."""
    if cfg.mlflow.experiment is not None:
        experiment = client.get_experiment_by_name(cfg.mlflow.experiment)
        if experiment is None:
            names = experiment_names(client)
            fix = (
                f"use one of {first_few(names, 10)}" if names else "it has none: give the store the runs were logged to"
            )
            raise UsageError(f"mlflow.experiment={cfg.mlflow.experiment} is not in {uri}: {fix}")
        if experiment.lifecycle_stage == LifecycleStage.DELETED:
            raise UsageError(
                f"mlflow.experiment={experiment.name} was deleted from {uri}: restore it (mlflow experiments restore "
                f"--experiment-id {experiment.experiment_id}) to report it"
            )
        runs = [r for r in search_all(client, experiment.experiment_id) if r.data.tags.get("role") != "sweep"]
        warn_deleted(client, experiment.experiment_id, "", f"experiment {experiment.name}")
        if not runs:
            raise UsageError(
                f"mlflow.experiment={experiment.name} has no runs in {uri}: give the experiment the runs logged to"
            )
        return Selection(f"experiment {experiment.name}", runs, None, REPORTS / folder_name(experiment.name))
    selector = f"sweep={cfg.sweep}" if cfg.sweep is not None else f"parent={cfg.parent}"
    if cfg.sweep is not None:
        folder = Path(cfg.sweep).expanduser()
        if not folder.is_dir():
            raise UsageError(f"{selector}: no such folder: give a sweep folder (sweeps/<date>/<time>)")
        run_id = read_parent_id(folder)
        if run_id is None:
            raise UsageError(
                f"{selector} has no {PARENT_ID_FILE} file holding a run id: give the folder of a "
                f"python -m src.train -m sweep, or parent=<run id>"
            )
        parent = parent_run(client, run_id, selector, uri)
        out = folder / "report"
    else:
        parent = parent_run(client, cfg.parent, selector, uri)
        sweep_dir = Path(parent.data.tags.get("sweep_dir", "/nonexistent"))
        out = sweep_dir / "report" if sweep_dir.is_dir() else REPORTS / parent.info.run_id
    runs = sweep_runs(client, parent)
    if not runs:
        raise UsageError(
            f"{selector}: run {parent.info.run_id} has no child runs: give a sweep's parent run (tag role=sweep)"
        )
    return Selection(f"sweep {parent.data.tags.get('sweep_dir', parent.info.run_id)}", runs, parent.info.run_id, out)


def status(run: Run) -> str:
    """``FINISHED``, ``FAILED``, ``FAILED (oom, retried)`` ..."""
    tags = run.data.tags
    notes = [tags["status"]] if "status" in tags else []
    notes += ["retried"] if tags.get("retried") == "true" else []
    return f"{run.info.status} ({', '.join(notes)})" if notes else run.info.status


def run_metrics(client: mlflow.MlflowClient, run: Run) -> dict[str, float]:
    """:data:`METRICS` and :data:`STEPS_TIMED` of one run as defined in the module docstring (histories only for
    finished runs); the throughput is ``perf/samples_per_s_median``, else (a run logged before it) the median of
    the epochs' ``perf/samples_per_s``."""
    metrics = {key: run.data.metrics.get(key, float("nan")) for key in (*METRICS, STEPS_TIMED)}
    if run.info.status != "FINISHED":
        return metrics
    history = {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in (*BEST_EPOCH, THROUGHPUT)
    }
    auc = history[BEST_EPOCH[0]]
    tested = run.data.metrics.get("best_epoch", np.nan)  # the epoch the run tested (select_by), its step one less
    if abs(tested) < FLOAT_MAX:  # NaN or infinite (FLOAT_MAX in a SQL store): as missing
        best = int(tested) - 1
        metrics.update({key: history[key].get(best, float("nan")) for key in BEST_EPOCH})
    elif auc:  # a run logged before best_epoch (or a non-finite one): the first best val/auc, as fit kept it then
        best = min(auc, key=lambda step: (-auc[step], step))
        metrics.update({key: history[key].get(best, float("nan")) for key in BEST_EPOCH})
    if THROUGHPUT_MEDIAN in run.data.metrics:
        metrics[THROUGHPUT] = run.data.metrics[THROUGHPUT_MEDIAN]
    elif history[THROUGHPUT]:
        metrics[THROUGHPUT] = float(np.median(list(history[THROUGHPUT].values())))
    return metrics


def run_tags(run: Run) -> dict:
    """Whether other processes shared the machine (:data:`CONTENDED`; runs logged before it was tagged: not), the
    precision trained in (:data:`DTYPE`), its configuration's :data:`CONFIG_HASH`, its :data:`PROVENANCE` tags
    (each ``""`` when not tagged) and its :data:`STARTED` time."""
    tags = run.data.tags
    return {
        CONTENDED: tags.get(CONTENDED) == "true",
        **{tag: tags.get(tag, "") for tag in (DTYPE, CONFIG_HASH, *PROVENANCE)},
        STARTED: run.info.start_time,
    }


def run_frame(client: mlflow.MlflowClient, runs: list[Run]) -> pd.DataFrame:
    """One row per run: ``run_id``, ``status``, every param (string, ``""`` when a run lacks it, a key added since it
    was logged at the value it trained as: :data:`~src.tracking.identity.ADDED`; none named as one of
    these columns, :data:`NOT_PARAMS`, which would overwrite or be overwritten), :data:`METRICS`, :data:`STEPS_TIMED`
    (an infinite value as logged, not as the store keeps it: :data:`FLOAT_MAX`) and :func:`run_tags`."""
    rows = [
        {
            "run_id": r.info.run_id,
            "status": status(r),
            **{key: value for key, value in r.data.params.items() if key not in NOT_PARAMS},
            **run_metrics(client, r),
            **run_tags(r),
        }
        for r in runs
    ]
    frame = pd.DataFrame(rows)
    # a run logged before a key was added trained at its ADDED value (config_hash counts them as one configuration):
    # read it so, or "" against that value makes the key swept and pairs no run across it
    frame = frame.fillna({key: value for key, value in ADDED.items() if key in frame})
    params = param_columns(frame)
    frame[params] = frame[params].fillna("").astype(str)
    metrics = [*METRICS, STEPS_TIMED]
    frame[metrics] = frame[metrics].replace({FLOAT_MAX: np.inf, -FLOAT_MAX: -np.inf})
    return frame


def param_columns(frame: pd.DataFrame) -> list[str]:
    """The columns of a :func:`run_frame` that are params."""
    return [c for c in frame.columns if c not in NOT_PARAMS]


def with_tags(selection: Selection, tags: list[str]) -> Selection:
    """Only the runs tagged ``<name>=true`` for every name in ``tags`` (``python -m src.report tags=[...]``)."""
    if not tags:
        return selection
    runs = [run for run in selection.runs if all(run.data.tags.get(str(name)) == "true" for name in tags)]
    if not runs:
        raise UsageError(
            f"tags={list(tags)}: none of the {len(selection.runs)} runs of {selection.label} carries all of them: "
            f"drop tags, or give the tags the runs were started with"
        )
    return dataclasses.replace(selection, runs=runs, label=f"{selection.label} tagged {', '.join(map(str, tags))}")


def datasets_table(runs: list[Run]) -> pd.DataFrame:
    """One row per dataset input (file split and MD5) of ``runs``: its samples, file, medmnist version, runs."""
    rows = {}
    for run in runs:
        for entry in run.inputs.dataset_inputs if run.inputs else []:
            dataset, profile = entry.dataset, json.loads(entry.dataset.profile or "{}")
            row = rows.setdefault(
                (dataset.name, dataset.digest),
                {
                    "dataset": dataset.name,
                    "digest": dataset.digest,
                    "samples": profile.get("num_samples", ""),
                    "medmnist": profile.get("medmnist_version", ""),
                    "runs": 0,
                },
            )
            row["runs"] += 1
    return pd.DataFrame(list(rows.values()), columns=["dataset", "digest", "samples", "medmnist", "runs"])
