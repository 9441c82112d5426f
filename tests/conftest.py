"""Shared fixtures: the real MedMNIST files, a real MLflow store in a temp dir, a cache folder of the tests' own."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

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


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory) -> Iterator[Path]:
    """``MEDSWEEP_CACHE_DIR`` (the MFU peak probes) in a temp dir for the whole session, in ``os.environ`` so the
    processes the tests start inherit it: no test reads or writes the user's ``~/.cache/medsweep``."""
    folder = tmp_path_factory.mktemp("medsweep-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEDSWEEP_CACHE_DIR", str(folder))
        yield folder
