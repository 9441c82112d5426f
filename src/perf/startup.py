"""Job start-up: seconds from the process's start, or in a process that runs several jobs (an in-process multirun,
a joblib worker) from the previous job's end, to the first training step, by phase.

Logged per run as ``time/startup_s`` and ``time/startup/<phase>_s``. The first phases are ``imports`` and
``hydra`` in a fresh process, ``between_jobs`` (Hydra's own work between two jobs) in a process that ran a job
before. Wall-clock
time, so the clock travels with the job into spawned DDP ranks.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_previous_job_end: float | None = None
_entry_imported: float | None = None


def process_start() -> float:
    """This process's start (Unix time), from the kernel's record of it."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class StartupClock:
    origin: float
    last: float
    phases: dict[str, float] = field(default_factory=dict)

    @classmethod
    def begin(cls) -> StartupClock:
        """A job's clock, its first phases ending now: ``imports`` then ``hydra`` (from the entry module's
        imports to the job: composition, callbacks, the launcher) in a fresh process, else ``between_jobs``. Without
        :func:`entry_imported` (no entry module: a test, a notebook) ``imports`` runs to now."""
        if _previous_job_end is not None:
            clock = cls(_previous_job_end, _previous_job_end)
            clock.mark("between_jobs")
            return clock
        start = process_start()
        clock = cls(start, start)
        clock.mark("imports", _entry_imported)
        if _entry_imported is not None:
            clock.mark("hydra")
        return clock

    def mark(self, phase: str, at: float | None = None) -> None:
        """The phase named ``phase`` ends now, or ``at`` (a phase marked twice adds up)."""
        end = time.time() if at is None else at
        self.phases[phase] = self.phases.get(phase, 0.0) + end - self.last
        self.last = end

    def imported(self) -> None:
        """The job's own imports, made once its config is checked, end now: part of ``imports`` in a fresh process,
        of ``between_jobs`` in one that ran a job before (they are loaded already)."""
        self.mark("imports" if "imports" in self.phases else "between_jobs")

    def summary(self) -> str:
        return ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in self.phases.items())

    def metrics(self) -> dict[str, float]:
        return {"time/startup_s": self.last - self.origin, **{f"time/startup/{k}_s": v for k, v in self.phases.items()}}


def entry_imported() -> None:
    """Called by the entry module once its imports are done: a fresh process's ``imports`` phase ends here."""
    global _entry_imported
    _entry_imported = time.time()


@contextlib.contextmanager
def job_clock() -> Iterator[StartupClock]:
    """The clock of the job run inside; when it ends, however it ends, the next job of this process measures
    its start-up from then."""
    global _previous_job_end
    try:
        yield StartupClock.begin()
    finally:
        _previous_job_end = time.time()
