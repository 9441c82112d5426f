"""What a run records in MLflow besides its metrics: system metrics, dataset inputs, the logged model, tags, the
experiment's kind, and the links to the UI; the report's tag selection, datasets and model registration."""

from __future__ import annotations

import json
import re

import mlflow
import mlflow.pytorch
import numpy as np
import pandas as pd
import pytest
import torch
from medmnist import INFO
from mlflow.store.tracking.dbmodels.models import SqlDataset
from sqlalchemy import event

from src.config import RESERVED_TAGS
from src.data import read_npz, to_input
from src.parallel.dist import Rank
from src.tracking.runs import RunLogger
from src.tracking.store import experiment_id
from tests.helpers import run_cli, small_run

SYSTEM_METRICS = ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes")


def only_run(uri: str) -> mlflow.entities.Run:
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("medsweep").experiment_id])
    return run


@pytest.mark.slow
def test_a_run_records_system_metrics_its_datasets_its_model_and_tags(tmp_path, store, shared_data, monkeypatch):
    result = run_cli(
        *small_run(tmp_path, store, shared_data),
        "mlflow.log_model=true",
        "mlflow.system_metrics_interval_s=1",  # the shortest: a sample a second
        "tags=[baseline,amp-study]",
        "ema_decay=0.9",  # the logged model must be the tested (averaged) weights, not the last trained ones
    )
    assert result.returncode == 0, result.stderr[-3000:]
    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name("medsweep")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    run = only_run(store)

    assert set(SYSTEM_METRICS) <= set(run.data.metrics)

    files = read_npz(shared_data / "adrenalmnist3d.npz")
    inputs = {entry.dataset.name: entry for entry in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["adrenalmnist3d/test", "adrenalmnist3d/train", "adrenalmnist3d/val"]
    for split, context in (("train", "training"), ("val", "validation"), ("test", "test")):
        entry = inputs[f"adrenalmnist3d/{split}"]
        profile = json.loads(entry.dataset.profile)
        assert entry.dataset.digest == INFO["adrenalmnist3d"]["MD5"]
        assert [(tag.key, tag.value) for tag in entry.tags] == [("mlflow.data.context", context)]
        assert profile["num_samples"] == len(files[split][1])
        assert profile["class_counts"] == np.bincount(files[split][1], minlength=2).tolist()

    (output,) = run.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert (str(model.status), model.source_run_id) == ("READY", run.info.run_id)
    linked = {metric.key: metric for metric in model.metrics}
    assert linked["test/auc"].value == run.data.metrics["test/auc"]
    assert linked["test/auc"].dataset_name == "adrenalmnist3d/test"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # where models:/ URIs are looked up
    loaded = mlflow.pytorch.load_model(f"models:/{output.model_id}")
    logged = pd.read_csv(tmp_path / "run" / "eval" / "test_predictions.csv")
    images = torch.from_numpy(files["test"][0][logged["index"].to_numpy()]).unsqueeze(1)
    with torch.no_grad():
        scores = loaded(to_input(images)).softmax(1).numpy()
    np.testing.assert_allclose(scores, logged[["score_0", "score_1"]].to_numpy(), rtol=0, atol=1e-6)

    tags = run.data.tags
    assert (tags["baseline"], tags["amp-study"]) == ("true", "true")
    undotted = {key for key in tags if "." not in key} - {"baseline", "amp-study"}
    assert undotted <= RESERVED_TAGS, "a tag medsweep writes is missing from RESERVED_TAGS"

    log = result.stdout + result.stderr
    assert f"mlflow ui --backend-store-uri {store}" in log
    assert f"runs: http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs" in log
    assert f"run: http://127.0.0.1:5000/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}" in log


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


@pytest.mark.parametrize(
    "env,rank,expected",
    [
        ({}, Rank(1, 2, 1), None),  # ranks spawned by the job: one node
        ({"LOCAL_WORLD_SIZE": "2"}, Rank(2, 2, 0), None),  # torchrun on one node
        ({"LOCAL_WORLD_SIZE": "2"}, Rank(2, 4, 0), "node1"),  # the second of two nodes
        ({"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, Rank(3, 4, 1), "node1"),  # torchrun says which node
    ],
)
def test_each_node_of_a_multi_node_job_logs_its_system_metrics_apart(monkeypatch, env, rank, expected):
    for key in ("LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert rank.node == expected


def test_two_jobs_linking_the_same_dataset_at_once_both_succeed(store):
    """The race of two parallel jobs, made to happen every time: just before job A's store inserts the dataset
    (after it looked it up and found none), job B links the same dataset through its own client."""
    dataset = mlflow.entities.Dataset("adrenalmnist3d/train", "d1g3st", "local", '{"uri": "file:///a.npz"}')
    inputs = [mlflow.entities.DatasetInput(dataset, [])]
    first, second = mlflow.MlflowClient(store), mlflow.MlflowClient(store)
    experiment = experiment_id(first, "medsweep")
    run_a, run_b = (RunLogger(client, client.create_run(experiment).info.run_id) for client in (first, second))

    raced = []

    def job_b_first(mapper, connection, target):
        if not raced:
            raced.append(target.name)
            second.log_inputs(run_b.run_id, datasets=inputs)

    event.listen(SqlDataset, "before_insert", job_b_first)
    try:
        run_a.log_inputs(inputs)
    finally:
        event.remove(SqlDataset, "before_insert", job_b_first)
    assert raced == ["adrenalmnist3d/train"]
    for run in (run_a, run_b):
        linked = first.get_run(run.run_id).inputs.dataset_inputs
        assert [(entry.dataset.name, entry.dataset.digest) for entry in linked] == [("adrenalmnist3d/train", "d1g3st")]
