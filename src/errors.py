"""The one exception type for bad user input: printed as one line, exit code 2, no traceback."""

from __future__ import annotations

import sys
from typing import NoReturn


class UsageError(Exception):
    """A bad value in the user's config or environment; the message names the value and the fix."""


def exit_with(err: UsageError) -> NoReturn:
    """End the command on ``err``: its one ``error:`` line on stderr, exit code 2."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
