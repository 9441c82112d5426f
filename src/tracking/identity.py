"""A run's identity: its flattened config, the hash of what determines its results, the fingerprint of the code
that computes them, and its name."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
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
    "tags",
    "dry_run",
    "gpu_share",
    "fuse",  # a member trained fused computes its unfused run's steps to float32 rounding (docs/fused.md)
)  # how a job is started and what it returns
ADDED = {  # keys added from 2026-11-24, at the values that train as runs logged before them did: their hashes stay
    "select_by": "val_auc",
    "data.labels": "None",
    "data.classes": "None",
    "data.split_fractions": "[0.7, 0.1, 0.2]",
    "data.split_seed": "0",
    "data.spacing": "None",
    "data.intensity": "minmax",
    "data.window_level": "40.0",
    "data.window_width": "400.0",
    "cuda_graphs": "auto",  # 2026-11-25: CPU runs train as before; on CUDA the code fingerprint changed with it
}
NOT_NAMED = (*NOT_HASHED, "hydra.", "hydra/")  # run names leave out Hydra's own settings too
NAME_LIMIT = 160  # characters (MLflow keeps 250); a longer name is cut and ends with the hash
PACKAGE = Path(__file__).resolve().parents[1]  # src/
NOT_FINGERPRINTED = (
    "report/",
    "summary.py",
    "memory.py",
    "jobs/dry_run.py",
    "volumes/__main__.py",
)  # paths under src/ that train nothing


def flatten(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as ``{"model.name": "densenet121", ...}`` (enums by value)."""

    def walk(node: Any, prefix: str) -> dict[str, str]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        return {prefix[:-1]: str(unsigned_zero(node))}

    return walk(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "")


def unsigned_zero(value: Any) -> Any:
    """``value`` with -0.0 (in a list too) as 0.0, the number it equals: ``optim.lr=-0.0`` is ``optim.lr=0``'s run."""
    if isinstance(value, list):
        return [unsigned_zero(item) for item in value]
    return 0.0 if isinstance(value, float) and value == 0 else value


def config_hash(params: dict[str, str]) -> str:
    """A short hash of what determines a run's results (not where it logs or caches data); a key added after runs
    were logged counts only away from the value that trains as before it existed (:data:`ADDED`)."""
    kept = {k: v for k, v in params.items() if not k.startswith(NOT_HASHED) and ADDED.get(k) != v}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


@functools.cache
def code_fingerprint(root: Path = PACKAGE) -> str:
    """A short sha256 over the relative paths and bytes of the ``*.py`` files under ``root`` (the ``src`` package)
    that can change a run's results: all of them but ``report/`` (reads finished runs), ``summary.py`` and
    ``memory.py`` (commands that print a model's size or predicted memory and train nothing) and ``jobs/dry_run.py``
    (``dry_run=true``: lists the jobs, trains nothing). Tracking code is included: it decides what a run logs.
    Computed once per process and root."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if not relative.startswith(NOT_FINGERPRINTED):
            data = path.read_bytes()
            digest.update(f"{relative}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


def run_name(overrides: Iterable[str], hashed: str | None = None, prefix: str = "") -> str:
    """A short, stable name from the overrides that change results (the config hash's rule; Hydra's settings left
    out, ``+``/``++`` dropped, a key given twice once), after ``prefix``: ``model=densenet121 amp=true seed=1``, or
    ``defaults``. A name over ``NAME_LIMIT`` characters is cut and ends with ``hashed`` (the job's config hash; by
    default a hash of the named overrides, for a sweep's parent run), so cut names stay distinct."""
    overrides = list(overrides)
    named: dict[str, str] = {}  # a key given twice: its last value, as Hydra applies it
    for text, override in zip(overrides, OverridesParser.create().parse_overrides(overrides), strict=True):
        if not override.key_or_group.startswith(NOT_NAMED):
            named[override.key_or_group] = text.lstrip("+")
    name = " ".join([prefix, *(named.values() or ["defaults"])]).strip()
    if len(name) <= NAME_LIMIT:
        return name
    hashed = hashed or hashlib.sha256(" ".join(named.values()).encode()).hexdigest()[:16]
    return f"{name[: NAME_LIMIT - len(hashed) - 4].rstrip()}... {hashed}"
