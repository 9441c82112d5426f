"""src/caches.py: medsweep's own caches (the probes' JSON files and their locks in the cache folder), read through one
validating loader. A cache cut short, mistyped, zero-valued, stamped in the future, a folder in a file's place, or a
folder that cannot be written: the job goes on, with one warning naming the file, and the cache is written anew."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from src.caches import MAX_BYTES, check_folder, folder, lock
from src.perf.step_timing import CACHE
from tests.helpers import own_messages, run_cli, run_process, runs, small_run, unprivileged

CACHES = ("step_times.json", "memory_predictions.json", "flops_per_sample.json", "peak_flops.json")
LOCKS = ("machine.lock", "files.lock")


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory, empty_store, shared_data) -> Path:
    """A cache folder a dry run and a short run filled: every probe's file holds this code's entries."""
    folder = tmp_path_factory.mktemp("filled")
    shutil.copyfile(empty_store, folder / "mlflow.db")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEDSWEEP_CACHE_DIR", str(folder / "cache"))
        for extra in (("dry_run=true",), ()):
            result = run_cli(*small_run(folder, f"sqlite:///{folder / 'mlflow.db'}", shared_data, "epochs=1", *extra))
            assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.name for path in (folder / "cache").iterdir()) == sorted(CACHES + LOCKS)
    return folder / "cache"


def numbers(entry: dict[str, Any], value: Callable[[Any], Any]) -> dict[str, Any]:
    """``entry`` with each of its numbers (not its booleans) replaced by ``value(number)``."""
    return {k: value(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in entry.items()}


def entries(change: Callable[[dict[str, Any]], Any]) -> Callable[[str], str]:
    return lambda text: json.dumps({key: change(entry) for key, entry in json.loads(text).items()})


DAMAGE: dict[str, Callable[[str], str]] = {  # a cache file's text -> its damaged text
    "cut short": lambda text: text[: len(text) // 2],
    "numbers as strings": entries(lambda entry: numbers(entry, str)),
    "zero": entries(lambda entry: numbers(entry, lambda _: 0)),
    "negative": entries(lambda entry: numbers(entry, lambda v: -abs(v) - 1)),
    "NaN": entries(lambda entry: numbers(entry, lambda _: math.nan)),
    "infinite": entries(lambda entry: numbers(entry, lambda _: math.inf)),
    "a list for an object": entries(lambda entry: list(entry.values())),
    "a list for the shape": entries(lambda entry: {**entry, "shape": [1, 2]} if "shape" in entry else entry),
    "taken in the future": entries(lambda entry: {**entry, "at": "2999-01-01T00:00:00+00:00"}),
    "a total its parts do not make": entries(
        lambda entry: {**entry, "total_mb": entry["total_mb"] * 1e6} if "total_mb" in entry else entry
    ),
    "not an object": lambda text: "[1, 2]",
}


def damage(source: Path, folder: Path, names: tuple[str, ...], how: str) -> tuple[Path, list[str]]:
    """A copy of the cache ``source`` in ``folder``, its files ``names`` damaged ``how`` (a key of :data:`DAMAGE`,
    or ``folder``: a folder in each one's place); the names of those it changed."""
    shutil.copytree(source, folder)
    changed = []
    for name in names:
        path = folder / name
        if how == "folder":
            path.unlink()
            (path / "inside").mkdir(parents=True)
        elif (text := DAMAGE[how](path.read_text())) not in (path.read_text(), entries(lambda e: e)(path.read_text())):
            path.write_text(text)
        else:
            continue  # the damage leaves this cache's entries as they are
        changed.append(name)
    return folder, changed


def warned_once(result, path: Path) -> str:
    """The one line of the command's output that names ``path``: a warning (a sweep's main process logs as Hydra's
    ``[HYDRA]``)."""
    named = [line for line in (result.stdout + result.stderr).splitlines() if str(path) in line]
    assert len(named) == 1 and ("[WARNING]" in named[0] or "[HYDRA]" in named[0]), named or result.stdout[-3000:]
    return named[0]


def check_rewritten(path: Path) -> None:
    """``path`` holds a JSON object of entries again, none of them damaged: numbers finite, none negative, times
    past."""
    written = json.loads(path.read_text())
    assert isinstance(written, dict) and written
    for entry in written.values():
        assert isinstance(entry, dict) and entry["at"] < "2999", entry
        found = [v for v in entry.values() if isinstance(v, int | float) and not isinstance(v, bool)]
        assert found and all(math.isfinite(v) and v >= 0 for v in found), entry


@pytest.mark.slow
@pytest.mark.parametrize("how", [*DAMAGE, "folder"])
def test_a_damaged_cache_is_one_warning_and_a_dry_run_lists_the_job(
    tmp_path, store, shared_data, filled_cache, monkeypatch, how
):
    """The dry run reads the step times and the memory predictions: a damaged one ended in a ``ZeroDivisionError`` or
    ``TypeError`` traceback, was trusted as read, or (a folder in its place) in ``IsADirectoryError``."""
    names = ("step_times.json", "memory_predictions.json") + (LOCKS if how == "folder" else ())
    cache, changed = damage(filled_cache, tmp_path / "cache", names, how)
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(cache))
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1", "dry_run=true"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("job 0:")]
    for name in changed:
        warned_once(result, cache / name)
        if how != "folder":
            check_rewritten(cache / name)
    assert runs(store) == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["zero", "numbers as strings", "a total its parts do not make", "folder"])
def test_a_damaged_cache_is_one_warning_and_the_run_finishes(
    tmp_path, store, shared_data, filled_cache, monkeypatch, how
):
    """A run reads the memory prediction (its check and ``mem/predict_ratio``), the FLOP count and the peak FLOP/s:
    a zero prediction ended in ``ZeroDivisionError`` after training, a prediction a million times too large refused
    the job ("the memory predictor puts this job's peak at ... GiB") without naming the cache."""
    names = ("memory_predictions.json", "flops_per_sample.json", "peak_flops.json") + (LOCKS if how == "folder" else ())
    cache, changed = damage(filled_cache, tmp_path / "cache", names, how)
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(cache))
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for name in changed:
        warned_once(result, cache / name)
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.metrics["mem/predicted_mb"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("flag", [(), ("-m",)], ids=["run", "sweep"])
def test_a_cache_folder_that_cannot_be_written_is_one_warning_and_the_run_finishes(
    tmp_path, store, shared_data, filled_cache, monkeypatch, flag
):
    """A read-only home on a cluster's nodes (as root: without the capability that writes anything), or a
    ``MEDSWEEP_CACHE_DIR`` under a file: the probes are taken, not kept."""
    read_only = shutil.copytree(filled_cache, tmp_path / "read-only")
    for path in (read_only, *read_only.iterdir()):
        path.chmod(0o555 if path.is_dir() else 0o444)
    (tmp_path / "a-file").touch()
    for cache in (read_only, tmp_path / "a-file" / "cache"):
        monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(cache))
        sweep = ("seed=0,1",) if flag else ()
        args = small_run(tmp_path / "runs" / cache.name, store, shared_data, "epochs=1", *sweep)
        argv = [sys.executable, "-m", "src.train", *flag, *args]
        result = run_process(unprivileged(argv) if cache == read_only else argv)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
        warned_once(result, cache)  # a sweep's jobs run in its process: once for all
    assert {run.info.status for run in runs(store)} == {"FINISHED"}


@pytest.fixture
def cache_folder(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


STEP = {"seconds": 0.1, "spread": 0.02, "steps": 3, "others_cpu": 0.5, "busy": False, "shape": {"model.name": "a"}}


def stamped(**changes: Any) -> dict[str, Any]:
    return {**STEP, "at": "2026-11-29T05:00:00+00:00", **changes}


UNFIT = {  # an entry of step_times.json -> why it does not fit, as the warning says
    "a bool for a number": (stamped(seconds=True), "seconds=true"),
    "a string for a bool": (stamped(busy="false"), 'busy="false"'),
    "a float for a count": (stamped(steps=3.0), "steps=3.0"),
    "more steps than a timing takes": (stamped(steps=10**400), "steps="),
    "a step of a week": (stamped(seconds=7 * 86400.0), "seconds=604800.0"),
    "a time without its zone": (stamped(at="2026-11-29T05:00:00"), 'at="2026-11-29T05:00:00"'),
    "a time as a number": (stamped(at=1764390000), "at=1764390000"),
    "a field missing": ({k: v for k, v in stamped().items() if k != "spread"}, "no spread"),
    "a shape of numbers": (stamped(shape={"model.name": 1}), "shape="),
    "a number for an entry": (5, "a JSON int, not an object"),
}


@pytest.mark.parametrize("entry,why", UNFIT.values(), ids=UNFIT)
def test_an_entry_that_does_not_fit_is_dropped_with_one_warning_naming_the_file(cache_folder, caplog, entry, why):
    cache_folder.mkdir()
    CACHE.path.write_text(json.dumps({"kept": stamped(), "unfit": entry}))
    assert list(CACHE.entries()) == list(CACHE.entries()) == ["kept"]
    (warning,) = own_messages(caplog)
    assert warning.startswith(f"{CACHE.path}: 1 of its 2 entries do not fit the cache (the first, 'unfit': {why}")
    CACHE.put("new", STEP)
    assert sorted(json.loads(CACHE.path.read_text())) == ["kept", "new"]  # written anew, without it


def test_neither_a_pipe_nor_a_device_in_a_caches_or_a_locks_place_blocks(cache_folder, caplog):
    """A pipe nobody writes to blocked the job that read it, or opened it as a lock, for ever."""
    cache_folder.mkdir()
    os.mkfifo(CACHE.path)
    os.mkfifo(cache_folder / "machine.lock")
    (cache_folder / "files.lock").symlink_to("/dev/null")
    assert CACHE.entries() == {} and CACHE.put("new", STEP)["seconds"] == STEP["seconds"]
    with lock("machine.lock", exclusive=True):
        pass
    assert own_messages(caplog) == [
        f"{CACHE.path} is a pipe, not a file: it is ignored, its probes taken again, not kept: remove it",
        f"{cache_folder / 'files.lock'} is a device or socket, not a file: the probes go on unlocked: another "
        "process may time its steps meanwhile; remove it",
        f"{cache_folder / 'machine.lock'} is a pipe, not a file: the probes go on unlocked: another process may time "
        "its steps meanwhile; remove it",
    ]


@pytest.mark.parametrize(
    "content,why",
    [
        ("[" * 100_000 + "]" * 100_000, "is not JSON (cut short, or not written by medsweep)"),  # a RecursionError
        ('{"a": "' + "x" * MAX_BYTES + '"}', f"holds more than {MAX_BYTES} bytes"),
        ("\udcff", "is not JSON (cut short, or not written by medsweep)"),
    ],
    ids=["nested-100000-deep", "too-large", "not-utf-8"],
)
def test_a_file_that_cannot_be_read_is_one_warning_and_written_anew(cache_folder, caplog, content, why):
    cache_folder.mkdir()
    CACHE.path.write_bytes(content.encode("utf-8", "surrogateescape"))
    assert CACHE.entries() == CACHE.entries() == {}
    (warning,) = own_messages(caplog)
    assert warning == f"{CACHE.path} {why}: it is ignored, its probes taken again and the file written anew"
    CACHE.put("new", STEP)
    assert list(json.loads(CACHE.path.read_text())) == ["new"]


def test_a_folder_that_cannot_be_written_is_one_warning_and_its_probes_are_not_kept(tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").touch()
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    check_folder()
    with lock("machine.lock", exclusive=True):
        assert CACHE.get("k") is None and CACHE.put("k", STEP)["seconds"] == STEP["seconds"]
    assert own_messages(caplog) == [
        f"the cache folder {tmp_path / 'a-file' / 'cache'} cannot be written (Not a directory): the probes are taken "
        "but not kept (nor locked against another process's where a lock file is missing); set MEDSWEEP_CACHE_DIR to "
        "a folder this process can write"
    ]


def test_the_folder_is_where_the_environment_says_and_an_xdg_path_counts_when_absolute(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", "relative")
    assert folder() == Path.cwd() / "relative"
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "not/absolute")  # XDG: a relative path is ignored
    assert folder() == tmp_path / "home" / ".cache" / "medsweep"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert folder() == tmp_path / "xdg" / "medsweep"
