"""src/training/optim.py: the optimizers (fused or per-parameter loops), the warm-up schedule, class weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from src.training.optim import build_optimizer, class_weights
from tests.helpers import compose_config
from tests.training.helpers import trainer_for


def test_class_weights_are_sklearns_balanced_weights():
    from sklearn.utils.class_weight import compute_class_weight

    labels = torch.tensor([0] * 929 + [1] * 259)  # AdrenalMNIST3D's training split
    expected = compute_class_weight("balanced", classes=np.array([0, 1]), y=labels.numpy())
    torch.testing.assert_close(class_weights(labels, 2), torch.from_numpy(expected).float())
    assert class_weights(torch.tensor([0, 0, 2]), 3).tolist() == [0.5, 0.0, 1.0]  # an absent class weighs 0


def test_warmup_scales_the_learning_rate_then_hands_over_to_the_schedule(shared_data):
    trainer = trainer_for("warmup_epochs=2", "epochs=8", "optim.lr=0.01", "limit_batches=1", data_root=shared_data)
    lrs = []
    for _ in range(8):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.scheduler.step()
    assert lrs == pytest.approx([0.001, 0.0055, 0.01, 0.01, 0.001, 0.001, 0.0001, 0.0001])  # multistep at 4, 6


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_fused_optimizer_takes_the_per_parameter_loops_steps(name):
    """``optim.fused=true`` is torch's fused kernel: the loop's update, to float rounding."""
    trained = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv3d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6**3, 3))
        cfg = OmegaConf.to_object(compose_config(f"optim={name}", f"optim.fused={str(fused).lower()}")).optim
        optimizer = build_optimizer(cfg, model.parameters())
        assert optimizer.defaults["fused"] is fused
        for step in range(3):
            torch.manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            optimizer.step()
        trained.append(list(model.parameters()))
    for loop, fused in zip(*trained, strict=True):
        torch.testing.assert_close(fused, loop, rtol=1e-6, atol=1e-7)
