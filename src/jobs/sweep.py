"""A sweep (``-m``) from its main process and from its jobs.

The main process (:class:`Sweep`, a Hydra callback) checks every job before the first starts, makes their data ready,
holds the sweep folder, starts an MPS daemon where its jobs share a GPU (:mod:`src.parallel.mps`), opens the parent
run, takes the stop signals (passing them on to the jobs) and ends the command: exit 0, ``128 + signal`` after a stop
signal, or the one ``error:`` line of a failed job. A job (:func:`in_sweep`) never raises to the launcher (joblib
would kill the jobs running beside it): a stop signal or a failure writes the sweep's stop record, after which no job
starts, and running ones end as they would.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.errors import UsageError
from src.folders import held
from src.jobs.sweep_checks import check_jobs
from src.parallel import mps
from src.parallel.preemption import PreemptedExit, Preemption, SignalWatcher, exit_code, requeue_signal
from src.schema_check import check_known_keys
from src.tracking.identity import run_name
from src.tracking.store import check_store, ensure_store, tracking_uri
from src.tracking.sweep import close_parent, fail_parent_run, open_parent

log = logging.getLogger(__name__)

STOP_FILE = ".stop"  # in the sweep folder: why no job starts any more
MPS_DIR = ".mps"  # in the sweep folder: the pipes and log of an MPS daemon started for the sweep (gpu_share)


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why a sweep stopped: ``code`` is its exit code; ``error`` the one line of a failed job."""

    reason: str
    code: int
    error: str | None = None


def write_stop(sweep_dir: Path, stop: Stop) -> None:
    """Record ``stop`` unless a stop is recorded already (the first one stands; ``link`` creates atomically)."""
    path = sweep_dir / STOP_FILE
    partial = path.with_name(f"{STOP_FILE}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(dataclasses.asdict(stop)))
    with contextlib.suppress(FileExistsError):
        os.link(partial, path)
    partial.unlink()


def read_stop(sweep_dir: Path) -> Stop | None:
    path = sweep_dir / STOP_FILE
    return Stop(**json.loads(path.read_text())) if path.is_file() else None


def in_sweep(cfg: DictConfig, run: Callable[[], float], preemption: Preemption) -> float:
    """Run one job of a sweep (``run``), or none once the sweep is stopping; returns NaN rather than raise."""
    hydra_cfg = HydraConfig.get()
    sweep_dir, num = Path(hydra_cfg.sweep.dir), hydra_cfg.job.num
    if (stop := read_stop(sweep_dir)) is not None:
        log.warning("job %d not started: %s", num, stop.reason)
        return math.nan
    try:
        result = run()
    except PreemptedExit:
        if preemption.signum is not None and preemption.signum == requeue_signal():
            raise  # submitit requeues the job, which resumes by itself: the sweep goes on
        write_stop(sweep_dir, signalled(preemption.signum or signal.SIGTERM))
        return math.nan
    except KeyboardInterrupt:
        write_stop(sweep_dir, signalled(signal.SIGINT))
        return math.nan
    except BaseException as error:  # any failure stops the sweep; the main process reports it
        write_stop(sweep_dir, failure(num, hydra_cfg, error))
        with contextlib.suppress(Exception):
            fail_parent_run(cfg)
        return math.nan
    if preemption.requested:  # the signal came after this job's training: it finished, no other job starts
        write_stop(sweep_dir, signalled(preemption.signum))
    return result


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


class Sweep(Callback):
    """Hydra callback of a sweep's main process; see the module's docstring."""

    def __getstate__(self) -> dict:
        return {}  # launchers pickle the callbacks with each job: the main process's folder lock and threads stay

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir, uri = Path(config.hydra.sweep.dir), tracking_uri(config)
        self.held = contextlib.ExitStack()
        try:
            check_known_keys(config, config.hydra.overrides.task)
            check_store(uri)
            check_jobs(config, dry=config.dry_run)
            sharing = mps.sweep_sharing(config)
            if config.dry_run:
                return
            atexit.register(self.held.close)  # an exit before the parent run opens lets the folder and MPS go too
            self.held.enter_context(held(sweep_dir, "sweep", "wait for it to end, or give this one hydra.sweep.dir"))
            client = ensure_store(uri)
            self.held.enter_context(mps.shared(sharing, sweep_dir / MPS_DIR))
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        (sweep_dir / STOP_FILE).unlink(missing_ok=True)  # an earlier sweep's, in a folder given again
        self.sweep_dir = sweep_dir
        self.watcher = SignalWatcher(self.stopped)
        self.watcher.start()
        self.parent = open_parent(config, client, sweep_dir)
        atexit.register(self.close)

    def stopped(self, signum: int) -> None:
        log.warning(
            "received %s: running jobs checkpoint at their next step and stop, no other job starts (a second Ctrl-C "
            "stops them at once)",
            signal.Signals(signum).name,
        )
        write_stop(self.sweep_dir, signalled(signum))

    def close(self, complete: bool = False) -> Stop | None:
        """Stop taking signals, close the parent run, let the folder go; the sweep's stop record, if any."""
        self.watcher.close()
        stop = read_stop(self.sweep_dir)
        close_parent(self.parent, complete and stop is None, stopped=stop is not None and stop.error is None)
        self.held.close()
        return stop

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.dry_run:
            return
        atexit.unregister(self.close)
        stop = self.close(complete=True)
        if stop is None:
            return
        if stop.error is not None:
            print(f"error: {stop.error}", file=sys.stderr)
        else:
            log.warning(
                "%s: finished jobs are kept, stopped ones are resumable: the same command again resumes the sweep",
                stop.reason,
            )
        sys.exit(stop.code)
