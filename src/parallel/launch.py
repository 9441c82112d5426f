"""Starting a job's ranks: spawned on this machine (``spawn`` start method, a free port), on the GPUs this job
holds, with stop signals passed on."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.folders import METRICS_FILE
from src.parallel import dist
from src.parallel.machine_share import gpu_jobs, jobs_at_once, launcher_cpus, sharing_gpu
from src.parallel.preemption import Preempted, Preemption, signals_blocked


@contextlib.contextmanager
def visible_gpus(gpus: tuple[int, ...]) -> Iterator[None]:
    """Show processes started inside only ``gpus`` (indices into this process's visible GPUs)."""
    if not gpus:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] for i in gpus)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def spawn_ranks(entry: Callable[..., None], job: Any, world: int, preemption: Preemption) -> dict[str, float]:
    """Start ``world`` ranks as ``entry(index, job, world, store_address)`` with the ``spawn`` method, meeting at a
    TCPStore this process serves (:func:`src.parallel.dist.rendezvous`);
    stop signals are passed on to them. ``job`` has ``output_dir`` and ``gpus`` (the GPUs they see).

    torch.multiprocessing watches them: when one dies the others are terminated and this raises. The
    process-wide start method is set too: a spawned child restores its parent's, and a joblib (loky)
    worker's own, ``loky``, does not exist in a fresh interpreter. The ranks start with the stop signals blocked
    until each installs its own handler. Ranks that stopped on a signal exit 0 without ``metrics.json``: this raises
    :class:`Preempted` then.
    """
    mp.set_start_method("spawn", force=True)
    metrics = Path(job.output_dir) / METRICS_FILE
    metrics.unlink(missing_ok=True)
    with visible_gpus(job.gpus), dist.rendezvous(job.cfg.parallel.timeout_s) as address:
        with signals_blocked():  # a stop signal waits until a rank has its handler, rather than killing it
            ranks = mp.start_processes(
                entry,
                args=(dataclasses.replace(job, gpus=()), world, address),
                nprocs=world,
                start_method="spawn",
                join=False,
            )
        preemption.forward_to(ranks.processes)
        while not ranks.join():
            pass
    if not metrics.exists():
        raise Preempted(f"the ranks stopped, output folder {job.output_dir}")
    return json.loads(metrics.read_text())


@contextlib.contextmanager
def job_gpus(hydra_cfg: DictConfig, device: torch.device) -> Iterator[tuple[int, ...]]:
    """This job's GPUs (none when it runs on the CPU): all visible ones, or, where its sweep runs several jobs at once
    on this machine (:func:`jobs_at_once`), its own share, held through a slot lock for the job's lifetime; more jobs
    than GPUs share them, each job's memory budget its share of its GPU (:func:`sharing_gpu`)."""
    count, n_jobs, per_job = visible_gpus_count(device), jobs_at_once(), gpus_per_job(device)
    if n_jobs <= 1 or not count:
        yield tuple(range(count))
        return
    with dist.gpu_slot(Path(hydra_cfg.sweep.dir), n_jobs) as slot, sharing_gpu(gpu_jobs(slot, count)):
        yield tuple((slot * per_job + i) % count for i in range(per_job))


def visible_gpus_count(device: torch.device) -> int:
    return torch.cuda.device_count() if device.type == "cuda" else 0


def gpus_per_job(device: torch.device) -> int:
    """How many GPUs :func:`job_gpus` gives a job on ``device``'s type: all visible ones, or its share where its sweep
    runs several jobs at once on this machine (one at least); none on the CPU."""
    count, n_jobs = visible_gpus_count(device), jobs_at_once()
    return count if n_jobs <= 1 or not count else max(1, count // n_jobs)


def job_device(device: torch.device, gpus: tuple[int, ...]) -> torch.device:
    """Where a job with ``gpus`` (:func:`job_gpus`) plans its batch and trains its first rank: its first GPU."""
    return torch.device("cuda", gpus[0]) if device.type == "cuda" and gpus else device


def launcher_jobs(hydra_cfg: DictConfig, handed: int) -> int:
    """How many of the ``handed`` jobs a sweep's launcher runs at once on this machine: joblib's ``n_jobs`` (-1: one
    per CPU, as joblib counts them), submitit's local launcher every one; else 1 (Hydra's basic launcher runs them in
    turn, SLURM on its nodes)."""
    if hydra_cfg.mode is not RunMode.MULTIRUN:
        return 1
    if str(OmegaConf.select(hydra_cfg, "launcher._target_", default="")).endswith(".LocalLauncher"):
        return handed
    n_jobs = OmegaConf.select(hydra_cfg, "launcher.n_jobs", default=1)
    if n_jobs == -1:
        n_jobs = launcher_cpus()
    return min(handed, n_jobs)
