"""How a command ends other than by finishing: bad user input (one line, exit code 2, no traceback), a stop signal."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, NoReturn

from src.redaction import redact


class UsageError(Exception):
    """A bad value in the user's config or environment; the message names the value and the fix."""


class Stopped(BaseException):
    """SIGTERM or SIGHUP outside a job: raised in the main thread, as Ctrl-C raises :class:`KeyboardInterrupt`, so
    that what the command was doing ends as an exception ends it (an atomic write's temp file removed, a claimed folder
    released) rather than at once; a ``BaseException``: no ``except Exception`` takes it for a failure."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def interruption(err: BaseException) -> BaseException | None:
    """The Ctrl-C (:class:`KeyboardInterrupt`) or :class:`Stopped` that ``err`` was raised while handling (a library's
    cleanup failing over the signal that cut it short); None where there is none."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (KeyboardInterrupt, Stopped)):
            return err
        seen.add(id(err))
        err = err.__context__
    return None


def first_few(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names`` for a message, and how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def one_line(err: Exception) -> UsageError:
    """An OmegaConf or Hydra error as one line: the key (OmegaConf's ``full_key``; else, for an interpolation, the
    overrides that interpolate), then its message's first line."""
    line = str(err).strip().partition("\n")[0]
    interpolating = [arg for arg in sys.argv[1:] if "${" in arg] if "interpolation" in line.lower() else []
    key = getattr(err, "full_key", None) or ", ".join(interpolating)
    return UsageError(f"{key}: {line}" if key else line)


def exit_with(err: UsageError) -> NoReturn:
    """End the command on ``err``: its one ``error:`` line on stderr (a secret in it as ``***``), exit code 2."""
    print(f"error: {redact(str(err))}", file=sys.stderr)
    sys.exit(2)


def stop_while_importing() -> None:
    """Until a command's wrapper starts (``src.cli``, which puts Python's handler back), Ctrl-C ends the process with
    one line and exit code 130, not a traceback from the module being imported."""
    signal.signal(signal.SIGINT, stopped)


def stopped(*_: Any) -> NoReturn:
    """At once, before anything is made: an exception raised inside an import may be swallowed by the importer."""
    print("stopped (Ctrl-C)", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)
