"""How a model is trained: augmentation (``aug.*``), the optimizer (``optim.*``) and its schedule (``sched.*``)."""

from __future__ import annotations

from dataclasses import dataclass

from src.config.enums import OptimName, SchedName
from src.config.ranges import COUNT_MAX, check_unread
from src.config.rules import Range, Text, check_keys, key


@dataclass
class AugConfig:
    """Training-time augmentation, batched on the training device and seeded per step; never on val/test.

    ``flip``: each axis mirrored with probability 1/2, per sample. ``rot90``: a multiple of 90 degrees in each of
    the three planes, per sample. ``affine``: rotation up to ``affine_degrees`` about each axis, isotropic scale
    in 1 +- ``affine_scale``, shift up to ``affine_translate`` of the side (trilinear, zero outside), applied to a
    sample with probability ``affine_p``. ``intensity``: contrast x(1 +- ``intensity_scale``), brightness
    +- ``intensity_shift`` (on the [-1, 1] scale), Gaussian noise of std ``noise_std``.
    """

    name: str = key("none", "the option's name (aug=none or standard), logged with the run", Text())
    flip: bool = key(False, "each axis mirrored with probability 1/2, per sample")
    rot90: bool = key(False, "a multiple of 90 degrees in each of the three planes, per sample")
    affine: bool = key(False, "a rotation, isotropic scale and shift (trilinear, zero outside)")
    affine_p: float = key(
        1.0, "affine: the probability a sample is transformed", Range(0, 1, "[]", fix=" (a probability)")
    )
    affine_degrees: float = key(
        15.0, "affine: the most rotation about each axis", Range(0, 180, "[]", fix=" (rotation in +- affine_degrees)")
    )
    affine_scale: float = key(0.1, "affine: scale in 1 +- it", Range(0, 1, fix=" (scale 1 +- affine_scale)"))
    affine_translate: float = key(
        0.1,
        "affine: the most shift, a fraction of the side",
        Range(0, 1, "[]", fix=" (shift in +- affine_translate sides)"),
    )
    intensity: bool = key(False, "contrast and brightness jitter, Gaussian noise")
    intensity_scale: float = key(
        0.1, "intensity: contrast x(1 +- it)", Range(0, 1, fix=" (contrast 1 +- intensity_scale)")
    )
    intensity_shift: float = key(
        0.1,
        "intensity: brightness +- it, on the [-1, 1] scale",
        Range(0, 1, "[]", fix=" (brightness on the [-1, 1] scale)"),
    )
    noise_std: float = key(
        0.0,
        "intensity: the Gaussian noise's std, on the [-1, 1] scale",
        Range(0, 1, "[]", fix=" (on the [-1, 1] scale)"),
    )

    def __post_init__(self) -> None:
        check_keys(self, "aug")


@dataclass
class OptimConfig:
    name: OptimName = key(OptimName.adam, "the optimizer (optim=<name> sets it)")
    lr: float = key(1e-3, "the learning rate (cyclic: the cycle's top)", Range(0, fix=" (0 freezes the weights)"))
    weight_decay: float = key(0.0, "weight decay (adamw: decoupled)", Range(0))
    momentum: float = key(0.9, "sgd: its momentum", Range(0, 1))
    nesterov: bool = key(False, "sgd: Nesterov momentum", allowed="true with optim=sgd and optim.momentum > 0")
    betas: list[float] = key(
        [0.9, 0.999],
        "adam, adamw: beta1 and beta2",
        Range(0, 1, each=True, count=2, what="Adam's beta1 and beta2, e.g. [0.9,0.999]"),
    )
    fused: bool = key(True, "torch's fused kernel: one pass over each parameter (CPU and CUDA); false: its loop")

    def __post_init__(self) -> None:
        check_keys(self, "optim")
        if self.nesterov and not (self.name is OptimName.sgd and self.momentum > 0):
            raise ValueError(
                f"optim.nesterov=true with optim.name={self.name.value}, optim.momentum={self.momentum}: "
                f"Nesterov needs optim=sgd with optim.momentum > 0; or use optim.nesterov=false"
            )
        ignores = f"optim={self.name.value}"
        sgd = self.name is OptimName.sgd
        unread = {"betas": (ignores, "optim=adam or adamw")} if sgd else {"momentum": (ignores, "optim=sgd")}
        check_unread("optim", self, unread)


@dataclass
class SchedConfig:
    name: SchedName = key(SchedName.multistep, "the learning-rate schedule (sched=<name> sets it)")
    milestones: list[float] = key(
        [0.5, 0.75],
        "multistep: the fractions of the epochs where the rate is multiplied by gamma",
        Range(0, 1, "()", each=True, fix=" (a fraction of the epochs)"),
        allowed="increasing, each once",
    )
    gamma: float = key(
        0.1, "multistep: the factor at each milestone", Range(0, 1, "(]", fix=" (the factor at each milestone)")
    )
    min_lr: float = key(0.0, "cosine: the rate it anneals to", Range(0), allowed="at most optim.lr with sched=cosine")
    base_lr: float = key(
        1e-4, "cyclic: the cycle's bottom", Range(0, ends="()"), allowed="below optim.lr with sched=cyclic"
    )
    cycle_epochs: float = key(  # steps per cycle: an int, for torch
        2.0, "cyclic: epochs per up-and-down cycle", Range(0, COUNT_MAX, "(]")
    )

    def __post_init__(self) -> None:
        check_keys(self, "sched")
        if list(self.milestones) != sorted(set(self.milestones)):  # the scheduler sorts them: one training, two hashes
            increasing = ",".join(f"{m:g}" for m in sorted(set(self.milestones)))
            given = list(self.milestones)
            raise ValueError(f"sched.milestones={given} must increase, each once: give sched.milestones=[{increasing}]")
        readers = {"milestones": "multistep", "gamma": "multistep", "min_lr": "cosine"}
        readers |= {"base_lr": "cyclic", "cycle_epochs": "cyclic"}
        ignores = f"sched={self.name.value}"
        check_unread("sched", self, {k: (ignores, f"sched={v}") for k, v in readers.items() if v != self.name.value})
