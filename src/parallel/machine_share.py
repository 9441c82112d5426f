"""A sweep's jobs running at once on one machine (joblib's ``n_jobs``, submitit_local's every job) share its cores and
its memory. The sweep's main process records how many run at once and the memory free before the first starts, in the
environment that the launcher's workers and the jobs' ranks inherit; each job takes its share of both.
docs/parallelism.md."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psutil
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

JOBS_ENV = "MEDSWEEP_JOBS_AT_ONCE"  # the sweep's jobs running at once on this machine
FREE_ENV = "MEDSWEEP_FREE_MB"  # the memory free (MemAvailable, MiB) before the sweep's first job started
GPU_JOBS_ENV = "MEDSWEEP_GPU_JOBS"  # the jobs at once on this job's GPU, this one included (set by its GPU slot)
SHARE_ENV = "MEDSWEEP_GPU_SHARE"  # mps or none, where the jobs share GPUs (src.parallel.mps); each tags its run with it


def launcher_cpus() -> int:
    """The CPUs joblib's launcher counts for ``n_jobs=-1``: this process's affinity and CPU quota, not the machine's."""
    import joblib  # only where a sweep's launcher is checked or sized

    return joblib.cpu_count()


def free_mb() -> float:
    """The memory free on this machine now (Linux's ``MemAvailable``), MiB."""
    return psutil.virtual_memory().available / 2**20


def recorded_by_sweep(name: str) -> float | None:
    """A positive number the sweep recorded under ``name``; None where it is unset or not one."""
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


def jobs_at_once() -> int:
    """The jobs of this process's sweep running at once on this machine, this one included; 1 outside such a sweep."""
    return int(recorded_by_sweep(JOBS_ENV) or 1)


def free_at_start_mb() -> float | None:
    """The memory free before this process's sweep started, where several of its jobs run at once; else None."""
    return recorded_by_sweep(FREE_ENV) if jobs_at_once() > 1 else None


def memory_share_mb() -> float:
    """This job's share of the machine's memory: what was free before its sweep started over the jobs running at
    once (their peaks come later); outside such a sweep, what is free now."""
    free = free_at_start_mb()
    return free / jobs_at_once() if free else free_mb()


def gpu_jobs(slot: int, gpus: int) -> int:
    """How many of the jobs at once (:func:`jobs_at_once`, in GPU slots 0, 1, ... taking the ``gpus`` GPUs in turn)
    share the GPU of the job in ``slot``, this one included."""
    return len(range(slot % gpus, jobs_at_once(), gpus))


def gpu_share_mb(free: float, total: float) -> float:
    """This job's share of its GPU's memory (MiB): the ``total`` over the jobs on it (:data:`GPU_JOBS_ENV`; their peaks
    come later), at most what is ``free`` now."""
    return min(free, total / (recorded_by_sweep(GPU_JOBS_ENV) or 1))


@contextlib.contextmanager
def shared(jobs: int) -> Iterator[None]:
    """Record ``jobs`` at once and the memory free now for the jobs the ``with`` block starts (none where ``jobs`` is
    1, a stray value in the environment included)."""
    with environment({JOBS_ENV: str(jobs), FREE_ENV: f"{free_mb():.0f}"} if jobs > 1 else {}, JOBS_ENV, FREE_ENV):
        yield


@contextlib.contextmanager
def sharing_gpu(jobs: int) -> Iterator[None]:
    """Record, for the ``with`` block, that ``jobs`` jobs share this job's GPU (none where it is 1)."""
    with environment({GPU_JOBS_ENV: str(jobs)} if jobs > 1 else {}, GPU_JOBS_ENV):
        yield


@contextlib.contextmanager
def environment(values: dict[str, str], *names: str) -> Iterator[None]:
    """``names`` set to ``values`` (unset where it has none) for the block, then as they were."""
    before = {name: os.environ.pop(name, None) for name in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def outside_sweep() -> None:
    """A single run is no sweep's job: what a sweep records for its jobs, left in the environment, is dropped."""
    for name in (JOBS_ENV, FREE_ENV, GPU_JOBS_ENV, SHARE_ENV):
        os.environ.pop(name, None)


class OutsideSweep(Callback):
    """Hydra callback of a single run (``conf/config.yaml``'s): :func:`outside_sweep` as it starts."""

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        outside_sweep()
