"""Training and evaluation: precision, optimizer and schedule, the train step, MedMNIST metrics, fit."""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from medmnist.evaluator import getACC, getAUC
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from src.config import AmpDtype, Config, Device, OptimConfig, OptimName, SchedConfig, SchedName
from src.data import to_input
from src.dist import Rank, all_reduce, gather
from src.errors import UsageError
from src.measure import MemoryMonitor, ThroughputMeter, peak_flops

log = logging.getLogger(__name__)


def resolve_device(cfg: Config) -> torch.device:
    if cfg.device is Device.cuda and not torch.cuda.is_available():
        raise UsageError("device=cuda but no CUDA device is visible: use device=auto or device=cpu")
    if cfg.device is Device.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_amp_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """``auto``: float16 on CUDA, bfloat16 on CPU. float16 on CPU is refused (no fp16 units, ~50x slower)."""
    if cfg.amp_dtype is AmpDtype.auto:
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    if cfg.amp_dtype is AmpDtype.float16 and device.type != "cuda":
        raise UsageError("amp_dtype=float16 needs a CUDA device (this run is on cpu): use amp_dtype=bfloat16 or auto")
    return getattr(torch, cfg.amp_dtype.value)


@dataclass
class Precision:
    """Autocast context and gradient scaler built once, so the loop has no ``if amp`` branches."""

    autocast: Callable[[], contextlib.AbstractContextManager]
    scaler: torch.amp.GradScaler

    @classmethod
    def build(cls, enabled: bool, dtype: torch.dtype, device: torch.device) -> "Precision":
        return cls(lambda: torch.autocast(device.type, dtype=dtype, enabled=enabled),
                   torch.amp.GradScaler(device.type, enabled=enabled and dtype == torch.float16))


def build_optimizer(cfg: OptimConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.name is OptimName.sgd:
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay)
    optimizer = torch.optim.AdamW if cfg.name is OptimName.adamw else torch.optim.Adam
    return optimizer(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def build_scheduler(cfg: SchedConfig, optimizer: torch.optim.Optimizer, epochs: int,
                    steps_per_epoch: int) -> tuple[torch.optim.lr_scheduler.LRScheduler | None, bool]:
    """The schedule and whether it steps per optimizer step (cyclic) rather than per epoch."""
    if cfg.name is SchedName.multistep:
        milestones = sorted({max(1, round(f * epochs)) for f in cfg.milestones})
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma=cfg.gamma), False
    if cfg.name is SchedName.cosine:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs, eta_min=cfg.min_lr), False
    if cfg.name is SchedName.cyclic:
        max_lr = optimizer.param_groups[0]["lr"]
        up = max(1, round(cfg.cycle_epochs * steps_per_epoch / 2))
        return torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=cfg.base_lr, max_lr=max_lr, step_size_up=up,
                                                 cycle_momentum="momentum" in optimizer.defaults), True
    return None, False


def medmnist_metrics(labels: np.ndarray, scores: np.ndarray, task: str) -> dict[str, float]:
    """ACC and AUC exactly as ``medmnist.Evaluator`` computes them (its own functions).

    AUC is NaN where it is undefined: a (truncated) split missing a class.
    """
    try:
        auc = getAUC(labels, scores, task)
    except ValueError:  # roc_auc_score: only one class present
        auc = math.nan
    return {"acc": float(getACC(labels, scores, task)), "auc": float(auc)}


class Trainer:
    """Owns the model, optimizer, schedule and precision of one rank; ``fit`` trains, validates and tests.

    ``model`` may be wrapped (DDP, DataParallel); evaluation uses the bare module on the main rank only.
    With ``flops_per_sample`` (training FLOPs, forward and backward), epochs also report ``perf/tflops``
    and ``perf/mfu`` against ``devices`` x the device's peak in the compute dtype; with ``predicted_mb``,
    ``mem/predicted_mb`` and ``mem/predict_ratio`` (measured peak over predicted).
    """

    def __init__(self, cfg: Config, model: torch.nn.Module, loaders: dict, device: torch.device,
                 rank: Rank = Rank(), flops_per_sample: float | None = None, devices: int = 1,
                 predicted_mb: float | None = None) -> None:
        self.cfg, self.model, self.loaders, self.device, self.rank = cfg, model, loaders, device, rank
        self.net = getattr(model, "module", model)
        self.memory_format = torch.channels_last_3d if cfg.channels_last else torch.contiguous_format
        dtype = resolve_amp_dtype(cfg, device)
        self.precision = Precision.build(cfg.amp, dtype, device)
        self.optimizer = build_optimizer(cfg.optim, model.parameters())
        self.flops_per_sample, self.predicted_mb = flops_per_sample, predicted_mb
        if flops_per_sample:
            peak, self.peak_source = peak_flops(device, dtype if cfg.amp else torch.float32)
            self.peak_total = peak * devices
        fault = cfg.fault
        self.kill_after_step = fault.kill_step if fault.kill_rank == rank.rank else None
        self.oom_after_step = fault.oom_step if cfg.batch_size >= fault.oom_min_batch else None
        micro = len(loaders["train"]) if cfg.limit_batches is None else min(cfg.limit_batches, len(loaders["train"]))
        self.steps_per_epoch = max(1, micro // cfg.accumulate)
        self.scheduler, self.sched_per_step = build_scheduler(cfg.sched, self.optimizer, cfg.epochs,
                                                              self.steps_per_epoch)
        self.meter = ThroughputMeter(device)
        self.memory = MemoryMonitor(device)

    def _batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = (t.to(self.device, non_blocking=self.cfg.non_blocking) for t in batch)
        return to_input(images).contiguous(memory_format=self.memory_format), labels

    def _micro_step(self, images: torch.Tensor, labels: torch.Tensor,
                    sync: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch; returns its detached loss and correct count.

        ``sync=False`` (a non-final micro-step of an accumulation) skips DDP's gradient all-reduce.
        """
        no_sync = not sync and isinstance(self.model, DistributedDataParallel)
        with self.model.no_sync() if no_sync else contextlib.nullcontext(), self.precision.autocast():
            logits = self.model(images)
            loss = F.cross_entropy(logits, labels)
            self.precision.scaler.scale(loss / self.cfg.accumulate).backward()
        return loss.detach(), (logits.argmax(1) == labels).sum()

    def _optimizer_step(self) -> None:
        scaler = self.precision.scaler
        if self.cfg.grad_clip is not None:
            scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.sched_per_step:
            self.scheduler.step()

    def train_epoch(self, epoch: int) -> dict[str, float]:
        cfg, loader = self.cfg, self.loaders["train"]
        self.model.train()
        loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        samples_per_step = cfg.batch_size * cfg.accumulate
        self.meter.start_epoch(self.steps_per_epoch)
        bar = tqdm(range(self.steps_per_epoch), desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=None, leave=False)
        for step in bar:
            for micro in range(cfg.accumulate):
                waited = time.perf_counter()
                batch = next(batches)
                self.meter.data_wait(time.perf_counter() - waited)
                loss, hits = self._micro_step(*self._batch(batch), sync=micro == cfg.accumulate - 1)
                loss_sum += loss
                correct += hits
            self._optimizer_step()
            self.meter.step_done(samples_per_step)
            self._inject_fault(epoch * self.steps_per_epoch + step + 1)
            if (step + 1) % cfg.log_every == 0:  # the only host sync inside the epoch
                bar.set_postfix(loss=f"{loss.item():.4f}")
        if self.scheduler is not None and not self.sched_per_step:
            self.scheduler.step()
        return self._epoch_metrics(loss_sum, correct)

    def _inject_fault(self, step: int) -> None:
        """``fault.*`` (tests): this rank dies, or a real out-of-memory error is raised, after ``step``."""
        if step == self.kill_after_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.oom_after_step:
            raise torch.OutOfMemoryError(f"out of memory injected by fault.oom_step={step}")

    def _epoch_metrics(self, loss_sum: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
        """Training metrics over all ranks: mean loss and accuracy, summed throughput, slowest step, max memory."""
        micro_steps = self.steps_per_epoch * self.cfg.accumulate * self.rank.world
        perf, memory = self.meter.end_epoch(), self.memory.peak()
        sums = all_reduce({"loss": loss_sum, "correct": correct.double(),
                           "perf/samples_per_s": torch.tensor(perf["perf/samples_per_s"], device=self.device)},
                          dist.ReduceOp.SUM)
        maxima = all_reduce({k: torch.tensor(v, device=self.device) for k, v in {**perf, **memory}.items()
                             if k != "perf/samples_per_s"}, dist.ReduceOp.MAX)
        metrics = {"train/loss": sums["loss"].item() / micro_steps,
                   "train/acc": sums["correct"].item() / (micro_steps * self.cfg.batch_size),
                   "perf/samples_per_s": sums["perf/samples_per_s"].item(), **{k: v.item() for k, v in maxima.items()}}
        if self.predicted_mb:
            metrics.update({"mem/predicted_mb": self.predicted_mb,
                            "mem/predict_ratio": metrics["mem/peak_mb"] / self.predicted_mb})
        if self.flops_per_sample:
            achieved = self.flops_per_sample * metrics["perf/samples_per_s"]
            metrics.update({"perf/tflops": achieved / 1e12, "perf/mfu": achieved / self.peak_total})
        if self.rank.world > 1:
            per_rank = gather(memory["mem/peak_mb"], self.device)
            metrics.update({f"mem/peak_mb/rank{k}": v for k, v in enumerate(per_rank)})
        return metrics

    @torch.no_grad()
    def evaluate(self, split: str) -> dict[str, float]:
        """Loss, ACC and AUC on ``split`` (at most ``limit_batches`` batches)."""
        self.net.eval()
        loss_sum, scores, labels = torch.zeros((), device=self.device), [], []
        for i, batch in enumerate(self.loaders[split]):
            if self.cfg.limit_batches is not None and i == self.cfg.limit_batches:
                break
            images, target = self._batch(batch)
            with self.precision.autocast():
                logits = self.net(images)
            loss_sum += F.cross_entropy(logits.float(), target, reduction="sum")
            scores.append(logits.float().softmax(1))
            labels.append(target)
        scores, labels = torch.cat(scores).cpu().numpy(), torch.cat(labels).cpu().numpy()
        metrics = medmnist_metrics(labels, scores, self.cfg.data.task)
        return {f"{split}/loss": loss_sum.item() / len(labels), f"{split}/acc": metrics["acc"],
                f"{split}/auc": metrics["auc"]}

    def fit(self, log_metrics: Callable[[dict[str, float], int], None]) -> dict[str, float]:
        """Train ``epochs`` epochs, validating each; test the weights with the best validation AUC.

        Only the main rank validates, tests, logs and returns metrics; the others return ``{}``.
        """
        start = time.perf_counter()
        best_auc, best_state = -math.inf, None
        self.memory.start()
        for epoch in range(self.cfg.epochs):
            metrics = self.train_epoch(epoch)
            if not self.rank.is_main:
                continue
            metrics.update(self.evaluate("val"))
            log_metrics(metrics, epoch)
            log.info("epoch %d/%d %s", epoch + 1, self.cfg.epochs,
                     " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            if best_state is None or metrics["val/auc"] > best_auc:
                best_auc, best_state = metrics["val/auc"], copy.deepcopy(self.net.state_dict())
        if not self.rank.is_main:
            return {}
        self.net.load_state_dict(best_state)
        test = self.evaluate("test")
        final = {"test/acc": test["test/acc"], "test/auc": test["test/auc"],
                 "model/params": float(sum(p.numel() for p in self.net.parameters() if p.requires_grad)),
                 "time/total_s": time.perf_counter() - start}
        log_metrics(final, self.cfg.epochs)
        return final
