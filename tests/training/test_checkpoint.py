"""src/training/checkpoint.py: the file written atomically, weights only, every generator restored; an old format
upgraded."""

from __future__ import annotations

import random

import numpy as np
import torch

from src.training import checkpoint
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
