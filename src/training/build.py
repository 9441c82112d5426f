"""One ready Trainer from a config: the model (memory format, torch.compile, parallel wrapper), the loaders, and
the hooks every run has (``fault.*``); used by training, the batch probe, the benchmarks and the tests."""

from __future__ import annotations

import dataclasses

import torch

from src.config import Config
from src.data.loaders import load_splits, make_loader
from src.execution import Execution
from src.models import build_model
from src.parallel.dist import Rank
from src.parallel.ranks import data_parallel_width, wrap
from src.training.faults import fault_hooks
from src.training.trainer import Hooks, Trainer


def build_trainer(
    cfg: Config,
    execution: Execution,
    rank: Rank = Rank(),
    gpus: tuple[int, ...] = (),
    hooks: Hooks | None = None,
    splits: dict | None = None,
) -> Trainer:
    """The :class:`Trainer` of one rank on ``execution``'s device (seed first:
    :func:`src.parallel.ranks.seed_everything`); ``splits``
    (split name -> images, labels) replace the config's dataset (the batch probe's synthetic batches)."""
    splits = load_splits(cfg.data) if splits is None else splits
    device = execution.device
    model = build_model(cfg.model, cfg.data).to(device, memory_format=execution.memory_format)
    model = wrap(torch.compile(model) if cfg.compile else model, cfg, device, rank, gpus)
    width = data_parallel_width(cfg, gpus)
    loaders = {
        split: make_loader(
            cfg.data, tensors, cfg.batch_size * width, cfg.seed, split == "train", device, rank.rank, rank.world
        )
        for split, tensors in splits.items()
    }
    hooks = hooks or Hooks()
    hooks = dataclasses.replace(hooks, after_step=(*hooks.after_step, *fault_hooks(cfg, rank)))
    return Trainer(cfg, model, loaders, execution, rank, hooks)
