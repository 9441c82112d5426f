"""A job's process of a sweep killed outright (SIGKILL, the out-of-memory killer, a segfault): a resumable stop of the
sweep in one line, not the launcher's traceback.

joblib: loky, seeing one worker die, SIGKILLs the others at once (their runs stayed RUNNING, with nothing checkpointed
since their last epoch) and joblib raises ``TerminatedWorkerError`` through Hydra (a traceback, the parent run FAILED).
While a joblib sweep runs, its main process instead records the stop (no job starts after it), asks the other workers
to stop as SIGTERM stops them (checkpoint, KILLED, resumable) and waits for their jobs to end before loky ends them.

submitit_local: submitit raised ``UncompletedJobError`` through Hydra for the job without a result (a traceback, its
run left RUNNING, the parent run FAILED). Every job runs in a process of its own, so the others train on to their end;
the stop is recorded at once (no job starts after it).

Either way the main process then closes the dead job's run KILLED (``status=process_gone``) and ends the command with
one ``error:`` line, exit 128 + the signal that killed it: the same command again resumes the sweep."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from src.folders import LOCK_FILE
from src.jobs.stop_record import Stop, write_stop

log = logging.getLogger(__name__)

STOP_WAIT_S = 1800.0  # the most a worker's job is given to reach a step boundary, checkpoint and close its run
POLL_S = 0.2


def killed_by(processes: list) -> int:
    """The signal that ended the first of loky's worker ``processes`` (``multiprocessing`` processes) that died of one;
    SIGKILL where none did (the out-of-memory killer's)."""
    codes = [process.exitcode for process in processes if process.exitcode is not None and process.exitcode < 0]
    return -codes[0] if codes else signal.SIGKILL


def holds_a_job(pid: int) -> bool:
    """Whether process ``pid`` (a worker) runs a job: it holds a job folder's lock file open."""
    try:
        return any(Path(opened.path).name == LOCK_FILE for opened in psutil.Process(pid).open_files())
    except psutil.Error:
        return False


def stop_workers(pids: list[int], wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM the workers ``pids`` and wait until none runs a job (each has checkpointed and closed its run, or
    started none: the sweep's stop record stands), at most ``wait_s``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while (busy := [pid for pid in pids if holds_a_job(pid)]) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if busy:
        log.warning("worker(s) %s still train after %.0f s: loky ends them now", busy, wait_s)


@contextlib.contextmanager
def workers_killed_stop_the_sweep(sweep_dir: Path, ended: Callable[[int], None]) -> Iterator[None]:
    """For the block, loky's end of a broken pool first records the sweep's stop and lets its other workers' jobs stop
    (:func:`stop_workers`); joblib's ``TerminatedWorkerError`` then reaches the sweep as ``ended(signum)``, which ends
    the command. loky and joblib as they were after it."""
    from joblib import Parallel
    from joblib.externals.loky import process_executor

    manager, terminated = process_executor._ExecutorManagerThread, process_executor.TerminatedWorkerError
    end_pool, call, died = manager.terminate_broken, Parallel.__call__, []

    def terminate_broken(self, bpe):
        if isinstance(bpe, terminated):
            workers = list(self.processes.values())
            died.append(killed_by(workers))
            name = signal.Signals(died[0]).name
            write_stop(sweep_dir, Stop(f"a job's process was killed ({name})", 128 + died[0]))
            log.warning("a job's process was killed (%s): the other jobs checkpoint and stop", name)
            stop_workers([worker.pid for worker in workers if worker.exitcode is None])
        return end_pool(self, bpe)

    def parallel_call(self, iterable):
        try:
            return call(self, iterable)
        except terminated:
            if not died:
                raise
            ended(died[0])
            raise

    manager.terminate_broken, Parallel.__call__ = terminate_broken, parallel_call
    try:
        yield
    finally:
        manager.terminate_broken, Parallel.__call__ = end_pool, call


@contextlib.contextmanager
def local_jobs_killed_stop_the_sweep(sweep_dir: Path, ended: Callable[[int], None]) -> Iterator[None]:
    """For the block, a submitit_local job that ended without a result (its process killed: no result file) records
    the sweep's stop and returns NaN (a failed trial to Optuna) to Hydra's launcher, which waits for the other jobs;
    its ``launch`` then ends the sweep as ``ended(signum)``. submitit and the launcher as they were after it."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher
    from submitit.core.utils import UncompletedJobError
    from submitit.local.local import LocalJob

    results, launch, died = LocalJob.results, LocalLauncher.launch, []

    def job_results(self):
        try:
            return results(self)
        except UncompletedJobError:
            code = self._process.poll() if self._process is not None else None  # the controller's: its own signal
            died.append(-code if code is not None and code < 0 else signal.SIGKILL)
            name = signal.Signals(died[-1]).name
            write_stop(sweep_dir, Stop(f"a job's process was killed ({name})", 128 + died[-1]))
            log.warning("a job's process was killed (%s): the other jobs train on, no job starts", name)
            return [JobReturn(overrides=self.submission().args[0], status=JobStatus.COMPLETED, _return_value=math.nan)]

    def launched(self, job_overrides, initial_job_idx):
        returned = launch(self, job_overrides, initial_job_idx)
        if died:
            ended(died[0])
        return returned

    LocalJob.results, LocalLauncher.launch = job_results, launched
    try:
        yield
    finally:
        LocalJob.results, LocalLauncher.launch = results, launch
