"""src/jobs/plan.py: a job's plan: ``skip_finished`` (a sweep started again runs only the configs without a FINISHED
run), what ``resume=`` and a new run in a folder refuse."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from src.errors import UsageError
from src.jobs.plan import plan_job
from src.tracking.store import ensure_store
from src.training import checkpoint
from tests.helpers import ROOT, children, compose_config, hydra_job, run_cli, runs, small_run
from tests.jobs.helpers import unfinished_run


def finished_seeds(store: str) -> list[str]:
    return sorted(r.data.params["seed"] for r in children(store) if r.info.status == "FINISHED")


@pytest.mark.slow
def test_a_killed_sweep_started_again_runs_only_the_unfinished_jobs(tmp_path, store, shared_data):
    args = ("-m", *small_run(tmp_path, store, shared_data, "epochs=1", "seed=0,1,2,3"))
    ensure_store(store)  # created once, before the sweep's process and this test's polling open it
    with open(tmp_path / "first.log", "w") as out:
        first = subprocess.Popen(
            [sys.executable, "-m", "src.train", *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            deadline = time.monotonic() + 900  # two tiny jobs: ~1 min, minutes on a loaded machine
            while len(finished_seeds(store)) < 2:
                assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
                time.sleep(0.2)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert finished_seeds(store) == ["0", "1"]
    before = {r.info.run_id for r in runs(store)}

    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    (parent,) = [r for r in runs(store) if r.data.tags.get("role") == "sweep" and r.info.run_id not in before]
    trained = [r for r in children(store) if r.data.tags["mlflow.parentRunId"] == parent.info.run_id]
    assert sorted(r.data.params["seed"] for r in trained) == ["2", "3"]  # new, or resumed from the killed sweep
    assert {r.info.status for r in trained} == {"FINISHED"}
    assert finished_seeds(store) == ["0", "1", "2", "3"]  # one each
    assert parent.info.status == "FINISHED"
    done = {r.data.params["seed"]: r.info.run_id for r in children(store) if r.info.status == "FINISHED"}
    skipped = {k: v for k, v in parent.data.tags.items() if k.startswith("skipped.")}
    assert skipped.keys() == {"skipped.0", "skipped.1"}
    for job, seed in (("0", "0"), ("1", "1")):
        assert f"seed={seed}" in skipped[f"skipped.{job}"] and skipped[f"skipped.{job}"].endswith(f"-> {done[seed]}")
    log = result.stdout + result.stderr
    assert log.count("FINISHED with the same config") == 2 and f"run {done['0']} FINISHED" in log


@pytest.mark.slow
def test_a_finished_single_run_is_skipped_unless_skip_finished_is_false(tmp_path, store, shared_data):
    args = small_run(tmp_path, store, shared_data, "epochs=1", "deterministic=true")
    assert run_cli(*args).returncode == 0
    (first,) = runs(store)

    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run {first.info.run_id} FINISHED with the same config" in again.stdout + again.stderr
    assert [r.info.run_id for r in runs(store)] == [first.info.run_id]

    forced = run_cli(*args, "skip_finished=false", f"hydra.run.dir={tmp_path}/forced")  # run/ holds the first's best.pt
    assert forced.returncode == 0, forced.stderr[-3000:]
    second = next(r for r in runs(store) if r.info.run_id != first.info.run_id)
    assert second.info.status == "FINISHED"
    assert second.data.tags["config_hash"] == first.data.tags["config_hash"]
    assert second.data.metrics["test/auc"] == first.data.metrics["test/auc"]


def test_resume_of_a_config_that_already_finished_is_refused(tmp_path, store):
    client = ensure_store(store)
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    killed = unfinished_run(client, overrides, tmp_path / "a", "KILLED")
    finished = unfinished_run(client, overrides, tmp_path / "b", "FINISHED")
    command = [f"resume={killed}", f"mlflow.tracking_uri={store}"]
    with pytest.raises(UsageError) as refused:
        plan_job(compose_config(*command), hydra_job(tmp_path / "job", command))
    assert str(refused.value) == (
        f"resume={killed}: run {finished} already FINISHED with this config, so resuming run {killed} would train it "
        f"twice: rerun={finished} trains it again, or skip_finished=false resumes anyway"
    )
    anyway = [*command, "skip_finished=false"]
    assert plan_job(compose_config(*anyway), hydra_job(tmp_path / "j", anyway)).resume.run_id == killed


def test_a_new_run_never_overwrites_the_tested_weights_an_earlier_run_left_in_its_folder(tmp_path, store):
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / checkpoint.BEST_FILE).write_bytes(b"weights")
    with pytest.raises(UsageError) as refused:
        plan_job(compose_config(*overrides), hydra_job(tmp_path / "run", overrides))
    assert str(refused.value) == (
        f"{tmp_path / 'run'} holds the tested weights of an earlier run (best.pt), which a new run there would "
        "overwrite: give this job another folder (hydra.run.dir, or hydra.sweep.dir with -m)"
    )
