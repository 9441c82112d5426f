"""src/jobs/outcome.py: how a job's run ends: what it leaves on disk (``checkpoint.keep``), out of memory (tagged,
retried at half the micro-batch), diverged, a full disk or store in one line, a skipped job listed on its sweep."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from src.config import Config
from src.data.loaders import load_splits, to_input
from src.jobs.outcome import attempts, closed_failed
from src.models import build_model
from src.parallel.preemption import EXIT_PREEMPTED
from src.tracking.identity import config_hash, flatten
from src.tracking.runs import RunLogger
from src.tracking.store import ensure_store
from src.training import checkpoint
from src.training.metrics import medmnist_metrics
from tests.helpers import ROOT, children, clean_error_line, compose_config, kill_group, on_cpu, run_cli, runs, small_run


def job_config(folder: Path) -> Config:
    """The config the job in ``folder`` trained (its ``.hydra/config.yaml``), typed."""
    logged = OmegaConf.load(folder / ".hydra" / "config.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), logged))


def assert_best_weights_reproduce_the_test(folder: Path, run: mlflow.entities.Run) -> None:
    """``best.pt`` loads (weights only) into ``build_model`` and gives the logged test predictions and test AUC."""
    cfg = job_config(folder)
    model = build_model(cfg.model, cfg.data)
    weights = torch.load(folder / checkpoint.BEST_FILE, weights_only=True)
    assert all(w.dtype == torch.float32 for w in weights.values() if w.is_floating_point())
    model.load_state_dict(weights)
    logged = pd.read_csv(folder / "eval" / "test_predictions.csv")
    images, labels = load_splits(cfg.data)["test"]
    with torch.no_grad():
        scores = model.eval()(to_input(images[: len(logged)])).softmax(1).numpy()
    np.testing.assert_allclose(scores, logged.filter(like="score_").to_numpy(), atol=1e-5)
    assert np.array_equal(labels[: len(logged)].numpy(), logged["label"].to_numpy())
    auc = medmnist_metrics(logged["label"].to_numpy(), scores, cfg.data.task)["auc"]
    assert auc == pytest.approx(run.data.metrics["test/auc"], abs=1e-6)


def assert_finished_with_best_weights(store: str, run: mlflow.entities.Run, folder: Path) -> None:
    assert run.info.status == "FINISHED"
    assert run.data.tags["best_weights"] == str((folder / checkpoint.BEST_FILE).resolve())
    artifacts = {a.path for a in mlflow.MlflowClient(store).list_artifacts(run.info.run_id)}
    assert {".hydra", "eval", "metrics.json"} <= artifacts  # what stays in MLflow
    assert not {checkpoint.FILE, checkpoint.BEST_FILE} & artifacts  # weights stay on disk once, named by the tag


def test_checkpoint_keep_changes_no_result_and_takes_only_its_members():
    assert config_hash(flatten(compose_config("checkpoint.keep=always"))) == config_hash(flatten(compose_config()))
    assert compose_config().checkpoint.keep.name == "last"
    with pytest.raises(ConfigCompositionException) as err:
        compose_config("checkpoint.keep=never")
    assert "Invalid value 'never', expected one of [last, always]" in str(err.value.__cause__)


@pytest.mark.slow
def test_a_finished_sweep_leaves_best_weights_and_no_checkpoint(tmp_path, store, shared_data):
    result = run_cli("-m", *small_run(tmp_path, store, shared_data, "seed=0,1"))
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = tmp_path / "sweep"
    assert list(sweep.rglob(checkpoint.FILE)) == []
    assert sorted(p.parent.name for p in sweep.rglob(checkpoint.BEST_FILE)) == ["0", "1"]
    jobs = {r.data.params["seed"]: r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")}
    for seed, run in jobs.items():
        folder = sweep / seed  # job number = seed here
        assert_finished_with_best_weights(store, run, folder)
        assert_best_weights_reproduce_the_test(folder, run)


@pytest.mark.slow
def test_checkpoint_keep_always_keeps_the_checkpoint_beside_the_best_weights(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "checkpoint.keep=always"))
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    folder = tmp_path / "run"
    assert_finished_with_best_weights(store, run, folder)
    best = torch.load(folder / checkpoint.BEST_FILE, weights_only=True)
    state = checkpoint.load(folder / checkpoint.FILE)
    assert best.keys() == state["best_state"].keys()
    assert all(torch.equal(best[k], state["best_state"][k]) for k in best)  # the tested weights, the same bytes


@pytest.mark.slow
def test_a_preempted_run_keeps_its_checkpoint_until_its_resume_finishes(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "fault.term_step=4"))  # epoch 2, step 1 of 3
    assert result.returncode == EXIT_PREEMPTED, result.stderr[-3000:]
    folder = tmp_path / "run"
    assert (folder / checkpoint.FILE).is_file() and not (folder / checkpoint.BEST_FILE).exists()
    (run,) = runs(store)
    assert run.info.status == "KILLED"
    again = run_cli(f"resume={run.info.run_id}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (folder / checkpoint.FILE).exists()
    (run,) = runs(store)
    assert_finished_with_best_weights(store, run, folder)  # in the resumed run's folder, not the resuming job's
    assert not list((tmp_path / "again").glob("*.pt"))
    assert_best_weights_reproduce_the_test(folder, run)


@pytest.mark.slow
def test_an_oom_job_is_tagged_and_the_sweep_goes_on(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        *small_run(
            tmp_path, store, shared_data, "epochs=1", "fault.oom_step=1", "fault.oom_min_batch=8", "batch_size=4,8"
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    by_batch = {r.data.params["batch_size"]: r for r in children(store)}
    assert by_batch["4"].info.status == "FINISHED"
    oom = by_batch["8"]
    assert oom.info.status == "FAILED" and oom.data.tags["status"] == "oom" and oom.data.tags["retried"] == "false"
    assert oom.data.metrics["mem/peak_mb"] > 0
    parent = next(r for r in runs(store) if r.data.tags.get("role") == "sweep")
    assert parent.info.status == "FAILED"  # a job of the sweep failed


@pytest.mark.slow
def test_oom_retry_halves_the_micro_batch_and_keeps_the_effective_batch(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        *small_run(
            tmp_path,
            store,
            shared_data,
            "epochs=1",
            "batch_size=8",
            "accumulate=1",
            "oom_retry=true",
            "fault.oom_step=1",
            "fault.oom_min_batch=8",
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (first,) = [r for r in children(store) if r.data.tags.get("status") == "oom"]
    (retry,) = [r for r in children(store) if r.info.status == "FINISHED"]
    assert first.data.tags["retried"] == "true" and retry.data.tags["retry_of"] == first.info.run_id
    assert (retry.data.params["batch_size"], retry.data.params["accumulate"]) == ("4", "2")
    assert first.data.params["effective_batch_size"] == retry.data.params["effective_batch_size"] == "8"
    parent = next(r for r in runs(store) if r.data.tags.get("role") == "sweep")
    assert parent.info.status == "FINISHED"  # the job's last attempt succeeded


@pytest.mark.parametrize(
    "overrides,batches", [([], [8, 4, 2]), (["data.size=64"], [8, 4, 2, 1]), (["model.norm=group"], [8, 4, 2, 1])]
)
def test_oom_retries_stop_before_one_sample_batchnorm_cannot_train_on(shared_data, overrides, batches):
    cfg = OmegaConf.to_object(
        compose_config("model=resnet10", "batch_size=8", "oom_retry=true", f"data.root={shared_data}", *overrides)
    )
    assert [(c.batch_size, c.accumulate) for c in attempts(cfg)] == [(b, 8 // b) for b in batches]


@pytest.mark.parametrize(
    "overrides,retried", [(["batch_size=2"], False), (["batch_size=2", "data.size=64"], True), (["batch_size=4"], True)]
)
def test_an_oom_retry_is_announced_only_where_attempts_makes_one(tmp_path, store, shared_data, overrides, retried):
    """resnet10 at 28^3, batch 2: attempts() stops (one sample on BatchNorm's 1^3 map), so the failed run must not say
    it is retried: the job's loop would end with no attempt left and close the FAILED run FINISHED."""
    cfg = OmegaConf.to_object(
        compose_config("model=resnet10", "oom_retry=true", "epochs=1", f"data.root={shared_data}", *overrides)
    )
    (tmp_path / "oom_rank0.json").write_text(json.dumps({"mem/peak_mb": 123.0}))
    plan = type("P", (), {"output_dir": tmp_path, "execution": on_cpu(cfg), "multirun": True})()
    client = ensure_store(store)
    run = RunLogger(client, client.create_run(client.create_experiment("oom")).info.run_id)
    assert closed_failed(run, cfg, plan, torch.OutOfMemoryError("injected")) is retried
    logged = client.get_run(run.run_id)
    assert logged.data.tags["retried"] == str(retried).lower() and logged.info.status == "FAILED"
    assert (len(list(attempts(cfg))) > 1) is retried


@pytest.mark.slow
def test_oom_in_a_single_run_is_one_clear_line(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "fault.oom_step=1"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: out of memory at batch_size=4 (peak ")
    (run,) = runs(store)
    assert run.info.status == "FAILED" and run.data.tags["status"] == "oom"


def test_a_job_whose_config_another_command_trains_now_is_listed_on_its_sweeps_parent_run(tmp_path, store, monkeypatch):
    """Two sweeps sharing a config on one store: the one that found it training in the other trained nothing and
    named nothing, so its report left the config out (`report of 1 runs` for a sweep of 2 jobs, exit 0)."""
    from types import SimpleNamespace

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from src.jobs import outcome
    from src.tracking.sweep import PARENT_ID_FILE, SKIPPED_TAG

    client = ensure_store(store)
    experiment = client.create_experiment("e")
    parent = client.create_run(experiment).info.run_id
    other = client.create_run(experiment).info.run_id  # the other command's run of this config, training now
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / PARENT_ID_FILE).write_text(parent)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        composed = compose("config", [f"hydra.sweep.dir={sweep}"], return_hydra_config=True)
    with open_dict(composed):
        composed.hydra.mode = RunMode.MULTIRUN
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    HydraConfig.instance().set_config(composed)
    plan = SimpleNamespace(busy=other, finished=None, tracking_uri=store, job_num=3, overrides=["seed=0"])
    assert outcome.skip(plan) != outcome.skip(plan)  # NaN: no result of its own yet
    assert client.get_run(parent).data.tags[f"{SKIPPED_TAG}3"] == f"seed=0 -> {other}"


@pytest.mark.slow
def test_a_diverged_run_ends_failed_in_one_line(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1", "optim.lr=1e30"))
    (run,) = runs(store)
    assert clean_error_line(result) == (
        f"error: training diverged: train/loss is nan at epoch 1 step 3 (run {run.info.run_id} FAILED): lower "
        "optim.lr, set grad_clip, or amp=false"
    )
    assert (run.info.status, run.data.tags["status"]) == ("FAILED", "diverged")
    assert "test/auc" not in run.data.metrics


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    """A small tmpfs mounted at ``folder`` (root only); the test skips with the reason where none can be mounted."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.slow
def test_a_full_output_disk_is_one_line_and_the_run_resumes_once_there_is_space(tmp_path, store, shared_data):
    """resnet10's checkpoint is ~230 MB: the first fits in 300 MB, the second (written beside it) does not."""
    with tmpfs(tmp_path / "disk", "300m") as disk:
        every_epoch = ("epochs=2", "checkpoint.every_s=0")
        args = [a for a in small_run(tmp_path, store, shared_data, *every_epoch) if not a.startswith("hydra.run")]
        result = run_cli(*args, f"hydra.run.dir={disk}/run")
        (run,) = runs(store)
        assert clean_error_line(result) == (
            f"error: no space left on {disk}/run (writing checkpoint.pt): run {run.info.run_id} FAILED; its last "
            f"checkpoint is kept: free space, then resume it: python -m src.train resume={run.info.run_id}"
        )
        assert (run.info.status, run.data.tags["status"]) == ("FAILED", "no_space")
        assert checkpoint.load(disk / "run" / checkpoint.FILE)["epoch"] == 1
        subprocess.run(["mount", "-o", "remount,size=800m", str(disk)], check=True)
        again = run_cli(*args, f"hydra.run.dir={tmp_path}/again")  # the same command: it goes on from epoch 2
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = runs(store)
    assert (run.info.status, run.data.tags["resumes"], run.data.tags.get("status")) == ("FINISHED", "1", None)


@pytest.mark.slow
def test_a_store_whose_disk_fills_mid_run_is_one_line_naming_the_run_to_resume(tmp_path, shared_data):
    with tmpfs(tmp_path / "disk", "8m") as disk:
        store = f"sqlite:///{disk / 'mlflow.db'}"
        ensure_store(store)
        args = small_run(tmp_path, store, shared_data, "epochs=20", "mlflow.system_metrics=false")
        process = subprocess.Popen(
            [sys.executable, "-m", "src.train", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 900
            while not (started := runs(store)):  # the run exists: now fill the store's disk
                assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
                time.sleep(0.2)
            with contextlib.suppress(OSError), (disk / "filler").open("wb") as out:
                out.write(b"\0" * (64 << 20))
            stdout, stderr = process.communicate(timeout=900)
        finally:
            kill_group(process)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    run_id = started[0].info.run_id
    go_on = (  # the store failed at the run's first writes, or at an epoch's metrics after its checkpoint
        f"its last checkpoint is kept: fix the store, then resume it: python -m src.train resume={run_id} (or the same "
        "command again)"
        if (tmp_path / "run" / checkpoint.FILE).is_file()
        else "it wrote no checkpoint yet: fix the store, then run the same command again (a new run trains it)"
    )
    assert clean_error_line(result) == (
        f"error: the MLflow store {store} failed (no space left on its disk) with run {run_id}, which may stay "
        f"RUNNING; {go_on}"
    )
