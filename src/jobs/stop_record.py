"""A sweep's stop record: why no job of the sweep starts any more (a stop signal, a failed job), in its folder; the
first one written stands. Its jobs (:func:`src.jobs.job.in_sweep`) write and read it, its main process
(:mod:`src.jobs.sweep_main`) ends the command with it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
from pathlib import Path

from omegaconf import DictConfig

from src.atomic import temporary
from src.errors import UsageError
from src.parallel.preemption import exit_code
from src.tracking.identity import run_name

log = logging.getLogger(__name__)

STOP_FILE = ".stop"  # in the sweep folder: why no job starts any more


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why a sweep stopped: ``code`` is its exit code; ``error`` the one line of a failed job."""

    reason: str
    code: int
    error: str | None = None


def write_stop(sweep_dir: Path, stop: Stop) -> None:
    """Record ``stop`` unless a stop is recorded already (the first one stands; ``link`` creates atomically)."""
    path = sweep_dir / STOP_FILE
    partial = temporary(path)  # named as remove_stale finds it, should this process die mid-write
    partial.write_text(json.dumps(dataclasses.asdict(stop)))
    with contextlib.suppress(FileExistsError):
        os.link(partial, path)
    partial.unlink()


def read_stop(sweep_dir: Path) -> Stop | None:
    path = sweep_dir / STOP_FILE
    return Stop(**json.loads(path.read_text())) if path.is_file() else None


def signalled(signum: int) -> Stop:
    return Stop(f"{signal.Signals(signum).name} stopped the sweep", exit_code(signum))


def failure(num: int, hydra_cfg: DictConfig, error: BaseException) -> Stop:
    """A failed job's stop: its one line (a :class:`UsageError`'s, exit 2; else the error and the job's log, exit 1,
    its traceback in that log)."""
    name = run_name(hydra_cfg.overrides.task)
    if isinstance(error, UsageError):
        log.error("error: %s", error)
        return Stop(f"job {num} failed", 2, f"job {num} ({name}): {error}")
    log.exception("job %d failed", num)
    where = Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log"
    return Stop(f"job {num} failed", 1, f"job {num} ({name}) failed: {type(error).__name__}: {error} (log: {where})")
