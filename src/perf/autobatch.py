"""``batch_size=auto``: the largest micro-batch the memory predictor says fits, confirmed by real steps."""

from __future__ import annotations

import dataclasses
import logging

import torch

from src.config import Config, Norm
from src.data.files import split_sizes
from src.data.loaders import load_splits
from src.errors import UsageError
from src.execution import Execution
from src.models import build_model
from src.models.registry import MODELS
from src.parallel.machine_share import free_at_start_mb, gpu_share_mb, jobs_at_once, memory_share_mb
from src.perf.memory_cache import predicted
from src.training.build import build_trainer

log = logging.getLogger(__name__)

# On CPU one configuration's peak (the resident set's growth) spreads by +-10% run to run, as glibc places its heap
# (resnet10, small stem, batch 4, accumulate 2: 487, 488, 599 MiB), so auto plans within the budget less this share.
CPU_HEADROOM = 0.15


def budget_mb(cfg: Config, device: torch.device) -> float:
    """``mem_budget_mb``, or the device's free memory (CUDA: free device memory, at most the job's share of the GPU
    where jobs of its sweep share it: :func:`gpu_share_mb`; CPU: MemAvailable, the job's share of it where its sweep
    runs several jobs at once: :func:`memory_share_mb`)."""
    if cfg.mem_budget_mb is not None:
        return cfg.mem_budget_mb
    if device.type == "cuda":
        return gpu_share_mb(*(size / 2**20 for size in torch.cuda.mem_get_info(device)))
    return memory_share_mb()


def cap_to_budget(cfg: Config, device: torch.device) -> None:
    """On a GPU, cap this process's CUDA allocator at ``mem_budget_mb`` (of the device's total), so a job runs as if
    the GPU had that much memory: an allocation past it is a real ``torch.OutOfMemoryError``."""
    if cfg.mem_budget_mb is None or device.type != "cuda":
        return
    total_mb = torch.cuda.get_device_properties(device).total_memory / 2**20
    torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.mem_budget_mb / total_mb), device)


def check_fits(cfg: Config, execution: Execution) -> None:
    """A :class:`UsageError` where the job's ranks on this node (``execution.ranks_on_node`` processes of ``cfg``)
    are predicted to need more memory than the usable part of the budget (:func:`budget_mb`, :func:`usable_mb`): on
    a CPU always (the kernel would kill the job mid-run, its run left RUNNING), on a GPU under ``mem_budget_mb``
    (each rank's own: :func:`cap_to_budget`). Else on a GPU an out of memory is an error the job takes (status
    ``oom``, ``oom_retry``)."""
    device, ranks = execution.device, execution.ranks_on_node
    if device.type != "cpu":
        if cfg.mem_budget_mb is None:
            return
        ranks = 1  # each rank's process is capped on its own GPU
    each, budget = predicted(cfg, execution).total_mb, budget_mb(cfg, device)
    if ranks * each <= usable_mb(budget, device):
        return
    each = predicted(cfg, execution, cached=False).total_mb  # a refusal never rests on a cached figure alone
    if ranks * each <= usable_mb(budget, device):
        return
    ranked = f"{ranks} ranks x {each / 1024:.1f} GiB" if ranks > 1 else f"{each / 1024:.1f} GiB"
    free = free_at_start_mb()
    fewer = (
        "run fewer jobs at once (hydra/launcher=joblib hydra.launcher.n_jobs=<n>: submitit_local runs every job at "
        "once), or "
        if free is not None and cfg.mem_budget_mb is None
        else ""
    )
    room = (
        f"{budget_room(cfg, budget, free)} less {CPU_HEADROOM:.0%} (CPU peaks spread run to run; the kernel would kill "
        "the job mid-run)"
        if device.type == "cpu"
        else f"{budget_room(cfg, budget, free)} (the GPU's allocator is capped there)"
    )
    raise UsageError(
        f"batch_size={cfg.batch_size}: the memory predictor puts this job's peak at {ranked}, more than {room}: "
        f"{fewer}lower batch_size, or batch_size=auto (the largest that fits), or save memory "
        "(amp=true, model.checkpointing=true)"
    )


def budget_room(cfg: Config, budget: float, free_at_start: float | None) -> str:
    """Where a CPU job's budget comes from, in words."""
    if cfg.mem_budget_mb is not None:
        return f"mem_budget_mb={cfg.mem_budget_mb:g}"
    if free_at_start is None:
        return f"the {budget / 1024:.1f} GiB free here"
    return (
        f"this job's share of the {free_at_start / 1024:.1f} GiB free, {budget / 1024:.1f} GiB ({jobs_at_once()} jobs "
        "of the sweep at once)"
    )


def usable_mb(budget: float, device: torch.device) -> float:
    """What ``batch_size=auto`` lets a micro-batch's prediction and probe reach: the budget less the CPU headroom."""
    return budget * (1 - CPU_HEADROOM) if device.type == "cpu" else budget


def predicted_mb(cfg: Config, execution: Execution, batch_size: int, world: int = 1) -> float:
    """The prediction of ``cfg`` trained at ``batch_size``, at the accumulation it then trains with (:func:`at_batch`:
    ``effective_batch_size`` sets it, and an accumulated gradient step holds more than a single one); kept in the
    predictions' cache, so a dry run's search and the job's own replay each batch once."""
    target = cfg.effective_batch_size  # as at_batch sets it; at least 1 for a batch past the target (not a candidate)
    accumulate = max(1, target // (batch_size * world)) if target else cfg.accumulate
    at = dataclasses.replace(cfg, batch_size=batch_size, accumulate=accumulate)
    return predicted(at, execution).total_mb


def check_one_sample(cfg: Config) -> None:
    """A :class:`UsageError` where :func:`one_sample_fails`."""
    if one_sample_fails(cfg):
        raise UsageError(
            f"batch_size=1: model={cfg.model.name} at data.size={cfg.data.size} reaches a 1^3 map, where BatchNorm "
            "cannot train on one sample: use batch_size=2 or more (accumulate keeps the effective batch), or "
            "model.norm=group or instance"
        )


def one_sample_fails(cfg: Config) -> bool:
    """Whether a micro-batch of 1 meets BatchNorm on a 1^3 map, which cannot train on one value per channel (a
    forward pass on the meta device finds it: no memory, no compute)."""
    if cfg.batch_size != 1 or cfg.model.norm is not Norm.batch:
        return False
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.data).train()
        try:
            model(torch.empty(1, cfg.data.in_channels, *[cfg.data.size] * 3))
        except ValueError as err:
            if "more than 1 value per channel" not in str(err):
                raise
            return True
    return False


def smallest_batch(cfg: Config) -> int:
    """BatchNorm cannot train on one sample of a 1^3 map, so it needs micro-batches of 2 or more."""
    return 2 if cfg.model.norm is Norm.batch else 1


def largest_predicted(cfg: Config, execution: Execution, budget: float, upper: int, world: int = 1) -> int:
    """The largest micro-batch up to ``upper`` predicted within ``budget`` (``upper`` itself first: one replay where it
    fits, as most jobs' effective batch does; else bisection; 0 if none)."""
    if upper >= smallest_batch(cfg) and predicted_mb(cfg, execution, upper, world) <= budget:
        return upper
    low, high = smallest_batch(cfg) - 1, upper
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if predicted_mb(cfg, execution, mid, world) <= budget else (low, mid - 1)
    return low if low >= smallest_batch(cfg) else 0


def per_rank_batch(cfg: Config, world: int, accumulate: int = 1) -> int:
    """``effective_batch_size / (accumulate x world)``, which must divide exactly."""
    per_rank, rest = divmod(cfg.effective_batch_size, world * accumulate)
    if rest:
        split = f"accumulate x ranks = {accumulate} x {world}" if accumulate > 1 else f"the {world} ranks"
        raise UsageError(
            f"effective_batch_size={cfg.effective_batch_size} is not a multiple of {split}: "
            f"use a multiple of {world * accumulate}"
        )
    return per_rank


def derived_batch(cfg: Config, world: int) -> Config:
    """``batch_size=derived``: the micro-batch that makes ``batch_size x accumulate x world`` the effective batch."""
    return dataclasses.replace(cfg, batch_size=per_rank_batch(cfg, world, cfg.accumulate))


def candidates(cfg: Config, world: int, largest: int) -> list[int]:
    """Micro-batches to confirm, largest first: divisors of the per-rank effective batch, or halvings."""
    smallest = smallest_batch(cfg)
    if cfg.effective_batch_size is None:
        return [largest >> k for k in range(largest.bit_length()) if largest >> k >= smallest]
    per_rank = per_rank_batch(cfg, world)
    return [b for b in range(min(per_rank, largest), smallest - 1, -1) if per_rank % b == 0]


def probe_peak_mb(cfg: Config, execution: Execution, batch_size: int) -> float:
    """Measured peak of real training steps at ``batch_size`` (the run's model, data and precision): two, since the
    optimizer's state (Adam: 2x the parameters) exists only from the first step's end, in the second's peak."""
    probe = dataclasses.replace(cfg, batch_size=batch_size, accumulate=1, limit_batches=2, epochs=1, warmup_epochs=0)
    cap_to_budget(cfg, execution.device)
    trainer = build_trainer(probe, execution, splits={"train": load_splits(cfg.data)["train"]})
    trainer.memory.start()
    peak = trainer.train_epoch(0)["mem/peak_mb"]
    del trainer
    if execution.device.type == "cuda":
        torch.cuda.empty_cache()
    return peak


def predicted_candidates(cfg: Config, execution: Execution, world: int) -> tuple[float, list[int]]:
    """The budget, and the micro-batches to confirm, largest first, of those predicted within its usable part and
    whose optimizer step the training split fills (``accumulate`` kept where no ``effective_batch_size`` sets it)."""
    budget = budget_mb(cfg, execution.device)
    steps = world * (1 if cfg.effective_batch_size else cfg.accumulate)
    usable, upper = usable_mb(budget, execution.device), split_sizes(cfg.data)["train"] // steps
    if cfg.effective_batch_size:  # no candidate exceeds a rank's share of it: the search stops there
        upper = min(upper, cfg.effective_batch_size // world)
    largest = largest_predicted(cfg, execution, usable, upper, world)
    return budget, candidates(cfg, world, largest)


def at_batch(cfg: Config, batch_size: int, world: int) -> Config:
    """``cfg`` at ``batch_size``, with the accumulation that keeps ``effective_batch_size`` when it is set."""
    target = cfg.effective_batch_size
    return dataclasses.replace(
        cfg, batch_size=batch_size, accumulate=target // (batch_size * world) if target else cfg.accumulate
    )


def no_batch_fits(cfg: Config, budget: float) -> UsageError:
    checkpoints = "checkpointing" in MODELS[cfg.model.name].switches
    savers = "amp=true, model.checkpointing=true" if checkpoints else "amp=true"
    return UsageError(
        f"batch_size=auto: no micro-batch fits {budget_room(cfg, budget, free_at_start_mb())}: raise mem_budget_mb, "
        f"or save memory ({savers})"
    )


def fit_batch(cfg: Config, execution: Execution, world: int) -> tuple[Config, dict[str, str]]:
    """``cfg`` with the chosen micro-batch and accumulation, and tags saying how it was chosen."""
    budget, batches = predicted_candidates(cfg, execution, world)
    usable = usable_mb(budget, execution.device)
    for batch in batches:
        predicted = predicted_mb(cfg, execution, batch, world)
        try:
            measured = probe_peak_mb(cfg, execution, batch)
        except torch.OutOfMemoryError:
            continue
        if measured > usable:
            log.info("batch_size=auto: %d predicted %.0f MiB, probed %.0f > %.0f", batch, predicted, measured, usable)
            continue
        fitted = at_batch(cfg, batch, world)
        log.info(
            "batch_size=auto: batch_size=%d accumulate=%d (predicted %.0f MiB, probe %.0f MiB, budget %.0f MiB)",
            batch,
            fitted.accumulate,
            predicted,
            measured,
            budget,
        )
        return fitted, {
            "batch.auto": "true",
            "batch.auto_budget_mb": f"{budget:.0f}",
            "batch.auto_usable_mb": f"{usable:.0f}",
            "batch.auto_predicted_mb": f"{predicted:.0f}",
            "batch.auto_probe_mb": f"{measured:.0f}",
        }
    raise no_batch_fits(cfg, budget)


def predicted_batch(cfg: Config, execution: Execution, world: int, refuse: bool = True) -> Config:
    """``batch_size=auto`` as the predictor alone chooses it, confirmed by no training step (a dry run): the largest
    candidate; a probe may still refuse it. Where none fits: refused, or (not ``refuse``: a dry run's listing, which
    says so) the smallest micro-batch."""
    budget, batches = predicted_candidates(cfg, execution, world)
    if not batches:
        if refuse:
            raise no_batch_fits(cfg, budget)
        return at_batch(cfg, smallest_batch(cfg), world)
    return at_batch(cfg, batches[0], world)


def budget_fit(cfg: Config, execution: Execution, world: int, peak_mb: float) -> tuple[float, int | None]:
    """The budget (:func:`budget_mb`) and whether ``cfg``'s micro-batch, predicted at ``peak_mb``, fits its usable part
    (the job's ranks on a CPU's memory together): None where it fits, else the largest smaller micro-batch predicted
    to fit (0: none)."""
    device = execution.device
    budget = budget_mb(cfg, device)
    usable = usable_mb(budget, device) / (execution.ranks_on_node if device.type == "cpu" else 1)
    if peak_mb <= usable:
        return budget, None
    return budget, largest_predicted(cfg, execution, usable, cfg.batch_size - 1, world)
