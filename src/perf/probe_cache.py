"""Start-up probes kept across processes: one cache file per kind of probe in the caches' folder
(:func:`src.caches.folder`), read through its validating loader, entries stamped with the time they were taken, and
the lock that keeps probes from measuring each other.

A probe that times the machine holds :func:`machine` exclusively; other heavy work of a dry run (the memory replay)
holds it shared, so two processes of one sweep (joblib) never time a step while the other computes.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from src.caches import CacheFile, Entry, Rule, Schema, lock
from src.tracking.identity import code_fingerprint
from src.tracking.runs import host
from src.training.meters import device_name


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


def machine(exclusive: bool) -> contextlib.AbstractContextManager[None]:
    """This machine's probes: exclusively while timing, shared while doing work that must not overlap a timing."""
    return lock("machine.lock", exclusive)


class ProbeCache:
    """``<name>`` in the caches' folder: ``{key: entry}``, each entry a JSON object of ``fields`` (each with its
    rule), agreeing as ``agree`` says, stamped with its ``at``. An entry is used while ``fresh(entry)`` holds; writing
    one drops the entries no longer fresh."""

    def __init__(
        self,
        name: str,
        fresh: Callable[[Entry], bool],
        fields: Mapping[str, Rule],
        agree: Callable[[Entry], bool] = lambda entry: True,
    ) -> None:
        self.fresh, self.file = fresh, CacheFile(name, Schema(fields, agree))

    @property
    def name(self) -> str:
        return self.file.name

    @property
    def path(self) -> Path:
        return self.file.path

    def entries(self) -> dict[str, Entry]:
        """The file's entries that fit its schema: one that does not, cut short or written by hand, is probed
        again, never a job's failure (one warning names the file)."""
        return self.file.entries()

    def get(self, name: str) -> Entry | None:
        entry = self.entries().get(name)
        return entry if entry is not None and self.fresh(entry) else None

    def put(self, name: str, entry: Entry) -> Entry:
        """Store ``entry`` under ``name``, stamped now (read, changed and written under a lock, so the entries other
        processes write meanwhile stay); returns it stamped, also where the file cannot be written."""
        return self.file.update(name, {**entry, "at": now().isoformat()}, keep=self.fresh)
