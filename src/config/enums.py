"""The schema's choices. Members are named in lower case (or as the override spells them, like ``B``) because
OmegaConf matches an override against the member *name*."""

from __future__ import annotations

from enum import Enum


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
