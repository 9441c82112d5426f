"""The one exception type for bad user input: printed as one line, exit code 2, no traceback."""


class UsageError(Exception):
    """A bad value in the user's config or environment; the message names the value and the fix."""
