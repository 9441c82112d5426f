"""The model's keys (``model.*``): a member of the zoo and the switches that reach every block."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from src.config.enums import Activation, Init, InitMode, Norm, Shortcut, Stem
from src.config.rules import key


@dataclass
class ModelConfig:
    """A zoo member and the switches that reach every block."""

    name: str = key(MISSING, "the model: a registered one (model=<name> sets it with its defaults)")
    stem: Stem = key(  # MedMNIST's own 28^3 set-up is small: ~60x the FLOPs (docs/accuracy.md)
        Stem.standard,
        "standard: 7^3 stride-2 conv and max-pool; small: 3^3 stride 1 (~60x the FLOPs); auto: small below 64^3",
    )
    dsconv: bool = key(False, "depthwise-separable convs: each k^3 conv as a depthwise k^3 and a pointwise 1^3 conv")
    dsconv_mid_norm: bool = key(False, "dsconv: a norm and an activation between the depthwise and pointwise conv")
    activation: Activation = key(Activation.relu, "every block's activation (each position its own module)")
    norm: Norm = key(Norm.batch, "every block's norm")
    init: Init = key(Init.kaiming_normal, "the convs' weight init (torch_default: as PyTorch made them)")
    init_mode: InitMode = key(InitMode.fan_out, "kaiming inits: the fan their std is scaled by")
    zero_init_residual: bool = key(False, "ResNet: each block's last norm starts at zero (the block as its shortcut)")
    shortcut: Shortcut = key(Shortcut.B, "ResNet: A, the identity subsampled and zero-padded; B, a 1^3 conv and norm")
    checkpointing: bool = key(False, "DenseNet: each dense layer's bottleneck recomputed in backward (less memory)")
    inplace_act: bool = key(True, "ReLU in place (saves one activation map per position)")
