"""src/tracking/sweep.py: a sweep's parent run, its status following its children's."""

from __future__ import annotations

import mlflow
import pytest

from src.tracking.store import ensure_store, experiment_id
from src.tracking.sweep import parent_status

PREEMPTED = ("KILLED", {"preempted": "true"})


OOM_RETRIED = ("FAILED", {"status": "oom", "retried": "true"})


OOM = ("FAILED", {"status": "oom", "retried": "false"})


FINISHED = ("FINISHED", {})


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> mlflow.MlflowClient:
    """One store for the cases (creating one takes seconds)."""
    return ensure_store(f"sqlite:///{tmp_path_factory.mktemp('statuses') / 'mlflow.db'}")


@pytest.mark.parametrize(
    "children,status",
    [
        ([], "FINISHED"),
        ([FINISHED, FINISHED], "FINISHED"),
        ([OOM_RETRIED, FINISHED], "FINISHED"),
        ([FINISHED, PREEMPTED], "KILLED"),
        ([OOM_RETRIED, PREEMPTED], "KILLED"),
        ([OOM, PREEMPTED], "FAILED"),
        ([("FAILED", {}), PREEMPTED], "FAILED"),
        ([("KILLED", {}), FINISHED], "FAILED"),  # Ctrl-C: not resumable by the sweep's own means
        ([("RUNNING", {}), PREEMPTED], "FAILED"),  # a job that never closed its run
    ],
)
def test_the_parent_status_follows_its_children(client, request, children, status):
    experiment = experiment_id(client, request.node.name)  # one experiment per case
    for end, tags in children:
        run = client.create_run(experiment, tags=tags)
        if end != "RUNNING":
            client.set_terminated(run.info.run_id, end)
    assert parent_status(client.search_runs([experiment])) == status
