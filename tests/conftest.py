"""Shared fixtures: the real MedMNIST files and a real MLflow store in a temp dir."""

from __future__ import annotations

from pathlib import Path

import pytest

from src import config as schema
from tests.helpers import SHARED_DATA

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
