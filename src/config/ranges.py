"""The limits of the schema's keys, and the checks that refuse a value outside them.

Each check raises a ``ValueError`` naming the key, the value and what it must be (NaN and inf included);
``python -m src.<command>`` prints it as one ``error:`` line before it starts.
"""

from __future__ import annotations

import math
from dataclasses import fields
from enum import Enum
from typing import Any

SEED_MAX = 2**32 - 1  # NumPy's seed range is [0, 2**32 - 1]
THREADS_MAX = 1024  # CPU threads of a process: past any one machine's cores; libgomp fails far above
COUNT_MAX = 2**31 - 1  # counts (epochs, batches, steps): what torch's int32 sizes and indices hold
CHANNELS_MAX = 1024  # input channels of a volume: past any modality stack
CLASSES_MAX = 100_000  # a classifier's outputs: past any label set
WORKERS_MAX = 64  # DataLoader worker processes of a rank
NIFTI_SPACING_MAX = 100.0  # mm: the largest data.spacing (a 16^3 cube of it spans a whole body)
EXPERIMENT_NAME_MAX, TAG_KEY_MAX = 500, 250  # MLflow's limits (mlflow.utils.validation), checked before it loads
PARAM_VALUE_MAX = 6000  # ... and a param value's: MLflow cut a longer one, so the run's params were not its config
MODEL_NAME_BANNED = ("/", ":")  # in a registered model's name, as mlflow.utils.validation (. and ..*: ReportConfig)
SAMPLE_INTERVAL_MIN_S = 1.0  # MLflow's system metrics: shorter intervals slowed training (docs/benchmarks.md)
SAMPLE_INTERVAL_MAX_S = 86_400.0  # a sample a day; past threading.TIMEOUT_MAX MLflow's sampling thread failed


def bounds_text(low: float, high: float = math.inf, ends: str = "[)", null: bool = False) -> str:
    """What a value within ``low``..``high`` must be, as :func:`within`'s message and the key reference say it:
    ``in [1, 1024]``, ``>= 0``, ``> 0 or null``."""
    shown = f"in {ends[0]}{low}, {high}{ends[1]}" if high < math.inf else f"{'>=' if ends[0] == '[' else '>'} {low}"
    return f"{shown}{' or null' if null else ''}"


def within(
    key: str, value: Any, low: float, high: float = math.inf, ends: str = "[)", null: bool = False, fix: str = ""
) -> None:
    """Refuse ``value`` outside ``low``..``high`` (``ends``: ``[``/``]`` closed, ``(``/``)`` open), NaN and inf
    included; ``null``: None passes."""
    if value is None and null:
        return
    above = value >= low if ends[0] == "[" else value > low
    below = value <= high if ends[1] == "]" else value < high
    finite = not isinstance(value, float) or math.isfinite(value)  # an int of any size is finite
    if not (finite and above and below):
        raise ValueError(f"{key}={value} must be {bounds_text(low, high, ends, null)}{fix}")


def within_each(key: str, values: list, *bounds: Any, count: int | None = None, what: str = "", **options: Any) -> None:
    """``values``: exactly ``count`` of them (``what`` they are) if set, each :func:`within` ``bounds``."""
    if count is not None and len(values) != count:
        raise ValueError(f"{key}={values} must be {count} values: {what}")
    for i, value in enumerate(values):
        within(f"{key}[{i}]", value, *bounds, **options)


def check_unread(section: str, config: Any, unread: dict[str, tuple[str, str]]) -> None:
    """Refuse a key of ``config`` set off its default that the options chosen do not read (``unread``: key -> the
    setting that ignores it, what reads it): it would train as the default does, under another config hash."""
    defaults = {f.name: f.default_factory() if callable(f.default_factory) else f.default for f in fields(config)}
    for key, (setting, reader) in unread.items():
        if (value := getattr(config, key)) != defaults[key]:
            shown = value.name if isinstance(value, Enum) else value
            raise ValueError(f"{section}.{key}={shown}: {setting} ignores it (only {reader} reads it): drop it")


def not_longer(key: str, value: str | None, limit: int, whose: str) -> None:
    """Refuse a string of more than ``limit`` characters (``whose`` limit it is)."""
    if value is not None and len(value) > limit:
        raise ValueError(f"{key} is {len(value)} characters long: at most {limit} ({whose})")


def filled(key: str, value: str | None, null: bool = False) -> None:
    """Refuse an empty or blank string (None passes when ``null``)."""
    if not (value is None and null) and not (value or "").strip():
        raise ValueError(f"{key}={value!r} must be a non-blank string{' or null' if null else ''}")
