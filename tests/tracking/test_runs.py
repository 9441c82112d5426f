"""src/tracking/runs.py: a run's process gone only when no process has its pid and start time; two jobs linking one
dataset at once."""

from __future__ import annotations

import os

import mlflow
from mlflow.store.tracking.dbmodels.models import SqlDataset
from sqlalchemy import event

from src.tracking.runs import RunLogger, process_gone, process_tags
from src.tracking.store import experiment_id
from tests.helpers import ended_process


def test_a_process_is_gone_on_this_machine_only_when_no_process_has_its_pid_and_start_time():
    assert not process_gone(process_tags())
    assert process_gone(ended_process())
    assert process_gone({**process_tags(), "pid": f"{os.getpid()}@1.00"})  # its pid taken by another process since
    assert not process_gone({**ended_process(), "host": "another-node"})
    assert not process_gone({**ended_process(), "boot_id": "an-earlier-boot"})
    assert not process_gone({"host": process_tags()["host"]})  # a run logged before the tags


def test_two_jobs_linking_the_same_dataset_at_once_both_succeed(store):
    """The race of two parallel jobs, made to happen every time: just before job A's store inserts the dataset
    (after it looked it up and found none), job B links the same dataset through its own client."""
    dataset = mlflow.entities.Dataset("adrenalmnist3d/train", "d1g3st", "local", '{"uri": "file:///a.npz"}')
    inputs = [mlflow.entities.DatasetInput(dataset, [])]
    first, second = mlflow.MlflowClient(store), mlflow.MlflowClient(store)
    experiment = experiment_id(first, "medsweep")
    run_a, run_b = (RunLogger(client, client.create_run(experiment).info.run_id) for client in (first, second))

    raced = []

    def job_b_first(mapper, connection, target):
        if not raced:
            raced.append(target.name)
            second.log_inputs(run_b.run_id, datasets=inputs)

    event.listen(SqlDataset, "before_insert", job_b_first)
    try:
        run_a.log_inputs(inputs)
    finally:
        event.remove(SqlDataset, "before_insert", job_b_first)
    assert raced == ["adrenalmnist3d/train"]
    for run in (run_a, run_b):
        linked = first.get_run(run.run_id).inputs.dataset_inputs
        assert [(entry.dataset.name, entry.dataset.digest) for entry in linked] == [("adrenalmnist3d/train", "d1g3st")]
