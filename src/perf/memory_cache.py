"""The memory predictor's figures (:func:`src.perf.memory.predict`) kept in ``memory_predictions.json`` beside the
peak-FLOP/s cache (:mod:`src.perf.probe_cache`): a replay costs 1-5 s of one core (densenet121 at 28^3, 2026-11-24),
a read nothing, so a dry run listing a sweep again and a job's start-up read their peaks. Keyed by the config's hash
(:func:`src.tracking.identity.config_hash`: where a run logs, how it starts and its seed aside), the device and the
probe key's machine, software and code (the predictor and the models are in the code's fingerprint), the step
predicted (eager or graphed), and on the CPU the threads (a GPU job of a joblib sweep reads what a lone run on that
GPU predicted). Entries are used
for :data:`MAX_AGE`, then predicted again."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable

from omegaconf import OmegaConf

from src.config import Config
from src.execution import Execution
from src.perf.memory import MemoryPrediction, predict
from src.perf.probe_cache import ProbeCache, age, key, machine
from src.tracking.identity import config_hash, flatten

MAX_AGE = datetime.timedelta(days=7)
FIELDS = tuple(field.name for field in dataclasses.fields(MemoryPrediction))
CACHE = ProbeCache("memory_predictions.json", fresh=lambda entry: age(entry) <= MAX_AGE, fields=FIELDS)


def predicted(cfg: Config, execution: Execution) -> MemoryPrediction:
    """``predict(cfg, execution)``, from the cache when it holds it; the replay holds the machine shared (no step
    timing of another process meanwhile)."""
    device = execution.device
    probed = config_hash(flatten(OmegaConf.structured(dataclasses.replace(cfg, seed=0))))  # sizes, not values
    threads = execution.threads if device.type == "cpu" else 0  # a GPU's memory: not the host's threads
    step = " graphed" if execution.graphed else ""
    name = key(device, threads, f"{probed} {device.type}{step}")  # any GPU of the same name
    with machine(exclusive=False):
        entry = CACHE.get(name) or CACHE.put(name, dataclasses.asdict(predict(cfg, execution)))
    return MemoryPrediction(**{field: entry[field] for field in FIELDS})


def predicted_memory_metrics(cfg: Config, execution: Execution) -> Callable[[dict[str, float]], dict[str, float]]:
    """A Trainer's epoch-metrics hook: ``mem/predicted_mb`` and ``mem/predict_ratio`` (measured peak over it)."""
    total = predicted(cfg, execution).total_mb
    return lambda metrics: {"mem/predicted_mb": total, "mem/predict_ratio": metrics["mem/peak_mb"] / total}
