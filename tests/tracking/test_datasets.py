"""The MLflow dataset inputs of a run (:mod:`src.tracking.datasets`), from a real ``python -m src.train`` run on a
NIfTI folder."""

from __future__ import annotations

import hashlib
import json
import os

import mlflow
import pytest

from tests.data.nifti.folders import CSV, folder
from tests.helpers import run_cli, runs


@pytest.mark.slow
def test_a_run_trains_on_a_nifti_folder_and_records_its_dataset_and_keys(tmp_path, store):
    """A short real run through ``python -m src.train``: the dataset inputs (digest of the CSV and the volumes, the
    folder's name, its classes and spacing) and the preprocessing keys as params."""
    data = folder(tmp_path / "scans", [(f"v{i}.nii.gz", "ab"[i % 2]) for i in range(20)], header="image,label")
    result = run_cli(
        "data=nifti",
        f"data.root={data}",
        "data.size=16",
        "data.intensity=zscore",
        "model=resnet10",
        "batch_size=4",
        "epochs=1",
        "limit_batches=2",
        "num_threads=1",
        "device=cpu",
        "mlflow.system_metrics=false",
        f"mlflow.tracking_uri={store}",
        f"hydra.run.dir={tmp_path}/run",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    digest = hashlib.md5((data / CSV).read_bytes())
    for line in (data / CSV).read_text().split()[1:]:
        digest.update(hashlib.md5((data / line.split(",")[0]).read_bytes()).hexdigest().encode())
    inputs = {entry.dataset.name: entry.dataset for entry in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["scans_16/test", "scans_16/train", "scans_16/val"]
    for split, dataset in inputs.items():
        profile = json.loads(dataset.profile)
        assert dataset.digest == digest.hexdigest(), split
        assert json.loads(dataset.source) == {"uri": (data / CSV).as_uri()}
        assert (profile["classes"], profile["spacing_mm"], profile["size"]) == (["a", "b"], [1.0, 1.0, 1.0], 16)
    assert json.loads(inputs["scans_16/train"].profile)["class_counts"] == [7, 7]
    params = run.data.params
    assert {key: params[key] for key in ("data.name", "data.size", "data.intensity", "data.spacing")} == {
        "data.name": "nifti",
        "data.size": "16",
        "data.intensity": "zscore",
        "data.spacing": "None",
    }
    assert params["data.labels"] == str(data / CSV)
    assert mlflow.MlflowClient(store).get_run(run.info.run_id).info.status == "FINISHED"
    assert os.path.exists(tmp_path / "run" / "eval" / "test_predictions.csv")
