"""Ranks and process groups: spawned from inside a Hydra job, or started by torchrun or SLURM (submitit)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from src.config import Config
from src.errors import UsageError

HOST = "127.0.0.1"  # spawned ranks share this machine
PORT_MAX = 65535


@dataclass(frozen=True)
class Rank:
    """Where this process stands: global rank, world size, rank on its node."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def node(self) -> str | None:
        """``node<k>`` on a job of several nodes, else None."""
        per_node = env_count("LOCAL_WORLD_SIZE", 1) or self.world
        if per_node >= self.world:
            return None
        return f"node{os.environ.get('GROUP_RANK', self.rank // per_node)}"


@contextlib.contextmanager
def rendezvous(timeout_s: int) -> Iterator[str]:
    """A ``host:port`` where this process serves the ranks' TCPStore, on a port the OS picked (bind port 0) and
    bound here before any rank starts: no other process can take it in between, and parallel jobs never collide."""
    store = dist.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    try:
        yield f"{HOST}:{store.port}"
    finally:
        del store


def external_rank() -> Rank | None:
    """The rank torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) or a multi-task submitit job (SLURM or
    local, ``tasks_per_node`` x ``nodes`` tasks) started us as; submitit's variables are exported for ``env://``."""
    if "RANK" not in os.environ and "SUBMITIT_EXECUTOR" in os.environ:
        from submitit import JobEnvironment
        from submitit.helpers import TorchDistributedEnvironment

        if JobEnvironment().num_tasks > 1:
            TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = env_count("RANK", 0), env_count("WORLD_SIZE", 1)
    if rank >= world:
        raise UsageError(f"RANK={rank} in the environment must be below WORLD_SIZE={world}: unset both for one process")
    if world > 1 and (missing := [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]):
        raise UsageError(
            f"RANK={rank} and WORLD_SIZE={world} in the environment without {' and '.join(missing)}, where the ranks "
            "meet (torchrun and submitit set them all): set them, or unset RANK and WORLD_SIZE for one process"
        )
    if world > 1 and (port := env_count("MASTER_PORT", 1)) > PORT_MAX:
        raise UsageError(f"MASTER_PORT={port} in the environment is no TCP port: give one <= {PORT_MAX}")
    if world > 1 and rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        check_store_port(port)
    return Rank(rank, world, env_count("LOCAL_RANK", 0) or 0)


def check_store_port(port: int) -> None:
    """A :class:`UsageError` where rank 0 could not serve the ranks' store on ``port`` (torchrun's agent serves its
    own): the rendezvous failed with a traceback after the run was created."""
    with socket.socket() as probe:
        # as the store binds: a port still in TIME_WAIT after its last use is free to it
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            raise UsageError(
                f"MASTER_PORT={port} in the environment cannot be served here ({err.strerror}), where rank 0 serves "
                "the ranks' store: give a free port"
            ) from None


def env_count(name: str, least: int) -> int | None:
    """The count that torchrun, SLURM or submitit set in the environment variable ``name``, None where unset; a
    :class:`UsageError` for a value that is not a whole number >= ``least`` (a stray or mistyped export)."""
    value = os.environ.get(name)
    if value is None:
        return None
    if not (value.strip().isdigit() and int(value) >= least):
        raise UsageError(
            f"{name}={value} in the environment must be a whole number >= {least} (torchrun, SLURM and submitit set "
            f"it): fix or unset it"
        )
    return int(value)


def world_size(cfg: Config, gpus: tuple[int, ...]) -> int:
    """Ranks a ``parallel=ddp`` job spawns: ``parallel.nproc``, or the job's GPUs, or 2 on CPU."""
    return cfg.parallel.nproc or len(gpus) or 2


def init_process_group(cfg: Config, backend: str, rank: Rank, store_address: str | None = None) -> None:
    """Join the job's process group on ``backend``: through the TCPStore at ``store_address`` (:func:`rendezvous`,
    spawned ranks), else ``env://`` (torchrun, SLURM)."""
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    host, _, port = (store_address or "").rpartition(":")
    store = dist.TCPStore(host, int(port), rank.world, False, timeout=timeout) if store_address else None
    dist.init_process_group(
        backend,
        init_method=None if store else "env://",
        store=store,
        rank=rank.rank,
        world_size=rank.world,
        timeout=timeout,
    )


def all_reduce(values: dict[str, torch.Tensor], op: dist.ReduceOp.RedOpType) -> dict[str, torch.Tensor]:
    """One collective for a dict of scalars (a no-op without a process group)."""
    if not dist.is_initialized():
        return values
    stacked = torch.stack([v.double() for v in values.values()])
    dist.all_reduce(stacked, op)
    return dict(zip(values, stacked, strict=True))


def gather(value: float, device: torch.device) -> list[float]:
    """Every rank's ``value``, in rank order (just ``[value]`` without a process group)."""
    if not dist.is_initialized():
        return [value]
    out = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor(value, dtype=torch.float64, device=device))
    return [v.item() for v in out]


@contextlib.contextmanager
def gpu_slot(folder: Path, slots: int) -> Iterator[int]:
    """Hold the first free slot ``0..slots-1`` (an exclusive file lock in ``folder``) for this job's lifetime.

    Parallel sweep jobs on one machine each take a different slot, hence different GPUs.
    """
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(slots):
        with open(folder / f".gpu_slot_{slot}.lock", "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            yield slot
            return
    raise UsageError(f"all {slots} GPU slots in {folder} are taken: lower hydra.launcher.n_jobs")
