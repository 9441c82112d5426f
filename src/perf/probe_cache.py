"""Start-up probes kept across processes: one JSON file per kind of probe in the folder of the peak-FLOP/s cache
(``$MEDSWEEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/medsweep``, else ``~/.cache/medsweep``), entries stamped with the
time they were taken, and the lock that keeps probes from measuring each other.

A probe that times the machine holds :func:`machine` exclusively; other heavy work of a dry run (the memory replay)
holds it shared, so two processes of one sweep (joblib) never time a step while the other computes.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from src.atomic import atomic_path, read_json_object
from src.folders import CACHE_ENV, UNSUPPORTED, writable
from src.tracking.identity import code_fingerprint
from src.tracking.runs import host
from src.training.meters import device_name, peak_cache_file

Entry = dict[str, Any]


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


def age(entry: Entry) -> datetime.timedelta:
    """How long ago ``entry`` was taken (its ``at``, ISO 8601)."""
    return now() - datetime.datetime.fromisoformat(entry["at"])


def software_key(probed: str) -> str:
    """The key of a probe that does not depend on the machine: torch's version, the code's fingerprint and a hash of
    ``probed`` (what was probed)."""
    return f"torch {torch.__version__}|code {code_fingerprint()}|{hashlib.sha256(probed.encode()).hexdigest()[:16]}"


def key(device: torch.device, threads: int, probed: str) -> str:
    """A probe's key: the host, the device's name and the CPU threads, then :func:`software_key`, so a probe is
    reused only on the same machine, with the same software and code."""
    return f"{host()}|{device_name(device)}|threads {threads}|{software_key(probed)}"


@contextlib.contextmanager
def locked(path: Path, exclusive: bool) -> Iterator[None]:
    """A blocking ``flock`` on ``path`` for the block (none on a file system without flock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError as err:
            if err.errno not in UNSUPPORTED:
                raise
        yield


def check_folder() -> None:
    """A :class:`UsageError` where the cache folder cannot be written (a read-only home on a cluster's nodes, a
    ``MEDSWEEP_CACHE_DIR`` that is a file): every job probes and locks there."""
    folder = peak_cache_file().parent
    writable(folder, f"the probe cache {folder}", f"set {CACHE_ENV} to a folder this process can write")


def machine(exclusive: bool) -> contextlib.AbstractContextManager[None]:
    """This machine's probes: exclusively while timing, shared while doing work that must not overlap a timing."""
    return locked(peak_cache_file().with_name("machine.lock"), exclusive)


class ProbeCache:
    """``<name>`` in the cache folder: ``{key: entry}``, each entry a JSON object with ``fields`` and its ``at``. An
    entry is used while ``fresh(entry)`` holds; writing one drops the entries no longer fresh."""

    def __init__(self, name: str, fresh: Callable[[Entry], bool], fields: tuple[str, ...]) -> None:
        self.name, self.fresh, self.fields = name, fresh, fields

    @property
    def path(self) -> Path:
        return peak_cache_file().with_name(self.name)

    def entries(self) -> dict[str, Entry]:
        """The file's entries; none when it is absent or not a JSON object (it is written anew)."""
        return read_json_object(self.path)

    def usable(self, entry: Any) -> bool:
        """Whether ``entry`` holds this cache's fields and is fresh: one cut short or written by hand is probed
        again, never a job's failure."""
        try:
            return set(self.fields) <= entry.keys() and self.fresh(entry)
        except (AttributeError, KeyError, TypeError, ValueError):
            return False

    def get(self, name: str) -> Entry | None:
        entry = self.entries().get(name)
        return entry if self.usable(entry) else None

    def put(self, name: str, entry: Entry) -> Entry:
        """Store ``entry`` under ``name``, stamped now (read, changed and written under a lock, so the entries other
        processes write meanwhile stay); returns it stamped."""
        entry = {**entry, "at": now().isoformat()}
        with locked(self.path.with_name("files.lock"), exclusive=True):
            entries = {k: e for k, e in self.entries().items() if self.usable(e)} | {name: entry}
            with atomic_path(self.path) as partial:
                partial.write_text(json.dumps(entries, indent=1))
        return entry
