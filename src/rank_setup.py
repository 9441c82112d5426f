"""What a rank sets up before training, shared by ``src.train`` and the benchmarks: seeds and threads, the
parallel wrapper, the training FLOPs that ``perf/mfu`` divides by, and a ready :class:`Trainer`."""
from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import torch

from src import config as schema
from src import dist
from src.config import ParallelMode
from src.data import load_splits, make_loader
from src.engine import Trainer
from src.models import build_model
from src.models.profile import train_flops


def seed_everything(cfg: schema.Config, ranks_on_node: int = 1) -> int:
    """Seed Python, NumPy and torch, fix this rank's thread count, and enforce determinism when asked."""
    threads = cfg.num_threads or max(1, len(os.sched_getaffinity(0)) // ranks_on_node)
    torch.set_num_threads(threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = cfg.deterministic
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not cfg.deterministic
    return threads


def wrap(model: torch.nn.Module, cfg: schema.Config, device: torch.device, rank: dist.Rank,
         gpus: tuple[int, ...]) -> torch.nn.Module:
    """DDP (with SyncBatchNorm when asked) for several ranks, DataParallel for ``parallel=dp``."""
    if rank.world > 1:
        if cfg.parallel.sync_bn:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if cfg.parallel.mode is ParallelMode.dp:
        return torch.nn.DataParallel(model, device_ids=list(gpus))
    return model


def flops_per_sample(cfg: schema.Config) -> float:
    """Training FLOPs (forward and backward, recomputation not counted) per sample, counted on the meta device."""
    shape = (2, cfg.data.in_channels, *[cfg.data.size] * 3)  # batch 2: BatchNorm trains on 1^3 maps
    with torch.device("meta"):
        model = build_model(dataclasses.replace(cfg.model, checkpointing=False), cfg.data.in_channels,
                            cfg.data.num_classes, cfg.data.size).train()
        return train_flops(model, torch.empty(shape)) / shape[0]


def data_parallel_width(cfg: schema.Config, gpus: tuple[int, ...]) -> int:
    """How many devices share one loader batch: the GPUs of ``parallel=dp``, else 1."""
    return len(gpus) if cfg.parallel.mode is ParallelMode.dp else 1


def build_trainer(cfg: schema.Config, device: torch.device, rank: dist.Rank = dist.Rank(), gpus: tuple[int, ...] = (),
                  **trainer_args) -> Trainer:
    """The model (memory format, torch.compile, parallel wrapper), the loaders and the :class:`Trainer` of one rank
    (seeded first with :func:`seed_everything`); ``trainer_args`` go to the Trainer."""
    splits = load_splits(cfg.data)
    model = build_model(cfg.model, cfg.data.in_channels, cfg.data.num_classes, cfg.data.size)
    memory_format = torch.channels_last_3d if cfg.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    model = wrap(torch.compile(model) if cfg.compile else model, cfg, device, rank, gpus)
    width = data_parallel_width(cfg, gpus)
    loaders = {split: make_loader(cfg.data, tensors, cfg.batch_size * width, cfg.seed, split == "train", device,
                                  rank.rank, rank.world) for split, tensors in splits.items()}
    return Trainer(cfg, model, loaders, device, rank, devices=rank.world * width, **trainer_args)
