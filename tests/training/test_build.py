"""src/training/build.py: the switches a trainer is built with (memory format, torch.compile, in-place activations,
loaders), in real runs."""

from __future__ import annotations

import pytest

from tests.helpers import run_cli, runs, small_run


@pytest.mark.slow
@pytest.mark.parametrize(
    "switch", ["channels_last=true", "model.inplace_act=false", "non_blocking=false", "data.loader=dataloader"]
)
def test_speed_switches_train_and_are_logged(tmp_path, store, shared_data, switch):
    assert run_cli(*small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=2", switch)).returncode == 0
    (run,) = runs(store)
    key, value = switch.split("=")
    assert run.info.status == "FINISHED" and run.data.params[key].lower() == value


@pytest.mark.slow
def test_torch_compile_trains(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=2", "compile=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.params["compile"] == "True"
