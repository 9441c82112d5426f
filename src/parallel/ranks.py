"""What a rank sets up before training: seeds and threads, and the parallel wrapper of its model."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from src.config import Config, ParallelMode
from src.parallel import dist


def seed_everything(cfg: Config, threads: int) -> None:
    """Seed Python, NumPy and torch, fix this rank's thread count (results change with it), and enforce determinism
    when asked."""
    torch.set_num_threads(threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # CUDA: pooling backward has no deterministic kernel
    torch.backends.cudnn.deterministic = cfg.deterministic
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not cfg.deterministic


def wrap(
    model: torch.nn.Module, cfg: Config, device: torch.device, rank: dist.Rank, gpus: tuple[int, ...]
) -> torch.nn.Module:
    """DDP (with SyncBatchNorm when asked) for several ranks, DataParallel for ``parallel=dp``."""
    if rank.world > 1:
        if cfg.parallel.sync_bn:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if cfg.parallel.mode is ParallelMode.dp:
        return torch.nn.DataParallel(model, device_ids=list(gpus))
    return model


def job_world(cfg: Config, gpus: tuple[int, ...], external: dist.Rank | None = None) -> int:
    """The devices a job's effective batch spreads over: the ranks torchrun / SLURM started (``external``),
    ``parallel=ddp``'s ranks, ``parallel=dp``'s GPUs, else 1."""
    if external is not None:
        return external.world
    return dist.world_size(cfg, gpus) if cfg.parallel.mode is ParallelMode.ddp else data_parallel_width(cfg, gpus)


def data_parallel_width(cfg: Config, gpus: tuple[int, ...]) -> int:
    """How many devices share one loader batch: the GPUs of ``parallel=dp``, else 1."""
    return len(gpus) if cfg.parallel.mode is ParallelMode.dp else 1
