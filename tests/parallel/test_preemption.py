"""src/parallel/preemption.py: stop signals in a sweep and in a DDP job, a second Ctrl-C: real processes, a real MLflow
store."""

from __future__ import annotations

import os
import signal

import mlflow
import pytest
import torch

from src.parallel.preemption import EXIT_PREEMPTED, Preemption
from src.training import checkpoint
from tests.helpers import RESULTS, history, run_cli, runs, small_run

NOT_RESULTS = ("perf/", "mem/", "time/")  # measurements of the process, not results


def sweep_runs(store: str) -> tuple[mlflow.entities.Run, list[mlflow.entities.Run]]:
    """The sweep's parent run and its jobs' runs."""
    (parent,) = [r for r in runs(store) if r.data.tags.get("role") == "sweep"]
    return parent, [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


# -- a sweep stopped ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_in_a_local_sweep_leaves_the_parent_killed(tmp_path, store, shared_data):
    """The first job finishes, the second is preempted mid-epoch (a real SIGTERM): the sweep stops, exit 143."""
    result = run_cli("-m", *small_run(tmp_path, store, shared_data, "fault.term_step=null,4"))
    assert result.returncode == EXIT_PREEMPTED, result.stderr[-3000:]
    parent, children = sweep_runs(store)
    by_status = {r.info.status: r for r in children}
    assert len(children) == 2 and by_status.keys() == {"FINISHED", "KILLED"}
    assert by_status["KILLED"].data.tags["preempted"] == "true"
    assert parent.info.status == "KILLED"


# -- DDP: SIGTERM mid-epoch, then resume -------------------------------------------------------------------


def results(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    return {key: values for key, values in history(uri, run_id).items() if not key.startswith(NOT_RESULTS)}


@pytest.mark.slow
def test_ddp_stopped_by_sigterm_mid_epoch_resumes_to_the_uninterrupted_metrics(tmp_path, store, shared_data):
    """2 gloo ranks; rank 0 SIGTERMs itself after step 4 (epoch 2, step 1 of 3); ``log_every=1`` lets the ranks
    agree at every step, so they stop at the next one together."""
    ddp = ("device=cpu", "parallel=ddp", "parallel.nproc=2", "log_every=1", "skip_finished=false")
    whole = run_cli(*small_run(tmp_path / "whole", store, shared_data, *ddp))
    assert whole.returncode == 0, whole.stderr[-3000:]
    (reference,) = runs(store)

    stopped = run_cli(*small_run(tmp_path / "parts", store, shared_data, *ddp, "fault.term_step=4"))
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    (run,) = [r for r in runs(store) if r.info.run_id != reference.info.run_id]
    assert run.info.status == "KILLED" and run.data.tags["preempted"] == "true"
    state = torch.load(tmp_path / "parts" / "run" / checkpoint.FILE, weights_only=True)
    assert (state["epoch"], state["step"], len(state["running"]["loss"])) == (1, 1, 2)  # both ranks' sums

    again = run_cli(f"resume={run.info.run_id}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert mlflow.MlflowClient(store).get_run(run.info.run_id).info.status == "FINISHED"
    assert set(results(store, run.info.run_id)) >= RESULTS
    assert results(store, run.info.run_id) == results(store, reference.info.run_id)


# -- Ctrl-C twice ------------------------------------------------------------------------------------------


def test_a_second_ctrl_c_stops_at_once():
    preemption = Preemption()
    with preemption.installed(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.signum == signal.SIGINT  # the first: recorded only
        os.kill(os.getpid(), signal.SIGINT)
