"""The sweep presets (``conf/preset/``): the jobs Hydra's sweeper makes of them, and tiny real sweeps."""

from __future__ import annotations

import itertools

import mlflow
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.config import Activation, Config, Init
from src.models import MODELS
from src.perf.autobatch import derived_batch
from tests.helpers import ROOT, jobs, run_cli, runs, small_run


def values(configs: list[Config], *keys: str) -> list[tuple]:
    def get(cfg, key):
        value = OmegaConf.select(OmegaConf.structured(cfg), key)
        return value.name if hasattr(value, "name") and not isinstance(value, str) else value

    return sorted(tuple(get(cfg, key) for key in keys) for cfg in configs)


def test_memory_preset_crosses_the_savers_at_one_effective_batch():
    configs = jobs("preset=memory")
    assert values(configs, "amp", "model.dsconv", "accumulate", "model.checkpointing") == sorted(
        itertools.product([False, True], [False, True], [1, 2, 4], [False, True])
    )
    for cfg in configs:
        assert (cfg.batch_size, cfg.effective_batch_size, cfg.model.name) == ("derived", 32, "densenet121")
        micro = derived_batch(cfg, world=1).batch_size
        assert micro == 32 // cfg.accumulate and micro * cfg.accumulate == 32


def test_an_override_next_to_a_preset_pins_that_key():
    configs = jobs("preset=memory", "amp=true", "model=densenet169", "effective_batch_size=16")
    assert len(configs) == 12 and {(c.amp, c.model.name, c.effective_batch_size) for c in configs} == {
        (True, "densenet169", 16)
    }


def test_activation_init_preset_covers_every_activation_and_init():
    assert values(jobs("preset=activation_init"), "model.activation", "model.init") == sorted(
        itertools.product([a.name for a in Activation], [i.name for i in Init])
    )


def test_models_preset_is_the_whole_zoo():
    assert [name for (name,) in values(jobs("preset=models"), "model.name")] == sorted(MODELS)


def test_seeds_preset_repeats_one_config_three_times():
    configs = jobs("preset=seeds", "model=resnet18", "amp=true")
    assert values(configs, "seed", "model.name", "amp") == [
        (0, "resnet18", True),
        (1, "resnet18", True),
        (2, "resnet18", True),
    ]


def test_parallel_preset_runs_one_process_and_ddp_at_one_effective_batch():
    configs = jobs("preset=parallel")
    assert values(configs, "parallel.mode") == [("ddp",), ("none",)]
    assert {derived_batch(cfg, world).batch_size * world for cfg in configs for world in (1, 2)} == {32}


def test_optuna_preset_searches_lr_and_weight_decay_on_validation_auc():
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["preset=optuna"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize" and sweeper.storage is None
    assert dict(sweeper.params) == {
        "optim.lr": "tag(log, interval(1e-5, 1e-2))",
        "optim.weight_decay": "tag(log, interval(1e-6, 1e-2))",
    }
    assert cfg.objective == "val/auc"


@pytest.mark.slow
def test_memory_preset_runs_tiny_with_the_same_effective_batch(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        "preset=memory",
        *small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=2"),
        "batch_size=derived",
        "effective_batch_size=8",
        "amp=false",
        "model.dsconv=false",
        "model.checkpointing=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    children = [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]
    assert {r.info.status for r in children} == {"FINISHED"}
    assert sorted((int(r.data.params["accumulate"]), int(r.data.params["batch_size"])) for r in children) == [
        (1, 8),
        (2, 4),
        (4, 2),
    ]
    assert {r.data.params["effective_batch_size"] for r in children} == {"8"}


@pytest.mark.slow
def test_a_two_trial_optuna_sweep_logs_two_children_and_maximizes_their_validation_auc(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        "preset=optuna",
        "hydra.sweeper.n_trials=2",
        *small_run(tmp_path, store, shared_data, "epochs=2", "limit_batches=2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    children = [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 2 and {r.info.status for r in children} == {"FINISHED"}
    assert len({r.data.params["optim.lr"] for r in children}) == 2
    parent = next(r for r in runs(store) if r.data.tags.get("role") == "sweep")
    assert parent.info.status == "FINISHED" and {r.data.tags["mlflow.parentRunId"] for r in children} == {
        parent.info.run_id
    }
    client = mlflow.MlflowClient(store)
    best_val = max(m.value for r in children for m in client.get_metric_history(r.info.run_id, "val/auc"))
    assert OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml").best_value == best_val
