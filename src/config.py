"""Typed config schemas (Hydra structured configs); no torch import, Hydra only in ``register``.

Each ``__post_init__`` refuses a value outside its key's range (NaN and inf included) with a ``ValueError`` naming
the key, the value and the range; ``python -m src.<command>`` prints it as one ``error:`` line before it starts.

Enum members are named in lower case (or as the override spells them, like ``B``) because
OmegaConf matches an override against the member *name*.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any

from omegaconf import MISSING

OBJECTIVES = ("test/auc", "val/auc")  # what a job can return: the test AUC, or the best epoch's validation AUC
TASKS = ("binary-class", "multi-class")  # the single-label tasks the trainer's cross-entropy and metrics handle
SPLITS = ("train", "val", "test")  # a dataset's splits, in MedMNIST's order
NIFTI = "nifti"  # data=nifti: a folder of volumes and a labels CSV (src/volumes, docs/nifti.md)
SYNTHETIC = "synthetic"  # data=synthetic: generated volumes (src.data.write_synthetic)
NIFTI_KEYS = ("labels", "classes", "split_fractions", "split_seed", "spacing", "intensity")  # data.* only nifti reads
NIFTI_SIZES = (16, 256)  # the cube sides data=nifti crops or pads to (MedMNIST's files are 28^3 or 64^3)
NIFTI_SPACING_MAX = 100.0  # mm: the largest data.spacing (a 16^3 cube of it spans a whole body)
URL = re.compile(r"https?://[^/\s]+\S*|file://\S+")
SEED_MAX = 2**32 - 1  # NumPy's seed range is [0, 2**32 - 1]
THREADS_MAX = 1024  # CPU threads of a process: past any one machine's cores; libgomp fails far above
COUNT_MAX = 2**31 - 1  # counts (epochs, batches, steps): what torch's int32 sizes and indices hold
CHANNELS_MAX = 1024  # input channels of a volume: past any modality stack
CLASSES_MAX = 100_000  # a classifier's outputs: past any label set
WORKERS_MAX = 64  # DataLoader worker processes of a rank
EXPERIMENT_NAME_MAX, TAG_KEY_MAX = 500, 250  # MLflow's limits (mlflow.utils.validation), checked before it loads
PARAM_VALUE_MAX = 6000  # ... and a param value's: MLflow cut a longer one, so the run's params were not its config
MODEL_NAME_BANNED = ("/", ":")  # in a registered model's name, as mlflow.utils.validation (. and ..*: ReportConfig)
SAMPLE_INTERVAL_MIN_S = 1.0  # MLflow's system metrics: shorter intervals slowed training (docs/benchmarks.md)
SAMPLE_INTERVAL_MAX_S = 86_400.0  # a sample a day; past threading.TIMEOUT_MAX MLflow's sampling thread failed


def within(
    key: str, value: Any, low: float, high: float = math.inf, ends: str = "[)", null: bool = False, fix: str = ""
) -> None:
    """Refuse ``value`` outside ``low``..``high`` (``ends``: ``[``/``]`` closed, ``(``/``)`` open), NaN and inf
    included; ``null``: None passes."""
    if value is None and null:
        return
    closed_low = ends[0] == "["
    above = value >= low if closed_low else value > low
    below = value <= high if ends[1] == "]" else value < high
    finite = not isinstance(value, float) or math.isfinite(value)  # an int of any size is finite
    if not (finite and above and below):
        bounds = f"in {ends[0]}{low}, {high}{ends[1]}" if high < math.inf else f"{'>=' if closed_low else '>'} {low}"
        raise ValueError(f"{key}={value} must be {bounds}{' or null' if null else ''}{fix}")


def within_each(key: str, values: list, *bounds: Any, count: int | None = None, what: str = "", **options: Any) -> None:
    """``values``: exactly ``count`` of them (``what`` they are) if set, each :func:`within` ``bounds``."""
    if count is not None and len(values) != count:
        raise ValueError(f"{key}={values} must be {count} values: {what}")
    for i, value in enumerate(values):
        within(f"{key}[{i}]", value, *bounds, **options)


def check_unread(section: str, config: Any, unread: dict[str, tuple[str, str]]) -> None:
    """Refuse a key of ``config`` set off its default that the options chosen do not read (``unread``: key -> the
    setting that ignores it, what reads it): it would train as the default does, under another config hash."""
    defaults = {f.name: f.default_factory() if callable(f.default_factory) else f.default for f in fields(config)}
    for key, (setting, reader) in unread.items():
        if (value := getattr(config, key)) != defaults[key]:
            shown = value.name if isinstance(value, Enum) else value
            raise ValueError(f"{section}.{key}={shown}: {setting} ignores it (only {reader} reads it): drop it")


def not_longer(key: str, value: str | None, limit: int, whose: str) -> None:
    """Refuse a string of more than ``limit`` characters (``whose`` limit it is)."""
    if value is not None and len(value) > limit:
        raise ValueError(f"{key} is {len(value)} characters long: at most {limit} ({whose})")


def filled(key: str, value: str | None, null: bool = False) -> None:
    """Refuse an empty or blank string (None passes when ``null``)."""
    if not (value is None and null) and not (value or "").strip():
        raise ValueError(f"{key}={value!r} must be a non-blank string{' or null' if null else ''}")


class Stem(Enum):
    auto = "auto"
    small = "small"
    standard = "standard"


class Activation(Enum):
    relu = "relu"
    swish = "swish"
    prelu = "prelu"
    gelu = "gelu"
    mish = "mish"


class Norm(Enum):
    batch = "batch"
    group = "group"
    instance = "instance"


class Init(Enum):
    kaiming_normal = "kaiming_normal"
    kaiming_uniform = "kaiming_uniform"
    xavier_normal = "xavier_normal"
    torch_default = "torch_default"


class InitMode(Enum):
    fan_in = "fan_in"
    fan_out = "fan_out"


class Shortcut(Enum):
    A = "A"
    B = "B"


class AmpDtype(Enum):
    auto = "auto"
    float16 = "float16"
    bfloat16 = "bfloat16"


class GpuShare(Enum):
    auto = "auto"
    mps = "mps"
    none = "none"


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Intensity(Enum):
    minmax = "minmax"
    zscore = "zscore"
    window = "window"


class Loader(Enum):
    tensor = "tensor"
    dataloader = "dataloader"


class OptimName(Enum):
    adam = "adam"
    adamw = "adamw"
    sgd = "sgd"


class SchedName(Enum):
    multistep = "multistep"
    cosine = "cosine"
    cyclic = "cyclic"
    none = "none"


class ParallelMode(Enum):
    none = "none"
    ddp = "ddp"
    dp = "dp"


class Backend(Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class SelectBy(Enum):
    val_auc = "val_auc"
    val_auc_smoothed = "val_auc_smoothed"
    val_loss = "val_loss"
    last = "last"


class CheckpointKeep(Enum):
    last = "last"
    always = "always"


@dataclass
class ModelConfig:
    """A zoo member and the switches that reach every block."""

    name: str = MISSING
    stem: Stem = Stem.standard  # MedMNIST's own 28^3 set-up is small: ~60x the FLOPs (docs/accuracy.md)
    dsconv: bool = False
    dsconv_mid_norm: bool = False
    activation: Activation = Activation.relu
    norm: Norm = Norm.batch
    init: Init = Init.kaiming_normal
    init_mode: InitMode = InitMode.fan_out
    zero_init_residual: bool = False
    shortcut: Shortcut = Shortcut.B
    checkpointing: bool = False
    inplace_act: bool = True  # ReLU in place (saves one activation map per position)


@dataclass
class DataConfig:
    """A MedMNIST 3D dataset (``name`` is its medmnist flag), ``synthetic``, or ``nifti``: a folder of volumes and a
    labels CSV, preprocessed once into a cached file of MedMNIST's layout (the keys after ``synthetic_samples``)."""

    name: str = MISSING
    root: str = "~/.medmnist"  # nifti: the folder of the volumes
    size: int = 28  # the cube's side: 28 or 64 (MedMNIST's files), 16 to 256 (nifti)
    download: bool = True
    url: str | None = None  # null: medmnist's INFO url for this flag and size
    in_channels: int = 1
    num_classes: int = MISSING
    task: str = "multi-class"
    loader: Loader = Loader.tensor
    num_workers: int = 0
    pin_memory: bool = False
    synthetic_samples: list[int] = field(default_factory=lambda: [256, 64, 64])
    labels: str | None = None  # the CSV: image (relative to root), label, optional split; null: <root>/labels.csv
    classes: list[str] | None = None  # the class names in class order; null: the CSV's labels, sorted
    split_fractions: list[float] = field(default_factory=lambda: [0.7, 0.1, 0.2])  # without a split column, per class
    split_seed: int = 0  # ... that split's seed: not the training seed, so every run tests on the same volumes
    spacing: list[float] | None = None  # resampled voxel size in mm along R, A, S; null: the training median
    intensity: Intensity = Intensity.minmax  # per volume min-max, z-score (clipped at +-3 std), or a CT window
    window_level: float = 40.0  # intensity=window: its centre and width (40 and 400 HU: soft tissue)
    window_width: float = 400.0

    def __post_init__(self) -> None:
        filled("data.root", self.root)
        if self.name == NIFTI:
            within("data.size", self.size, *NIFTI_SIZES, "[]", fix=" for data=nifti")
        elif self.size not in (28, 64):
            raise ValueError(f"data.size={self.size} is not a MedMNIST 3D size: use data.size=28 or 64")
        if self.url is not None and not URL.fullmatch(self.url):
            raise ValueError(f"data.url={self.url!r} must be an http(s):// or file:// URL, or null (medmnist's own)")
        within("data.in_channels", self.in_channels, 1, CHANNELS_MAX, "[]")
        within("data.num_classes", self.num_classes, 2, CLASSES_MAX, "[]")
        if self.task not in TASKS:
            raise ValueError(f"data.task={self.task} is not a task the trainer supports: use one of {', '.join(TASKS)}")
        if self.task == TASKS[0] and self.num_classes != 2:  # binary metrics on k outputs: nonsense that finished
            raise ValueError(
                f"data.task=binary-class with data.num_classes={self.num_classes}: a binary task has 2 classes: "
                "use data.num_classes=2, or data.task=multi-class"
            )
        within("data.num_workers", self.num_workers, 0, WORKERS_MAX, "[]", fix=" (worker processes per rank)")
        sizes = "the train, val and test sizes, e.g. [256,64,64]"
        within_each("data.synthetic_samples", self.synthetic_samples, 1, count=3, what=sizes)
        self.check_volume_keys()
        self.check_ignored_keys()

    def check_volume_keys(self) -> None:
        """The keys only ``nifti`` reads."""
        filled("data.labels", self.labels, null=True)
        for i, name in enumerate(self.classes or []):
            filled(f"data.classes[{i}]", name)
        if self.classes is not None and len(set(self.classes)) < max(2, len(self.classes)):
            raise ValueError(f"data.classes={self.classes} must name 2 or more classes, each once")
        fractions = "the train, val and test fractions of each class, e.g. [0.7,0.1,0.2]"
        within_each("data.split_fractions", self.split_fractions, 0, 1, "()", count=3, what=fractions)
        if not math.isclose(sum(self.split_fractions), 1):
            raise ValueError(f"data.split_fractions={self.split_fractions} must sum to 1 ({fractions})")
        within("data.split_seed", self.split_seed, 0, SEED_MAX, "[]")
        if self.spacing is not None:
            millimetres = "millimetres along R, A and S, e.g. [1,1,1]; or null: the training volumes' median"
            within_each("data.spacing", self.spacing, 0, NIFTI_SPACING_MAX, "(]", count=3, what=millimetres)
        if not math.isfinite(self.window_level):
            raise ValueError(f"data.window_level={self.window_level} must be a finite number (the window's centre)")
        within("data.window_width", self.window_width, 0, ends="()", fix=" (the window's width)")

    def check_ignored_keys(self) -> None:
        """Refuse a key this dataset or loader does not read set off its default (:func:`check_unread`)."""
        ignores, window = f"data={self.name}", "data=nifti with data.intensity=window"
        nifti = self.name == NIFTI
        unread = {} if self.name == SYNTHETIC else {"synthetic_samples": (ignores, "data=synthetic")}
        unread |= {} if nifti else dict.fromkeys(NIFTI_KEYS, (ignores, "data=nifti"))
        if not (nifti and self.intensity is Intensity.window):
            setting = f"data.intensity={self.intensity.name}" if nifti else ignores
            unread |= dict.fromkeys(("window_level", "window_width"), (setting, window))
        if self.loader is not Loader.dataloader:
            setting = f"data.loader={self.loader.value}"
            unread |= dict.fromkeys(("num_workers", "pin_memory"), (setting, "data.loader=dataloader"))
        check_unread("data", self, unread)


@dataclass
class AugConfig:
    """Training-time augmentation, batched on the training device and seeded per step; never on val/test.

    ``flip``: each axis mirrored with probability 1/2, per sample. ``rot90``: a multiple of 90 degrees in each of
    the three planes, per sample. ``affine``: rotation up to ``affine_degrees`` about each axis, isotropic scale
    in 1 +- ``affine_scale``, shift up to ``affine_translate`` of the side (trilinear, zero outside), applied to a
    sample with probability ``affine_p``. ``intensity``: contrast x(1 +- ``intensity_scale``), brightness
    +- ``intensity_shift`` (on the [-1, 1] scale), Gaussian noise of std ``noise_std``.
    """

    name: str = "none"
    flip: bool = False
    rot90: bool = False
    affine: bool = False
    affine_p: float = 1.0
    affine_degrees: float = 15.0
    affine_scale: float = 0.1
    affine_translate: float = 0.1
    intensity: bool = False
    intensity_scale: float = 0.1
    intensity_shift: float = 0.1
    noise_std: float = 0.0

    def __post_init__(self) -> None:
        filled("aug.name", self.name)
        within("aug.affine_p", self.affine_p, 0, 1, "[]", fix=" (a probability)")
        within("aug.affine_degrees", self.affine_degrees, 0, 180, "[]", fix=" (rotation in +- affine_degrees)")
        within("aug.affine_scale", self.affine_scale, 0, 1, fix=" (scale 1 +- affine_scale)")
        within("aug.affine_translate", self.affine_translate, 0, 1, "[]", fix=" (shift in +- affine_translate sides)")
        within("aug.intensity_scale", self.intensity_scale, 0, 1, fix=" (contrast 1 +- intensity_scale)")
        within("aug.intensity_shift", self.intensity_shift, 0, 1, "[]", fix=" (brightness on the [-1, 1] scale)")
        within("aug.noise_std", self.noise_std, 0, 1, "[]", fix=" (on the [-1, 1] scale)")


@dataclass
class OptimConfig:
    name: OptimName = OptimName.adam
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    fused: bool = True  # torch's fused kernel: one pass over each parameter (CPU and CUDA); false: its loop

    def __post_init__(self) -> None:
        within("optim.lr", self.lr, 0, fix=" (0 freezes the weights)")
        within("optim.weight_decay", self.weight_decay, 0)
        within("optim.momentum", self.momentum, 0, 1)
        if self.nesterov and not (self.name is OptimName.sgd and self.momentum > 0):
            raise ValueError(
                f"optim.nesterov=true with optim.name={self.name.value}, optim.momentum={self.momentum}: "
                f"Nesterov needs optim=sgd with optim.momentum > 0; or use optim.nesterov=false"
            )
        within_each("optim.betas", self.betas, 0, 1, count=2, what="Adam's beta1 and beta2, e.g. [0.9,0.999]")
        ignores = f"optim={self.name.value}"
        sgd = self.name is OptimName.sgd
        unread = {"betas": (ignores, "optim=adam or adamw")} if sgd else {"momentum": (ignores, "optim=sgd")}
        check_unread("optim", self, unread)


@dataclass
class SchedConfig:
    name: SchedName = SchedName.multistep
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])  # fractions of epochs
    gamma: float = 0.1
    min_lr: float = 0.0
    base_lr: float = 1e-4  # cyclic
    cycle_epochs: float = 2.0  # cyclic: epochs per up-and-down cycle

    def __post_init__(self) -> None:
        within_each("sched.milestones", self.milestones, 0, 1, "()", fix=" (a fraction of the epochs)")
        if list(self.milestones) != sorted(set(self.milestones)):  # the scheduler sorts them: one training, two hashes
            increasing = ",".join(f"{m:g}" for m in sorted(set(self.milestones)))
            given = list(self.milestones)
            raise ValueError(f"sched.milestones={given} must increase, each once: give sched.milestones=[{increasing}]")
        within("sched.gamma", self.gamma, 0, 1, "(]", fix=" (the factor at each milestone)")
        within("sched.min_lr", self.min_lr, 0)
        within("sched.base_lr", self.base_lr, 0, ends="()")
        within("sched.cycle_epochs", self.cycle_epochs, 0, COUNT_MAX, "(]")  # steps per cycle: an int, for torch
        readers = {"milestones": "multistep", "gamma": "multistep", "min_lr": "cosine"}
        readers |= {"base_lr": "cyclic", "cycle_epochs": "cyclic"}
        ignores = f"sched={self.name.value}"
        check_unread("sched", self, {k: (ignores, f"sched={v}") for k, v in readers.items() if v != self.name.value})


@dataclass
class ParallelConfig:
    """``ddp``: ``nproc`` ranks spawned by the job (or started by torchrun / SLURM); ``dp``: DataParallel."""

    mode: ParallelMode = ParallelMode.none
    nproc: int | None = None  # null: the visible GPUs, or 2 on CPU
    backend: Backend = Backend.auto  # auto: nccl on CUDA, gloo on CPU
    sync_bn: bool = False
    timeout_s: int = 600  # a collective waiting longer than this fails the job

    def __post_init__(self) -> None:
        within("parallel.nproc", self.nproc, 1, COUNT_MAX, "[]", null=True)
        within("parallel.timeout_s", self.timeout_s, 1, COUNT_MAX, "[]")  # timedelta holds up to ~8.6e13 s


@dataclass
class FaultConfig:
    """Fault injection for tests: ``kill_rank`` SIGKILLs itself after optimizer step ``kill_step``;
    ``oom_step`` raises a real ``torch.OutOfMemoryError`` after that step when ``batch_size >= oom_min_batch``;
    ``term_step``: rank 0 sends itself SIGTERM (a preemption) after that step."""

    kill_rank: int | None = None
    kill_step: int = 1
    term_step: int | None = None
    oom_step: int | None = None
    oom_min_batch: int = 1

    def __post_init__(self) -> None:
        within("fault.kill_rank", self.kill_rank, 0, null=True)
        within("fault.kill_step", self.kill_step, 1)
        within("fault.term_step", self.term_step, 1, null=True)
        within("fault.oom_step", self.oom_step, 1, null=True)
        within("fault.oom_min_batch", self.oom_min_batch, 1)


@dataclass
class CheckpointConfig:
    """``keep=last``: the run's ``checkpoint.pt`` stays while the run is unfinished (resume needs it) and is deleted
    when it ends FINISHED; ``always``: it stays after that too. ``best.pt`` (the tested weights) always stays.
    ``every_s``: an epoch is checkpointed once this many seconds have passed since the last checkpoint (0: every
    epoch), the last epoch and a stopped step always; its metrics are logged after the checkpoint that holds them."""

    keep: CheckpointKeep = CheckpointKeep.last
    every_s: float = 30.0

    def __post_init__(self) -> None:
        within("checkpoint.every_s", self.every_s, 0)


@dataclass
class StoreConfig:
    tracking_uri: str | None = None  # null: $MLFLOW_TRACKING_URI where set, else sqlite:///<project root>/mlflow.db

    def __post_init__(self) -> None:
        filled("mlflow.tracking_uri", self.tracking_uri, null=True)


@dataclass
class MlflowConfig(StoreConfig):
    experiment: str = "medsweep"
    system_metrics: bool = True  # MLflow's system metrics (CPU, memory, GPU) on each job's run, per node
    system_metrics_interval_s: float = 10.0  # seconds between samples
    log_model: bool = False  # the tested weights (select_by) as an MLflow PyTorch model (the run's logged model)

    def __post_init__(self) -> None:
        super().__post_init__()
        filled("mlflow.experiment", self.experiment)
        not_longer("mlflow.experiment", self.experiment, EXPERIMENT_NAME_MAX, "MLflow's limit for an experiment name")
        fix = " (each sample writes to the store: 0.001 s slowed training 2.6x, docs/benchmarks.md)"
        low, high = SAMPLE_INTERVAL_MIN_S, SAMPLE_INTERVAL_MAX_S
        within("mlflow.system_metrics_interval_s", self.system_metrics_interval_s, low, high, "[]", fix=fix)


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
    amp: bool = False
    amp_dtype: AmpDtype = AmpDtype.auto
    batch_size: Any = 32  # an int >= 1, "auto" (the largest micro-batch that fits mem_budget_mb), or "derived"
    accumulate: int = 1
    mem_budget_mb: float | None = None  # batch_size=auto: null, the device's free memory (or a job's share of it)
    effective_batch_size: int | None = None  # auto keeps it by setting accumulate; derived: / (accumulate x ranks)
    epochs: int = 15
    seed: int = 0
    deterministic: bool = False
    limit_batches: int | None = None
    device: Device = Device.auto
    num_threads: int | None = None  # null: all cores of this process's affinity
    grad_clip: float | None = None
    class_weights: bool = False  # cross-entropy weighted n / (classes x n_class) from the training labels
    label_smoothing: float = 0.0
    early_stop_patience: int | None = None  # stop after this many epochs without a better select_by score
    warmup_epochs: int = 0  # linear learning-rate warm-up from lr/10 (before the schedule)
    ema_decay: float | None = None  # validate, keep and test an EMA of the weights and BatchNorm buffers (0.99)
    select_by: SelectBy = SelectBy.val_loss  # which epoch's weights are tested (val_auc: MedMNIST's): docs/accuracy.md
    channels_last: bool = False
    cudnn_benchmark: bool = False
    compile: bool = False  # torch.compile the model
    cuda_graphs: Any = "auto"  # the whole optimizer step as one CUDA graph: auto (where it can run), true, false
    gpu_share: GpuShare = GpuShare.auto  # jobs sharing a GPU: auto (an MPS daemon where one can start), mps, none
    non_blocking: bool = True  # asynchronous host-to-device copies
    oom_retry: bool = False  # on out-of-memory: rerun with half the micro-batch, twice the accumulation
    log_every: int = 10
    skip_finished: Any = True  # skip a job with a FINISHED run: true (same config and code), config, or false
    rerun: str | None = None  # an MLflow run id: train that run's exact config again
    resume: str | None = None  # a run output folder or MLflow run id: continue that run from its checkpoint
    objective: str = "test/auc"  # what a job returns to the sweeper (Optuna): test/auc, or val/auc (best epoch)
    tags: list[str] = field(default_factory=list)  # MLflow tags <name>=true on every job's run and the sweep's
    dry_run: bool = False  # list what the job (or each job of -m) would do; train nothing, log nothing

    def __post_init__(self) -> None:
        named = self.batch_size in ("auto", "derived")
        if not named and not (isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool)):
            raise ValueError(f"batch_size={self.batch_size} must be an integer >= 1, auto or derived")
        if self.batch_size == "derived" and self.effective_batch_size is None:
            raise ValueError(
                "batch_size=derived needs effective_batch_size=<n>: batch_size is "
                "effective_batch_size / (accumulate x ranks)"
            )
        if not isinstance(self.cuda_graphs, bool) and self.cuda_graphs != "auto":
            raise ValueError(f"cuda_graphs={self.cuda_graphs} must be auto, true or false")
        if not isinstance(self.skip_finished, bool) and self.skip_finished != "config":
            raise ValueError(f"skip_finished={self.skip_finished} must be true, false or config")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective} is not a job result: use one of {', '.join(OBJECTIVES)}")
        for key in (() if named else ("batch_size",)) + ("accumulate", "epochs", "log_every"):
            within(key, getattr(self, key), 1, COUNT_MAX, "[]")
        for key in ("limit_batches", "effective_batch_size", "early_stop_patience"):
            within(key, getattr(self, key), 1, COUNT_MAX, "[]", null=True)
        within("num_threads", self.num_threads, 1, THREADS_MAX, "[]", null=True)
        within("mem_budget_mb", self.mem_budget_mb, 0, ends="()", null=True)
        within("seed", self.seed, 0, SEED_MAX, "[]")
        within("label_smoothing", self.label_smoothing, 0, 1)
        within("warmup_epochs", self.warmup_epochs, 0, self.epochs, fix=f" (below epochs={self.epochs})")
        check_early_stop(self)
        within("ema_decay", self.ema_decay, 0, 1, "()", null=True, fix=" (no EMA)")
        within("grad_clip", self.grad_clip, 0, ends="()", null=True)
        filled("rerun", self.rerun, null=True)
        filled("resume", self.resume, null=True)
        check_tags(self.tags)
        check_schedule(self)
        check_param_lengths(self)


@dataclass
class ReportMlflowConfig(StoreConfig):
    experiment: str | None = None  # a selector here: report every run of this experiment

    def __post_init__(self) -> None:
        super().__post_init__()
        filled("mlflow.experiment", self.experiment, null=True)
        not_longer("mlflow.experiment", self.experiment, EXPERIMENT_NAME_MAX, "MLflow's limit for an experiment name")


@dataclass
class ReportConfig:
    """``python -m src.report``: one of ``sweep``, ``parent``, ``mlflow.experiment`` selects the runs (none: the latest
    sweep)."""

    mlflow: ReportMlflowConfig = field(default_factory=ReportMlflowConfig)
    sweep: str | None = None  # a sweep folder (it holds the parent run id)
    parent: str | None = None  # a sweep's parent run id
    out: str | None = None  # null: <sweep folder>/report, else reports/<parent run id or experiment>
    margin: float = 0.01  # test-AUC loss a switch may cost and still be judged "no loss"
    speed_margin: float = 0.05  # samples/s ratios within [1/(1 + it), 1 + it] are judged "no difference"
    memory_margin: float = 0.05  # peak-memory ratios within [1/(1 + it), 1 + it] are judged "no difference"
    tags: list[str] = field(default_factory=list)  # only the runs carrying every one of these tags
    register: str | None = None  # register the best run's logged model (by val/auc) under this name

    def __post_init__(self) -> None:
        for key in ("sweep", "parent", "out", "register"):
            filled(key, getattr(self, key), null=True)
        if self.register and (banned := [c for c in MODEL_NAME_BANNED if c in self.register]):
            raise ValueError(f"register={self.register}: MLflow's model names cannot hold {' or '.join(banned)}")
        if self.register == "." or (self.register or "").startswith(".."):  # MLflow: it would resolve as a path
            raise ValueError(
                f"register={self.register}: MLflow's model names cannot be . or start with .. (a path to another "
                f"name): give a name such as medsweep-best"
            )
        within("margin", self.margin, 0, 1, "[]", fix=" (an AUC difference)")
        for key in ("speed_margin", "memory_margin"):
            within(key, getattr(self, key), 0, 1, "[]", fix=" (a fraction of the baseline: 0.05 is 5%)")
        check_tags(self.tags)


def check_param_lengths(node: Any, prefix: str = "") -> None:
    """Each key of ``node`` (a schema dataclass) is one MLflow param of a run: its value as text, at most
    :data:`PARAM_VALUE_MAX` characters."""
    for key in fields(node):
        if is_dataclass(value := getattr(node, key.name)):
            check_param_lengths(value, f"{prefix}{key.name}.")
        else:
            not_longer(f"{prefix}{key.name}", str(value), PARAM_VALUE_MAX, "MLflow's limit for a param value")


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


TAG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
RESERVED_TAGS = frozenset(  # the undotted tag keys medsweep writes itself (its dotted ones cannot clash)
    [
        "config_hash",
        "code_fingerprint",
        "overrides",
        "output_dir",
        "rerun_of",
        "retry_of",
        "git_commit",
        "torch_version",
        "cuda_version",
        "host",
        "boot_id",
        "pid",
        "device",
        "num_threads",
        "status",
        "retried",
        "preempted",
        "resume_with",
        "resumes",
        "resumed_at",
        "best_weights",
        "sweep_dir",
        "role",
        "cuda_graphs",
        "gpu_share",
    ]
)


def check_tags(tags: list[str]) -> None:
    """``tags`` become MLflow tags ``<name>=true``: letters, digits, ``_`` and ``-``, none of medsweep's own keys."""
    for name in tags:
        if not TAG_NAME.fullmatch(str(name)):
            raise ValueError(f"tags: {name!r} is not a tag name: use letters, digits, _ and - (tags=[baseline,amp])")
        not_longer("tags: a name", str(name), TAG_KEY_MAX, "MLflow's limit for a tag key")
        if name in RESERVED_TAGS:
            raise ValueError(f"tags: {name} is a tag medsweep sets itself: choose another name")


def register(zoo: bool = True) -> None:
    """Register the schema as ``base_config``; ``conf/config.yaml`` composes on top of it, so every
    group file is merged into a typed node (a wrong key, type or choice fails at composition).
    ``base_report`` is ``conf/report.yaml``'s. The resolver ``${fresh:<folder>}`` claims a folder of its own
    (:func:`src.folders.fresh`). With ``zoo`` (``conf/config.yaml`` needs it, the report does not: it spares the
    report importing torch), the ``model`` group's options are the registered models (:mod:`src.models.registry`),
    and ``${models:}`` names them all, comma-separated (``preset=models``' sweep)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from src.folders import fresh

    ConfigStore.instance().store(name="base_config", node=Config)
    ConfigStore.instance().store(name="base_report", node=ReportConfig)
    if not OmegaConf.has_resolver("fresh"):
        OmegaConf.register_new_resolver("fresh", fresh, use_cache=True)
    if zoo and not OmegaConf.has_resolver("models"):
        from src.models import MODELS  # importing the zoo registers it

        OmegaConf.register_new_resolver("models", lambda: ",".join(MODELS))
