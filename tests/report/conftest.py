"""The report tests' fixtures."""

from __future__ import annotations

import pytest
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from src.tracking.store import ensure_store
from src.tracking.sweep import PARENT_ID_FILE
from tests.report.helpers import log_run


@pytest.fixture(scope="module")
def logged_sweep(tmp_path_factory):
    """A sweep's parent and its children as ``src.train`` logs them: amp=true,false x seed=0,1 finished, one
    more job out of memory. One store for the module (creating one takes seconds); reports overwrite theirs."""
    tmp_path = tmp_path_factory.mktemp("logged")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = ensure_store(store)
    experiment_id = client.create_experiment("medsweep", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(experiment_id, tags={"role": "sweep", "sweep_dir": str(tmp_path / "sweep")}).info.run_id
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / PARENT_ID_FILE).write_text(parent)
    child = {MLFLOW_PARENT_RUN_ID: parent}
    for amp in ("True", "False"):
        for seed in (0, 1):
            fast = amp == "True"
            epochs = [
                {"val/auc": 0.7, "val/acc": 0.6, "perf/samples_per_s": 6.0 + 4 * fast * 2 + seed},  # slow start
                {"val/auc": 0.9, "val/acc": 0.8, "perf/samples_per_s": 22.0 + 4 * fast * 2 + seed},
                {"val/auc": 0.9, "val/acc": 0.5, "perf/samples_per_s": 20.0 + 4 * fast * 2 + seed},
            ]
            for epoch in epochs:
                epoch.update({"mem/peak_mb": 60.0 if fast else 100.0, "mem/predicted_mb": 80.0})
            log_run(
                client,
                experiment_id,
                {"amp": amp, "seed": str(seed), "batch_size": "4"},
                epochs,
                {"test/acc": 0.7, "test/auc": 0.81 + 0.01 * fast + 0.02 * seed},
                tags=child,
            )
    log_run(
        client,
        experiment_id,
        {"amp": "True", "seed": "0", "batch_size": "64"},
        [],
        {"mem/peak_mb": 5000.0, "mem/predicted_mb": 4800.0},
        "FAILED",
        {**child, "status": "oom", "retried": "false"},
    )
    return client, parent, tmp_path / "sweep", store
