"""``rerun=<run id>``: a logged run's config, trained again into a new run."""

from __future__ import annotations

import mlflow
import pytest
from omegaconf import OmegaConf

from src.errors import UsageError
from src.jobs.rerun import rerun_config
from src.tracking.store import ensure_store, experiment_id
from tests.helpers import alias_bomb, compose_config, history, one_error_line, run_cli, runs, small_run


def config_artifact(store: str, run_id: str, folder) -> dict:
    path = mlflow.MlflowClient(store).download_artifacts(run_id, ".hydra/config.yaml", str(folder))
    return OmegaConf.to_container(OmegaConf.load(path))


@pytest.mark.slow
def test_a_rerun_repeats_the_run_exactly(tmp_path, store, shared_data):
    assert run_cli(*small_run(tmp_path / "first", store, shared_data, "seed=3", "deterministic=true")).returncode == 0
    (original,) = runs(store)
    result = run_cli(f"rerun={original.info.run_id}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/rerun")
    assert result.returncode == 0, result.stderr[-3000:]
    (rerun,) = [r for r in runs(store) if r.info.run_id != original.info.run_id]

    assert rerun.info.status == "FINISHED" and rerun.data.tags["rerun_of"] == original.info.run_id
    assert rerun.data.params == original.data.params
    assert rerun.data.tags["config_hash"] == original.data.tags["config_hash"]
    for key in ("test/acc", "test/auc"):
        assert rerun.data.metrics[key] == original.data.metrics[key], key
    assert history(store, rerun.info.run_id)["train/loss"] == history(store, original.info.run_id)["train/loss"]
    assert config_artifact(store, rerun.info.run_id, tmp_path / "a") == config_artifact(
        store, original.info.run_id, tmp_path / "b"
    )  # the artifact is what was trained, not the command line


@pytest.mark.slow
def test_a_rerun_with_a_result_key_fails_in_one_line(tmp_path, store, shared_data):
    assert run_cli(*small_run(tmp_path, store, shared_data, "epochs=1")).returncode == 0
    (original,) = runs(store)
    result = run_cli(
        f"rerun={original.info.run_id}", f"mlflow.tracking_uri={store}", "seed=5", f"hydra.run.dir={tmp_path}/rerun"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: seed cannot change next to rerun=")
    assert [r.info.run_id for r in runs(store)] == [original.info.run_id]


def refused(store: str, *overrides: str) -> str:
    cfg = compose_config(*overrides, f"mlflow.tracking_uri={store}")
    with pytest.raises(UsageError) as err:
        rerun_config(cfg, list(overrides), store)
    return str(err.value)


def test_unknown_runs_runs_without_a_config_and_result_keys_are_refused(tmp_path, store):
    assert "rerun=0123abcd is not a run in" in refused(store, "rerun=0123abcd")
    assert "is not a run in" in refused(f"sqlite:///{tmp_path / 'fresh.db'}", "rerun=0123abcd")
    assert not (tmp_path / "fresh.db").exists()  # a store not created yet stays so
    client = ensure_store(store)
    empty = client.create_run(experiment_id(client, "medsweep")).info.run_id
    assert f"rerun={empty} has no .hydra/config.yaml artifact" in refused(store, f"rerun={empty}")
    message = refused(store, f"rerun={empty}", "data.root=/x", "model=resnet18")
    assert message.startswith(f"model cannot change next to rerun={empty}") and "data.root" in message


def test_non_result_keys_replace_the_logged_ones(tmp_path, store, capfd):
    client = ensure_store(store)
    logged = compose_config("model=resnet10", "seed=4", "data.root=/old", "mlflow.experiment=old")
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(logged, tmp_path / ".hydra" / "config.yaml")
    run_id = client.create_run(experiment_id(client, "medsweep")).info.run_id
    client.log_artifacts(run_id, str(tmp_path / ".hydra"), ".hydra")

    overrides = [f"rerun={run_id}", "data.root=/new"]
    rebuilt, _ = rerun_config(compose_config(*overrides, f"mlflow.tracking_uri={store}"), overrides, store)
    assert (rebuilt.model.name, rebuilt.seed, rebuilt.data.root) == ("resnet10", 4, "/new")
    assert (rebuilt.mlflow.tracking_uri, rebuilt.mlflow.experiment, rebuilt.rerun) == (store, "old", None)
    assert "Downloading artifacts" not in capfd.readouterr().err  # no tqdm bar before the job's log


def test_a_rerun_takes_the_name_of_the_run_and_the_threads_it_trained_with(tmp_path, store):
    """A config that left the thread count to the machine (``num_threads=null``) reruns with the count the run
    logged (its ``num_threads`` tag): results depend on it."""
    client = ensure_store(store)
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_config("model=resnet10"), tmp_path / ".hydra" / "config.yaml")
    tags = {"num_threads": "3", "mlflow.runName": "model=resnet10 seed=0"}
    run_id = client.create_run(experiment_id(client, "medsweep"), tags=tags).info.run_id
    client.log_artifacts(run_id, str(tmp_path / ".hydra"), ".hydra")
    overrides = [f"rerun={run_id}"]
    rebuilt, name = rerun_config(compose_config(*overrides, f"mlflow.tracking_uri={store}"), overrides, store)
    assert (rebuilt.num_threads, name) == (3, "model=resnet10 seed=0")


@pytest.mark.parametrize(
    "config,params,trains",
    [
        (("batch_size=auto",), ("12", "1"), (12, 1)),  # probed against the memory free then
        (("batch_size=8", "oom_retry=true"), ("4", "2"), (4, 2)),  # the retry after an out of memory
        (("batch_size=8", "accumulate=2"), ("8", "2"), (8, 2)),  # as configured
        (("batch_size=derived", "effective_batch_size=32", "accumulate=2"), ("16", "2"), ("derived", 2)),  # ranks
    ],
    ids=["auto", "oom-retried", "given", "derived"],
)
def test_a_rerun_trains_the_micro_batch_and_accumulation_the_run_trained(tmp_path, store, config, params, trains):
    client = ensure_store(store)
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_config("model=resnet10", *config), tmp_path / ".hydra" / "config.yaml")
    run_id = client.create_run(experiment_id(client, "medsweep")).info.run_id
    client.log_param(run_id, "batch_size", params[0])
    client.log_param(run_id, "accumulate", params[1])
    client.log_artifacts(run_id, str(tmp_path / ".hydra"), ".hydra")
    overrides = [f"rerun={run_id}"]
    rebuilt, _ = rerun_config(compose_config(*overrides, f"mlflow.tracking_uri={store}"), overrides, store)
    assert (rebuilt.batch_size, rebuilt.accumulate) == trains


@pytest.mark.parametrize(
    "artifact,why",
    [
        ("epochs: [unclosed\n", "while parsing a flow sequence"),
        ("", "missing mandatory value: data"),
        ("model: {old_key: 1}\n", "Key 'old_key' not in 'ModelConfig'"),
    ],
    ids=["not-yaml", "empty", "a-removed-key"],
)
def test_a_damaged_or_outdated_config_artifact_is_one_line(tmp_path, store, artifact, why):
    client = ensure_store(store)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(artifact)
    run_id = client.create_run(experiment_id(client, "medsweep")).info.run_id
    client.log_artifacts(run_id, str(tmp_path / ".hydra"), ".hydra")
    message = refused(store, f"rerun={run_id}")
    assert message.startswith(f"rerun={run_id}: its logged config does not fit today's schema (") and why in message
    assert message.endswith("): check out the run's git_commit tag to rerun it")


@pytest.mark.slow
def test_a_rerun_of_a_config_artifact_holding_an_alias_bomb_is_one_line(tmp_path, store):
    """The artifact is the run's, anyone who logs to the store can replace it: the rerun gave no answer in 60 s."""
    client = ensure_store(store)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(alias_bomb())
    run_id = client.create_run(experiment_id(client, "medsweep")).info.run_id
    client.log_artifacts(run_id, str(tmp_path / ".hydra"), ".hydra")
    result = run_cli(f"rerun={run_id}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/rerun", timeout=60)
    line = one_error_line(result)
    assert line.startswith(f"error: rerun={run_id}: its .hydra/config.yaml artifact ") and "alias" in line, line
    assert [r.info.run_id for r in runs(store)] == [run_id]
