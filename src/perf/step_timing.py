"""Seconds per optimizer step of a job's shape, timed once on this machine and kept in ``step_times.json`` beside
the peak-FLOP/s cache (:mod:`src.perf.probe_cache`), so later dry runs, in any process, list the same figure.
A timing stops once its 95% interval is tight enough, and records whether other processes made the machine busy.
Key, stopping rule, expiry: docs/sweeps.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import statistics
import time
from collections.abc import Callable

import psutil
import torch

from src.caches import boolean, integer, number, strings
from src.perf.probe_cache import Entry, ProbeCache, age, key, machine
from src.training.meters import CONTENDED_CORES, busy_cpu_seconds, tree_cpu_seconds

WARMUP = 1  # untimed steps first: allocations, oneDNN primitives, optimizer state
TARGET = 0.10  # stop once the 95% interval of the mean step time is within ±10% ...
MIN_STEPS = 3  # ... of at least this many timed steps (an interval from two is ~6x their difference wide)
MAX_STEPS = 30  # ... or at this many
MAX_SECONDS = 2.5  # ... or once two or more timed steps took this long
MAX_AGE = datetime.timedelta(days=7)
BUSY_MAX_AGE = datetime.timedelta(hours=1)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Mean ``seconds`` per optimizer step over ``steps`` timed ones; ``spread``: the half-width of the 95% interval
    of the mean, relative to it; ``others_cpu``: the cores' worth of CPU other processes used meanwhile, ``busy``
    whether that contended with the timing."""

    seconds: float
    spread: float
    steps: int
    others_cpu: float
    busy: bool


def spread(times: list[float]) -> float:
    """Half-width of the 95% Student-t interval of the mean of ``times`` (two or more), relative to the mean."""
    from scipy import stats

    n = len(times)
    return stats.t.ppf(0.975, n - 1) * statistics.stdev(times) / math.sqrt(n) / statistics.mean(times)


def timing_done(times: list[float]) -> bool:
    """Whether ``times`` (seconds of the steps timed so far) end the timing."""
    n = len(times)
    return (n >= 2 and sum(times) >= MAX_SECONDS) or (n >= MIN_STEPS and (n >= MAX_STEPS or spread(times) <= TARGET))


def measure(step: Callable[[], float], threads: int) -> StepTime:
    """Time ``step`` (one optimizer step on ``threads`` CPU threads, returning its seconds) after :data:`WARMUP`
    untimed ones."""
    for _ in range(WARMUP):
        step()
    machine_start, own_start, start = busy_cpu_seconds(), tree_cpu_seconds(psutil.Process()), time.perf_counter()
    times: list[float] = []
    while not timing_done(times):
        times.append(step())
    elapsed = time.perf_counter() - start
    others = max(0.0, (busy_cpu_seconds() - machine_start) - (tree_cpu_seconds(psutil.Process()) - own_start)) / elapsed
    busy = others >= max(0, psutil.cpu_count() - threads) + CONTENDED_CORES
    return StepTime(statistics.mean(times), spread(times), len(times), others, busy)


def fresh(entry: Entry) -> bool:
    return age(entry) <= (BUSY_MAX_AGE if entry["busy"] else MAX_AGE)


DAY = 24 * 3600.0
SCHEMA = {  # a step timed, as measure() takes it: a timing of one step over a day is no timing
    "seconds": number(0, DAY, above=True),
    "spread": number(0),
    "steps": integer(2, MAX_STEPS),
    "others_cpu": number(0),
    "busy": boolean,
    "shape": strings,
}
FIELDS = tuple(field.name for field in dataclasses.fields(StepTime))
CACHE = ProbeCache("step_times.json", fresh, SCHEMA)


def step_time(
    shape: dict[str, str], device: torch.device, threads: int, prepare: Callable[[], Callable[[], float]]
) -> StepTime:
    """The cached timing of ``shape``, else one taken now of the step ``prepare()`` returns (built only then), with
    the machine held: a process that waited for another's timing of the same shape reads it."""
    name = key(device, threads, json.dumps(shape, sort_keys=True))
    with machine(exclusive=True):
        entry = CACHE.get(name) or CACHE.put(name, {**dataclasses.asdict(measure(prepare(), threads)), "shape": shape})
    return StepTime(**{field: entry[field] for field in FIELDS})
