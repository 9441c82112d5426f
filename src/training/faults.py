"""``fault.*`` (tests): after a given optimizer step this rank dies (SIGKILL), is asked to stop (SIGTERM), or
raises a real out-of-memory error; attached to a Trainer as an ``after_step`` hook."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import torch

from src.config import Config
from src.parallel.dist import Rank


def fault_hooks(cfg: Config, rank: Rank) -> tuple[Callable[[int], None], ...]:
    """The hook injecting ``cfg.fault``'s faults on this rank; none when no fault is set."""
    fault = cfg.fault
    kill = fault.kill_step if fault.kill_rank == rank.rank else None
    term = fault.term_step if rank.is_main else None
    oom = fault.oom_step if cfg.batch_size >= fault.oom_min_batch else None
    if kill is None and term is None and oom is None:
        return ()

    def inject(step: int) -> None:
        if step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == term:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == oom:
            raise torch.OutOfMemoryError(f"out of memory injected by fault.oom_step={step}")

    return (inject,)
