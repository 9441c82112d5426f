"""The MLflow dataset inputs of a run: one per split of the `.npz` file it trains on (or of a NIfTI folder's cache),
named ``<file stem>/<split>``, digested by the file's MD5 and profiled with the split's samples and class counts.
Names, digests and profiles: docs/mlflow.md, docs/nifti.md.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from mlflow.data.schema import TensorDatasetSchema
from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.types import Schema, TensorSpec
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

from src.config import NIFTI, SYNTHETIC, DataConfig
from src.data.medmnist import expected_md5, md5
from src.data.nifti.cache import read_meta

CONTEXTS = {"train": "training", "val": "validation", "test": "test"}


def file_digest(cfg: DataConfig, path: Path) -> str:
    """The file's MD5: medmnist's, which ``ensure_file`` checked the file against, or the synthetic file's own; a NIfTI
    folder's cache: the MD5 of its CSV and volumes."""
    if cfg.name == NIFTI:
        return read_meta(path)["digest"]
    return md5(path) if cfg.name == SYNTHETIC else expected_md5(cfg)


def source(cfg: DataConfig, path: Path) -> tuple[str, str, dict]:
    """The dataset's name (before ``/<split>``), the URI of its source and what its profile says of them."""
    if cfg.name == NIFTI:
        meta = read_meta(path)
        profile = {key: meta[key] for key in ("root", "labels", "classes", "split_given")}
        cache = {"spacing_mm": meta["spacing"], "cache": path.name, "cache_bytes": path.stat().st_size}
        name = f"{Path(meta['root']).name}_{cfg.size}"
        return name, Path(meta["labels"]).as_uri(), profile | cache | {"monai_version": version("monai")}
    about = {"file": path.name, "file_bytes": path.stat().st_size, "medmnist_version": version("medmnist")}
    return path.stem, path.resolve().as_uri(), {"flag": cfg.name, **about}


def split_dataset(
    cfg: DataConfig, path: Path, split: str, images: torch.Tensor, labels: torch.Tensor, digest: str
) -> Dataset:
    name, uri, about = source(cfg, path)
    schema = TensorDatasetSchema(
        features=Schema([TensorSpec(np.dtype(np.uint8), (-1, *images.shape[1:]), "images")]),
        targets=Schema([TensorSpec(np.dtype(np.int64), (-1,), "labels")]),
    )
    profile = {
        "split": split,
        "num_samples": len(labels),
        "class_counts": torch.bincount(labels, minlength=cfg.num_classes).tolist(),
        "size": cfg.size,
        **about,
    }
    return Dataset(
        name=f"{name}/{split}",
        digest=digest,
        source_type="local",
        source=json.dumps({"uri": uri}),
        schema=json.dumps(schema.to_dict()),
        profile=json.dumps(profile),
    )


def dataset_inputs(
    cfg: DataConfig, path: Path, splits: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> list[DatasetInput]:
    """One input per split of ``splits`` (``src.data.loaders.load_splits``), read from ``path``."""
    digest = file_digest(cfg, path)
    return [
        DatasetInput(
            split_dataset(cfg, path, split, images, labels, digest), [InputTag(MLFLOW_DATASET_CONTEXT, CONTEXTS[split])]
        )
        for split, (images, labels) in splits.items()
    ]
