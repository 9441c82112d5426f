"""Stop signals in sweeps and DDP, and where a store's artifacts go: real processes, a real MLflow store."""

from __future__ import annotations

import logging
import math
import signal

import mlflow
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from src.jobs.job import in_sweep
from src.jobs.sweep import read_stop
from src.parallel.preemption import EXIT_PREEMPTED, Preemption
from src.tracking.store import ensure_store, experiment_id
from src.tracking.sweep import parent_status
from src.training import checkpoint
from tests.helpers import RESULTS, ROOT, history, own_messages, run_cli, runs, small_run

NOT_RESULTS = ("perf/", "mem/", "time/")  # measurements of the process, not results


def sweep_runs(store: str) -> tuple[mlflow.entities.Run, list[mlflow.entities.Run]]:
    """The sweep's parent run and its jobs' runs."""
    (parent,) = [r for r in runs(store) if r.data.tags.get("role") == "sweep"]
    return parent, [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]


# -- the parent run's status -------------------------------------------------------------------------------

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


def test_a_sweep_whose_data_is_missing_fails_in_one_line_before_any_run(tmp_path, new_store, shared_data):
    """Every job's data is checked before the first job starts: no parent run, no job run."""
    args = [a for a in small_run(tmp_path, new_store, shared_data) if not a.startswith("data=")]
    result = run_cli("-m", "data=adrenalmnist3d,organmnist3d", *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: job 1 (data=organmnist3d): ")
    assert "organmnist3d.npz not found" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "mlflow.db").exists()  # no store created, so no run


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


# -- artifacts beside an SQLite store ----------------------------------------------------------------------


@pytest.mark.slow
def test_an_sqlite_store_keeps_the_artifacts_beside_it_whatever_the_working_directory(tmp_path, shared_data):
    (tmp_path / "store").mkdir()
    (tmp_path / "cwd").mkdir()
    store = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1"), cwd=tmp_path / "cwd")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    beside = tmp_path / "store" / "mlartifacts" / run.info.experiment_id / run.info.run_id / "artifacts"
    assert run.info.artifact_uri == beside.as_uri()
    assert (beside / "metrics.json").is_file() and (beside / ".hydra" / "config.yaml").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []


def test_an_experiment_with_artifacts_under_the_working_directory_is_used_with_one_warning(
    tmp_path, store, monkeypatch, caplog
):
    client = ensure_store(store)
    created = client.create_experiment("old", artifact_location=str(tmp_path / "mlruns" / "old"))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="src.tracking.store"):
        assert experiment_id(client, "old") == experiment_id(client, "old") == created
    assert own_messages(caplog) == [
        f"experiment old keeps its artifacts in {tmp_path / 'mlruns' / 'old'}, under the working directory "
        f"{tmp_path}: run from another folder, or set mlflow.experiment to a new experiment (its artifacts go "
        "beside the store)"
    ]
    assert client.get_experiment(created).artifact_location == str(tmp_path / "mlruns" / "old")  # left as it is


def test_an_experiment_medsweep_created_beside_the_store_is_used_without_a_warning_from_the_store_folder(
    tmp_path, store, monkeypatch, caplog
):
    """The default store is ``mlflow.db`` at the project root and the docs run from there: the experiment's artifacts
    in ``<root>/mlartifacts/<id>`` are under the working directory, yet where medsweep puts them wherever it runs."""
    client = ensure_store(store)
    created = experiment_id(client, "beside")  # made here: its artifacts in tmp_path / "mlartifacts" / <id>
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="src.tracking.store"):
        assert experiment_id(client, "beside") == created
    assert own_messages(caplog) == []


@pytest.mark.parametrize("signum,stops", [(signal.SIGUSR2, False), (signal.SIGTERM, True)], ids=["USR2", "TERM"])
def test_submitits_timeout_signal_after_a_job_trained_ends_that_job_only(tmp_path, monkeypatch, signum, stops):
    """submitit's timeout signal (USR2) that came during a job's test stopped the whole sweep: on SLURM, with
    ``array_parallelism`` jobs at a time, the jobs not started yet never were."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        composed = compose("config", [f"hydra.sweep.dir={tmp_path}"], return_hydra_config=True)
    with open_dict(composed):
        composed.hydra.job.num = 0
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # the test's Hydra config goes with it
    HydraConfig.instance().set_config(composed)
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
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        composed = compose("config", [f"hydra.sweep.dir={tmp_path}"], return_hydra_config=True)
    with open_dict(composed):
        composed.hydra.job.num = 0
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    HydraConfig.instance().set_config(composed)
    preemption = Preemption()

    def not_requeued(signum, frame):
        raise RuntimeError("Job not requeued because: timed-out too many times.")  # submitit's UncompletedJobError

    preemption._previous[signal.SIGUSR2] = not_requeued

    class Run:
        """Stand-ins here (the run, submitit's refusing handler): a real refusal comes after max_num_timeout real
        timeouts of a submitit_local job, minutes each."""

        run_id = "r"

        def set_tags(self, tags):
            self.tags = tags

        def finish(self, status):
            self.status = status

    run = Run()

    def stopped() -> float:
        preemption.signum = signal.SIGUSR2
        outcome.stop_preempted(run, Preempted("stopped at epoch 1 step 1/3"), preemption)
        return 0.9

    assert math.isnan(in_sweep(OmegaConf.create(), stopped, preemption))
    assert run.status == "KILLED" and run.tags["preempted"] == "true"
    stop = read_stop(tmp_path)
    assert stop is not None and stop.error is None and stop.code == 128 + signal.SIGUSR2  # not "job 0 failed", exit 1


def test_the_optuna_sweeper_records_a_trial_that_returned_nan_as_failed_and_goes_on(monkeypatch):
    """A trial stopped by SIGTERM (or out of memory, diverged) returns NaN: hydra-optuna-sweeper told it FAIL with
    that value, Optuna refused (`ValueError: Values were told. Values cannot be specified when state is ... FAIL`),
    and `python -m src.train -m preset=optuna` ended in a traceback, exit 1, rather than `SIGTERM stopped the sweep`."""
    import optuna

    from src.jobs.sweep import told_failures

    monkeypatch.setattr(optuna.study.Study, "tell", optuna.study.Study.tell)  # undone after the test
    told_failures()
    told_failures()  # once only
    study = optuna.create_study(direction="maximize")
    done, stopped = study.ask(), study.ask()
    study.tell(done, 0.9)
    with pytest.raises(ValueError, match="returned nan"):
        study.tell(stopped, [float("nan")], optuna.trial.TrialState.COMPLETE)  # as the sweeper tells it first
    study.tell(stopped, state=optuna.trial.TrialState.FAIL, values=[float("nan")])  # then as failed
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL]
    assert study.best_trial.number == 0
