"""src/training/checkpoint_log.py: when a run checkpoints, and its epochs' metrics logged only once a checkpoint holds
them."""

from __future__ import annotations

import pytest
import torch

from src.training import checkpoint
from tests.training.helpers import trainer


@pytest.mark.parametrize("every_s,saved_at", [(0, [1, 2, 3]), (3600, [3, 3, 3])])
def test_an_epochs_metrics_are_logged_only_after_a_checkpoint_that_holds_it(tmp_path, shared_data, every_s, saved_at):
    """``checkpoint.every_s=0`` saves every epoch; a longer interval than the run saves once, after its last epoch,
    and logs every epoch then. Each log reads the checkpoint on disk at that moment."""
    logged = []

    def log(metrics, step):
        logged.append((step, torch.load(tmp_path / checkpoint.FILE, weights_only=True)["epoch"]))

    trainer(shared_data, tmp_path, f"checkpoint.every_s={every_s}").fit(log)
    assert logged[:-1] == list(zip([0, 1, 2], saved_at, strict=True)) and logged[-1] == (3, 3)  # then the test


def test_a_crash_between_checkpoints_logs_none_of_the_epochs_it_retrains(tmp_path, shared_data):
    """A real out-of-memory error in epoch 3 (``fault.oom_step``), no checkpoint written yet: resumed, the run would
    train from its last checkpoint (none: from the start), so nothing was logged."""
    logged = []
    with pytest.raises(torch.OutOfMemoryError):
        trainer(shared_data, tmp_path, "checkpoint.every_s=3600", "fault.oom_step=7").fit(
            lambda metrics, step: logged.append(step)
        )
    assert logged == [] and not (tmp_path / checkpoint.FILE).exists()
