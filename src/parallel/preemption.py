"""Stop requests by signal (SIGTERM: SLURM preemption, ``kill``; SIGINT: Ctrl-C; SIGHUP: the terminal or SSH connection
closed, unless ``nohup`` ignores it; submitit's requeue signal), acted on between steps, and the stop signals of a
sweep's main process."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

import psutil

from src.atomic import uninterrupted_now, when_uninterrupted
from src.errors import UsageError

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143, the shell's code for "terminated by SIGTERM"
HANGUP = (signal.SIGHUP,) if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL else ()  # () under nohup: ignored
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, *HANGUP)
AT_ONCE = "stopping at once"  # a job's stop under way after a second Ctrl-C
AGAIN_S = 0.05  # a second Ctrl-C Python ignored (raised in a finalizer) is sent again after this many seconds


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by ``signum``: 143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP."""
    return 128 + signum


class Preempted(Exception):
    """Raised on every rank once a stop request was honoured and the checkpoint is written."""


class PreemptedExit(SystemExit):
    """The job's exit after a preemption (checkpointed, resumable): ``exit_code(signal)``, or submitit's own code."""


def requeue_signal() -> signal.Signals | None:
    """submitit's preemption/timeout signal in a submitit job (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default)."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    name = "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    if name not in signal.Signals.__members__:
        raise UsageError(
            f"SUBMITIT_PREEMPT_SIGNAL={name[3:]} in the environment is not a signal: use USR2, or unset it"
        )
    return signal.Signals[name]


def stop_signals() -> list[signal.Signals]:
    return [*STOP_SIGNALS, *filter(None, [requeue_signal()])]


@contextlib.contextmanager
def signals_blocked(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Block ``signals`` in this thread for the block: processes started inside inherit them blocked (pending until
    they install their own handlers), not killed by them."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class Preemption:
    """While installed, a stop signal only records itself and is passed on, as SIGTERM, to child processes; a second
    Ctrl-C raises :class:`KeyboardInterrupt` at once, but never inside a checkpoint write (it waits for the file to be
    whole: :func:`src.atomic.uninterrupted`) nor once the stop is under way (:meth:`begin`): a signal then is only
    said on the console.

    The training loop checks :attr:`requested` at optimizer-step boundaries (a Python attribute, no device sync),
    checkpoints and raises :class:`Preempted`. :meth:`hand_over` then calls submitit's requeue handler when that was
    the signal.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.refused: str | None = None  # why submitit did not requeue the job its signal stopped
        self.under_way: str | None = None  # the job's stop or end, once begun: what it does
        self._together = False  # a rank of several: it stops with the others, at a step they agree on
        self._previous: dict[int, object] = {}
        self._children: Sequence = ()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stop_together(self) -> None:
        """This process is one of several ranks: a second Ctrl-C does not stop it at once (alone, it would leave the
        others waiting in a collective, and their job FAILED), it stops with them at their next agreed step."""
        self._together = True

    def begin(self, what: str) -> None:
        """The job's stop (or its end) is under way, doing ``what``: no signal from now on interrupts it."""
        self.under_way = what

    def _record(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            log.warning("received %s: stopping at the next step boundary (a second Ctrl-C stops at once)", name)
            self.signum = signum
        elif self.under_way is not None:
            log.warning("received %s: the stop is under way (%s), it ends by itself", name, self.under_way)
        elif signum == signal.SIGINT and (self._together or self._children):  # ranks, or the job starting them
            log.warning(
                "received SIGINT again: the ranks stop together at their next agreed step (the stop is under way)"
            )
        elif signum == signal.SIGINT and (doing := uninterrupted_now()) is not None:
            log.warning("received SIGINT again: stopping at once when %s is done (the stop is under way)", doing)
            self.begin(f"stopping when {doing} is done")
            when_uninterrupted(self._stop_now)
        elif signum == signal.SIGINT:
            self._forward()
            self._stop_now()
        else:
            log.warning("received %s: the stop is under way (at the next step boundary)", name)
        self._forward()

    def _stop_now(self) -> NoReturn:
        self.begin(AT_ONCE)
        raise KeyboardInterrupt("a second Ctrl-C: stopping now")

    def _forward(self) -> None:
        for child in self._children:
            if child.is_alive():
                os.kill(child.pid, signal.SIGTERM)

    def forward_to(self, children: Sequence) -> None:
        """Pass stop signals on to ``children`` (``multiprocessing.Process``es, e.g. spawned DDP ranks), one that came
        while they started too."""
        self._children = children
        if self.requested:
            self._forward()

    @contextlib.contextmanager
    def installed(self) -> Iterator[Preemption]:
        """Handle the stop signals in this block, unblocked (a sweep's main process blocks them between jobs, and its
        workers inherit them blocked); only the main thread can, elsewhere they keep their handlers."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM is not turned into a checkpoint and a clean exit")
            yield self
            return
        signals = stop_signals()
        self._previous = {sig: signal.signal(sig, self._record) for sig in signals}
        before = signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)  # a signal pending since it was blocked: now
        hook, sys.unraisablehook = sys.unraisablehook, functools.partial(self._ignored, sys.unraisablehook)
        try:
            yield self
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            sys.unraisablehook = hook
            self._children = ()

    def _ignored(self, hook: Callable, unraisable) -> None:
        """Python ignores an exception raised in a finalizer or a weakref callback, printing its traceback: a second
        Ctrl-C's ``KeyboardInterrupt`` that landed in one (a joblib worker's) is sent again a moment later, outside
        it, rather than printed and lost. Any other goes to ``hook``."""
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.under_way == AT_ONCE:
            self.under_way = None
            again = threading.Timer(AGAIN_S, os.kill, (os.getpid(), signal.SIGINT))
            again.daemon = True
            again.start()
            return
        hook(unraisable)

    def hand_over(self) -> None:
        """Call submitit's handler when its requeue signal stopped the job: it requeues the job and exits, or refuses
        (a job timed out more than ``max_num_timeout`` times: 0 in ``conf/hydra/launcher/submitit_slurm.yaml``) with
        an error, recorded in :attr:`refused`; the job then stops as SIGTERM stops it, resumable."""
        previous = self._previous.get(self.signum)
        if self.signum == requeue_signal() and callable(previous):
            try:
                previous(self.signum, None)
            except Exception as refused:  # submitit's UncompletedJobError: not a failure of the job
                self.refused = str(refused)
                log.warning("submitit did not requeue this job: %s", refused)

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum or signal.SIGTERM)


PARENT_CHECK_S = 2.0  # how often a sweep's worker looks for the main process that started it
IN_JOB = threading.Event()  # set while this process runs a job of a sweep
WATCHED: set[int] = set()  # the main process this process watches, once it does


@contextlib.contextmanager
def ended_with_parent(parent: int | None) -> Iterator[None]:
    """A job of a sweep in a process the sweep's main process ``parent`` started (joblib's worker, submitit's local
    job): once that process is gone (SIGKILL, the out-of-memory killer), the job stops as SIGTERM stops it, and the
    process exits when no job runs: it trained on unsupervised, then idled for ever. One daemon thread a process."""
    if parent is not None and os.getppid() == parent and parent not in WATCHED:
        WATCHED.add(parent)
        threading.Thread(target=watch_parent, args=(parent,), name="medsweep-parent", daemon=True).start()
    IN_JOB.set()
    try:
        yield
    finally:
        IN_JOB.clear()


def watch_parent(parent: int) -> None:
    stopped = False
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() == parent:
            continue
        if not IN_JOB.is_set():
            os._exit(exit_code(signal.SIGTERM))
        if not stopped:
            log.warning("the sweep's main process %d is gone: this job stops", parent)
            os.kill(os.getpid(), signal.SIGTERM)
            stopped = True


class SignalWatcher:
    """A sweep's main process: the stop signals are blocked in its threads, so every process its launcher starts
    (joblib's workers, submitit's jobs) inherits them blocked and survives them until a job installs its
    :class:`Preemption`. A thread of its own takes them (and a handler, should a native thread that does not block
    them take one), calls ``on_stop(signum)`` once and passes SIGTERM on to the child processes (a second SIGINT
    passes on as SIGINT: a second Ctrl-C)."""

    def __init__(self, on_stop: Callable[[int], None]) -> None:
        self.on_stop = on_stop
        self.received: int | None = None
        self.ending = False  # the sweep closes: a signal is only said
        self._closing = False
        self._restore = contextlib.ExitStack()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        for sig in STOP_SIGNALS:
            self._restore.callback(signal.signal, sig, signal.signal(sig, lambda signum, frame: self._take(signum)))
        self._restore.enter_context(signals_blocked())
        self._thread = threading.Thread(target=self._wait, name="medsweep-stop-signals", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        while not self._closing:
            self._take(signal.sigwait(STOP_SIGNALS))

    def _take(self, signum: int) -> None:
        if self._closing:
            return
        name = signal.Signals(signum).name
        if self.ending:
            log.warning("received %s: the sweep is closing its parent run, it ends by itself", name)
            return
        again = self.received is not None
        if not again:
            self.received = signum
            self.on_stop(signum)
        elif signum == signal.SIGINT:
            log.warning("received SIGINT again: running jobs stop at once, each resumable from its last checkpoint")
        else:
            log.warning("received %s: the sweep's stop is under way", name)
        forwarded = signal.SIGINT if again and signum == signal.SIGINT else signal.SIGTERM
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                child.send_signal(forwarded)

    def close(self) -> None:
        """End the watching thread; the signals' mask and handlers as they were."""
        if self._thread is None:
            return
        self._closing = True
        signal.pthread_kill(self._thread.ident, signal.SIGTERM)
        self._thread.join()
        self._thread = None
        self._restore.close()
