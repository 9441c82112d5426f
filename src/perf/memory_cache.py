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
import math
from collections.abc import Callable

from omegaconf import OmegaConf

from src.caches import Entry, integer, number, one_of, text, warn_once
from src.config import Config
from src.execution import Execution
from src.perf.memory import MemoryPrediction, predict
from src.perf.probe_cache import ProbeCache, age, key, machine
from src.tracking.identity import config_hash, flatten

MAX_AGE = datetime.timedelta(days=7)
FIELDS = tuple(field.name for field in dataclasses.fields(MemoryPrediction))
SCHEMA = {
    "device": text,
    "step": one_of("eager", "graphed"),
    "batch_size": integer(1),
    **{name: number(0) for name in FIELDS if name.endswith("_mb")},
    "total_mb": number(0, above=True),
}


def adds_up(entry: Entry) -> bool:
    """Whether the entry's total is the sum of the parts its device counts, as :func:`predict` makes it."""
    prediction = MemoryPrediction(**{field: entry[field] for field in FIELDS})
    parts = sum(getattr(prediction, name) for name, counted in prediction.counted().items() if counted)
    return math.isclose(prediction.total_mb, parts, rel_tol=1e-6)


CACHE = ProbeCache("memory_predictions.json", lambda entry: age(entry) <= MAX_AGE, SCHEMA, adds_up)


def predicted(cfg: Config, execution: Execution, cached: bool = True) -> MemoryPrediction:
    """``predict(cfg, execution)``, from the cache when it holds it; the replay holds the machine shared (no step
    timing of another process meanwhile). ``cached=False``: replayed whatever the cache holds, and its entry replaced
    (one warning where it held another figure), so a job is never refused on a cached figure alone."""
    device = execution.device
    probed = config_hash(flatten(OmegaConf.structured(dataclasses.replace(cfg, seed=0))))  # sizes, not values
    threads = execution.threads if device.type == "cpu" else 0  # a GPU's memory: not the host's threads
    step = " graphed" if execution.graphed else ""
    name = key(device, threads, f"{probed} {device.type}{step}")  # any GPU of the same name
    with machine(exclusive=False):
        entry = CACHE.get(name)
        if entry is None or not cached:
            replayed = dataclasses.asdict(predict(cfg, execution))
            if entry is not None and not math.isclose(entry["total_mb"], replayed["total_mb"], rel_tol=1e-6):
                warn_once(
                    CACHE.path,
                    f"{CACHE.path} held {entry['total_mb']:.1f} MiB for this job, {replayed['total_mb']:.1f} MiB "
                    "predicted now: its entry is replaced",
                )
            entry = CACHE.put(name, replayed)
    return MemoryPrediction(**{field: entry[field] for field in FIELDS})


def predicted_memory_metrics(cfg: Config, execution: Execution) -> Callable[[dict[str, float]], dict[str, float]]:
    """A Trainer's epoch-metrics hook: ``mem/predicted_mb`` and ``mem/predict_ratio`` (measured peak over it)."""
    total = predicted(cfg, execution).total_mb
    return lambda metrics: {"mem/predicted_mb": total, "mem/predict_ratio": metrics["mem/peak_mb"] / total}
