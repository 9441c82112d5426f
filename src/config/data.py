"""The dataset's keys (``data.*``): a MedMNIST 3D file, generated volumes, or a NIfTI folder."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from src.config.enums import Intensity, Loader
from src.config.ranges import (
    CHANNELS_MAX,
    CLASSES_MAX,
    NIFTI_SPACING_MAX,
    SEED_MAX,
    WORKERS_MAX,
    bounds_text,
    check_unread,
    filled,
    within,
)
from src.config.rules import Finite, OneOf, Pattern, Range, Text, check_keys, key

TASKS = ("binary-class", "multi-class")  # the single-label tasks the trainer's cross-entropy and metrics handle
SPLITS = ("train", "val", "test")  # a dataset's splits, in MedMNIST's order
NIFTI = "nifti"  # data=nifti: a folder of volumes and a labels CSV (src/volumes, docs/nifti.md)
SYNTHETIC = "synthetic"  # data=synthetic: generated volumes (src.data.synthetic)
NIFTI_KEYS = ("labels", "classes", "split_fractions", "split_seed", "spacing", "intensity")  # data.* only nifti reads
MEDMNIST_SIZES = (28, 64)  # the cube sides of MedMNIST's 3D files
NIFTI_SIZES = (16, 256)  # the cube sides data=nifti crops or pads to
URL = re.compile(r"https?://[^/\s]+\S*|file://\S+")
FRACTIONS = "the train, val and test fractions of each class, e.g. [0.7,0.1,0.2]"


@dataclass(frozen=True)
class CubeSide:
    """``data.size``: a side MedMNIST has files of; any side in :data:`NIFTI_SIZES` for ``data=nifti``."""

    def check(self, key: str, value: Any, node: Any) -> None:
        if node.name == NIFTI:
            within(key, value, *NIFTI_SIZES, "[]", fix=f" for data={NIFTI}")
        elif value not in MEDMNIST_SIZES:
            sizes = " or ".join(map(str, MEDMNIST_SIZES))
            raise ValueError(f"{key}={value} is not a MedMNIST 3D size: use {key}={sizes}")

    def text(self) -> str:
        return f"{' or '.join(map(str, MEDMNIST_SIZES))}; {bounds_text(*NIFTI_SIZES, '[]')} with data={NIFTI}"


@dataclass(frozen=True)
class ClassNames:
    """Class names: 2 or more, each once, none blank; or None."""

    def check(self, key: str, value: Any, node: Any) -> None:
        for i, name in enumerate(value or []):
            filled(f"{key}[{i}]", name)
        if value is not None and len(set(value)) < max(2, len(value)):
            raise ValueError(f"{key}={value} must name 2 or more classes, each once")

    def text(self) -> str:
        return "2 or more non-blank names, each once, or null"


@dataclass
class DataConfig:
    """A MedMNIST 3D dataset (``name`` is its medmnist flag), ``synthetic``, or ``nifti``: a folder of volumes and a
    labels CSV, preprocessed once into a cached file of MedMNIST's layout (the keys after ``synthetic_samples``)."""

    name: str = key(MISSING, "the dataset: a MedMNIST 3D flag (its medmnist name), synthetic or nifti")
    root: str = key("~/.medmnist", "the dataset's folder (nifti: of the volumes)", Text())
    size: int = key(28, "the volumes' cube side", CubeSide())
    download: bool = key(True, "fetch MedMNIST's file when it is missing (its MD5 checked)")
    url: str | None = key(
        None,
        "where to fetch it from (a mirror); null: medmnist's URL for this flag and size",
        Pattern(URL, "an http(s):// or file:// URL", null=True, fix=" (medmnist's own)"),
    )
    in_channels: int = key(1, "the volumes' channels", Range(1, CHANNELS_MAX, "[]"))
    num_classes: int = key(MISSING, "the classes: the model's outputs", Range(2, CLASSES_MAX, "[]"))
    task: str = key(
        "multi-class",
        "the task the metrics score (binary-class: 2 classes)",
        OneOf(TASKS, "a task the trainer supports"),
        allowed="binary-class with data.num_classes=2",
    )
    loader: Loader = key(
        Loader.tensor, "tensor: each split kept on the device, shuffled there; dataloader: torch's DataLoader"
    )
    num_workers: int = key(
        0,
        "data.loader=dataloader: its worker processes",
        Range(0, WORKERS_MAX, "[]", fix=" (worker processes per rank)"),
    )
    pin_memory: bool = key(False, "data.loader=dataloader: pinned host memory")
    synthetic_samples: list[int] = key(
        [256, 64, 64],
        "data=synthetic: the train, val and test sizes",
        Range(1, each=True, count=3, what="the train, val and test sizes, e.g. [256,64,64]"),
    )
    labels: str | None = key(
        None, "nifti: the CSV (image relative to root, label, optional split); null: <root>/labels.csv", Text(null=True)
    )
    classes: list[str] | None = key(
        None, "nifti: the class names in class order; null: the CSV's, sorted", ClassNames()
    )
    split_fractions: list[float] = key(
        [0.7, 0.1, 0.2],
        "nifti without a split column: each class's train, val and test fractions",
        Range(0, 1, "()", each=True, count=3, what=FRACTIONS),
        allowed="summing to 1",
    )
    split_seed: int = key(
        0, "nifti: that split's seed (not the run's: every run tests on the same volumes)", Range(0, SEED_MAX, "[]")
    )
    spacing: list[float] | None = key(
        None,
        "nifti: the voxel size in mm along R, A, S it resamples to; null: the training volumes' median",
        Range(
            0,
            NIFTI_SPACING_MAX,
            "(]",
            null=True,
            each=True,
            count=3,
            what="millimetres along R, A and S, e.g. [1,1,1]; or null: the training volumes' median",
        ),
    )
    intensity: Intensity = key(
        Intensity.minmax, "nifti: per volume min-max, z-score (clipped at +-3 std), or a CT window"
    )
    window_level: float = key(
        40.0, "nifti, intensity=window: its centre (40 HU: soft tissue)", Finite(fix=" (the window's centre)")
    )
    window_width: float = key(
        400.0, "nifti, intensity=window: its width (400 HU)", Range(0, ends="()", fix=" (the window's width)")
    )

    def __post_init__(self) -> None:
        check_keys(self, "data")
        if self.task == TASKS[0] and self.num_classes != 2:  # binary metrics on k outputs: nonsense that finished
            raise ValueError(
                f"data.task=binary-class with data.num_classes={self.num_classes}: a binary task has 2 classes: "
                "use data.num_classes=2, or data.task=multi-class"
            )
        if not math.isclose(sum(self.split_fractions), 1):
            raise ValueError(f"data.split_fractions={self.split_fractions} must sum to 1 ({FRACTIONS})")
        self.check_ignored_keys()

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
