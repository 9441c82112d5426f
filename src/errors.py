"""The one exception type for bad user input: printed as one line, exit code 2, no traceback."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, NoReturn

from src.redaction import redact


class UsageError(Exception):
    """A bad value in the user's config or environment; the message names the value and the fix."""


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
