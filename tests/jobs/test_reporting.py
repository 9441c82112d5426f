"""src/jobs/reporting.py: what a job's main rank records in MLflow besides its metrics: system metrics, dataset inputs,
the logged model, tags, the experiment's kind, the links to the UI."""

from __future__ import annotations

import json

import mlflow
import mlflow.pytorch
import numpy as np
import pandas as pd
import pytest
import torch
from medmnist import INFO

from src.config import RESERVED_TAGS
from src.data.loaders import to_input
from src.data.npz import read_npz
from tests.helpers import only_run, run_cli, small_run

SYSTEM_METRICS = ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes")


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
