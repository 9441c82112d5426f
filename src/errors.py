"""The one exception type for bad user input: printed as one line, exit code 2, no traceback."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, NoReturn


class UsageError(Exception):
    """A bad value in the user's config or environment; the message names the value and the fix."""


def first(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names`` for a message, and how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def exit_with(err: UsageError) -> NoReturn:
    """End the command on ``err``: its one ``error:`` line on stderr, exit code 2."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def stop_while_importing() -> None:
    """Until a command's wrapper starts (``src.cli``, which puts Python's handler back), Ctrl-C ends the process with
    one line and exit code 130, not a traceback from the module being imported."""
    signal.signal(signal.SIGINT, stopped)


def stopped(*_: Any) -> NoReturn:
    """At once, before anything is made: an exception raised inside an import may be swallowed by the importer."""
    print("stopped (Ctrl-C)", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)
