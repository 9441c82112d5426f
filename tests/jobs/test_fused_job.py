"""src/jobs/fused_job.py: a ``fuse=true`` sweep on the CPU trains its same-shape jobs as one stacked model in the first
job's call, each member its own MLflow run as an unfused sweep's (params, per-epoch metrics, artifacts, predictions to
float32 rounding), tagged with its group; the other job's call trains nothing; ``fuse=auto`` on the CPU keeps jobs
apart and says why."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from src.tracking.store import ensure_store
from tests.helpers import JOBLIB, history, kill_group, run_cli, small_run, start_command, sweep_runs, wait_for_text


def sweep(tmp_path, store, shared_data, name: str, *overrides: str):
    result = run_cli(
        "-m", *small_run(tmp_path / name, store, shared_data, "deterministic=true", "seed=0,1", *overrides)
    )
    assert result.returncode == 0, result.stderr[-4000:]
    parents, jobs = sweep_runs(store)
    assert len(parents) == 1 and len(jobs) == 2
    return result, sorted(jobs, key=lambda run: run.data.params["seed"])


def artifacts(client: MlflowClient, run_id: str, path: str = "") -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def predictions(client: MlflowClient, run_id: str, folder) -> pd.DataFrame:
    return pd.read_csv(client.download_artifacts(run_id, "eval/test_predictions.csv", str(folder)))


@pytest.mark.slow
def test_a_fused_cpu_sweep_gives_each_member_the_run_an_unfused_sweep_gives_it(tmp_path, shared_data):
    fused_store, plain_store = f"sqlite:///{tmp_path / 'fused.db'}", f"sqlite:///{tmp_path / 'plain.db'}"
    result, fused = sweep(tmp_path, fused_store, shared_data, "fused", "fuse=true")
    _, plain = sweep(tmp_path, plain_store, shared_data, "plain")  # fuse=auto: apart on the CPU
    output = result.stdout + result.stderr
    assert "fused group g0: training jobs 0, 1 as one stacked model" in output
    assert "job 1: trained in fused group g0 as run" in output
    groups = {run.data.tags["fuse.group"] for run in fused}
    assert len(groups) == 1 and groups.pop().endswith("#g0")
    for ours, theirs in zip(fused, plain, strict=True):
        assert ours.info.status == theirs.info.status == "FINISHED"
        assert ours.data.tags["fuse"] == "true" and ours.data.tags["fuse.size"] == "2"
        assert theirs.data.tags["fuse"] == "false"
        assert theirs.data.tags["fuse.alone_because"].startswith("fuse=auto fuses on CUDA only")
        assert ours.data.tags["config_hash"] == theirs.data.tags["config_hash"]  # fuse is not hashed: skip, resume
        apart = ("fuse", "mlflow.tracking_uri")  # the sweeps' own stores
        assert {k: v for k, v in ours.data.params.items() if k not in apart} == {
            k: v for k, v in theirs.data.params.items() if k not in apart
        }
        # system metrics are sampled every few seconds; a member's start-up phases are its group's (the first job's)
        varying = ("system/", "time/startup/")
        keys = {key for key in ours.data.metrics.keys() | theirs.data.metrics.keys() if key.startswith(varying)}
        assert ours.data.metrics.keys() - keys == theirs.data.metrics.keys() - keys
        assert "time/startup_s" in ours.data.metrics
        for key in ("train/loss", "val/loss"):  # AUC and accuracy: a rounding flips a near tie, 1/27 of the AUC here
            a, b = history(fused_store, ours.info.run_id)[key], history(plain_store, theirs.info.run_id)[key]
            assert [step for step, _ in a] == [step for step, _ in b]
            np.testing.assert_allclose([v for _, v in a], [v for _, v in b], rtol=1e-3, atol=1e-4)
        mine, reference = MlflowClient(fused_store), MlflowClient(plain_store)
        logged = artifacts(mine, ours.info.run_id)
        assert {".hydra/config.yaml", "eval/test_predictions.csv", "metrics.json"} <= logged
        assert {p for p in artifacts(reference, theirs.info.run_id) if not p.endswith(".log")} <= logged
        ours_csv = predictions(mine, ours.info.run_id, tmp_path / "a" / ours.info.run_id)
        theirs_csv = predictions(reference, theirs.info.run_id, tmp_path / "b" / theirs.info.run_id)
        assert list(ours_csv.columns) == list(theirs_csv.columns)
        assert (ours_csv["label"] == theirs_csv["label"]).all()
        scores = [column for column in ours_csv.columns if column.startswith("score")]
        np.testing.assert_allclose(ours_csv[scores].to_numpy(), theirs_csv[scores].to_numpy(), rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_joblib_workers_of_a_group_train_it_once(tmp_path, store, shared_data):
    """Two workers start the group's jobs at once: one holds the group and trains both, the other returns."""
    _, jobs = sweep(tmp_path, store, shared_data, "joblib", "fuse=true", *JOBLIB)
    assert all(run.info.status == "FINISHED" and run.data.tags["fuse.size"] == "2" for run in jobs)
    again = run_cli(
        "-m", *small_run(tmp_path / "again", store, shared_data, "deterministic=true", "seed=0,1", "fuse=true")
    )
    assert again.returncode == 0 and "skipping" in again.stdout + again.stderr  # finished members are skipped
    assert len(sweep_runs(store)[1]) == 2


@pytest.mark.slow
def test_a_stopped_group_checkpoints_every_member_and_the_same_command_resumes_it_fused(tmp_path, store, shared_data):
    args = ("-m", *small_run(tmp_path, store, shared_data, "epochs=3", "seed=0,1", "fuse=true", "checkpoint.every_s=0"))
    ensure_store(store)
    process, log = start_command(tmp_path / "first", *args)
    try:
        wait_for_text(log, "epoch 1/3 train/loss", process, count=2)  # each member's first epoch logged
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=900) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        kill_group(process)
    _, stopped = sweep_runs(store)
    assert len(stopped) == 2 and all(run.info.status == "KILLED" for run in stopped), log.read_text()[-3000:]
    assert all(run.data.tags["preempted"] == "true" for run in stopped)
    assert all((Path(run.data.tags["output_dir"]) / "checkpoint.pt").is_file() for run in stopped)
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    _, jobs = sweep_runs(store)
    assert {run.info.run_id for run in jobs} == {run.info.run_id for run in stopped}  # the same runs went on
    assert all(run.info.status == "FINISHED" and run.data.tags["fuse.size"] == "2" for run in jobs)
    assert "fused group g0: training jobs 0, 1 as one stacked model" in result.stdout + result.stderr
    for run in jobs:
        assert [step for step, _ in history(store, run.info.run_id)["train/loss"]] == [0, 1, 2]  # each epoch once


@pytest.mark.slow
def test_a_diverged_member_fails_its_run_alone_and_the_group_and_sweep_go_on(tmp_path, store, shared_data):
    lrs = ("optim=sgd", "optim.momentum=0", "optim.lr=0.001,1e30", "log_every=1", "fuse=true")
    result = run_cli("-m", *small_run(tmp_path, store, shared_data, "seed=0,1", *lrs))
    assert result.returncode == 0, result.stderr[-3000:]  # as an unfused sweep: a config that cannot train, it goes on
    _, jobs = sweep_runs(store)
    by_lr = {(run.data.params["seed"], run.data.params["optim.lr"]): run for run in jobs}
    assert len(by_lr) == 4 and all(run.data.tags["fuse.size"] == "4" for run in jobs)
    for seed in ("0", "1"):
        assert by_lr[seed, "0.001"].info.status == "FINISHED"
        assert by_lr[seed, "1e+30"].info.status == "FAILED" and by_lr[seed, "1e+30"].data.tags["status"] == "diverged"
    assert "job 1: trained in fused group g0 as run" in result.stdout + result.stderr
