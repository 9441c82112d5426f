"""Folders that belong to one sweep or one run: claimed fresh by ``${fresh:...}`` (conf/config.yaml's default output
folders), and held by an exclusive lock while a sweep or a job works in them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import itertools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from src.atomic import is_temporary, remove_stale
from src.errors import UsageError, exit_with, first_few, one_line

log = logging.getLogger(__name__)

LOCK_FILE = ".medsweep.lock"  # holds the pid of the process holding it
CACHE_ENV = "MEDSWEEP_CACHE_DIR"  # the folder of the start-up probes' cache and of data=nifti's cached volumes
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # file systems without flock (some Lustre mounts)
CHECKPOINT_FILE = "checkpoint.pt"  # a run's checkpoint, in its folder
BEST_FILE = "best.pt"  # its tested weights
METRICS_FILE = "metrics.json"  # its final metrics
EVAL_DIR = "eval"  # its test predictions and confusion matrix
RUN_FILES = (
    ".hydra",
    EVAL_DIR,
    CHECKPOINT_FILE,
    BEST_FILE,
    METRICS_FILE,
    LOCK_FILE,
    "*.log",
    "oom_rank*.json",
    "diverged_rank*.txt",
)


CLAIMED: dict[Path, list[Path]] = {}  # each folder fresh() created in this process: the folders it made, deepest first


def fresh(path: str) -> str:
    """``path``, else ``path-2``, ``path-3``, ...: the first that did not exist, created now. ``mkdir`` is atomic, so
    two sweeps started in the same second get two folders."""
    base = Path(path)
    for n in itertools.count(1):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        made = missing(candidate.absolute())
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        CLAIMED[candidate.absolute()] = made
        return str(candidate)


def register_fresh() -> None:
    """``${fresh:<folder>}`` (``conf/config.yaml``'s run and sweep folders): :func:`fresh`, once per folder and
    process."""
    if not OmegaConf.has_resolver("fresh"):
        OmegaConf.register_new_resolver("fresh", fresh, use_cache=True)


def release(folder: Path, refused: bool = False) -> None:
    """Remove ``folder`` where :func:`fresh` claimed it in this process and it holds no more than Hydra writes before
    a command starts (``.hydra/``, an empty log; with ``refused``, a command that ended on its ``error:`` line before
    any run was made for the folder: its log and lock too), with the parents it made that are empty: a refused
    command leaves no folder."""
    made = CLAIMED.pop(folder.absolute(), [])
    if not (made and folder.is_dir() and hydra_file(folder, refused)):
        return
    shutil.rmtree(folder, ignore_errors=True)
    for path in made[1:]:
        with contextlib.suppress(OSError):  # not empty: another command's
            path.rmdir()


def release_claimed() -> None:
    """:func:`release` each folder :func:`fresh` claimed in this process: at a command's end, those it left as Hydra
    made them go (Hydra resolves a default folder that a command's config or a flag replaces, e.g. ``src.memory``'s,
    ``--cfg``)."""
    for folder in reversed(list(CLAIMED)):  # the last first: an earlier one made the parents
        release(folder)


def release_refused(hydra: DictConfig) -> None:
    """:func:`release` a single run's folder (``hydra.runtime.output_dir``) as its command ends on its ``error:``
    line: unless a run was made for it (:func:`never_release`), its log and lock go with what Hydra wrote."""
    if hydra.mode is RunMode.RUN:
        release(Path(hydra.runtime.output_dir), refused=True)


def never_release(*folders: Path) -> None:
    """A run is made for ``folders``: they are its own, never released."""
    for folder in folders:
        CLAIMED.pop(folder.absolute(), None)


def missing(folder: Path) -> list[Path]:
    """``folder`` and its parents that do not exist, deepest first."""
    return list(itertools.takewhile(lambda path: not path.exists(), (folder, *folder.parents)))


def hydra_file(path: Path, refused: bool = False) -> bool:
    """What Hydra writes in a run's or sweep's folder before the command starts: ``.hydra/``, an empty log,
    ``multirun.yaml``, a job's folder holding no more; with ``refused``, any log and the lock file of :func:`held`."""
    if path.is_symlink() or not (path.is_dir() or path.is_file()):
        return False
    if path.is_dir():
        return path.name == ".hydra" or all(hydra_file(inner, refused) for inner in path.iterdir())
    if refused and (path.suffix == ".log" or path.name == LOCK_FILE):
        return True
    return path.name == "multirun.yaml" or (path.suffix == ".log" and path.stat().st_size == 0)


def writable(folder: Path, what: str, fix: str = "give a folder this process can write") -> None:
    """A :class:`UsageError` (``what`` cannot be written: ``fix``) where this process cannot create ``folder`` and
    write in it: tried, then the folders the try made are removed."""
    made = missing(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        raise UsageError(f"{what} cannot be written ({err.strerror or err}): {fix}") from None
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()


def check_hydra_files(hydra: DictConfig, folder: Path) -> None:
    """Where Hydra writes a run's or a job's own files writable: ``hydra.output_subdir`` in ``folder``, and each log
    handler's ``filename`` that resolves now (one in ``hydra.runtime.output_dir`` is in ``folder``). Hydra failed on
    them with a traceback."""
    if (subdir := OmegaConf.select(hydra, "output_subdir", default=None)) is not None:
        writable(folder / subdir, f"hydra.output_subdir={subdir}")
    for name, handler in (OmegaConf.select(hydra, "job_logging.handlers", default=None) or {}).items():
        filename = OmegaConf.select(handler, "filename", default=None, throw_on_resolution_failure=False)
        if filename:
            writable(Path(filename).parent, f"hydra.job_logging.handlers.{name}.filename={filename}")


def check_no_chdir(config: DictConfig) -> None:
    """A :class:`UsageError` for ``hydra.job.chdir=true``: a job reads relative paths from the command's working
    directory, and writes its files into its own folder without changing to it."""
    if config.hydra.job.chdir:
        raise UsageError(
            "hydra.job.chdir=true would read each job's relative paths (an sqlite:/// store, data.root, resume=) "
            "in the job's own folder: drop it (a job writes its files there without it)"
        )


def check_own_folder(folder: Path, what: str) -> None:
    """A :class:`UsageError` where ``folder`` holds entries no run writes (:data:`RUN_FILES`): a run logs its folder
    to MLflow, and a project's or a home folder would go with it."""
    names = sorted(
        path.name
        for path in (folder.iterdir() if folder.is_dir() else ())
        if not (is_temporary(path) or any(fnmatch.fnmatch(path.name, name) for name in RUN_FILES))
    )
    if names:
        raise UsageError(
            f"{what} holds files no run writes ({first_few(names)}), and a run logs its folder to MLflow: give an "
            "empty folder"
        )


def follower_rank() -> bool:
    """Whether torchrun or SLURM started this process as a rank above 0 (``RANK`` with ``WORLD_SIZE``): it trains
    in the working directory and writes nothing there; rank 0 holds the run's folder."""
    rank = os.environ.get("RANK", "0")
    return "WORLD_SIZE" in os.environ and rank.isdigit() and int(rank) > 0


class RunFolder(Callback):
    """Hydra callback: a run's folder (``hydra.run.dir``) it cannot write is one ``error:`` line before Hydra makes
    it (a sweep's folder: :class:`src.jobs.sweep.Sweep`); with ``run=False`` (a command that writes nothing there,
    whose folder is ``.``) only one that does not exist and cannot be made. A given folder not there yet is claimed
    as ``${fresh:...}`` claims the default one: a command refused before any run leaves neither behind."""

    def __init__(self, run: bool = True) -> None:
        self.run = run

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            folder, what = Path(config.hydra.run.dir), f"hydra.run.dir={config.hydra.run.dir}"
            if self.run:
                check_no_chdir(config)
                if not follower_rank():
                    check_own_folder(folder, what if config.hydra.run.dir else f"{what} (the working directory)")
            if self.run or not folder.is_dir():
                writable(folder, what)
            check_hydra_files(config.hydra, folder)
            if self.run and not follower_rank() and (made := missing(folder.absolute())):
                CLAIMED.setdefault(folder.absolute(), made)  # Hydra makes it now: a refused command removes it
        except UsageError as err:
            exit_with(err)
        except OmegaConfBaseException as err:  # hydra.run.dir=${oc.env:UNSET}: Hydra warns of it, then fails anew
            exit_with(one_line(err))


@contextlib.contextmanager
def held(folder: Path, what: str, fix: str) -> Iterator[None]:
    """Hold ``folder`` (an exclusive ``flock`` on its lock file) for the block; a :class:`UsageError` naming the
    holder's pid and ``fix`` when another process holds it. The lock ends with the process, however it ends. Held,
    the folder's temp files of writes whose process is gone are removed (:func:`src.atomic.remove_stale`)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise UsageError(
                f"{folder} is in use by another {what} (pid {handle.read().strip() or '?'}): {fix}"
            ) from None
        except OSError as err:
            if err.errno not in UNSUPPORTED:
                raise
            log.warning("%s: this file system has no flock (%s): nothing keeps a second process out", folder, err)
        handle.truncate(0)
        handle.write(str(os.getpid()))
        handle.flush()
        remove_stale(folder)  # what writes of a process killed outright (SIGKILL) left here: 0.5 GB a checkpoint
        yield


def holder(folder: Path) -> int | None:
    """The pid :func:`held` wrote in ``folder``'s lock file: the process that holds it, or last held it."""
    try:
        text = (folder / LOCK_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def in_use(folder: Path) -> bool:
    """Whether a live process holds ``folder`` (see :func:`held`)."""
    try:
        with open(folder / LOCK_FILE) as handle:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except FileNotFoundError:
        return False
    except BlockingIOError:
        return True
    except OSError as err:
        if err.errno not in UNSUPPORTED:
            raise
    return False
