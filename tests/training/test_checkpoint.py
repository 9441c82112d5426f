"""src/training/checkpoint.py: the file written atomically, weights only, every generator restored; an old format
upgraded."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from src.training import checkpoint
from tests.helpers import kill_group, run_cli, runs, small_run, start_command, wait_for_path
from tests.training.helpers import trainer


def test_checkpoint_is_atomic_weights_only_and_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = tmp_path / checkpoint.FILE
    checkpoint.save({"rng": checkpoint.rng_state()}, path)
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILE]  # no temp file left behind
    checkpoint.set_rng_state(torch.load(path, weights_only=True)["rng"])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])


def test_a_checkpoint_from_before_2026_11_27_hands_its_last_epochs_metrics_to_check(tmp_path, shared_data):
    """Such a checkpoint holds ``last_metrics`` (the epoch before ``epoch``), not the list of epochs ``pending``."""
    run = trainer(shared_data, tmp_path, "epochs=2")
    run.fit(lambda metrics, step: None)
    state = torch.load(tmp_path / checkpoint.FILE, weights_only=True)
    assert [epoch for epoch, _ in state.pop("pending")] == [0, 1]  # one checkpoint, written before both were logged
    del state["format"]  # format 1
    old = trainer(shared_data, tmp_path, "epochs=2")
    old.load_state_dict(checkpoint.upgrade({**state, "last_metrics": {"val/auc": 0.5}}))
    assert old.maybe_unlogged == [(1, {"val/auc": 0.5})]


@pytest.mark.slow
def test_a_run_killed_while_it_writes_a_checkpoint_resumes_from_the_one_before_and_leaves_no_temp_file(
    tmp_path, store, shared_data
):
    """SIGKILL during a checkpoint write left its temp file (263 MB for densenet121) in the run folder for good."""
    args = small_run(tmp_path, store, shared_data, "model=resnet18", "epochs=3", "checkpoint.every_s=0")
    process, _ = start_command(tmp_path, *args)
    try:
        wait_for_path(tmp_path / "run", checkpoint.FILE, process)  # epoch 1's
        wait_for_path(tmp_path / "run", f".{checkpoint.FILE}.*.tmp", process)  # epoch 2's, being written
        process.kill()
        process.wait()
    finally:
        kill_group(process)
    (run,) = runs(store)
    assert checkpoint.load(tmp_path / "run" / checkpoint.FILE)["epoch"] == 1  # the one before: whole
    assert list((tmp_path / "run").glob(".*.tmp"))

    again = run_cli(*args)  # the same command: the folder's next holder sweeps the dead write's file
    assert again.returncode == 0, again.stderr[-3000:]
    assert [(r.info.run_id, r.info.status) for r in runs(store)] == [(run.info.run_id, "FINISHED")]
    assert not list((tmp_path / "run").glob(".*.tmp"))
