"""Stop requests by signal (SLURM preemption, ``kill``, submitit's requeue signal), acted on between steps."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterator, Sequence

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143, the shell's code for "terminated by SIGTERM"


class Preempted(Exception):
    """Raised on every rank once a stop request was honoured and the checkpoint is written."""


class PreemptedExit(SystemExit):
    """The job's exit after a preemption (checkpointed, resumable): ``EXIT_PREEMPTED``, or submitit's own code."""


def stop_signals() -> list[signal.Signals]:
    """SIGTERM, and in a submitit job its preemption/timeout signal (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default)."""
    signals = [signal.SIGTERM]
    if "SUBMITIT_EXECUTOR" in os.environ:
        signals.append(signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")])
    return signals


class Preemption:
    """While installed, a stop signal only records itself (and is forwarded to child processes).

    The training loop checks :attr:`requested` at optimizer-step boundaries (a Python attribute, no
    device sync), checkpoints and raises :class:`Preempted`. :meth:`hand_over` then calls the handler the
    signal had before: under submitit that is submitit's, which requeues the job and exits.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._children: Sequence = ()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is None:
            log.warning("received %s: stopping at the next step boundary", signal.Signals(signum).name)
        self.signum = signum
        for child in self._children:
            if child.is_alive():
                os.kill(child.pid, signum)

    def forward_to(self, children: Sequence) -> None:
        """Pass stop signals on to ``children`` (``multiprocessing.Process``es, e.g. spawned DDP ranks)."""
        self._children = children

    @contextlib.contextmanager
    def installed(self) -> Iterator["Preemption"]:
        """Handle the stop signals in this block (only the main thread can; elsewhere they keep their handlers)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM is not turned into a checkpoint and a clean exit")
            yield self
            return
        self._previous = {sig: signal.signal(sig, self._record) for sig in stop_signals()}
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._children = ()

    def hand_over(self) -> None:
        """Call the handler the received signal had before :meth:`installed` (submitit's requeue), if any."""
        previous = self._previous.get(self.signum)
        if callable(previous):
            previous(self.signum, None)
