"""Helpers the tests share: paths, real Hydra composition, real processes, a real MLflow store's runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data" / "medmnist"


RESULTS = {"train/loss", "train/acc", "val/loss", "val/acc", "val/auc", "test/acc", "test/auc", "model/params"}


def small_run(tmp_path, store, shared_data, *overrides: str) -> tuple[str, ...]:
    """A quick job on the real AdrenalMNIST3D file, outputs and store under ``tmp_path``."""
    return (
        "data=adrenalmnist3d",
        f"data.root={shared_data}",
        "data.download=false",
        "model=resnet10",
        "model.stem=standard",
        "batch_size=4",
        "epochs=2",
        "limit_batches=3",
        "num_threads=1",
        f"mlflow.tracking_uri={store}",
        f"hydra.run.dir={tmp_path}/run",
        f"hydra.sweep.dir={tmp_path}/sweep",
        *overrides,
    )


def history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = mlflow.MlflowClient(uri)
    return {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
        for key in client.get_run(run_id).data.metrics
    }


def compose_config(*overrides: str):
    """The real Hydra composition of ``conf/config.yaml`` with ``overrides``."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def run_cli(*args: str, module: str = "src.train", timeout: int = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m src.train ARGS`` in a real process from ``cwd`` (the project root's code either way)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def runs(uri: str, experiment: str = "medsweep") -> list[mlflow.entities.Run]:
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []
