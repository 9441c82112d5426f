"""src/tracking/identity.py: a run's identity: the config hash, the code fingerprint,
``skip_finished=true|config|false`` and run names, in real processes and a real MLflow store."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import mlflow
import pytest
from omegaconf import OmegaConf

from src.jobs.plan import skipped_for
from src.tracking.identity import ADDED, NAME_LIMIT, code_fingerprint, config_hash, flatten, run_name
from src.tracking.store import ensure_store, experiment_id, finished_run
from tests.helpers import ROOT, compose_config, own_messages, run_cli, runs, small_run

SMALL_RUN_NAME = (  # small_run's overrides that change results, epochs=1 given after its epochs=2
    "device=cpu data=adrenalmnist3d model=resnet10 model.stem=standard batch_size=4 epochs=1 limit_batches=3 "
    "num_threads=1"
)


def project_copy(tmp_path: Path) -> Path:
    """``src/`` and ``conf/`` copied to ``tmp_path/project``: a project whose code a test may change."""
    copy = tmp_path / "project"
    for folder in ("src", "conf"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def change_a_model(copy: Path) -> None:
    with open(copy / "src" / "models" / "resnet3d.py", "a") as source:
        source.write("# a changed model\n")


def finished(client: mlflow.MlflowClient, tags: dict[str, str], end_time: int) -> str:
    """A FINISHED run with ``tags`` and no params or metrics, as a run from before fingerprints has them."""
    run_id = client.create_run(experiment_id(client, "medsweep"), start_time=0, tags=tags).info.run_id
    client.set_terminated(run_id, "FINISHED", end_time=end_time)
    return run_id


@pytest.mark.parametrize(
    "overrides,name",
    [
        (["model=densenet121", "amp=true", "seed=1"], "model=densenet121 amp=true seed=1"),
        (
            ["mlflow.tracking_uri=sqlite:///x.db", "mlflow.experiment=e", "data.root=/d", "data.download=false"],
            "defaults",
        ),
        (["hydra.sweep.dir=s", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "resume=a", "rerun=b"], "defaults"),
        (["skip_finished=config", "log_every=5", "objective=val/auc", "data.url=http://m", "seed=2"], "seed=2"),
        (["+seed=1", "++amp=true", "~data.download", "+mlflow.x=1"], "seed=1 amp=true"),
        (["epochs=2", "seed=0", "epochs=1"], "epochs=1 seed=0"),  # a key given twice: Hydra applies the last
        ([], "defaults"),
    ],
)
def test_a_run_name_holds_only_the_overrides_that_change_results(overrides, name):
    assert run_name(overrides, "0123456789abcdef") == name


def test_a_long_run_name_is_cut_and_ends_with_the_hash():
    overrides = [f"model.k{i}=value{i}" for i in range(30)]
    name = run_name(overrides, "0123456789abcdef")
    assert len(name) <= NAME_LIMIT and name.endswith("... 0123456789abcdef")
    assert name.startswith("model.k0=value0 model.k1=value1")
    parent = run_name([*overrides, "seed=0,1"], prefix="sweep 12-00-00")
    other = run_name([*overrides, "seed=2,3"], prefix="sweep 12-00-00")
    assert parent.startswith("sweep 12-00-00 model.k0=value0") and len(parent) <= NAME_LIMIT
    assert parent[:-16] == other[:-16] and parent != other  # cut alike, told apart by the hash
    assert run_name(["amp=true,false", "data.root=/d"], prefix="sweep 12-00-00") == "sweep 12-00-00 amp=true,false"


@pytest.mark.parametrize("value,expected", [("true", True), ("True", True), ("false", False), ("config", "config")])
def test_skip_finished_composes_from_the_command_line(value, expected):
    assert OmegaConf.to_object(compose_config(f"skip_finished={value}")).skip_finished == expected


@pytest.mark.parametrize("value", ["maybe", "1", "code"])
def test_a_bad_skip_finished_names_the_value_and_the_allowed_ones(value):
    with pytest.raises(ValueError, match=f"^skip_finished={value} must be true, false or config$"):
        OmegaConf.to_object(compose_config(f"skip_finished={value}"))


def test_the_fingerprint_follows_the_code_that_changes_results(tmp_path):
    same, model, report = (project_copy(tmp_path / name) / "src" for name in ("same", "model", "report"))
    fingerprint = code_fingerprint()
    assert re.fullmatch("[0-9a-f]{16}", fingerprint)
    assert code_fingerprint(same) == fingerprint  # relative paths and bytes: where the tree lies does not count
    change_a_model(model.parent)
    assert code_fingerprint(model) != fingerprint
    with open(report / "report" / "writer.py", "a") as source:
        source.write("# reports read finished runs\n")
    assert code_fingerprint(report) == fingerprint


def test_a_run_logged_without_a_fingerprint_counts_as_other_code(tmp_path, store, caplog):
    """A store holding a FINISHED run of this config from before fingerprints (its tags written directly)."""
    cfg = OmegaConf.to_object(compose_config("seed=7", f"mlflow.tracking_uri={store}"))
    client = ensure_store(store)
    old = finished(client, {"config_hash": "h"}, end_time=1000)
    assert finished_run(store, "medsweep", "h", code_fingerprint()).info.run_id == old
    with caplog.at_level(logging.INFO, logger="src.jobs.plan"):
        assert skipped_for(cfg, "h", ["seed=7", f"mlflow.tracking_uri={store}"]) is None
    assert own_messages(caplog) == [
        f"running seed=7 again: run {old} FINISHED with this config but other code "
        f"(code_fingerprint none -> {code_fingerprint()}); skip_finished=config would skip it"
    ]
    config_only = OmegaConf.to_object(compose_config("seed=7", f"mlflow.tracking_uri={store}", "skip_finished=config"))
    assert skipped_for(config_only, "h", []).info.run_id == old

    new = finished(client, {"config_hash": "h", "code_fingerprint": code_fingerprint()}, end_time=2000)
    later = finished(client, {"config_hash": "h"}, end_time=3000)
    assert skipped_for(cfg, "h", []).info.run_id == new  # this code's run, though another finished later
    assert finished_run(store, "medsweep", "h", "other").info.run_id == later


@pytest.mark.slow
def test_a_sweep_run_again_after_a_model_change_trains_every_job_again(tmp_path, store, shared_data):
    copy = project_copy(tmp_path)
    sweep = ("epochs=1", "seed=0,1")

    first = run_cli("-m", *small_run(tmp_path / "first", store, shared_data, *sweep), cwd=copy)
    assert first.returncode == 0, first.stderr[-3000:]
    before = runs(store)
    old = code_fingerprint(copy / "src")
    assert old == code_fingerprint() and {r.data.tags["code_fingerprint"] for r in before} == {old}
    names = sorted(r.info.run_name for r in before)
    assert names[:2] == [f"{SMALL_RUN_NAME} seed=0", f"{SMALL_RUN_NAME} seed=1"]
    assert names[2] == f"sweep sweep {SMALL_RUN_NAME} seed=0,1"
    assert all(len(name) <= NAME_LIMIT for name in names)
    assert not any("mlflow." in name or "data.root" in name or str(tmp_path) in name for name in names)
    trained = {r.data.params["seed"]: r.info.run_id for r in before if "seed" in r.data.params}

    change_a_model(copy)
    new = code_fingerprint.__wrapped__(copy / "src")  # the changed tree, not this process's cached reading
    assert new != old
    config_only = run_cli(
        "-m", *small_run(tmp_path / "config", store, shared_data, *sweep, "skip_finished=config"), cwd=copy
    )
    assert config_only.returncode == 0, config_only.stderr[-3000:]
    assert {r.info.run_id for r in runs(store) if r.data.tags.get("role") != "sweep"} == set(trained.values())
    log = config_only.stdout + config_only.stderr
    assert f"skipping {SMALL_RUN_NAME} seed=0: run {trained['0']} FINISHED with the same config\n" in log

    again = run_cli("-m", *small_run(tmp_path / "again", store, shared_data, *sweep), cwd=copy)
    assert again.returncode == 0, again.stderr[-3000:]
    retrained = [r for r in runs(store) if r.info.run_id not in {r.info.run_id for r in before}]
    children = [r for r in retrained if r.data.tags.get("role") != "sweep"]
    assert sorted(r.data.params["seed"] for r in children) == ["0", "1"]
    assert {r.info.status for r in children} == {"FINISHED"}
    assert {r.data.tags["code_fingerprint"] for r in retrained} == {new}
    log = again.stdout + again.stderr
    for seed in ("0", "1"):
        line = (
            f"running {SMALL_RUN_NAME} seed={seed} again: run {trained[seed]} FINISHED with this config but other "
            f"code (code_fingerprint {old} -> {new}); skip_finished=config would skip it"
        )
        assert log.count(line) == 1, log[-3000:]
    assert "skipping" not in log
    assert mlflow.MlflowClient(store).get_run(trained["0"]).data.tags["code_fingerprint"] == old


@pytest.mark.parametrize(
    "overrides", [("select_by=val_auc",), ("model=resnet18", "amp=true", "select_by=val_auc"), ("data=vesselmnist3d",)]
)
def test_keys_added_later_keep_the_hashes_of_runs_logged_before_them(overrides):
    """A run logged before ``select_by`` and the ``data=nifti`` keys existed had none of them in its params: its hash
    is the hash of today's config at their old behaviour; another value of one of them is another config."""
    params = flatten(compose_config(*overrides))
    before = {key: value for key, value in params.items() if key not in ADDED or ADDED[key] != value}
    assert config_hash(params) == config_hash(before)
    assert config_hash({**params, "select_by": "last"}) != config_hash(params)


def test_the_hash_ignores_where_a_run_logs_and_how_it_is_started():
    base = config_hash(flatten(compose_config("seed=1")))
    same = compose_config(
        "seed=1",
        "mlflow.tracking_uri=sqlite:///other.db",
        "mlflow.experiment=e",
        "data.root=/x",
        "data.download=false",
        "skip_finished=false",
        "rerun=abc",
        "objective=val/auc",
    )
    assert config_hash(flatten(same)) == base
    for override in ("seed=2", "model.dsconv=true", "batch_size=derived"):
        extra = ("effective_batch_size=32",) if override == "batch_size=derived" else ()
        assert config_hash(flatten(compose_config("seed=1", override, *extra))) != base, override
