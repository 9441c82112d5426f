"""Files that are whole or absent: checkpoints, downloads, generated data, caches."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from src.errors import UsageError

FULL = (errno.ENOSPC, errno.EDQUOT)


class NoSpace(UsageError):
    """A write failed for want of space (or quota) on its disk."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"no space left on {path.parent} (writing {path.name})")
        self.path = path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends without an error it is fsynced and renamed
    over ``path`` (and the folder fsynced), otherwise removed. A crash leaves the old file or the new one; a full disk
    raises :class:`NoSpace`, the old file kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
    try:
        yield tmp
        with tmp.open("rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as err:
        if err.errno in FULL:
            raise NoSpace(path) from err
        raise
    finally:
        tmp.unlink(missing_ok=True)


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is an :func:`atomic_path` write in progress (another process's, maybe)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def read_json_object(path: Path) -> dict[str, Any]:
    """``path``'s JSON object; empty where the file is absent, unreadable, not JSON or not an object (a cache, then
    written anew)."""
    try:
        found = json.loads(path.read_bytes())
    except (OSError, ValueError):  # ValueError: JSON's decode errors and UTF-8's
        return {}
    return found if isinstance(found, dict) else {}
