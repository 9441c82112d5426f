"""What a Trainer steps with: precision (autocast and gradient scaler), optimizer, LR schedule, class weights."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from src.config import OptimConfig, OptimName, SchedConfig, SchedName


@dataclass
class Precision:
    """Autocast context and gradient scaler built once, so the loop has no ``if amp`` branches."""

    autocast: Callable[[], contextlib.AbstractContextManager]
    scaler: torch.amp.GradScaler

    @classmethod
    def build(cls, dtype: torch.dtype, device: torch.device, graphed: bool = False) -> Precision:
        """Autocast to ``dtype`` unless float32, with a gradient scaler for float16; a ``graphed`` step (captured in a
        CUDA graph) autocasts without the weight cache (PyTorch's rule)."""
        enabled = dtype != torch.float32
        return cls(
            lambda: torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=not graphed),
            torch.amp.GradScaler(device.type, enabled=dtype == torch.float16),
        )


def build_optimizer(cfg: OptimConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.name is OptimName.sgd:
        return torch.optim.SGD(
            params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
            fused=cfg.fused,
        )
    optimizer = torch.optim.AdamW if cfg.name is OptimName.adamw else torch.optim.Adam
    return optimizer(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=cfg.fused)


def build_scheduler(
    cfg: SchedConfig, optimizer: torch.optim.Optimizer, epochs: int, steps_per_epoch: int, warmup_epochs: int = 0
) -> tuple[torch.optim.lr_scheduler.LRScheduler | None, bool]:
    """The schedule and whether it steps per optimizer step (cyclic) rather than per epoch. ``warmup_epochs``
    multiplies the learning rate by a factor rising linearly from 0.1 to 1 over those epochs (per-epoch
    schedules only: the schema refuses it with ``sched=cyclic``)."""
    scheduler, per_step = epoch_schedule(cfg, optimizer, epochs, steps_per_epoch)
    if not warmup_epochs:
        return scheduler, per_step
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup_epochs)
    return torch.optim.lr_scheduler.ChainedScheduler([warmup, *([scheduler] if scheduler else [])]), False


def epoch_schedule(
    cfg: SchedConfig, optimizer: torch.optim.Optimizer, epochs: int, steps_per_epoch: int
) -> tuple[torch.optim.lr_scheduler.LRScheduler | None, bool]:
    if cfg.name is SchedName.multistep:
        milestones = sorted({max(1, round(f * epochs)) for f in cfg.milestones})
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=cfg.gamma), False
    if cfg.name is SchedName.cosine:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs, eta_min=cfg.min_lr), False
    if cfg.name is SchedName.cyclic:
        max_lr = optimizer.param_groups[0]["lr"]
        up = max(1, round(cfg.cycle_epochs * steps_per_epoch / 2))
        return torch.optim.lr_scheduler.CyclicLR(
            optimizer,
            base_lr=cfg.base_lr,
            max_lr=max_lr,
            step_size_up=up,
            cycle_momentum="momentum" in optimizer.defaults,
        ), True
    return None, False


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Ready ``optimizer`` for a CUDA graph: each group's learning rate a device tensor that schedules fill in place
    (a captured step reads the current one, never a value baked in at capture), and on CUDA ``capturable`` (the step
    count on the device). Again after each ``load_state_dict``, which replaces both."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), device=device)
        if device.type == "cuda":
            group["capturable"] = True


def class_weights(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``n / (classes x n_c)`` per class (scikit-learn's "balanced"); a class absent from ``labels`` weighs 0."""
    counts = torch.bincount(labels.cpu(), minlength=num_classes).double()
    return torch.where(counts > 0, len(labels) / (num_classes * counts.clamp(min=1)), 0.0).float()
