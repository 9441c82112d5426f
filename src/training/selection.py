"""Which epoch's weights a run keeps to test (``select_by``), scored on validation only: the higher the score, the
better; an epoch whose score is NaN is never chosen over a scored one."""

from __future__ import annotations

import math
from typing import Any

from src.config import SelectBy

SMOOTHING = 0.9  # val_auc_smoothed: 0.9 x the previous epochs' average + 0.1 x this epoch's AUC (nnU-Net's)


class Selection:
    """The selection score of each epoch under ``rule``, and the best one so far."""

    def __init__(self, rule: SelectBy) -> None:
        self.rule = rule
        self.smoothed: float | None = None  # val_auc_smoothed's moving average
        self.best = -math.inf

    def score(self, metrics: dict[str, float], epoch: int) -> float:
        """The score of the epoch whose validation ``metrics`` these are (``epoch``: epochs trained)."""
        if self.rule is SelectBy.val_auc_smoothed:
            auc = metrics["val/auc"]
            self.smoothed = (
                auc
                if self.smoothed is None or math.isnan(self.smoothed)
                else (SMOOTHING * self.smoothed + (1 - SMOOTHING) * auc)
            )
            return self.smoothed
        return {
            SelectBy.val_auc: lambda: metrics["val/auc"],
            SelectBy.val_loss: lambda: -metrics["val/loss"],
            SelectBy.last: lambda: float(epoch),
        }[self.rule]()

    def improves(self, metrics: dict[str, float], epoch: int, first: bool) -> bool:
        """Whether this epoch is the best so far: the first always is (there are weights to test); a scored epoch
        is better than NaN, a NaN one never better."""
        score = self.score(metrics, epoch)
        if first or (not math.isnan(score) and (math.isnan(self.best) or score > self.best)):
            self.best = score
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"smoothed": self.smoothed, "best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.smoothed, self.best = state["smoothed"], state["best"]
