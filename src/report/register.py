"""``python -m src.report ... register=<name>``: the best run's logged model into MLflow's Model Registry."""

from __future__ import annotations

import dataclasses
import logging

import mlflow
import pandas as pd
from mlflow.entities import Run

from src.errors import UsageError

log = logging.getLogger(__name__)
RANKED_BY = "val/auc"  # at the tested epoch (select_by); never the test split, which would leak into the choice


@dataclasses.dataclass(frozen=True)
class Best:
    """The FINISHED run with the highest ``val/auc``, of ``among``, and its logged model."""

    run_id: str
    model_id: str
    val_auc: float
    among: int


def best_model(frame: pd.DataFrame, runs: list[Run], name: str) -> Best:
    """The model ``register=<name>`` takes: the logged model of the FINISHED run with the highest ``val/auc``; a
    :class:`UsageError` where there is none, before the report is written."""
    finished = frame[(frame["status"] == "FINISHED") & frame[RANKED_BY].notna()]
    if finished.empty:
        raise UsageError(f"register={name}: no FINISHED run has {RANKED_BY}: nothing to register")
    best = finished.loc[finished[RANKED_BY].idxmax()]
    run = next(run for run in runs if run.info.run_id == best["run_id"])
    outputs = run.outputs.model_outputs if run.outputs else []
    if not outputs:
        raise UsageError(
            f"register={name}: run {run.info.run_id} (best {RANKED_BY} {best[RANKED_BY]:.4f}) logged no model: "
            f"train it with mlflow.log_model=true (python -m src.train rerun={run.info.run_id} mlflow.log_model=true)"
        )
    return Best(run.info.run_id, outputs[-1].model_id, float(best[RANKED_BY]), len(finished))


def register(best: Best, name: str, uri: str) -> str:
    """Register ``best``'s model under ``name`` in the registry of the store ``uri``; its version. A model already
    registered under ``name`` (the report run again, after its logging failed, say) keeps its version: no duplicate."""
    source = f"models:/{best.model_id}"
    for found in mlflow.MlflowClient(uri).search_model_versions(f"run_id = '{best.run_id}'"):
        if found.name == name and found.source == source:
            log.info(
                "%s version %s already holds model %s (run %s): not registered again",
                name,
                found.version,
                best.model_id,
                best.run_id,
            )
            return found.version
    mlflow.set_tracking_uri(uri)  # the registry of the store the runs are in
    version = mlflow.register_model(source, name, tags={RANKED_BY: f"{best.val_auc:.6g}"})
    log.info(
        "registered %s version %s: run %s (%s %.4f, the best of %d), model %s",
        name,
        version.version,
        best.run_id,
        RANKED_BY,
        best.val_auc,
        best.among,
        best.model_id,
    )
    return version.version
