"""Files that are whole or absent: checkpoints, downloads, generated data, caches."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends without an error it is fsynced and renamed
    over ``path`` (and the folder fsynced), otherwise removed. A crash leaves the old file or the new one."""
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
    finally:
        tmp.unlink(missing_ok=True)
