"""Shared fixtures: the real MedMNIST files, a real MLflow store in a temp dir, real composition."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from hydra import compose, initialize_config_dir

from src import config as schema

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data" / "medmnist"

schema.register()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "adrenalmnist3d.npz").exists():
        pytest.fail(f"real MedMNIST files expected in {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def store(tmp_path: Path) -> str:
    """A fresh SQLite MLflow store in the test's temp dir."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def compose_config(*overrides: str):
    """The real Hydra composition of ``conf/config.yaml`` with ``overrides``."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def run_cli(*args: str, module: str = "src.train", timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m src.train ARGS`` in a real process from the project root."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def runs(uri: str, experiment: str = "medsweep") -> list[mlflow.entities.Run]:
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []
