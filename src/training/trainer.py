"""The Trainer of one rank: the train step, epochs, evaluation, fit, and its state for checkpoints."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from src.config import Config
from src.data.loaders import to_input, train_labels
from src.execution import Execution
from src.parallel.dist import Rank, all_reduce, gather
from src.parallel.preemption import Preempted, Preemption
from src.training import checkpoint
from src.training.augment import Augment, step_generator
from src.training.checkpoint_log import CheckpointLog
from src.training.ema import WeightEMA
from src.training.meters import RUN_WARMUP, MemoryMonitor, OtherLoad, ThroughputMeter, is_contended
from src.training.metrics import clinical_metrics, medmnist_metrics
from src.training.optim import Precision, build_optimizer, build_scheduler, class_weights, make_capturable
from src.training.selection import Selection
from src.training.step_graph import WARMUP_STEPS, Batch, GraphedStep

log = logging.getLogger(__name__)

MEMORY = ("mem/peak_mb", "mem/peak_reserved_mb")  # peaks: a resumed run logs the maximum of all its processes
TIMING = ("perf/samples_per_s", "perf/steps_timed")
LOAD = ("perf/others_cpu", "perf/own_cpu", "perf/others_gpu_procs")  # cores' worth of CPU; processes on the GPU


class Diverged(Exception):
    """The training loss became NaN or infinite."""


@dataclasses.dataclass
class Hooks:
    """What a caller attaches to a :class:`Trainer`: where checkpoints go (main rank), the stop signal to honour,
    ``after_step`` callables given the optimizer steps done so far (fault injection), and ``epoch_metrics``
    callables that add to an epoch's training metrics (MFU, predicted memory)."""

    checkpoint_to: Path | None = None
    checkpoint_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    preemption: Preemption = dataclasses.field(default_factory=Preemption)  # never installed: never requested
    after_step: tuple[Callable[[int], None], ...] = ()
    epoch_metrics: tuple[Callable[[dict[str, float]], dict[str, float]], ...] = ()


def steps_per_epoch(cfg: Config, batches: int) -> int:
    """Optimizer steps of an epoch over ``batches`` training micro-batches, at most ``limit_batches`` of them but one
    step at least (``accumulate`` micro-batches, past a ``limit_batches`` below it: a sweep's smoke run still steps)."""
    micro = batches if cfg.limit_batches is None else min(cfg.limit_batches, batches)
    return max(1, micro // cfg.accumulate)


class Trainer:
    """Owns the model, optimizer, schedule and precision of one rank; ``fit`` trains, validates and tests.

    ``model`` is what trains (maybe compiled, maybe wrapped in DDP or DataParallel); ``raw_model`` the module
    underneath, which every rank checkpoints; ``evaluated`` the one the main rank validates, keeps as the best and
    tests: ``raw_model``, or with ``ema_decay`` its exponential moving average (weights and BatchNorm buffers,
    updated after every optimizer step). With ``hooks.checkpoint_to`` epochs are saved with ``hooks.checkpoint_meta``
    and their metrics logged as :class:`CheckpointLog` schedules; a requested ``hooks.preemption`` saves the exact
    step and raises :class:`Preempted`. :meth:`load_state_dict` continues from a checkpoint, bitwise as if
    never stopped on CPU.
    """

    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        loaders: dict,
        execution: Execution,
        rank: Rank = Rank(),
        hooks: Hooks | None = None,
    ) -> None:
        self.cfg, self.model, self.loaders, self.execution, self.rank = cfg, model, loaders, execution, rank
        self.device = device = execution.device
        self.raw_model = checkpoint.unwrap(model)
        self.ema = None if cfg.ema_decay is None else WeightEMA(self.raw_model, cfg.ema_decay)
        self.evaluated = self.raw_model if self.ema is None else self.ema.module
        self.hooks = hooks or Hooks()
        self.epoch, self.step = 0, 0  # the next optimizer step: epoch, and step within it
        self.running: dict[str, list[float]] | None = None  # resumed mid-epoch: every rank's sums so far
        self.selection = Selection(cfg.select_by)
        self.best_state, self.best_epoch = None, 0  # the weights to test and the epochs trained then
        self.test_predictions: tuple[np.ndarray, np.ndarray] | None = None  # labels and scores of the test split
        self.saving = CheckpointLog(self.hooks.checkpoint_to, self.hooks.checkpoint_meta, cfg.checkpoint.every_s)
        self.maybe_unlogged: list[tuple[int, dict[str, float]]] = []  # a loaded checkpoint's: its caller checks
        self.memory_peak: dict[str, float] = {}  # the run's peak memory before this epoch, over ranks and processes
        self.elapsed_s, self._start = 0.0, time.perf_counter()
        self.spent_s = {"time/validate_s": 0.0, "time/checkpoint_s": 0.0}  # the run's seconds validating, checkpointing
        self.precision = Precision.build(execution.dtype, device, execution.graphed)
        self.optimizer = build_optimizer(cfg.optim, model.parameters())
        self.steps_per_epoch = steps_per_epoch(cfg, len(loaders["train"]))
        self.scheduler, self.sched_per_step = build_scheduler(
            cfg.sched, self.optimizer, cfg.epochs, self.steps_per_epoch, cfg.warmup_epochs
        )
        weight = class_weights(train_labels(loaders["train"]), cfg.data.num_classes) if cfg.class_weights else None
        self.loss_weight = None if weight is None else weight.to(device)
        self.augment = Augment(cfg.aug)
        self.meter = ThroughputMeter(device, load=OtherLoad.for_device(device, execution.ranks_on_node))
        self.timed: list[dict[str, float]] = []  # each epoch's samples/s, steps timed and other processes' load
        self.memory = MemoryMonitor(device)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)  # this epoch's so far, on this rank
        self.correct = torch.zeros((), dtype=torch.long, device=device)
        self.step_graph: GraphedStep | None = None
        if execution.graphed:
            self.graph_steps()

    def graph_steps(self, **capture: Any) -> None:
        """Replay each optimizer step as one CUDA graph (:class:`GraphedStep`; ``capture`` replaces its warm-up and
        capture, as the CPU tests do)."""
        make_capturable(self.optimizer, self.device)
        self.step_graph = GraphedStep(self._step_body, **capture)
        # the first epoch a process meters leaves out the graph's eager steps and the step that captures it
        self.meter = ThroughputMeter(self.device, first_warmup=max(RUN_WARMUP, WARMUP_STEPS + 1), load=self.meter.load)

    def _batch(
        self, batch: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A loader batch on the device as model input; augmented (training) when given the step's generator."""
        images, labels = (t.to(self.device, non_blocking=self.cfg.non_blocking) for t in batch)
        images = to_input(images)
        if generator is not None:
            images = self.augment(images, generator)
        return images.contiguous(memory_format=self.execution.memory_format), labels

    def train_batch(
        self, batch: tuple[torch.Tensor, torch.Tensor], epoch: int, micro_step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The augmentation stream is a pure function of (seed, epoch, micro-step, rank): reruns and resumed
        runs draw the same transforms with no state to save."""
        if not self.augment.enabled:
            return self._batch(batch)
        generator = step_generator(self.device, self.cfg.seed, epoch, micro_step, self.rank.rank)
        return self._batch(batch, generator)

    def micro_step(
        self, images: torch.Tensor, labels: torch.Tensor, sync: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch; returns its detached loss and correct count.

        ``sync=False`` (a non-final micro-step of an accumulation) skips DDP's gradient all-reduce.
        """
        no_sync = not sync and isinstance(self.model, DistributedDataParallel)
        with self.model.no_sync() if no_sync else contextlib.nullcontext(), self.precision.autocast():
            logits = self.model(images)
            loss = F.cross_entropy(logits, labels, weight=self.loss_weight, label_smoothing=self.cfg.label_smoothing)
            self.precision.scaler.scale(loss / self.cfg.accumulate).backward()
        return loss.detach(), (logits.argmax(1) == labels).sum()

    def optimizer_step(self) -> None:
        """After the micro-steps: unscale and clip, step, zero the gradients, update the EMA and a per-step schedule."""
        self._update()
        self._count_step()

    def train_step(self, batches: Iterable[Batch]) -> torch.Tensor:
        """One optimizer step on its micro-batches as the run executes it: eagerly, or replayed as its CUDA graph.
        Returns the last micro-batch's loss."""
        loss = self._step_body(batches) if self.step_graph is None else self.step_graph(list(batches))
        self._count_step()
        return loss

    def _step_body(self, batches: Iterable[Batch]) -> torch.Tensor:
        """One optimizer step's device work on its micro-batches (fetched as iterated): forward and backward each, add
        to the running sums, update. Returns the last micro-batch's loss."""
        last = self.cfg.accumulate - 1
        for micro, (images, labels) in enumerate(batches):
            loss, hits = self.micro_step(images, labels, sync=micro == last)
            self.loss_sum += loss
            self.correct += hits
        self._update()
        return loss

    def _update(self) -> None:
        scaler = self.precision.scaler
        if self.cfg.grad_clip is not None:
            scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        scaler.step(self.optimizer)
        scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.raw_model)

    def _count_step(self) -> None:
        """The host's part of an optimizer step: the EMA's count, a per-step schedule (filling a graphed step's
        learning-rate tensor)."""
        if self.ema is not None:
            self.ema.count()
        if self.sched_per_step:
            self.scheduler.step()

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """One epoch from step :attr:`step` (0 unless resumed mid-epoch: :meth:`_open_epoch`)."""
        cfg, first = self.cfg, self.step
        batches = self._open_epoch(epoch)
        samples_per_step = self.loaders["train"].batch_size * cfg.accumulate  # parallel=dp: a batch spans the GPUs
        bar = tqdm(
            range(first, self.steps_per_epoch), desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=None, leave=False
        )
        for step in bar:
            if self._stop_requested(step):
                self._preempt(epoch, step)
            micro_batches = (
                self._fetch(next(batches), epoch, step * cfg.accumulate + micro) for micro in range(cfg.accumulate)
            )
            loss = self.train_step(micro_batches)
            self.meter.step_done(samples_per_step)
            for hook in self.hooks.after_step:
                hook(epoch * self.steps_per_epoch + step + 1)
            if (step + 1) % cfg.log_every == 0:  # the only host sync inside the epoch
                value = loss.item()
                if self.rank.world == 1:  # ranks agree on their mean loss at the epoch's end
                    self._check_finite(value, epoch, step + 1)
                bar.set_postfix(loss=f"{value:.4f}")
        return self._close_epoch()

    def _open_epoch(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Epoch ``epoch`` starts at step :attr:`step`: its training micro-batches from there (the order is a pure
        function of the seed and the epoch, so the batches already trained on are skipped), the running sums
        restored, the meter started."""
        loader, first = self.loaders["train"], self.step
        self.model.train()
        loader.sampler.set_epoch(epoch)
        batches = itertools.islice(iter(loader), first * self.cfg.accumulate, None)
        running = self.running or {"loss": [0.0] * self.rank.world, "correct": [0] * self.rank.world}
        self.loss_sum.fill_(running["loss"][self.rank.rank])
        self.correct.fill_(int(running["correct"][self.rank.rank]))
        self.meter.start_epoch(self.steps_per_epoch - first)
        return batches

    def _close_epoch(self) -> dict[str, float]:
        """The epoch's steps done: an epoch-wise schedule stepped, the next epoch from step 0; its training metrics."""
        if self.scheduler is not None and not self.sched_per_step:
            self.scheduler.step()
        self.step, self.running = 0, None
        return self._epoch_metrics()

    def _fetch(self, batch: tuple[torch.Tensor, torch.Tensor], epoch: int, micro_step: int) -> Batch:
        """:meth:`train_batch`, its time counted as waiting for data (fetching, converting, augmenting)."""
        waited = time.perf_counter()
        images_labels = self.train_batch(batch, epoch, micro_step)
        self.meter.data_wait(time.perf_counter() - waited)
        return images_labels

    def _stop_requested(self, step: int) -> bool:
        """Whether to stop before ``step``. One process: its signal flag, a Python bool (no device sync).
        Several ranks must stop at the same step: they agree (one MAX all-reduce) at the steps after a log
        step and at the first step of each epoch, where the host syncs anyway."""
        if self.rank.world == 1:
            return self.hooks.preemption.requested
        if step % self.cfg.log_every and step != self.step:
            return False
        flag = torch.tensor(float(self.hooks.preemption.requested), device=self.device)
        return bool(all_reduce({"stop": flag}, dist.ReduceOp.MAX)["stop"].item())

    def _preempt(self, epoch: int, step: int) -> NoReturn:
        """Checkpoint the exact position (every rank's running sums gathered to the main rank), then stop; a signal
        from now on does not interrupt it."""
        self.hooks.preemption.begin("checkpointing the stopped step")
        self.epoch, self.step = epoch, step
        self.running = {
            "loss": gather(self.loss_sum.item(), self.device),
            "correct": gather(self.correct.item(), self.device),
        }
        self._checkpoint_and_log()
        raise Preempted(
            f"stopped at epoch {epoch + 1} step {step}/{self.steps_per_epoch}"
            + (f", checkpoint {self.hooks.checkpoint_to}" if self.hooks.checkpoint_to else "")
        )

    def _epoch_metrics(self) -> dict[str, float]:
        """Training metrics over all ranks: mean loss and accuracy, summed throughput, slowest step, max memory."""
        micro_steps = self.steps_per_epoch * self.cfg.accumulate * self.rank.world
        perf, memory = self.meter.end_epoch(), self.memory.peak()
        sums = all_reduce(
            {
                "loss": self.loss_sum.clone(),
                "correct": self.correct.double(),
                "perf/samples_per_s": torch.tensor(perf["perf/samples_per_s"], device=self.device),
            },
            dist.ReduceOp.SUM,
        )
        maxima = all_reduce(
            {
                k: torch.tensor(v, device=self.device)
                for k, v in {**perf, **memory}.items()
                if k != "perf/samples_per_s"
            },
            dist.ReduceOp.MAX,
        )
        metrics = {
            "train/loss": sums["loss"].item() / micro_steps,
            "train/acc": sums["correct"].item() / (micro_steps * self.loaders["train"].batch_size),
            "perf/samples_per_s": sums["perf/samples_per_s"].item(),
            **{k: v.item() for k, v in maxima.items()},
        }
        self._check_finite(metrics["train/loss"], self.epoch, self.steps_per_epoch)
        self.timed.append({k: metrics[k] for k in (*TIMING, *LOAD) if k in metrics})
        del metrics["perf/steps_timed"]  # the run's total is logged at its end
        self.memory_peak = {k: max(metrics[k], self.memory_peak.get(k, 0.0)) for k in MEMORY if k in metrics}
        metrics.update(self.memory_peak)
        for extra in self.hooks.epoch_metrics:
            metrics.update(extra(metrics))
        if self.rank.world > 1:
            per_rank = gather(memory["mem/peak_mb"], self.device)
            metrics.update({f"mem/peak_mb/rank{k}": v for k, v in enumerate(per_rank)})
        return metrics

    def _check_finite(self, loss: float, epoch: int, step: int) -> None:
        if not math.isfinite(loss):
            raise Diverged(f"train/loss is {loss} at epoch {epoch + 1} step {step}")

    @torch.no_grad()
    def predict(self, split: str) -> tuple[float, np.ndarray, np.ndarray]:
        """Mean cross-entropy, labels and softmax scores on ``split`` (at most ``limit_batches`` batches)."""
        self.evaluated.eval()
        loss_sum, scores, labels = torch.zeros((), device=self.device), [], []
        for i, batch in enumerate(self.loaders[split]):
            if self.cfg.limit_batches is not None and i == self.cfg.limit_batches:
                break
            images, target = self._batch(batch)
            with self.precision.autocast():
                logits = self.evaluated(images)
            loss_sum += F.cross_entropy(logits.float(), target, reduction="sum")
            scores.append(logits.float().softmax(1))
            labels.append(target)
        scores, labels = torch.cat(scores).cpu().numpy(), torch.cat(labels).cpu().numpy()
        return loss_sum.item() / len(labels), labels, scores

    def evaluate(self, split: str) -> dict[str, float]:
        """Loss, the MedMNIST protocol's ACC and AUC, and :func:`src.training.metrics.clinical_metrics` on ``split``;
        the test split's labels and scores are kept in :attr:`test_predictions`."""
        loss, labels, scores = self.predict(split)
        if not math.isfinite(loss):  # weights the last optimizer step made non-finite: no train/loss saw them yet
            raise Diverged(f"{split}/loss is {loss} after epoch {self.epoch}")
        if split == "test":
            self.test_predictions = labels, scores
        task = self.cfg.data.task
        metrics = {"loss": loss, **medmnist_metrics(labels, scores, task), **clinical_metrics(labels, scores, task)}
        return {f"{split}/{k}": v for k, v in metrics.items()}

    def fit(
        self,
        log_metrics: Callable[[dict[str, float], int], None],
        log_tested: Callable[[dict[str, float], int], None] | None = None,
    ) -> dict[str, float]:
        """Train from :attr:`epoch` to ``epochs``, validating each; test the weights of the epoch ``select_by`` chose
        (:attr:`evaluated` holds them when ``log_tested``, default ``log_metrics``, logs the test metrics).

        Epochs' metrics are logged after the checkpoint that holds them (:class:`CheckpointLog`). Only the main rank
        validates, tests, logs and returns metrics; the others return ``{}``.
        """
        self.begin(log_metrics)
        for epoch in range(self.epoch, self.cfg.epochs):
            if self._patience_exhausted():
                break
            self.end_epoch(epoch, self.train_epoch(epoch))
        if not self.rank.is_main:
            return {}
        return self.test_selected(log_tested or log_metrics)

    def begin(self, log_metrics: Callable[[dict[str, float], int], None]) -> None:
        """Training starts (or goes on): the run's clock, the checkpoint interval, the memory peaks."""
        self._start = time.perf_counter() - self.elapsed_s
        self.saving.start(log_metrics)
        self.memory.start()

    def end_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        """After epoch ``epoch`` trained (``metrics``: its training metrics): the main rank validates, keeps the
        weights ``select_by`` chooses, and checkpoints when due (its metrics logged once a checkpoint holds them)."""
        self.epoch = epoch + 1
        if not self.rank.is_main:
            return
        with self._spent("time/validate_s"):
            metrics.update(self.evaluate("val"))
        if self.selection.improves(metrics, self.epoch, first=self.best_state is None):
            self.best_state, self.best_epoch = copy.deepcopy(self.evaluated.state_dict()), self.epoch
        self.saving.pending.append((epoch, metrics))
        log.info("epoch %d/%d %s", epoch + 1, self.cfg.epochs, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        if self.saving.due():
            self._checkpoint_and_log()

    def test_selected(self, log_tested: Callable[[dict[str, float], int], None]) -> dict[str, float]:
        """The main rank's end of training: the last epochs checkpointed and logged, the selected weights tested; the
        run's final figures, logged by ``log_tested``."""
        if self.saving.pending:  # the last epoch trained (or the one early stopping ended on)
            self._checkpoint_and_log()
        self.evaluated.load_state_dict(self.best_state)
        test = self.evaluate("test")
        del test["test/loss"]
        final = {
            **test,
            "model/params": float(sum(p.numel() for p in self.raw_model.parameters() if p.requires_grad)),
            "time/total_s": time.perf_counter() - self._start,
            **self.spent_s,
            "stopped_epoch": float(self.epoch),
            "best_epoch": float(self.best_epoch),
            **self.speed(),
        }
        log_tested(final, self.cfg.epochs)
        return final

    def speed(self) -> dict[str, float]:
        """The run's throughput: median, least and most ``perf/samples_per_s`` of its epochs, and its steps timed."""
        rates = [epoch["perf/samples_per_s"] for epoch in self.timed]
        if not rates:  # resumed at its end from a checkpoint that timed nothing (format 1, before 2026-11-24)
            return {}
        return {
            "perf/samples_per_s_median": statistics.median(rates),
            "perf/samples_per_s_lo": min(rates),
            "perf/samples_per_s_hi": max(rates),
            "perf/steps_timed": sum(epoch["perf/steps_timed"] for epoch in self.timed),
        }

    @property
    def contended(self) -> bool:
        """Whether other processes shared the machine while the run trained: :func:`is_contended` on the medians over
        its epochs."""
        if not self.timed:
            return False
        others, own, gpu = (statistics.median(epoch.get(key, 0.0) for epoch in self.timed) for key in LOAD)
        return is_contended(others, own, gpu)

    def _patience_exhausted(self) -> bool:
        """Early stopping: ``early_stop_patience`` epochs trained since the selected epoch (``select_by``). Only the
        main rank validates and selects: with several ranks its decision is shared (one MAX all-reduce), or the
        others trained on alone and failed the run when it left (Connection closed by peer)."""
        patience = self.cfg.early_stop_patience
        stop = patience is not None and self.best_state is not None and self.epoch - self.best_epoch >= patience
        if patience is not None and self.rank.world > 1:
            flag = torch.tensor(float(stop), device=self.device)
            stop = bool(all_reduce({"stop": flag}, dist.ReduceOp.MAX)["stop"].item())
        if stop and self.rank.is_main:
            log.info(
                "early stop after epoch %d: no better %s for %d epochs (best at epoch %d)",
                self.epoch,
                self.cfg.select_by.value,
                patience,
                self.best_epoch,
            )
        return stop

    @contextlib.contextmanager
    def _spent(self, name: str) -> Iterator[None]:
        """Add the block's wall seconds to ``spent_s[name]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spent_s[name] += time.perf_counter() - start

    def _checkpoint_and_log(self) -> None:
        """Save the checkpoint, then log the epochs it holds that are not logged yet (the main rank)."""
        with self._spent("time/checkpoint_s"):
            self.saving.save(self.state_dict())
        if self.rank.is_main:
            self.saving.flush()

    def state_dict(self) -> dict[str, Any]:
        """Everything that carries over to the next step, as tensors and plain values (``weights_only`` safe)."""
        return {
            "format": checkpoint.FORMAT,
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.precision.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "rng": checkpoint.rng_state(),
            "epoch": self.epoch,
            "step": self.step,
            "running": self.running,
            "selection": self.selection.state_dict(),
            "best_state": self.best_state,
            "best_epoch": self.best_epoch,
            "pending": self.saving.pending,
            "memory_peak": {k: max(v, self.memory_peak.get(k, 0.0)) for k, v in self.memory.peak().items()},
            "timed": self.timed,
            "elapsed_s": time.perf_counter() - self._start,
            "spent_s": self.spent_s,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (every rank loads the main rank's checkpoint, upgraded to
        :data:`~src.training.checkpoint.FORMAT` by :func:`~src.training.checkpoint.load`)."""
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.step_graph is not None:  # new state tensors, learning rates as floats: capture them anew
            make_capturable(self.optimizer, self.device)
            self.step_graph.reset()
        self.precision.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        checkpoint.set_rng_state(state["rng"])
        self.epoch, self.step, self.running = state["epoch"], state["step"], state["running"]
        self.selection.load_state_dict(state["selection"])
        self.best_state, self.best_epoch = state["best_state"], state["best_epoch"]
        self.maybe_unlogged = [(epoch, metrics) for epoch, metrics in state["pending"]]
        self.memory_peak, self.timed, self.elapsed_s = state["memory_peak"], state["timed"], state["elapsed_s"]
        self.spent_s = state["spent_s"]
