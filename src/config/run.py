"""A training run's whole config (:class:`Config`: the top-level keys and the sections), its ranks
(``parallel.*``), its checkpoints (``checkpoint.*``) and the faults tests inject (``fault.*``); the checks that
span sections."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING

from src.config.data import DataConfig
from src.config.enums import AmpDtype, Backend, CheckpointKeep, Device, GpuShare, ParallelMode, SchedName, SelectBy
from src.config.model import ModelConfig
from src.config.ranges import COUNT_MAX, PARAM_VALUE_MAX, SEED_MAX, THREADS_MAX, bounds_text, not_longer, within
from src.config.rules import Either, OneOf, Range, Text, check_keys, key
from src.config.tags import TAGS_ALLOWED, check_tags
from src.config.tracking import MlflowConfig
from src.config.training import AugConfig, OptimConfig, SchedConfig

OBJECTIVES = ("test/auc", "val/auc")  # what a job can return: the test AUC, or the best epoch's validation AUC
BATCH_NAMES = ("auto", "derived")  # batch_size's values besides a number
COUNT = Range(1, COUNT_MAX, "[]")  # epochs, batches, steps
COUNT_OR_NULL = Range(1, COUNT_MAX, "[]", null=True)


@dataclass
class ParallelConfig:
    """``ddp``: ``nproc`` ranks spawned by the job (or started by torchrun / SLURM); ``dp``: DataParallel."""

    mode: ParallelMode = key(
        ParallelMode.none, "none: one process; ddp: DistributedDataParallel ranks; dp: DataParallel"
    )
    nproc: int | None = key(None, "ddp: the ranks; null: the visible GPUs, or 2 on CPU", COUNT_OR_NULL)
    backend: Backend = key(Backend.auto, "ddp's collectives: auto, nccl on CUDA, gloo on CPU")
    sync_bn: bool = key(False, "ddp: BatchNorm's statistics synchronised across the ranks")
    timeout_s: int = key(  # timedelta holds up to ~8.6e13 s
        600, "a collective waiting longer than this many seconds fails the job", COUNT
    )

    def __post_init__(self) -> None:
        check_keys(self, "parallel")


@dataclass
class FaultConfig:
    """Fault injection for tests: ``kill_rank`` SIGKILLs itself after optimizer step ``kill_step``;
    ``oom_step`` raises a real ``torch.OutOfMemoryError`` after that step when ``batch_size >= oom_min_batch``;
    ``term_step``: rank 0 sends itself SIGTERM (a preemption) after that step."""

    kill_rank: int | None = key(None, "tests: this rank SIGKILLs itself after step kill_step", Range(0, null=True))
    kill_step: int = key(1, "tests: kill_rank's optimizer step", Range(1))
    term_step: int | None = key(
        None, "tests: rank 0 sends itself SIGTERM (a preemption) after this step", Range(1, null=True)
    )
    oom_step: int | None = key(None, "tests: a real out-of-memory error after this step", Range(1, null=True))
    oom_min_batch: int = key(1, "tests: ... where batch_size is at least this", Range(1))

    def __post_init__(self) -> None:
        check_keys(self, "fault")


@dataclass
class CheckpointConfig:
    """``keep=last``: the run's ``checkpoint.pt`` stays while the run is unfinished (resume needs it) and is deleted
    when it ends FINISHED; ``always``: it stays after that too. ``best.pt`` (the tested weights) always stays.
    ``every_s``: an epoch is checkpointed once this many seconds have passed since the last checkpoint (0: every
    epoch), the last epoch and a stopped step always; its metrics are logged after the checkpoint that holds them."""

    keep: CheckpointKeep = key(
        CheckpointKeep.last, "last: checkpoint.pt deleted as the run ends FINISHED; always: kept"
    )
    every_s: float = key(
        30.0, "an epoch is checkpointed once this many seconds passed since the last (0: every epoch)", Range(0)
    )

    def __post_init__(self) -> None:
        check_keys(self, "checkpoint")


@dataclass
class Config:
    """The whole experiment; every top-level key is a sweepable override."""

    data: DataConfig = MISSING
    model: ModelConfig = MISSING
    optim: OptimConfig = MISSING
    sched: SchedConfig = MISSING
    parallel: ParallelConfig = MISSING
    aug: AugConfig = MISSING
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    amp: bool = key(False, "mixed precision: autocast to amp_dtype (float32 where the CPU has no native bfloat16)")
    amp_dtype: AmpDtype = key(
        AmpDtype.auto, "auto: bfloat16 where the device has it natively, else float16 on CUDA, float32 on CPU"
    )
    batch_size: Any = key(
        32,
        "the micro-batch per device; auto: the largest that fits mem_budget_mb; derived: effective_batch_size / "
        "(accumulate x ranks)",
        allowed=f"an integer {bounds_text(1, COUNT_MAX, '[]')}, {' or '.join(BATCH_NAMES)}",
    )
    accumulate: int = key(1, "micro-batches per optimizer step (gradient accumulation)", COUNT)
    mem_budget_mb: float | None = key(
        None,
        "MiB a job plans and runs in: batch_size=auto fits it, a batch predicted past it is refused, a GPU's "
        "allocator is capped there; null: the device's free memory (or a job's share of it)",
        Range(0, ends="()", null=True),
    )
    effective_batch_size: int | None = key(
        None,
        "batch_size=auto keeps it by setting accumulate; derived divides it by accumulate x ranks",
        COUNT_OR_NULL,
        allowed="set with batch_size=auto or derived only",
    )
    epochs: int = key(15, "training epochs", COUNT)
    seed: int = key(0, "the run's seed", Range(0, SEED_MAX, "[]"))
    deterministic: bool = key(False, "torch's and cuDNN's deterministic algorithms")
    limit_batches: int | None = key(None, "at most this many batches per split and epoch (smoke runs)", COUNT_OR_NULL)
    device: Device = key(Device.auto, "auto: cuda where a GPU is visible, else cpu")
    num_threads: int | None = key(
        None,
        "CPU threads, fixed per run (results depend on it); null: all cores of this process's affinity",
        Range(1, THREADS_MAX, "[]", null=True),
    )
    grad_clip: float | None = key(
        None, "the gradients' largest norm; null: not clipped", Range(0, ends="()", null=True)
    )
    class_weights: bool = key(False, "cross-entropy weighted n / (classes x n_class) from the training labels")
    label_smoothing: float = key(0.0, "cross-entropy's label smoothing", Range(0, 1))
    early_stop_patience: int | None = key(
        None,
        "stop after this many epochs without a better select_by score; null: never",
        COUNT_OR_NULL,
        allowed="not with select_by=last",
    )
    warmup_epochs: int = key(
        0,
        "the learning rate rises linearly from x0.1 over these epochs (before the schedule)",
        Range(0, "epochs"),
        allowed="0 with sched=cyclic",
    )
    ema_decay: float | None = key(
        None,
        "validate, keep and test an EMA of the weights and BatchNorm buffers (e.g. 0.99); null: none",
        Range(0, 1, "()", null=True, fix=" (no EMA)"),
    )
    select_by: SelectBy = key(  # val_auc: MedMNIST's (docs/accuracy.md)
        SelectBy.val_loss, "which epoch's weights are tested: least val loss, best val AUC (smoothed), or the last"
    )
    channels_last: bool = key(False, "the channels-last memory format")
    cudnn_benchmark: bool = key(False, "cuDNN times its kernels and keeps the fastest")
    compile: bool = key(False, "torch.compile the model")
    cuda_graphs: Any = key(
        "auto",
        "the whole optimizer step as one CUDA graph: auto (where it can run), true (required), false (eager)",
        Either(("auto", "true", "false")),
    )
    gpu_share: GpuShare = key(
        GpuShare.auto, "jobs sharing a GPU: auto (an MPS daemon where one can start), mps (required), none"
    )
    fuse: Any = key(
        "auto",
        "a sweep's jobs that differ only in keys that change no shape or kernel (seed, optim.*, sched.*, aug.* ...) "
        "trained as one stacked model, each its own run: auto (on CUDA), true (required; CPU too), false",
        Either(("auto", "true", "false")),
    )
    non_blocking: bool = key(True, "asynchronous host-to-device copies")
    oom_retry: bool = key(False, "on out-of-memory: rerun with half the micro-batch, twice the accumulation")
    log_every: int = key(10, "optimizer steps between reads of the loss (progress bar, divergence check)", COUNT)
    skip_finished: Any = key(
        True,
        "skip a job with a FINISHED run: true (same config and code), config (same config), or false",
        Either(("true", "false", "config")),
    )
    rerun: str | None = key(None, "an MLflow run id: train that run's exact config again", Text(null=True))
    resume: str | None = key(
        None, "a run's output folder or MLflow run id: continue that run from its checkpoint", Text(null=True)
    )
    objective: str = key(
        "test/auc",
        "what a job returns to the sweeper (Optuna): the test AUC, or the best epoch's validation AUC",
        OneOf(OBJECTIVES, "a job result"),
    )
    tags: list[str] = key([], "MLflow tags <name>=true on every job's run and the sweep's", allowed=TAGS_ALLOWED)
    dry_run: bool = key(False, "list what the job (or each job of -m) would do; train nothing, log nothing")

    def __post_init__(self) -> None:
        named = self.batch_size in BATCH_NAMES
        if not named and not (isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool)):
            raise ValueError(f"batch_size={self.batch_size} must be an integer >= 1, auto or derived")
        if self.batch_size == "derived" and self.effective_batch_size is None:
            raise ValueError(
                "batch_size=derived needs effective_batch_size=<n>: batch_size is "
                "effective_batch_size / (accumulate x ranks)"
            )
        if not named:
            COUNT.check("batch_size", self.batch_size, self)
        check_keys(self)
        check_early_stop(self)
        check_tags(self.tags)
        check_schedule(self)
        check_param_lengths(self)


def check_param_lengths(node: Any, prefix: str = "") -> None:
    """Each key of ``node`` (a schema dataclass) is one MLflow param of a run: its value as text, at most
    :data:`PARAM_VALUE_MAX` characters."""
    for declared in fields(node):
        if is_dataclass(value := getattr(node, declared.name)):
            check_param_lengths(value, f"{prefix}{declared.name}.")
        else:
            not_longer(f"{prefix}{declared.name}", str(value), PARAM_VALUE_MAX, "MLflow's limit for a param value")


def check_early_stop(cfg: Config) -> None:
    """``early_stop_patience`` where it can stop a run: not with ``select_by=last``, whose every epoch is the best so
    far (it would train as without it, under another config hash)."""
    if cfg.early_stop_patience is not None and cfg.select_by is SelectBy.last:
        raise ValueError(
            f"early_stop_patience={cfg.early_stop_patience} with select_by=last, whose every epoch is the best so far: "
            "it never stops the run: drop it, or select by val_loss, val_auc or val_auc_smoothed"
        )


def check_schedule(cfg: Config) -> None:
    """The schedule against the optimizer and the warm-up: cosine anneals from ``optim.lr`` down to ``min_lr``; cyclic
    runs between ``base_lr`` and ``optim.lr`` and steps per optimizer step, so it takes no per-epoch warm-up."""
    lr, sched = cfg.optim.lr, cfg.sched
    if sched.name is SchedName.cosine:
        within("sched.min_lr", sched.min_lr, 0, lr, "[]", fix=": cosine's floor, at most optim.lr (its start)")
    if sched.name is SchedName.cyclic:
        within("sched.base_lr", sched.base_lr, 0, lr, "()", fix=": the cycle's bottom, below optim.lr (its top)")
        if cfg.warmup_epochs:
            raise ValueError(
                f"warmup_epochs={cfg.warmup_epochs} with sched=cyclic, which steps per optimizer step: "
                f"use warmup_epochs=0 or a per-epoch schedule"
            )
