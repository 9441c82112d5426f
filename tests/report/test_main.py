"""src/report/__main__.py: ``python -m src.report`` in real processes: one error line and exit 2 for what it refuses, a
real sweep reported end to end."""

from __future__ import annotations

import subprocess
import sys

import matplotlib.image
import mlflow
import numpy as np
import pytest
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from src.tracking.sweep import PARENT_ID_FILE
from tests.helpers import ROOT, run_cli, runs
from tests.report.helpers import LONG, PNG_SIGNATURE, REPORT_FILES, tables


def test_the_report_command_does_not_import_torch():
    """It composes conf/report.yaml only, so it spares the model zoo and torch (~2 s of its start)."""
    code = "import sys, src.report.__main__; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_missing_store_is_one_error_line_and_exit_2(tmp_path):
    result = run_cli(
        "mlflow.experiment=medsweep", f"mlflow.tracking_uri=sqlite:///{tmp_path}/none.db", module="src.report"
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: mlflow.tracking_uri=sqlite:///{tmp_path}/none.db: no such store: "
        f"set it to the store the runs logged to"
    )
    assert not (tmp_path / "none.db").exists()


@pytest.mark.slow
def test_a_real_sweep_is_reported_with_seeds_aggregated(tmp_path, store):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "data=synthetic",
        "model=resnet10",
        "model.stem=standard",
        "batch_size=4",
        "epochs=1",
        "limit_batches=2",
        "num_threads=1",
        "amp=true,false",
        "seed=0,1",
        f"mlflow.tracking_uri={store}",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(f"sweep={sweep}", module="src.report")  # the store the sweep logged to, from its folder
    assert result.returncode == 0, result.stderr[-3000:]
    out = sweep / "report"
    found = tables((out / "report.md").read_text())
    children = [r for r in runs(store) if r.data.tags.get(MLFLOW_PARENT_RUN_ID)]
    for row in found["Configurations"]:
        aucs = [r.data.metrics["test/auc"] for r in children if r.data.params["amp"].lower() == row["amp"]]
        assert row["n"] == "2" and row["test/auc"] == f"{np.mean(aucs):.3f} ± {np.std(aucs, ddof=1):.3f}"
    assert sorted(row["amp"] for row in found["Configurations"]) == ["false", "true"]
    assert [(row["comparison"], row["pairs"]) for row in found["Paired effects"]] == [("amp=true vs false", "2")]
    for name in ("throughput_memory.png", "paired_effects.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert width > 1000 and height > 300
    parent = read_parent(sweep)
    logged = {a.path for a in mlflow.MlflowClient(store).list_artifacts(parent, "report")}
    assert logged == {f"report/{name}" for name in REPORT_FILES}


def read_parent(sweep) -> str:
    return (sweep / PARENT_ID_FILE).read_text().strip()


def test_a_path_too_long_is_one_line_and_exit_2(tmp_path):
    result = run_cli("mlflow.experiment=medsweep", f"out={tmp_path}/{LONG}", module="src.report")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: out={tmp_path}/{LONG}: too long for the file system (a name in it over 255 bytes, or over 4096 "
        "in all): give a shorter path"
    ]
