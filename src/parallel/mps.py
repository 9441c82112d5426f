"""Jobs of a sweep sharing a GPU (``gpu_share``): NVIDIA's MPS control daemon for them, used where one serves, else
started for the sweep and stopped at its end; without one, a warning with the measured cost. docs/parallelism.md."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from enum import Enum
from pathlib import Path

from src.config import GpuShare
from src.errors import UsageError
from src.parallel.machine_share import SHARE_ENV

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
DEFAULT_PIPE = "/tmp/nvidia-mps"  # the daemon's pipe folder where CUDA_MPS_PIPE_DIRECTORY is unset
PIPE_ROOM = 80  # bytes of a pipe folder's path: a UNIX socket's path holds 107, the daemon's socket names go inside
COST = "graphed jobs time-slice a GPU without MPS: 4 jobs gave 0.90x the samples/s of one on an H100 (2026-11-24)"
TIMEOUT_S = 60


class Action(Enum):
    nothing = "nothing"  # no GPU shared, or gpu_share=none
    use = "use"  # a daemon serves already
    start = "start"  # one is started for the sweep
    warn = "warn"  # gpu_share=auto without MPS: one warning, the jobs time-slice
    refuse = "refuse"  # gpu_share=mps where MPS cannot be had


def decide(setting: GpuShare, jobs: int, gpus: int, binary: bool, serving: bool) -> Action:
    """What a sweep running ``jobs`` at once on ``gpus`` visible GPUs (0: on the CPU) does about MPS, given whether
    ``nvidia-cuda-mps-control`` is on PATH (``binary``) and whether a daemon ``serving`` already."""
    if jobs <= 1 or setting is GpuShare.none:
        return Action.nothing
    if not gpus:
        return Action.refuse if setting is GpuShare.mps else Action.nothing
    if jobs <= gpus:
        return Action.nothing
    if serving:
        return Action.use
    if binary:
        return Action.start
    return Action.refuse if setting is GpuShare.mps else Action.warn


@dataclasses.dataclass(frozen=True)
class Sharing:
    """A sweep's jobs on its GPUs and what it does about MPS."""

    setting: GpuShare
    jobs: int
    gpus: int
    action: Action

    @property
    def shares(self) -> bool:
        return 0 < self.gpus < self.jobs

    def __str__(self) -> str:
        return f"{self.jobs} jobs at once share {self.gpus} GPU(s)"

    def warning(self, why: str) -> str:
        return (
            f"gpu_share=auto: {self} without MPS ({why}): {COST}; start a daemon ({CONTROL} -d) before the sweep, "
            "or set gpu_share=none"
        )


def serving_pipe() -> Path:
    return Path(os.environ.get(PIPE_ENV) or DEFAULT_PIPE)


def sharing(setting: GpuShare, jobs: int, gpus: int) -> Sharing:
    """``jobs`` at once on ``gpus`` visible GPUs (0: on the CPU), on this machine; a :class:`UsageError` where
    ``gpu_share=mps`` cannot be had."""
    binary = shutil.which(CONTROL) is not None
    action = decide(setting, jobs, gpus, binary, (serving_pipe() / "control").exists())
    if action is Action.refuse:
        why = "this sweep runs on the CPU" if not gpus else f"{CONTROL} is not on PATH (NVIDIA's driver ships it)"
        raise UsageError(f"gpu_share=mps needs an MPS daemon for the jobs sharing a GPU: {why}; use gpu_share=auto")
    return Sharing(setting, jobs, gpus, action)


@contextlib.contextmanager
def shared(sharing: Sharing, folder: Path) -> Iterator[None]:
    """The sweep's MPS, for the ``with`` block: a daemon started with its pipes and log in ``folder`` (its pipe
    folder and :data:`SHARE_ENV` in ``os.environ``, which the launcher's workers inherit) and stopped at the end."""
    before = {key: os.environ.get(key) for key in (PIPE_ENV, LOG_ENV, SHARE_ENV)}
    daemon, mps = None, sharing.action is Action.use
    try:
        if sharing.action is Action.use:
            log.info("%s: using the MPS daemon serving %s", sharing, serving_pipe())
        elif sharing.action is Action.start:
            try:
                daemon = start(folder)
            except (OSError, subprocess.SubprocessError) as err:
                if sharing.setting is GpuShare.mps:
                    raise UsageError(f"gpu_share=mps: {CONTROL} -d failed: {err}; use gpu_share=auto") from None
                log.warning(sharing.warning(f"{CONTROL} -d failed: {err}"))
            else:
                os.environ.update(daemon.env)
                mps = True
                log.info("%s: started an MPS daemon for the sweep (pipes in %s)", sharing, daemon.pipe)
        elif sharing.action is Action.warn:
            log.warning(sharing.warning(f"{CONTROL} is not on PATH"))
        if sharing.shares:
            os.environ[SHARE_ENV] = "mps" if mps else "none"
        else:
            os.environ.pop(SHARE_ENV, None)
        yield
    finally:
        if daemon is not None:
            end_idle_workers()
            stop(daemon)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_tags() -> dict[str, str]:
    """A job's ``gpu_share`` tag (``mps`` or ``none``) where its sweep's jobs share a GPU."""
    share = os.environ.get(SHARE_ENV)
    return {"gpu_share": share} if share in ("mps", "none") else {}


@dataclasses.dataclass(frozen=True)
class Daemon:
    """A control daemon this process started: its pipe and log folders (``own_pipe``: a temp folder to remove)."""

    pipe: Path
    log: Path
    own_pipe: bool = False

    @property
    def env(self) -> dict[str, str]:
        return {PIPE_ENV: str(self.pipe), LOG_ENV: str(self.log)}


def start(folder: Path) -> Daemon:
    """``nvidia-cuda-mps-control -d`` with its pipes in ``folder/pipe`` (in a short temp folder where that path leaves
    a socket's name no room) and its log in ``folder/log``; raises ``OSError`` or ``SubprocessError``."""
    folder = folder.resolve()  # the daemon leaves the working folder
    pipe, own = folder / "pipe", len(os.fsencode(folder / "pipe")) > PIPE_ROOM
    if own:
        pipe = Path(tempfile.mkdtemp(prefix="medsweep-mps-", dir="/tmp"))
    daemon = Daemon(pipe, folder / "log", own)
    daemon.pipe.mkdir(parents=True, exist_ok=True)
    daemon.log.mkdir(parents=True, exist_ok=True)
    try:
        control(daemon, ["-d"])
    except BaseException:
        if own:
            shutil.rmtree(pipe, ignore_errors=True)
        raise
    return daemon


def end_idle_workers() -> None:
    """Shut down the worker processes joblib's loky keeps idle for its next call (up to 300 s): each that trained on
    the GPU is an MPS client, and the daemon's ``quit`` waits for every client (an H200, 2026-11-28: ``quit`` timed
    out after 60 s and left the daemon running)."""
    from joblib.externals.loky import reusable_executor

    executor = getattr(reusable_executor, "_executor", None)  # loky's one reusable executor, None before any sweep
    if executor is not None:
        executor.shutdown(wait=True)


def stop(daemon: Daemon) -> None:
    """``echo quit | nvidia-cuda-mps-control`` to ``daemon``; a failure is logged, never raised."""
    try:
        control(daemon, [], "quit\n")
    except (OSError, subprocess.SubprocessError) as err:
        log.warning(
            "could not stop the sweep's MPS daemon (%s): stop it with: echo quit | %s=%s %s",
            err,
            PIPE_ENV,
            daemon.pipe,
            CONTROL,
        )
    else:
        log.info("stopped the sweep's MPS daemon")
    if daemon.own_pipe:
        shutil.rmtree(daemon.pipe, ignore_errors=True)


def control(daemon: Daemon, args: list[str], stdin: str = "") -> None:
    """Run ``nvidia-cuda-mps-control args`` with ``daemon``'s folders; its output goes to a file rather than a pipe,
    which the forked daemon could hold open."""
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run(
            [CONTROL, *args],
            input=stdin,
            env={**os.environ, **daemon.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
        )
        if done.returncode:
            out.seek(0)
            said = " ".join(out.read().split())[:300]
            raise subprocess.SubprocessError(f"exit {done.returncode}: {said}")
