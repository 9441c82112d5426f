"""``skip_finished``: a sweep started again runs only the configs without a FINISHED run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from src.tracking.identity import config_hash, flatten
from src.tracking.store import ensure_store
from tests.helpers import ROOT, compose_config, run_cli, runs, small_run


def children(store: str) -> list:
    return [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]


def finished_seeds(store: str) -> list[str]:
    return sorted(r.data.params["seed"] for r in children(store) if r.info.status == "FINISHED")


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
