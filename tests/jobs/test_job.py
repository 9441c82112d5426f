"""src/jobs/job.py: one job of ``python -m src.train`` against other processes training its run or config, and a stop
signal after it trained."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys

import mlflow
import pytest
from omegaconf import OmegaConf

from src.folders import held
from src.jobs.job import in_sweep
from src.jobs.stop_record import read_stop
from src.parallel.preemption import Preemption
from src.tracking.store import ensure_store
from tests.helpers import ROOT, clean_error_line, run_cli, runs, small_run
from tests.jobs.helpers import as_sweep_job, unfinished_run


@pytest.mark.slow
def test_a_run_in_use_is_not_resumed_by_another_process(tmp_path, store, shared_data):
    client = ensure_store(store)
    killed = unfinished_run(client, ["model=resnet10"], tmp_path / "run", "KILLED")
    with held(tmp_path / "run", "job", "wait"):
        result = run_cli(f"resume={tmp_path / 'run'}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/x")
    line = clean_error_line(result)
    assert line.startswith(f"error: {tmp_path / 'run'} is in use by another job (pid ")
    assert line.endswith("): it trains the run to resume now: wait for it to end")
    assert mlflow.MlflowClient(store).get_run(killed).info.status == "KILLED"


@pytest.mark.slow
def test_the_same_command_started_twice_at_once_trains_once(tmp_path, store, shared_data):
    """Two identical commands planning at once (``batch_size=auto``'s probes keep each seconds from its run): each
    found no run of the config when it planned; the later run to start goes."""
    path = ":".join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0"}
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "src.train",
                *small_run(tmp_path / str(n), store, shared_data, "batch_size=auto", "epochs=1"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(2)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    assert [run.info.status for run in runs(store)] == ["FINISHED"], outputs
    assert sum("this job trains nothing" in output for output in outputs) == 1


@pytest.mark.parametrize("signum,stops", [(signal.SIGUSR2, False), (signal.SIGTERM, True)], ids=["USR2", "TERM"])
def test_submitits_timeout_signal_after_a_job_trained_ends_that_job_only(tmp_path, monkeypatch, signum, stops):
    """submitit's timeout signal (USR2) that came during a job's test stopped the whole sweep: on SLURM, with
    ``array_parallelism`` jobs at a time, the jobs not started yet never were."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    as_sweep_job(tmp_path, monkeypatch)
    preemption = Preemption()

    def trained() -> float:
        preemption.signum = signum  # the signal came after the training loop: the job finished its test
        return 0.9

    assert in_sweep(OmegaConf.create(), trained, preemption) == 0.9
    assert (read_stop(tmp_path) is not None) == stops


def test_a_submitit_job_its_signal_stopped_that_submitit_will_not_requeue_stops_the_sweep_as_a_signal(
    tmp_path, monkeypatch
):
    """submitit refuses to requeue a job that timed out more than ``max_num_timeout`` times (0 in the shipped
    submitit_slurm preset: its first timeout) by raising from its handler: the checkpointed, KILLED, resumable job
    was reported as failed (`error: job 0 (...) failed: UncompletedJobError: Job not requeued because: timed-out too
    many times.`, exit 1, the parent run FAILED)."""
    from src.jobs import outcome
    from src.parallel.preemption import Preempted

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    as_sweep_job(tmp_path, monkeypatch)
    preemption = Preemption()

    def not_requeued(signum, frame):
        raise RuntimeError("Job not requeued because: timed-out too many times.")  # submitit's UncompletedJobError

    preemption._previous[signal.SIGUSR2] = not_requeued

    class Run:
        """Stand-ins here (the run, submitit's refusing handler): a real refusal comes after max_num_timeout real
        timeouts of a submitit_local job, minutes each."""

        run_id = "r"

        def set_tags(self, tags):
            self.tags = {**getattr(self, "tags", {}), **tags}

        def finish(self, status):
            self.status = status

    run = Run()

    def stopped() -> float:
        preemption.signum = signal.SIGUSR2
        outcome.stop_preempted(run, Preempted("stopped at epoch 1 step 1/3"), preemption)
        return 0.9

    assert math.isnan(in_sweep(OmegaConf.create(), stopped, preemption))
    assert run.status == "KILLED" and run.tags["preempted"] == "true"
    assert run.tags["requeue_refused"] == "Job not requeued because: timed-out too many times."  # why, on the run
    stop = read_stop(tmp_path)
    assert stop is not None and stop.error is None and stop.code == 128 + signal.SIGUSR2  # not "job 0 failed", exit 1
