"""medsweep's own caches: JSON files of ``{key: entry}`` in one folder (``$MEDSWEEP_CACHE_DIR``, else
``$XDG_CACHE_HOME/medsweep``, else ``~/.cache/medsweep``) and the locks beside them, each read through
:meth:`CacheFile.entries`, which checks every entry against its cache's :class:`Schema`.

A cache is best-effort, never a job's failure, and never trusted as read: a file that cannot be read (cut short, not
JSON, too large, a folder or a pipe in its place) or entries that do not fit the schema (a string for a number, a zero
step time, a NaN, a total its parts do not make, a time to come) are ignored with one warning naming the file, their
probes taken again and the file written anew; a file or a lock that cannot be written or taken (a read-only home, a
folder in the way, a full disk) is skipped with one warning, and the job goes on without it. One warning per file (a
folder's, where the folder is the cause) and process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from src.atomic import atomic_path
from src.config.bounded import Unfit, kind, read_bounded
from src.errors import UsageError
from src.folders import CACHE_ENV, UNSUPPORTED

log = logging.getLogger(__name__)

Entry = dict[str, Any]
Rule = Callable[[Any], bool]  # whether a field's value is one the cache may hold

MAX_BYTES = 16 * 2**20  # a cache of this size holds thousands of job shapes (a step time's entry: ~2 KB)
CLOCK_SKEW = datetime.timedelta(minutes=10)  # an entry stamped later than now by more is refused: it never expires
READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)
_warned: set[Path] = set()


def folder() -> Path:
    """The caches' folder: ``$MEDSWEEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/medsweep`` (an absolute one: XDG's rule),
    else ``~/.cache/medsweep``."""
    if given := os.environ.get(CACHE_ENV):
        return Path(given).absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg if os.path.isabs(xdg) else Path.home() / ".cache", "medsweep")


def warn_once(path: Path, message: str) -> None:
    """``message``, once per ``path`` in this process."""
    if path not in _warned:
        _warned.add(path)
        log.warning("%s", message)


def number(low: float = 0, high: float = math.inf, above: bool = False) -> Rule:
    """A finite int or float (not a bool) in ``[low, high]`` (``(low, high]`` with ``above``)."""
    return lambda value: (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if above else value >= low)
        and value <= high
    )


def integer(low: int = 0, high: float = math.inf) -> Rule:
    """An int (not a bool) in ``[low, high]``."""
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def one_of(*choices: str) -> Rule:
    return lambda value: isinstance(value, str) and value in choices


def text(value: Any) -> bool:
    return isinstance(value, str)


def boolean(value: Any) -> bool:
    return isinstance(value, bool)


def strings(value: Any) -> bool:
    """A JSON object of strings."""
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def timestamp(value: Any) -> bool:
    """An ISO 8601 time with its zone, not later than now (give or take :data:`CLOCK_SKEW`)."""
    try:
        at = datetime.datetime.fromisoformat(value)
    except (TypeError, ValueError):
        return False
    return at.tzinfo is not None and at <= datetime.datetime.now(datetime.timezone.utc) + CLOCK_SKEW


@dataclasses.dataclass(frozen=True)
class Schema:
    """What an entry holds: each field and its rule (every entry is stamped: ``at``, a :func:`timestamp`), and
    ``agree``, what its fields must satisfy together (a prediction's total is the sum of its parts)."""

    fields: Mapping[str, Rule]
    agree: Callable[[Entry], bool] = lambda entry: True

    def fault(self, entry: Any) -> str | None:
        """Why ``entry`` does not fit, in words; None where it does."""
        if not isinstance(entry, dict):
            return f"a JSON {type(entry).__name__}, not an object"
        for name, rule in {**self.fields, "at": timestamp}.items():
            if name not in entry:
                return f"no {name}"
            if not rule(entry[name]):
                return f"{name}={json.dumps(entry[name])[:40]}"
        return None if self.agree(entry) else "fields that disagree"


class CacheFile:
    """One cache: ``name`` in :func:`folder`, ``{key: entry}`` with entries of ``schema``."""

    def __init__(self, name: str, schema: Schema) -> None:
        self.name, self.schema = name, schema

    @property
    def path(self) -> Path:
        return folder() / self.name

    def entries(self) -> dict[str, Entry]:
        """The entries that fit the schema; none where the file is absent or cannot be read. What is ignored, the
        file or some of its entries, is one warning (written anew at the next :meth:`update`)."""
        path, found = self.path, read_object(self.path)
        faults = {key: fault for key, entry in found.items() if (fault := self.schema.fault(entry)) is not None}
        if faults:
            key, fault = next(iter(faults.items()))
            warn_once(
                path,
                f"{path}: {len(faults)} of its {len(found)} entries do not fit the cache (the first, "
                f"{key[-40:]!r}: {fault}): they are ignored, probed again and the file written anew",
            )
        return {key: entry for key, entry in found.items() if key not in faults}

    def update(self, key: str, entry: Entry, keep: Callable[[Entry], bool] = lambda entry: True) -> Entry:
        """``entry`` stored under ``key`` with the entries ``keep`` keeps (read, changed and written under the
        folder's lock, so what other processes write meanwhile stays); returns ``entry``, also where the file cannot
        be written (one warning)."""
        with lock("files.lock", exclusive=True):
            kept = {k: e for k, e in self.entries().items() if keep(e)}
            try:
                with atomic_path(self.path) as partial:
                    partial.write_text(json.dumps(kept | {key: entry}, indent=1))
            except (OSError, UsageError) as err:  # UsageError: atomic's NoSpace, a full disk
                unwritable(self.path, err)
        return entry


def read_object(path: Path) -> dict[str, Any]:
    """``path``'s JSON object; empty, with one warning saying why, where it is not a file of one (absent: no
    warning). Never blocks: a pipe in its place is not read."""
    try:
        found = json.loads(read_bounded(path, MAX_BYTES))
    except FileNotFoundError:
        return {}
    except Unfit as err:
        return ignored(path, str(err))
    except OSError as err:
        if not os.path.isdir(path.parent):  # the folder's fault (a file in its place): one warning, for it
            unwritable(path, err)
            return {}
        return ignored(path, f"cannot be read ({err.strerror or err})")
    except (ValueError, RecursionError):  # ValueError: JSON's decode errors and UTF-8's
        return ignored(path, "is not JSON (cut short, or not written by medsweep)")
    if not isinstance(found, dict):
        return ignored(path, f"holds a JSON {type(found).__name__}, not an object of entries")
    return found


def ignored(path: Path, why: str) -> dict[str, Any]:
    """No entries, and one warning: ``path`` ``why``, ignored (and written anew, where it is a file)."""
    anew = " and the file written anew" if stat.S_ISREG(mode(path)) else ", not kept: remove it"
    warn_once(path, f"{path} {why}: it is ignored, its probes taken again{anew}")
    return {}


def mode(path: Path) -> int:
    """``path``'s ``st_mode``; a regular file's where it is absent or cannot be looked at."""
    try:
        return path.stat().st_mode
    except OSError:
        return stat.S_IFREG


KEPT = "the probes are taken but not kept"
LOCKED = "the probes go on unlocked: another process may time its steps meanwhile"


def unwritable(path: Path, err: BaseException, lost: str = KEPT) -> None:
    """One warning for ``path`` that cannot be written or locked, saying what is ``lost``: naming it where something
    else is in its place (remove it), else its folder (a read-only home, no space left: another folder)."""
    if not stat.S_ISREG(found := mode(path)):
        warn_once(path, f"{path} is {kind(found)}, not a file: {lost}; remove it")
        return
    why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    warn_once(
        path.parent,
        f"the cache folder {path.parent} cannot be written ({why}): the probes are taken but not kept (nor locked "
        f"against another process's where a lock file is missing); set {CACHE_ENV} to a folder this process can write",
    )


def check_folder() -> None:
    """One warning where the caches' folder cannot be written (a read-only home on a cluster's nodes, a
    ``MEDSWEEP_CACHE_DIR`` under a file), before a job starts: it goes on, its probes taken but not kept."""
    path = folder()
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except FileExistsError:  # a file in its place
        unwritable(path / "files.lock", NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    except OSError as err:
        unwritable(path / "files.lock", err)


@contextlib.contextmanager
def lock(name: str, exclusive: bool) -> Iterator[None]:
    """A blocking ``flock`` on the lock file ``name`` of the caches' folder for the block (opened for reading where
    it cannot be for writing: a read-only folder's lock file locks still); none, with one warning, where it cannot be
    taken (a folder in its place); none on a file system without flock."""
    path, handle = folder() / name, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        except OSError as err:
            if err.errno not in READ_ONLY:
                raise
            handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise OSError(0, "not a file")
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except OSError as err:
        if err.errno not in UNSUPPORTED:
            unwritable(path, err, LOCKED)
    try:
        yield
    finally:
        if handle is not None:
            os.close(handle)
