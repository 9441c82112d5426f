"""When a run checkpoints, and its epochs' metrics logged only once a checkpoint holds them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from src.training import checkpoint

LogMetrics = Callable[[dict[str, float], int], None]


class CheckpointLog:
    """An epoch is checkpointed to ``path`` (with ``meta``) once ``every_s`` has passed since the last save
    (:meth:`due`), the last epoch and a stopped step always; without a ``path`` every epoch is due. Epochs' metrics
    wait in :attr:`pending` until a checkpoint holds them: a crash in between loses none, one before it retrains
    those epochs, logged once."""

    def __init__(self, path: Path | None, meta: dict[str, Any], every_s: float) -> None:
        self.path, self.meta, self.every_s = path, meta, every_s
        self.pending: list[tuple[int, dict[str, float]]] = []  # (epoch, metrics) of epochs not logged yet
        self.log: LogMetrics | None = None
        self.saved_at = time.perf_counter()

    def start(self, log: LogMetrics) -> None:
        """Training starts: the interval counts from now; ``log`` logs an epoch's metrics."""
        self.log, self.saved_at = log, time.perf_counter()

    def due(self) -> bool:
        return self.path is None or time.perf_counter() - self.saved_at >= self.every_s

    def save(self, state: dict[str, Any]) -> None:
        """Write the checkpoint: ``meta`` and ``state`` (which holds :attr:`pending`)."""
        if self.path is not None:
            checkpoint.save({**self.meta, **state}, self.path)
        self.saved_at = time.perf_counter()

    def flush(self) -> None:
        """Log the pending epochs, which the checkpoint just saved holds."""
        if self.log is not None:
            for epoch, metrics in self.pending:
                self.log(metrics, epoch)
        self.pending = []
