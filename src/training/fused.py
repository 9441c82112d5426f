"""Several runs of one model shape trained as one stacked model (``fuse``: docs/fused.md).

Each member is a whole :class:`~src.training.trainer.Trainer` of its own config: its model built and initialised from
its seed, its loaders (its data order), its augmentation stream, optimizer, schedule, EMA, selection, checkpoint and
meters, exactly as an unfused run has them. What is stacked is the forward and backward: the members' parameters and
BatchNorm buffers are stacked along a leading member dim (:func:`torch.func.stack_module_state`) and the step runs
``vmap(functional_call)`` over them, each member on its own micro-batch, so N small convolutions become one grouped
convolution (vmap's batching rule for a convolution with batched weights is HFTA's grouped convolution). Each member's
module holds views of its slice of the stack, so its optimizer updates the stack in place with torch's own kernels,
its evaluation runs its own module, and its checkpoint is the one an unfused run writes (copies, never views: a view
would save the whole stack). The step reads nothing back to the host (the losses on log steps only) and can be
replayed as one CUDA graph.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from tqdm import tqdm

from src.config import Config, Loader
from src.data.loaders import make_loader
from src.execution import Execution
from src.models import build_model
from src.parallel.preemption import Preempted
from src.parallel.ranks import seed_everything
from src.training.step_graph import Batch, GraphedStep
from src.training.trainer import Diverged, Hooks, Trainer

log = logging.getLogger(__name__)

# The keys in which the members of one group may differ: none changes a tensor's shape or a kernel, and each is read
# by a member's own Trainer (init and seed when its model is built, the rest by its optimizer, schedule, loss, EMA,
# augmentation, selection). ``SECTIONS``: every key under them.
KEYS = (
    "seed",
    "label_smoothing",
    "class_weights",
    "ema_decay",
    "grad_clip",
    "warmup_epochs",
    "select_by",
    "early_stop_patience",
    "model.init",
    "model.init_mode",
    "model.zero_init_residual",
)
SECTIONS = ("optim.", "sched.", "aug.")

Ended = Callable[[int, "dict[str, float] | BaseException"], None]
LogMetrics = Callable[[dict[str, float], int], None]


def fusable(key: str) -> bool:
    """Whether members of one group may differ in the flattened config key ``key`` (``optim.lr``)."""
    return key in KEYS or key.startswith(SECTIONS)


def _own(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule that holds the parameter or buffer ``name`` (``layer1.0.norm1.weight``), and its own name there."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _copies(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    """A member's state dict holds copies of its slices: a view would save (and deep-copy) the whole stack."""
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            state[name] = value.detach().clone()


class FloatBatchNorm3d(nn.BatchNorm3d):
    """A BatchNorm of a fused step on CUDA: a bf16 or float16 input normalized in float32, the output cast back (what
    cuDNN's mixed-precision BatchNorm computes unfused). vmap's batch rule refused the bf16 input beside float32
    running statistics in backward (``Expected running_mean to have type BFloat16``: torch 2.11, an H200,
    2026-11-29)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float16):
            return super().forward(x.float()).to(x.dtype)
        return super().forward(x)


class StackedModel:
    """``modules`` (one shape) as stacked parameters and buffers, each module rebound to views of its slice; called on
    ``(N, B, ...)`` images (member i's batch at i) it returns ``(N, B, classes)`` logits. BatchNorm's running
    statistics are batched buffers (vmap's in-dim 0): each member's are updated in place in its own slice, as torch.func
    asks of batch norm under vmap with its statistics kept."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.params, self.buffers = stack_module_state(list(modules))
        for index, module in enumerate(modules):
            for name in self.params:
                owner, leaf = _own(module, name)
                owner._parameters[leaf] = nn.Parameter(self.params[name].data[index])
            for name in self.buffers:
                owner, leaf = _own(module, name)
                owner._buffers[leaf] = self.buffers[name][index]
            module.register_state_dict_post_hook(_copies)
        self.base = copy.deepcopy(modules[0]).to("meta")  # the structure functional_call runs: no weights of its own
        if next(iter(self.params.values())).is_cuda:
            for norm in self.base.modules():
                if type(norm) is nn.BatchNorm3d:
                    norm.__class__ = FloatBatchNorm3d
        self.members = list(modules)
        self.member_params = [[module.get_parameter(name) for name in self.params] for module in modules]

    def _one(self, params: dict, buffers: dict, images: torch.Tensor) -> torch.Tensor:
        return functional_call(self.base, (params, buffers), (images,))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        return vmap(self._one)(self.params, self.buffers, images)

    def train(self) -> None:
        self.base.train()

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None

    def bind_grads(self, index: int) -> None:
        """Member ``index``'s parameters take their slices of the stack's gradients (views: no copy)."""
        for param, stacked in zip(self.member_params[index], self.params.values(), strict=True):
            param.grad = stacked.grad[index]


def build_fused(
    cfgs: Sequence[Config],
    execution: Execution,
    hooks: Sequence[Hooks],
    splits: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> FusedTrainer:
    """The members of ``cfgs`` (one shape: :func:`fusable` keys apart) as one :class:`FusedTrainer` on ``execution``,
    each member's model built after seeding with its seed (the init its unfused run gets), its loaders over the shared
    ``splits`` (moved to the device once)."""
    device = execution.device
    models = []
    for cfg in cfgs:
        seed_everything(cfg, execution.threads)
        models.append(build_model(cfg.model, cfg.data).to(device))
    stacked = StackedModel(models)
    if cfgs[0].data.loader is Loader.tensor:
        splits = {split: (images.to(device), labels.to(device)) for split, (images, labels) in splits.items()}
    members = []
    for cfg, model, hook in zip(cfgs, models, hooks, strict=True):
        loaders = {
            split: make_loader(cfg.data, tensors, cfg.batch_size, cfg.seed, split == "train", device)
            for split, tensors in splits.items()
        }
        members.append(Trainer(cfg, model, loaders, execution, hooks=hook))
    return FusedTrainer(members, stacked)


class FusedTrainer:
    """``members`` (Trainers at one position, their models rebound to ``stacked``) trained as one: each optimizer step
    is one stacked forward and backward over every member's micro-batches, then each member's own update (clipping,
    optimizer, EMA, a per-step schedule). A member that stops early, diverges or ends is masked: it leaves the update
    and the summed loss but stays in the stacked forward (its slice computed and ignored) until the group ends; the
    ``ended`` callback of :meth:`fit` closes its run meanwhile."""

    def __init__(self, members: Sequence[Trainer], stacked: StackedModel) -> None:
        self.members, self.stacked = list(members), stacked
        self._at_one_position("start")
        first = members[0]
        self.cfg, self.precision = first.cfg, first.precision
        self.loss_sum = torch.zeros(len(members), dtype=torch.float32, device=first.device)
        self.correct = torch.zeros(len(members), dtype=torch.long, device=first.device)
        for index, member in enumerate(members):
            member.loss_sum, member.correct = self.loss_sum[index], self.correct[index]
        self.active = list(range(len(members)))
        self.step_graph = GraphedStep(self._step_body) if first.execution.graphed else None

    def graph_steps(self, **capture: Any) -> None:
        """Replay each step as one CUDA graph (``capture`` replaces its warm-up and capture, as the CPU tests do)."""
        self.step_graph = GraphedStep(self._step_body, **capture)

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Each member goes on from its own checkpoint (:meth:`Trainer.load_state_dict`); all at one position."""
        for member, state in zip(self.members, states, strict=True):
            member.load_state_dict(state)
        self._at_one_position("resume")
        if self.step_graph is not None:
            self.step_graph.reset()

    def _at_one_position(self, what: str) -> None:
        positions = {(member.epoch, member.step) for member in self.members}
        if len(positions) != 1:
            raise ValueError(f"fused members must {what} at one position (epoch, step), got {sorted(positions)}")

    def fetch(self, batches: Sequence[Iterator], epoch: int, micro_step: int) -> Batch:
        """Each member's next training micro-batch (its order, its augmentation stream), stacked ``(N, B, ...)``."""
        fetched = [member._fetch(next(it), epoch, micro_step) for member, it in zip(self.members, batches, strict=True)]
        return torch.stack([images for images, _ in fetched]), torch.stack([labels for _, labels in fetched])

    def train_step(self, batches: Iterable[Batch]) -> torch.Tensor:
        """One optimizer step of every member as the run executes it (eagerly or replayed as its CUDA graph); returns
        the members' losses on the last micro-batch, ``(N,)``."""
        losses = self._step_body(batches) if self.step_graph is None else self.step_graph(list(batches))
        for index in self.active:
            self.members[index]._count_step()
        return losses

    def _step_body(self, batches: Iterable[Batch]) -> torch.Tensor:
        """Device work only: every micro-batch's stacked forward and backward (each member's loss as its own run
        computes it), the running sums, then each active member's update."""
        members, accumulate = self.members, self.cfg.accumulate
        self.stacked.zero_grad()
        for images, labels in batches:
            with self.precision.autocast():
                logits = self.stacked(images)
                losses = torch.stack(
                    [
                        F.cross_entropy(
                            logits[i], labels[i], weight=member.loss_weight, label_smoothing=member.cfg.label_smoothing
                        )
                        for i, member in enumerate(members)
                    ]
                )
                total = sum(members[i].precision.scaler.scale(losses[i] / accumulate) for i in self.active)
                total.backward()
            losses = losses.detach()
            self.loss_sum += losses
            self.correct += (logits.argmax(-1) == labels).sum(-1)
        for index in self.active:
            self.stacked.bind_grads(index)
            members[index]._update()
        return losses

    def train_epoch(self, epoch: int) -> dict[int, dict[str, float] | BaseException]:
        """One epoch of every active member from their step (0 unless resumed mid-epoch, as
        :meth:`Trainer.train_epoch`); each member's training metrics, or the :class:`Diverged` that ended it."""
        cfg, lead = self.cfg, self.members[self.active[0]]
        first = lead.step
        self.stacked.train()
        batches = [member._open_epoch(epoch) for member in self.members]
        steps = lead.steps_per_epoch
        samples_per_step = lead.loaders["train"].batch_size * cfg.accumulate
        failed: dict[int, BaseException] = {}
        bar = tqdm(range(first, steps), desc=f"epoch {epoch + 1}/{cfg.epochs} (fused)", disable=None, leave=False)
        for step in bar:
            if any(self.members[index].hooks.preemption.requested for index in self.active):
                self._preempt(epoch, step)
            micro = (self.fetch(batches, epoch, step * cfg.accumulate + k) for k in range(cfg.accumulate))
            losses = self.train_step(micro)
            for index in self.active:
                member = self.members[index]
                member.meter.step_done(samples_per_step)
                for hook in member.hooks.after_step:
                    hook(epoch * steps + step + 1)
            if (step + 1) % cfg.log_every == 0:  # the only host sync inside the epoch
                values = losses.tolist()
                for index in list(self.active):
                    try:
                        self.members[index]._check_finite(values[index], epoch, step + 1)
                    except Diverged as err:
                        failed[index] = err
                        self.mask(index)
        results: dict[int, dict[str, float] | BaseException] = dict(failed)
        for index in list(self.active):
            try:
                results[index] = self.members[index]._close_epoch()
            except Diverged as err:
                results[index] = err
                self.mask(index)
        return results

    def mask(self, index: int) -> None:
        """Member ``index`` ended: out of the update and the summed loss from the next step (a graphed step is
        captured again without it)."""
        self.active.remove(index)
        if self.step_graph is not None:
            self.step_graph.reset()

    def _preempt(self, epoch: int, step: int) -> None:
        """Every active member checkpoints the exact position (:meth:`Trainer._preempt`), then the group stops."""
        stops = []
        for index in self.active:
            try:
                self.members[index]._preempt(epoch, step)
            except Preempted as stop:
                stops.append(str(stop))
        raise Preempted(f"{len(stops)} fused members: {stops[0]}" if stops else "stopped")

    def fit(self, logs: Sequence[tuple[LogMetrics, LogMetrics]], ended: Ended) -> None:
        """Train every member from its epoch to ``epochs`` as :meth:`Trainer.fit` does (``logs``: each member's
        ``log_metrics`` and ``log_tested``): validated each epoch, its own selection, early stopping and test. Each
        member's end is given to ``ended`` as it comes: its final figures, or the :class:`Diverged` that ended it
        (its run FAILED as an unfused run's). Any other error (out of memory, a failing store) or a stop signal
        (:class:`Preempted`, every member checkpointed) ends the group."""
        for member, (log_metrics, _) in zip(self.members, logs, strict=True):
            member.begin(log_metrics)
        for epoch in range(self.members[0].epoch, self.cfg.epochs):
            for index in list(self.active):
                if self.members[index]._patience_exhausted():
                    self._test(index, logs[index][1], ended)
            if not self.active:
                break
            saved = [member.saving.saved_at for member in self.members]
            for index, result in self.train_epoch(epoch).items():
                if isinstance(result, BaseException):
                    ended(index, result)
                    continue
                try:
                    self.members[index].end_epoch(epoch, result)
                except Diverged as err:
                    self.mask(index)
                    ended(index, err)
            self._checkpoint_together(saved)
        for index in list(self.active):
            self._test(index, logs[index][1], ended)

    def _checkpoint_together(self, saved: Sequence[float]) -> None:
        """Where one active member checkpointed this epoch (``saved``: each one's last save before it), every active
        member does: a group stopped outright resumes with its members at one position, fused again."""
        if any(self.members[index].saving.saved_at != saved[index] for index in self.active):
            for index in self.active:
                if self.members[index].saving.pending:
                    self.members[index]._checkpoint_and_log()

    def _test(self, index: int, log_tested: LogMetrics, ended: Ended) -> None:
        """Member ``index``'s end: its selected weights tested, its final figures logged and handed to ``ended``."""
        self.mask(index)
        try:
            final = self.members[index].test_selected(log_tested)
        except Diverged as err:
            ended(index, err)
            return
        ended(index, final)
