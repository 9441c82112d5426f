"""src/training/ema.py: the exponential moving average of the weights, through a real trainer."""

from __future__ import annotations

import numpy as np
import torch

from src.data.loaders import load_splits, to_input
from tests.training.helpers import tiny_net, trainer_for


def test_ema_follows_the_recurrence_over_optimizer_steps_and_is_what_evaluation_sees(shared_data):
    """EMA weights: the first step's, then ``decay x ema + (1 - decay) x weights`` after each optimizer step."""
    trainer = trainer_for("ema_decay=0.5", "batch_size=4", "accumulate=2", "limit_batches=6", data_root=shared_data)
    expected = {}

    def average(step: int) -> None:
        for name, value in trainer.raw_model.state_dict().items():
            expected[name] = value.clone() if step == 1 else 0.5 * expected[name] + 0.5 * value

    trainer.hooks.after_step = (average,)
    trainer.train_epoch(0)
    averaged, trained = trainer.evaluated.state_dict(), trainer.raw_model.state_dict()
    assert averaged.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(averaged[name], value, rtol=1e-6, atol=1e-7)
        assert not torch.equal(averaged[name], trained[name]), name
    reference = tiny_net()
    reference.load_state_dict(expected)
    images = load_splits(trainer.cfg.data)["val"][0]
    with torch.no_grad():
        scores = reference.eval()(to_input(images)).softmax(1).numpy()
    np.testing.assert_allclose(trainer.predict("val")[2], scores[:24], rtol=0, atol=1e-6)  # limit_batches: 6 x 4
