"""Run checkpoints: one atomic file per job folder that ``torch.load(..., weights_only=True)`` reads.

The file holds what a :class:`src.training.trainer.Trainer` needs to go on bitwise as if never stopped (model,
optimizer, GradScaler, LR schedule, RNG states, position, best weights, running sums) and what the job
needs to find and check the run (MLflow run id, resolved config, micro-batch, ranks). A run that trained to the
end also leaves ``best.pt``: the tested weights alone, what stays of it once ``checkpoint.pt`` is deleted.
"""

from __future__ import annotations

import io
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from src.atomic import atomic_path, uninterrupted
from src.errors import UsageError
from src.folders import BEST_FILE as BEST_FILE
from src.folders import CHECKPOINT_FILE

FILE = CHECKPOINT_FILE
FORMAT = 2  # what a checkpoint holds: bump it, and give upgrade() a step from the one before, when that changes


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module under DistributedDataParallel / DataParallel (``.module``) and torch.compile (``._orig_mod``)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


class Unreadable(UsageError):
    """A checkpoint that does not load: truncated, corrupt, or no medsweep checkpoint."""


class _Writer(io.RawIOBase):
    """A file torch writes into, keeping the ``OSError`` a write raised: torch's writer reports only ``unexpected
    pos``."""

    def __init__(self, file: io.RawIOBase) -> None:
        self.file, self.error = file, None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise


def save(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` atomically: a crash at any moment leaves the previous checkpoint or the new one; a full disk
    raises :class:`src.atomic.NoSpace`. A second Ctrl-C during the write stops the job once the file is whole
    (:func:`src.atomic.uninterrupted`): cut, the stop it serves would lose its checkpoint."""
    with uninterrupted(f"writing {path.name}"), atomic_path(path) as tmp, tmp.open("wb", buffering=0) as file:
        writer = _Writer(file)
        try:
            torch.save(state, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


def save_weights(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Write a model's ``state_dict`` atomically, on the CPU, floating tensors in fp32: it loads with
    ``torch.load(path, weights_only=True)`` into ``build_model(...)`` on any machine."""
    weights = {
        key: value.detach().cpu().float() if value.is_floating_point() else value.detach().cpu()
        for key, value in state_dict.items()
    }
    save(weights, path)


def load(path: Path, mmap: bool = False) -> dict[str, Any]:
    r"""The checkpoint at ``path`` on the CPU, tensors and plain Python values only (``weights_only=True``).

    ``mmap=True`` maps the file instead of loading it into memory: cheap when only the metadata is needed (the CRC
    check still reads the file once, ~0.5 s for 287 MB). A file that does not load raises :class:`Unreadable`, as does
    one whose bytes changed since it was written: ``torch.load`` does not check the zip's CRC-32s, so a flipped bit in
    a tensor would otherwise resume as a silently different run. A checkpoint of an earlier format is
    :func:`upgrade`\ d.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            if (bad := archive.testzip()) is not None:
                raise Unreadable(f"{path} is unreadable (truncated or corrupt: {bad} fails its CRC check)")
        return upgrade(torch.load(path, map_location="cpu", weights_only=True, mmap=mmap))
    except (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
        why = getattr(err, "strerror", None) or str(err).strip().splitlines()[0].split(". ")[0].rstrip(".")
        raise Unreadable(f"{path} is unreadable (truncated or corrupt: {why})") from None


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of an earlier format as :data:`FORMAT` holds it. Format 1 (no ``format`` key; written up to
    2026-11-28) gained its keys over time; each one missing there takes the value a run that lacked it trained as:
    ``selection`` (before 2026-11-24, ``select_by=val_auc`` kept ``best_auc``), ``best_epoch`` (before early
    stopping: the epoch reached), ``pending`` (before 2026-11-27: the epoch before ``epoch``, its ``last_metrics``),
    ``memory_peak`` and ``timed`` (before 2026-11-24: none), ``spent_s`` and the meta key ``threads`` (before
    2026-11-27: none)."""
    if state.get("format", 1) >= FORMAT:
        return state
    epoch = state.get("epoch", 0)
    last = [(epoch - 1, state["last_metrics"])] if state.get("last_metrics") else []
    return {
        "selection": {"smoothed": None, "best": state.get("best_auc")},
        "best_epoch": epoch,
        "pending": last,
        "memory_peak": {},
        "timed": [],
        "spent_s": {"time/validate_s": 0.0, "time/checkpoint_s": 0.0},
        "threads": None,
        **{key: value for key, value in state.items() if key not in ("best_auc", "last_metrics")},
        "format": FORMAT,
    }


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states as tensors and plain values (``weights_only`` safe)."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, torch.tensor(words, dtype=torch.int64), gauss],
        "numpy": [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s generators (CUDA ones when this process sees as many devices)."""
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words.tolist()), gauss))
    keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
