"""Shared fixtures: the shipped MedMNIST files, a real MLflow store in a temp dir, a cache folder of the tests' own."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from src.cli import register
from src.data.shipped import SHIPPED
from src.tracking.store import TRACKING_URI_ENV
from tests.helpers import ROOT

register()
os.environ.pop(TRACKING_URI_ENV, None)  # a store of the developer's own is no test's: each test names its store


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped where no CUDA device is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``data/medmnist``: AdrenalMNIST3D at 28^3 and 64^3, VesselMNIST3D at 28^3."""
    if not (SHIPPED / "adrenalmnist3d.npz").exists():
        pytest.fail(f"real MedMNIST files expected in {SHIPPED}")
    return SHIPPED


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An SQLite database MLflow created, its schema migrated and nothing logged: made once, since MLflow's
    migrations take ~2.6 s of each process that creates a store (2026-11-27)."""
    path = tmp_path_factory.mktemp("empty-store") / "mlflow.db"
    mlflow.MlflowClient(f"sqlite:///{path}").search_experiments(max_results=1)
    return path


@pytest.fixture
def store(tmp_path: Path, empty_store: Path) -> str:
    """A real SQLite MLflow store in the test's temp dir, empty (a copy of :func:`empty_store`)."""
    shutil.copyfile(empty_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def new_store(tmp_path: Path) -> str:
    """An SQLite MLflow store not created yet, in the test's temp dir: the first process that logs creates it."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory) -> Iterator[Path]:
    """``MEDSWEEP_CACHE_DIR`` (the MFU peak probes) in a temp dir for the whole session, in ``os.environ`` so the
    processes the tests start inherit it: no test reads or writes the user's ``~/.cache/medsweep``."""
    folder = tmp_path_factory.mktemp("medsweep-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEDSWEEP_CACHE_DIR", str(folder))
        yield folder


def checkout_files() -> set[str]:
    """Untracked and ignored paths in the checkout (bytecode caches aside), as git lists them; none where git cannot
    (a copy of the tree without ``.git`` or without git, as a GPU machine may get): the check is then not made."""
    try:
        listed = subprocess.run(
            ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return set()
    return {line[3:] for line in listed if line[:2] in ("??", "!!") and "__pycache__" not in line}


@pytest.fixture(scope="session", autouse=True)
def checkout_untouched() -> Iterator[None]:
    """No test writes into the checkout (``mlruns/``, ``outputs/``, ``sweeps/``, ``mlflow.db``): every store and
    folder lives in a temp dir. Fails the session's last test otherwise."""
    before = checkout_files()
    yield
    written = sorted(checkout_files() - before)
    assert not written, f"tests wrote into the checkout {ROOT}: {written[:10]}"
