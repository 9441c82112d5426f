"""A run's identity: its flattened config and the hash of what determines its results."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

NOT_HASHED = (
    "mlflow.",
    "data.root",
    "data.download",
    "data.url",
    "log_every",  # where it logs, caches data
    "checkpoint.",  # what stays on disk once it is FINISHED
    "skip_finished",
    "rerun",
    "resume",
    "objective",
)  # how a job is started and what it returns


def flatten(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as ``{"model.name": "densenet121", ...}`` (enums by value)."""

    def walk(node: Any, prefix: str) -> dict[str, str]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        return {prefix[:-1]: str(node)}

    return walk(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "")


def config_hash(params: dict[str, str]) -> str:
    """A short hash of what determines a run's results (not where it logs or caches data)."""
    kept = {k: v for k, v in params.items() if not k.startswith(NOT_HASHED)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]
