"""What a run leaves on disk (``checkpoint.keep``): real sweeps, a real SIGTERM and ``resume=``, a real MLflow store."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from src.config import Config
from src.data import load_splits, to_input
from src.models import build_model
from src.parallel.preemption import EXIT_PREEMPTED
from src.tracking.identity import config_hash, flatten
from src.training import checkpoint
from src.training.metrics import medmnist_metrics
from tests.helpers import compose_config, run_cli, runs, small_run


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
