"""src/report/register.py: ``register=<name>`` registers the best run's logged model (by val/auc), once; a run that
logged none says how to get one."""

from __future__ import annotations

import json
import re

import mlflow
import pandas as pd
import pytest
from medmnist import INFO
from mlflow.entities import LoggedModelOutput

from src.report.writer import report
from tests.helpers import only_run, run_cli, small_run
from tests.report.helpers import log_run, report_config, store_with


def test_a_report_run_again_registers_its_model_once(tmp_path, request):
    request.addfinalizer(lambda: mlflow.set_tracking_uri(None))  # register= sets it (and its variable) in-process
    client, uri, experiment_id = store_with(tmp_path, "medsweep", [])
    run_id = log_run(client, experiment_id, {"amp": "True"}, [{"val/auc": 0.9}], {"test/auc": 0.8})
    model = client.create_logged_model(experiment_id, source_run_id=run_id, name="model")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    for out in ("r1", "r2"):  # the second: rerun as the error of a report that could not be logged says
        report(
            report_config(
                "mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path / out}", "register=best"
            )
        )
    (version,) = client.search_model_versions("name = 'best'")
    assert (int(version.version), version.source) == (1, f"models:/{model.model_id}")


@pytest.mark.slow
def test_without_log_model_a_run_logs_no_model_and_register_says_how_to_get_one(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data), "mlflow.system_metrics=false")
    assert result.returncode == 0, result.stderr[-3000:]
    run = only_run(store)
    assert not run.outputs.model_outputs
    assert not [key for key in run.data.metrics if key.startswith("system/")]
    report = run_cli(
        f"mlflow.tracking_uri={store}",
        "mlflow.experiment=medsweep",
        f"out={tmp_path / 'report'}",
        "register=best",
        module="src.report",
    )
    assert report.returncode == 2
    line = (
        f"error: register=best: run {run.info.run_id} (best val/auc {run_val_auc(store, run)}) logged no model: "
        f"train it with mlflow.log_model=true (python -m src.train rerun={run.info.run_id} mlflow.log_model=true)"
    )
    assert report.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "report" / "report.md").exists()  # refused before the report is written


def run_val_auc(uri: str, run: mlflow.entities.Run) -> str:
    """The validation AUC of the epoch the run tested (``best_epoch``, chosen by ``select_by``)."""
    history = mlflow.MlflowClient(uri).get_metric_history(run.info.run_id, "val/auc")
    tested = int(run.data.metrics["best_epoch"]) - 1  # epochs are logged at step epoch - 1
    return f"{next(metric.value for metric in history if metric.step == tested):.4f}"


@pytest.mark.slow
def test_report_selects_by_tags_lists_datasets_and_registers_the_best_by_val_auc(tmp_path, store, shared_data):
    sweep = run_cli("-m", *small_run(tmp_path, store, shared_data), "seed=0,1", "mlflow.log_model=true", "tags=[a]")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    other = run_cli(*small_run(tmp_path / "other", store, shared_data), "seed=2")
    assert other.returncode == 0, other.stderr[-3000:]
    client = mlflow.MlflowClient(store)
    experiment_id = client.get_experiment_by_name("medsweep").experiment_id
    tagged = client.search_runs([experiment_id], "tags.a = 'true'")
    children = [run for run in tagged if run.data.tags.get("role") != "sweep"]
    assert len(children) == 2 and len(tagged) == 3  # the sweep's parent run carries the tags too
    log = sweep.stdout + sweep.stderr
    compare = re.search(r"compare: (\S+)", log).group(1)
    assert sorted(json.loads(re.search(r"runs=(\[[^&]*\])", compare).group(1))) == sorted(
        run.info.run_id for run in children
    )

    report = run_cli(
        f"mlflow.tracking_uri={store}",
        "mlflow.experiment=medsweep",
        "tags=[a]",
        "register=medsweep-best",
        f"out={tmp_path / 'report'}",
        module="src.report",
    )
    assert report.returncode == 0, report.stderr[-3000:]
    runs = pd.read_csv(tmp_path / "report" / "runs.csv")
    assert sorted(runs["run_id"]) == sorted(run.info.run_id for run in children)
    text = (tmp_path / "report" / "report.md").read_text()
    assert f"| adrenalmnist3d/train | {INFO['adrenalmnist3d']['MD5']} | 1188 |" in text

    best = max(children, key=lambda run: float(run_val_auc(store, run)))
    (version,) = client.search_model_versions("name = 'medsweep-best'")
    assert (version.source, version.run_id) == (f"models:/{best.outputs.model_outputs[0].model_id}", best.info.run_id)
