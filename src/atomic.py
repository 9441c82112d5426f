"""Files that are whole or absent: checkpoints, downloads, generated data, caches."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from src.errors import UsageError

FULL = (errno.ENOSPC, errno.EDQUOT)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # Linux's, new at each boot
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)(?:-(?P<boot>[0-9a-f]{8}))?\.\d+\.tmp$")  # see temporary()


class NoSpace(UsageError):
    """A write failed for want of space (or quota) on its disk."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"no space left on {path.parent} (writing {path.name})")
        self.path = path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends without an error it is fsynced and renamed
    over ``path`` (and the folder fsynced), otherwise removed. A crash leaves the old file or the new one; a full disk
    raises :class:`NoSpace`, the old file kept. Temp files of earlier writes of ``path`` whose process is gone are
    removed first (:func:`remove_stale`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path.parent, path.name)  # a write of the file killed outright (SIGKILL) left its temp file
    tmp = temporary(path)
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


def temporary(path: Path) -> Path:
    """The temp file of this process's write of ``path``, beside it: ``.<name>.<pid>-<boot>.<ns>.tmp``, which says
    whose it is (:func:`remove_stale`)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{this_boot()}.{time.time_ns()}.tmp")


def this_boot() -> str:
    """The first 8 hex digits of this machine's boot id: a pid names the same process only within one boot."""
    try:
        return BOOT_ID.read_text().strip().replace("-", "")[:8]
    except OSError:
        return "00000000"


def remove_stale(folder: Path, name: str | None = None) -> list[Path]:
    """Remove the temp files in ``folder`` (of writes of ``name`` only, if given) whose writing process is gone: killed
    outright (SIGKILL, the out-of-memory killer, a power cut), it could not remove them. A temp file of a live process
    is kept, as is one whose writer may live on elsewhere (of another boot or machine, written since this boot); the
    paths removed. The holder of a folder calls it when it takes the folder, every write of a file before it writes."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        found = TEMPORARY.match(entry.name)
        if found is None or (name is not None and found["name"] != name) or not entry.is_file(follow_symlinks=False):
            continue
        if writer_gone(int(found["pid"]), found["boot"], entry):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def writer_gone(pid: int, boot: str | None, entry: os.DirEntry) -> bool:
    """Whether the process that wrote temp file ``entry`` has ended: of this boot (or of no boot named: before
    2026-11-29) and no process has its pid, or of another boot and the file is older than this one."""
    if boot is not None and boot != this_boot():
        try:
            return entry.stat(follow_symlinks=False).st_mtime < psutil.boot_time()
        except OSError:
            return False
    return pid != os.getpid() and not psutil.pid_exists(pid)  # another user's live process exists too


class _Uninterrupted:
    """The uninterrupted blocks the main thread is in (what each does) and what waits for their end."""

    def __init__(self) -> None:
        self.blocks: list[str] = []
        self.waiting: list[Callable[[], None]] = []


_UNINTERRUPTED = _Uninterrupted()


@contextlib.contextmanager
def uninterrupted(what: str) -> Iterator[None]:
    """A block that a stop signal must not cut (``what``: "writing checkpoint.pt"): a handler that would interrupt
    the main thread during it (a second Ctrl-C raising :class:`KeyboardInterrupt`) hands its action to
    :func:`when_uninterrupted`, which runs it as the block ends; if the block fails, its own error stands. Cut, a
    checkpoint write leaves the one before (it is atomic), and the stop it served loses its steps; an import that
    catches every exception (medmnist's) swallows the interrupt. Only the main thread, where Python runs signal
    handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    state = _UNINTERRUPTED
    state.blocks.append(what)
    try:
        yield
    except BaseException:
        if len(state.blocks) == 1:
            state.waiting.clear()
        raise
    finally:
        state.blocks.pop()
    if not state.blocks:
        waiting, state.waiting = state.waiting, []
        for action in waiting:
            action()


def uninterrupted_now() -> str | None:
    """What the main thread's innermost :func:`uninterrupted` block does; None outside one."""
    return _UNINTERRUPTED.blocks[-1] if _UNINTERRUPTED.blocks else None


def when_uninterrupted(action: Callable[[], None]) -> None:
    """Run ``action`` now, or, inside an :func:`uninterrupted` block of the main thread, as the block ends."""
    if threading.current_thread() is threading.main_thread() and _UNINTERRUPTED.blocks:
        _UNINTERRUPTED.waiting.append(action)
    else:
        action()


def read_json_object(path: Path) -> dict[str, Any]:
    """``path``'s JSON object; empty where the file is absent, unreadable, not JSON or not an object (a cache, then
    written anew)."""
    try:
        found = json.loads(path.read_bytes())
    except (OSError, ValueError):  # ValueError: JSON's decode errors and UTF-8's
        return {}
    return found if isinstance(found, dict) else {}
