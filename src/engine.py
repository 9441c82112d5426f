"""Training and evaluation: precision, optimizer and schedule, the train step, MedMNIST metrics, fit."""
from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from medmnist.evaluator import getACC, getAUC
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from src import checkpoint
from src.augment import Augment, step_generator
from src.clinical import clinical_metrics
from src.config import AmpDtype, Config, Device, OptimConfig, OptimName, SchedConfig, SchedName
from src.data import to_input, train_labels
from src.dist import Rank, all_reduce, gather
from src.errors import UsageError
from src.measure import MemoryMonitor, ThroughputMeter, peak_flops
from src.preemption import Preempted, Preemption

log = logging.getLogger(__name__)


def resolve_device(cfg: Config) -> torch.device:
    if cfg.device is Device.cuda and not torch.cuda.is_available():
        raise UsageError("device=cuda but no CUDA device is visible: use device=auto or device=cpu")
    if cfg.device is Device.cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN runs bf16 convolutions natively here (avx512_bf16 / AMX); otherwise torch falls back to a
    reference kernel ~100x slower than float32 (measured on an AVX2-only AMD EPYC: docs/benchmarks.md)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_amp_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """``auto``: float16 on CUDA; on CPU bfloat16 where it is native, else float32 (autocast would only slow
    the run down). float16 on CPU is refused (no fp16 units, ~50x slower)."""
    if cfg.amp_dtype is AmpDtype.auto:
        if device.type == "cuda":
            return torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
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
        enabled = enabled and dtype != torch.float32
        return cls(lambda: torch.autocast(device.type, dtype=dtype, enabled=enabled),
                   torch.amp.GradScaler(device.type, enabled=enabled and dtype == torch.float16))


def build_optimizer(cfg: OptimConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.name is OptimName.sgd:
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=cfg.weight_decay, fused=cfg.fused)
    optimizer = torch.optim.AdamW if cfg.name is OptimName.adamw else torch.optim.Adam
    return optimizer(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=cfg.fused)


def build_scheduler(cfg: SchedConfig, optimizer: torch.optim.Optimizer, epochs: int, steps_per_epoch: int,
                    warmup_epochs: int = 0) -> tuple[torch.optim.lr_scheduler.LRScheduler | None, bool]:
    """The schedule and whether it steps per optimizer step (cyclic) rather than per epoch. ``warmup_epochs``
    multiplies the learning rate by a factor rising linearly from 0.1 to 1 over those epochs (per-epoch
    schedules only)."""
    scheduler, per_step = epoch_schedule(cfg, optimizer, epochs, steps_per_epoch)
    if not warmup_epochs:
        return scheduler, per_step
    if per_step:
        raise UsageError(f"warmup_epochs={warmup_epochs} with sched={cfg.name.value}, which steps per optimizer "
                         f"step: use warmup_epochs=0 or a per-epoch schedule")
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup_epochs)
    return torch.optim.lr_scheduler.ChainedScheduler([warmup, *([scheduler] if scheduler else [])]), False


def epoch_schedule(cfg: SchedConfig, optimizer: torch.optim.Optimizer, epochs: int,
                   steps_per_epoch: int) -> tuple[torch.optim.lr_scheduler.LRScheduler | None, bool]:
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


def class_weights(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``n / (classes x n_c)`` per class (scikit-learn's "balanced"); a class absent from ``labels`` weighs 0."""
    counts = torch.bincount(labels.cpu(), minlength=num_classes).double()
    return torch.where(counts > 0, len(labels) / (num_classes * counts.clamp(min=1)), 0.0).float()


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

    With ``checkpoint_to`` (main rank only), each epoch is saved there with ``checkpoint_meta`` before its
    metrics are logged; a requested ``preemption`` saves the exact step and raises :class:`Preempted`.
    :meth:`load_state_dict` continues from a checkpoint, bitwise as if never stopped on CPU.
    """

    def __init__(self, cfg: Config, model: torch.nn.Module, loaders: dict, device: torch.device,
                 rank: Rank = Rank(), flops_per_sample: float | None = None, devices: int = 1,
                 predicted_mb: float | None = None, checkpoint_to: Path | None = None,
                 checkpoint_meta: dict[str, Any] | None = None, preemption: Preemption | None = None) -> None:
        self.cfg, self.model, self.loaders, self.device, self.rank = cfg, model, loaders, device, rank
        self.net = getattr(model, "module", model)
        self.bare = checkpoint.unwrap(model)
        self.checkpoint_to, self.checkpoint_meta = checkpoint_to, checkpoint_meta or {}
        self.preemption = preemption or Preemption()  # never installed: never requested
        self.epoch, self.step = 0, 0  # the next optimizer step: epoch, and step within it
        self.running: dict[str, list[float]] | None = None  # resumed mid-epoch: every rank's sums so far
        self.best_auc, self.best_state, self.best_epoch = -math.inf, None, 0  # best_epoch: epochs trained then
        self.test_predictions: tuple[np.ndarray, np.ndarray] | None = None  # labels and scores of the test split
        self.last_metrics: dict[str, float] | None = None  # the last finished epoch's
        self.elapsed_s, self._start = 0.0, time.perf_counter()
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
        self.term_after_step = fault.term_step if rank.is_main else None
        micro = len(loaders["train"]) if cfg.limit_batches is None else min(cfg.limit_batches, len(loaders["train"]))
        self.steps_per_epoch = max(1, micro // cfg.accumulate)
        self.scheduler, self.sched_per_step = build_scheduler(cfg.sched, self.optimizer, cfg.epochs,
                                                              self.steps_per_epoch, cfg.warmup_epochs)
        weight = class_weights(train_labels(loaders["train"]), cfg.data.num_classes) if cfg.class_weights else None
        self.loss_weight = None if weight is None else weight.to(device)
        self.augment = Augment(cfg.aug)
        self.meter = ThroughputMeter(device)
        self.memory = MemoryMonitor(device)

    def _batch(self, batch: tuple[torch.Tensor, torch.Tensor],
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A loader batch on the device as model input; augmented (training) when given the step's generator."""
        images, labels = (t.to(self.device, non_blocking=self.cfg.non_blocking) for t in batch)
        images = to_input(images)
        if generator is not None:
            images = self.augment(images, generator)
        return images.contiguous(memory_format=self.memory_format), labels

    def _train_batch(self, batch: tuple[torch.Tensor, torch.Tensor], epoch: int,
                     micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The augmentation stream is a pure function of (seed, epoch, micro-step, rank): reruns and resumed
        runs draw the same transforms with no state to save."""
        if not self.augment.enabled:
            return self._batch(batch)
        generator = step_generator(self.device, self.cfg.seed, epoch, micro_step, self.rank.rank)
        return self._batch(batch, generator)

    def _micro_step(self, images: torch.Tensor, labels: torch.Tensor,
                    sync: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch; returns its detached loss and correct count.

        ``sync=False`` (a non-final micro-step of an accumulation) skips DDP's gradient all-reduce.
        """
        no_sync = not sync and isinstance(self.model, DistributedDataParallel)
        with self.model.no_sync() if no_sync else contextlib.nullcontext(), self.precision.autocast():
            logits = self.model(images)
            loss = F.cross_entropy(logits, labels, weight=self.loss_weight, label_smoothing=self.cfg.label_smoothing)
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
        """One epoch from step :attr:`step` (0 unless resumed mid-epoch: the order is a pure function of the
        seed and the epoch, so the batches already trained on are skipped, and the running sums restored)."""
        cfg, loader, first = self.cfg, self.loaders["train"], self.step
        self.model.train()
        loader.sampler.set_epoch(epoch)
        batches = itertools.islice(iter(loader), first * cfg.accumulate, None)
        running = self.running or {"loss": [0.0] * self.rank.world, "correct": [0] * self.rank.world}
        loss_sum = torch.tensor(running["loss"][self.rank.rank], dtype=torch.float32, device=self.device)
        correct = torch.tensor(int(running["correct"][self.rank.rank]), dtype=torch.long, device=self.device)
        samples_per_step = cfg.batch_size * cfg.accumulate
        self.meter.start_epoch(self.steps_per_epoch - first)
        bar = tqdm(range(first, self.steps_per_epoch), desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=None,
                   leave=False)
        for step in bar:
            if self._stop_requested(step):
                self._preempt(epoch, step, loss_sum, correct)
            for micro in range(cfg.accumulate):
                waited = time.perf_counter()  # fetching, converting and augmenting the batch
                images, labels = self._train_batch(next(batches), epoch, step * cfg.accumulate + micro)
                self.meter.data_wait(time.perf_counter() - waited)
                loss, hits = self._micro_step(images, labels, sync=micro == cfg.accumulate - 1)
                loss_sum += loss
                correct += hits
            self._optimizer_step()
            self.meter.step_done(samples_per_step)
            self._inject_fault(epoch * self.steps_per_epoch + step + 1)
            if (step + 1) % cfg.log_every == 0:  # the only host sync inside the epoch
                bar.set_postfix(loss=f"{loss.item():.4f}")
        if self.scheduler is not None and not self.sched_per_step:
            self.scheduler.step()
        self.step, self.running = 0, None
        return self._epoch_metrics(loss_sum, correct)

    def _stop_requested(self, step: int) -> bool:
        """Whether to stop before ``step``. One process: its signal flag, a Python bool (no device sync).
        Several ranks must stop at the same step: they agree (one MAX all-reduce) at the steps after a log
        step and at the first step of each epoch, where the host syncs anyway."""
        if self.rank.world == 1:
            return self.preemption.requested
        if step % self.cfg.log_every and step != self.step:
            return False
        flag = torch.tensor(float(self.preemption.requested), device=self.device)
        return bool(all_reduce({"stop": flag}, dist.ReduceOp.MAX)["stop"].item())

    def _preempt(self, epoch: int, step: int, loss_sum: torch.Tensor, correct: torch.Tensor) -> NoReturn:
        """Checkpoint the exact position (every rank's running sums gathered to the main rank), then stop."""
        self.epoch, self.step = epoch, step
        self.running = {"loss": gather(loss_sum.item(), self.device), "correct": gather(correct.item(), self.device)}
        self._save()
        raise Preempted(f"stopped at epoch {epoch + 1} step {step}/{self.steps_per_epoch}"
                        + (f", checkpoint {self.checkpoint_to}" if self.checkpoint_to else ""))

    def _inject_fault(self, step: int) -> None:
        """``fault.*`` (tests): this rank dies, is asked to stop (SIGTERM), or a real out-of-memory error is
        raised, after ``step``."""
        if step == self.kill_after_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.term_after_step:
            os.kill(os.getpid(), signal.SIGTERM)
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
    def predict(self, split: str) -> tuple[float, np.ndarray, np.ndarray]:
        """Mean cross-entropy, labels and softmax scores on ``split`` (at most ``limit_batches`` batches)."""
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
        return loss_sum.item() / len(labels), labels, scores

    def evaluate(self, split: str) -> dict[str, float]:
        """Loss, the MedMNIST protocol's ACC and AUC, and :func:`src.clinical.clinical_metrics` on ``split``;
        the test split's labels and scores are kept in :attr:`test_predictions`."""
        loss, labels, scores = self.predict(split)
        if split == "test":
            self.test_predictions = labels, scores
        task = self.cfg.data.task
        metrics = {"loss": loss, **medmnist_metrics(labels, scores, task), **clinical_metrics(labels, scores, task)}
        return {f"{split}/{k}": v for k, v in metrics.items()}

    def fit(self, log_metrics: Callable[[dict[str, float], int], None]) -> dict[str, float]:
        """Train from :attr:`epoch` to ``epochs``, validating each; test the weights with the best validation AUC.

        Each epoch is checkpointed before its metrics are logged, so a crash in between loses none (the
        checkpoint holds them: see :attr:`last_metrics`). Only the main rank validates, tests, logs and
        returns metrics; the others return ``{}``.
        """
        self._start = time.perf_counter() - self.elapsed_s
        self.memory.start()
        for epoch in range(self.epoch, self.cfg.epochs):
            if self._patience_exhausted():
                break
            metrics = self.train_epoch(epoch)
            self.epoch = epoch + 1
            if not self.rank.is_main:
                continue
            metrics.update(self.evaluate("val"))
            if self.best_state is None or metrics["val/auc"] > self.best_auc:
                self.best_auc, self.best_state = metrics["val/auc"], copy.deepcopy(self.bare.state_dict())
                self.best_epoch = self.epoch
            self.last_metrics = metrics
            self._save()
            log_metrics(metrics, epoch)
            log.info("epoch %d/%d %s", epoch + 1, self.cfg.epochs,
                     " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        if not self.rank.is_main:
            return {}
        self.bare.load_state_dict(self.best_state)
        test = self.evaluate("test")
        del test["test/loss"]
        final = {**test, "model/params": float(sum(p.numel() for p in self.net.parameters() if p.requires_grad)),
                 "time/total_s": time.perf_counter() - self._start, "stopped_epoch": float(self.epoch),
                 "best_epoch": float(self.best_epoch)}
        log_metrics(final, self.cfg.epochs)
        return final

    def _patience_exhausted(self) -> bool:
        """Early stopping: ``early_stop_patience`` epochs trained since the best validation AUC."""
        patience = self.cfg.early_stop_patience
        stop = patience is not None and self.best_state is not None and self.epoch - self.best_epoch >= patience
        if stop and self.rank.is_main:
            log.info("early stop after epoch %d: no better val/auc for %d epochs (best at epoch %d)",
                     self.epoch, patience, self.best_epoch)
        return stop

    def _save(self) -> None:
        if self.checkpoint_to is not None:
            checkpoint.save({**self.checkpoint_meta, **self.state_dict()}, self.checkpoint_to)

    def state_dict(self) -> dict[str, Any]:
        """Everything that carries over to the next step, as tensors and plain values (``weights_only`` safe)."""
        return {"model": self.bare.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.precision.scaler.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "rng": checkpoint.rng_state(), "epoch": self.epoch, "step": self.step, "running": self.running,
                "best_auc": self.best_auc, "best_state": self.best_state, "best_epoch": self.best_epoch,
                "last_metrics": self.last_metrics,
                "elapsed_s": time.perf_counter() - self._start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (every rank loads the main rank's checkpoint)."""
        self.bare.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        self.epoch, self.step, self.running = state["epoch"], state["step"], state["running"]
        self.best_auc, self.best_state = state["best_auc"], state["best_state"]
        self.best_epoch = state.get("best_epoch", self.epoch)  # checkpoints before early stopping lack it
        self.last_metrics = state["last_metrics"]
        self.elapsed_s = state["elapsed_s"]
