"""src/parallel/preemption.py: stop signals in a sweep and in a DDP job, a second Ctrl-C: real processes, a real MLflow
store."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import mlflow
import pytest
import torch

from src.parallel.preemption import EXIT_PREEMPTED, Preemption
from src.training import checkpoint
from tests.helpers import (
    RESULTS,
    history,
    kill_group,
    run_cli,
    runs,
    small_run,
    start_command,
    wait_for_path,
    wait_for_text,
)

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


def signal_once_written(folder: Path, signum: int) -> threading.Thread:
    """A thread that sends this process ``signum`` once an atomic write's temp file appears in ``folder``."""

    def send() -> None:
        while not any(folder.glob(".*.tmp")):
            pass
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_second_ctrl_c_during_a_checkpoint_write_stops_once_the_checkpoint_is_whole(tmp_path):
    """The write was cut: the stop lost its checkpoint (``inline_container.cc ... unexpected pos``, or none at all),
    and the run it served could not be resumed."""
    preemption = Preemption()
    state = {"weights": torch.arange(2**26, dtype=torch.float32)}  # 256 MiB: written in many pieces
    with preemption.installed(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # the first: recorded only
        sender = signal_once_written(tmp_path, signal.SIGINT)
        checkpoint.save(state, tmp_path / checkpoint.FILE)
    sender.join()
    assert torch.equal(checkpoint.load(tmp_path / checkpoint.FILE)["weights"], state["weights"])
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILE]


def test_a_second_ctrl_c_that_lands_in_a_finalizer_is_sent_again_not_printed_and_lost(capfd):
    """Raised in a weakref callback (a joblib worker's), the ``KeyboardInterrupt`` was ignored by Python, which printed
    its traceback (`Exception ignored in: <function WeakValueDictionary...remove>`); the job did not stop at once."""

    class Finalized:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C: its handler runs here, in the finalizer
            sum(range(1000))

    preemption = Preemption()
    with preemption.installed(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # the first: recorded only
        Finalized()  # collected at once
        threading.Event().wait(timeout=120)  # the signal sent again ends the wait
    assert "Traceback" not in capfd.readouterr().err


def test_once_the_stop_is_under_way_another_signal_starts_no_second_one(caplog):
    preemption = Preemption()
    with preemption.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        preemption.begin("checkpointing the stopped step")
        os.kill(os.getpid(), signal.SIGINT)  # raises nothing: the stop is under way
        os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.signum == signal.SIGTERM
    assert sum("the stop is under way (checkpointing the stopped step)" in m for m in caplog.messages) == 2


def two_ctrl_cs(folder: Path, args: tuple[str, ...], first: Callable, second: Callable) -> str:
    """``python -m src.train ARGS`` given Ctrl-C once ``first(process, log)`` returns, again once ``second`` does; its
    output, once it exited 130 without a traceback."""
    process, log = start_command(folder, *args)
    try:
        first(process, log)
        process.send_signal(signal.SIGINT)
        second(process, log)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=600) == 130, log.read_text()[-3000:]
    finally:
        kill_group(process)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    return text


def test_a_rank_of_several_stops_with_the_others_on_a_second_ctrl_c(caplog):
    """Two Ctrl-Cs to a DDP job (its process group) stopped the job's process at once while rank 0 still wrote the
    stop's checkpoint: the run, seen without a checkpoint, was deleted, and the checkpoint written after it refused the
    same command (`holds the checkpoint of run ..., deleted`)."""
    preemption = Preemption()
    preemption.stop_together()
    with preemption.installed():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # raises nothing: the ranks stop together
    assert preemption.signum == signal.SIGINT and preemption.under_way is None
    assert any("the ranks stop together" in m for m in caplog.messages)


@pytest.mark.slow
def test_two_ctrl_cs_while_the_stop_writes_its_checkpoint_leave_a_resumable_run(tmp_path, store, shared_data):
    """The second Ctrl-C cut the stop's checkpoint: the run ended KILLED with nothing to resume, and the same command
    trained a second run of the config beside it."""
    args = small_run(tmp_path, store, shared_data, "model=resnet18", "limit_batches=6")  # a 0.5 GB checkpoint
    text = two_ctrl_cs(
        tmp_path,
        args,
        lambda process, log: wait_for_text(log, "start-up", process),  # it trains
        lambda process, log: wait_for_path(tmp_path / "run", ".checkpoint.pt.*.tmp", process),  # the stop's write
    )
    assert "the stop is under way" in text, text[-3000:]
    (run,) = runs(store)
    assert (run.info.status, run.data.tags["preempted"]) == ("KILLED", "true")
    assert checkpoint.load(tmp_path / "run" / checkpoint.FILE)["run_id"] == run.info.run_id
    assert not list((tmp_path / "run").glob(".*.tmp"))

    again = run_cli(*args)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert [(r.info.run_id, r.info.status) for r in runs(store)] == [(run.info.run_id, "FINISHED")]


@pytest.mark.slow
def test_a_second_ctrl_c_before_the_first_checkpoint_leaves_no_run_beside_the_one_the_same_command_trains(
    tmp_path, store, shared_data
):
    """Stopped at once before its first checkpoint, the run had nothing to resume: it stayed KILLED, and the same
    command trained the config in a second run."""
    args = small_run(tmp_path, store, shared_data)
    text = two_ctrl_cs(
        tmp_path,
        args,
        lambda process, log: wait_for_text(log, "rank 0/1 on cpu", process),  # the run exists; the model is next
        lambda process, log: wait_for_text(log, "received SIGINT", process),
    )
    assert "nothing to resume" in text, text[-3000:]
    assert runs(store) == []  # deleted: it held no epoch
    assert not (tmp_path / "run" / checkpoint.FILE).exists()

    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r.info.status for r in runs(store)] == ["FINISHED"]
