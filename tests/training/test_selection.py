"""``select_by``: which epoch's weights a run tests, on a constructed validation history with a one-epoch spike."""

from __future__ import annotations

import math

import pytest

from src.config import SelectBy
from src.training.selection import SMOOTHING, Selection
from tests.training.helpers import trainer_for

# epoch 2 is a spike (the Adrenal seed-2 case of docs/accuracy.md: a high AUC, a high loss); 5-7 have settled
AUC = [0.70, 0.86, 0.62, 0.74, 0.80, 0.81, 0.80]
LOSS = [0.60, 2.90, 0.70, 0.52, 0.45, 0.44, 0.46]


def picked(rule: SelectBy, auc=AUC, loss=LOSS) -> int:
    selection, best = Selection(rule), 0
    for epoch, (area, entropy) in enumerate(zip(auc, loss, strict=True), start=1):
        if selection.improves({"val/auc": area, "val/loss": entropy}, epoch, first=epoch == 1):
            best = epoch
    return best


def test_each_rule_picks_its_epoch_from_a_history_with_a_spike():
    assert picked(SelectBy.val_auc) == 2  # the protocol keeps the spike
    assert picked(SelectBy.val_loss) == 6
    assert picked(SelectBy.last) == len(AUC)
    smoothed, averages = AUC[0], [AUC[0]]
    for auc in AUC[1:]:
        smoothed = SMOOTHING * smoothed + (1 - SMOOTHING) * auc
        averages.append(smoothed)
    assert picked(SelectBy.val_auc_smoothed) == max(range(len(AUC)), key=averages.__getitem__) + 1 != 2


def test_an_undefined_first_score_does_not_block_later_epochs():
    assert picked(SelectBy.val_auc, auc=[math.nan, 0.6, 0.7], loss=LOSS[:3]) == 3
    assert picked(SelectBy.val_auc_smoothed, auc=[math.nan, 0.6, 0.7], loss=LOSS[:3]) == 3


@pytest.mark.parametrize("rule,epoch", [("last", 3), ("val_auc", None)])
def test_the_trainer_tests_the_epoch_its_rule_picks(shared_data, rule, epoch):
    trainer = trainer_for("epochs=3", "limit_batches=2", "batch_size=4", f"select_by={rule}", data_root=shared_data)
    logged = []
    final = trainer.fit(lambda metrics, step: logged.append(metrics))
    aucs = [m["val/auc"] for m in logged if "val/auc" in m]
    expected = epoch or max(range(len(aucs)), key=aucs.__getitem__) + 1
    assert final["best_epoch"] == expected
