"""Pure pandas over a sweep's runs: which parameters were swept, means over seeds, the Pareto front, paired effects
and whether a switch costs accuracy.

A runs frame has one row per run: its params as strings (columns named like MLflow's, ``amp``,
``model.name``) and its metrics as floats (``test/auc``, ``perf/samples_per_s``, ``mem/peak_mb`` ...).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
from scipy import stats

from src.tracking.identity import NOT_HASHED

SEED = "seed"
THROUGHPUT, MEMORY, AUC = "perf/samples_per_s", "mem/peak_mb", "test/auc"
NO_LOSS, LOSS, INCONCLUSIVE = "no loss", "loss", "inconclusive"
MAX_PAIRS = 10**9  # more_pairs beyond this: the mean sits at -margin (to float rounding), no sweep would settle it
EFFECT_COLUMNS = [
    "param",
    "value",
    "baseline",
    "pairs",
    "speed_ratio",
    "memory_ratio",
    "dauc_mean",
    "dauc_lo",
    "dauc_hi",
    "verdict",
    "more_pairs",
    "margin",
]
DERIVED = {"effective_batch_size": ["batch_size", "accumulate", "world_size"]}  # a param: the params it follows


def determined(frame: pd.DataFrame, column: str, by: list[str]) -> bool:
    """Whether ``column`` has one value for each combination of ``by`` (it adds no information to them)."""
    return bool(by) and bool((frame.groupby(by, dropna=False)[column].nunique(dropna=False) <= 1).all())


def swept_columns(params: pd.DataFrame) -> list[str]:
    """The params whose values differ across runs, in column order.

    Not counted: settings that never change results (``tracking.NOT_HASHED``), the other keys of a config
    group when they follow from its ``<group>.name`` (``data=vesselmnist3d`` also changes ``data.num_classes``),
    and ``effective_batch_size`` when ``batch_size``, ``accumulate`` and ``world_size`` determine it.
    """
    varying = [c for c in params.columns if not c.startswith(NOT_HASHED) and params[c].nunique(dropna=False) > 1]
    kept = [
        c
        for c in varying
        if not (
            c.count(".")
            and f"{c.split('.')[0]}.name" in varying
            and not c.endswith(".name")
            and determined(params, c, [f"{c.split('.')[0]}.name"])
        )
    ]
    return [c for c in kept if not determined(params, c, [k for k in DERIVED.get(c, []) if k in params])]


def natural_key(value: str) -> tuple:
    """Sort key: ``False`` before ``True``, numbers by value, then text (``4 < 8 < 16``, ``resnet10 < resnet18``)."""
    if value in ("False", "True"):
        return (0, value == "True", "")
    try:
        return (1, float(value), "")
    except ValueError:
        return (2, 0.0, [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", value)])


def shown(value: str) -> str:
    """A param value as an override spells it (``True`` -> ``true``)."""
    return value.lower() if value in ("False", "True") else value


def short_name(param: str) -> str:
    """``model.dsconv`` -> ``dsconv``; a group's ``model.name`` -> ``model``."""
    head, _, tail = param.rpartition(".")
    return head if tail == "name" else tail


def aggregate(runs: pd.DataFrame, keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per combination of ``keys``: ``n`` runs and each metric's mean and std (``<metric> std``).

    A NaN in any run (a diverged seed, an AUC undefined on a one-class split) makes its combination's mean and
    std NaN rather than a mean of the other runs that ``n`` would misstate.
    """
    if not keys:
        runs, keys = runs.assign(_all=""), ["_all"]
    grouped = runs.groupby(keys, dropna=False, sort=False)
    table = grouped[metrics].mean(skipna=False).join(grouped[metrics].std(skipna=False).add_suffix(" std"))
    table.insert(0, "n", grouped.size())
    table = table.reset_index().drop(columns="_all", errors="ignore")
    order = sorted(range(len(table)), key=lambda i: [natural_key(str(table.at[i, k])) for k in keys if k != "_all"])
    return table.iloc[order].reset_index(drop=True)


def pareto_front(throughput: np.ndarray, memory: np.ndarray, auc: np.ndarray) -> np.ndarray:
    """Mask of the points no other point dominates: none is at least as fast, as small and as accurate, and
    strictly better in one of the three. A NaN AUC counts as the worst."""
    auc = np.asarray(auc, float)
    better = np.column_stack(
        [np.asarray(throughput, float), -np.asarray(memory, float), np.where(np.isnan(auc), -np.inf, auc)]
    )  # higher is better in each column
    mine, theirs = better[:, None, :], better[None, :, :]
    dominates = (theirs >= mine).all(axis=2) & (theirs > mine).any(axis=2)  # [i, j]: j dominates i
    return ~dominates.any(axis=1)


def pairs(runs: pd.DataFrame, swept: list[str], param: str) -> pd.DataFrame:
    """Runs that differ only in ``param``: each value against the baseline (the first in natural order).

    Columns: ``value``, ``baseline``, ``speed_ratio`` (samples/s) and ``memory_ratio`` (peak memory), value over
    baseline, ``dauc`` (test AUC, value minus baseline), one row per pair.
    """
    values = sorted(runs[param].unique(), key=natural_key)
    others = [c for c in swept if c != param]
    base = runs[runs[param] == values[0]]
    found = []
    for value in values[1:]:
        joined = (
            runs[runs[param] == value].merge(base, on=others, suffixes=("", " base"))
            if others
            else runs[runs[param] == value].merge(base, how="cross", suffixes=("", " base"))
        )
        found.append(
            pd.DataFrame(
                {
                    "value": value,
                    "baseline": values[0],
                    "speed_ratio": joined[THROUGHPUT] / joined[f"{THROUGHPUT} base"],
                    "memory_ratio": joined[MEMORY] / joined[f"{MEMORY} base"],
                    "dauc": joined[AUC] - joined[f"{AUC} base"],
                }
            )
        )
    return pd.concat(found, ignore_index=True)


def paired_effects(runs: pd.DataFrame, swept: list[str]) -> pd.DataFrame:
    """Every swept switch (not ``seed``) with 2+ values: its pairs (:func:`pairs`) with a ``param`` column.

    Seeds pair with their own seed, so a 2-seed sweep gives two pairs per comparison.
    """
    found = [
        pairs(runs, swept, param).assign(param=param) for param in swept if param != SEED and runs[param].nunique() > 1
    ]
    columns = ["param", "value", "baseline", "speed_ratio", "memory_ratio", "dauc"]
    return pd.concat(found, ignore_index=True)[columns] if found else pd.DataFrame(columns=columns)


def summarize_effects(found: pd.DataFrame, margin: float) -> pd.DataFrame:
    """One row per comparison, :data:`EFFECT_COLUMNS`: ``pairs``, geometric means of the ratios and the test-AUC
    difference judged against ``margin`` (:func:`auc_interval`)."""
    rows = [
        {
            "param": param,
            "value": value,
            "baseline": baseline,
            "pairs": len(group),
            "speed_ratio": geometric_mean(group["speed_ratio"]),
            "memory_ratio": geometric_mean(group["memory_ratio"]),
            **auc_interval(group["dauc"], margin),
            "margin": margin,
        }
        for (param, value, baseline), group in found.groupby(["param", "value", "baseline"], sort=False)
    ]
    return pd.DataFrame(rows, columns=EFFECT_COLUMNS).astype({"pairs": int, "more_pairs": "Int64"})


def verdict(lo: float, hi: float, margin: float) -> str:
    """``no loss`` when the whole interval lies above ``-margin``, ``loss`` when it lies below, else
    ``inconclusive`` (NaN bounds included)."""
    return NO_LOSS if lo > -margin else LOSS if hi < -margin else INCONCLUSIVE


def auc_interval(differences: pd.Series, margin: float) -> dict:
    """The mean of paired test-AUC differences with its 95% Student-t interval (NaN bounds from one pair, all NaN
    when a difference is), the :func:`verdict` and, when inconclusive, :func:`more_pairs`."""
    d = differences.to_numpy(float)
    n, mean = len(d), d.mean()
    sd = d.std(ddof=1) if n > 1 else np.nan
    half = stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n)
    found = verdict(mean - half, mean + half, margin)
    return {
        "dauc_mean": mean,
        "dauc_lo": mean - half,
        "dauc_hi": mean + half,
        "verdict": found,
        "more_pairs": more_pairs(n, mean, sd, margin) if found == INCONCLUSIVE else None,
    }


def more_pairs(n: int, mean: float, sd: float, margin: float) -> int | None:
    """Pairs to add to ``n`` for the 95% interval to clear ``-margin`` if mean and sd stay: the smallest N with
    t_{0.975,N-1} * sd / sqrt(N) < |mean + margin|, less n (0: it already does). None when no number can be said:
    one pair (sd unknown), a NaN, or a mean at ``-margin`` (beyond :data:`MAX_PAIRS`: none would do)."""
    gap = abs(mean + margin)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        enough = (stats.t.ppf(0.975, n - 1) * np.float64(sd) / gap) ** 2  # any N above it will do: t falls with N
    if not enough < MAX_PAIRS:
        return None
    few, many = n - 1, max(n, int(enough) + 1)  # bisect: `many` pairs do, `few` are not known to
    while many - few > 1:
        mid = (few + many) // 2
        few, many = (few, mid) if stats.t.ppf(0.975, mid - 1) * sd / np.sqrt(mid) < gap else (mid, many)
    return many - n


def verdict_text(effect) -> str:
    """The verdict of a :func:`summarize_effects` row (``itertuples``); if inconclusive, what would settle it."""
    if effect.verdict != INCONCLUSIVE:
        return effect.verdict
    if not pd.isna(effect.more_pairs):
        return f"{INCONCLUSIVE} (~{effect.more_pairs} more pairs)"
    if effect.pairs < 2:
        return f"{INCONCLUSIVE} (1 pair: spread unknown)"
    if pd.isna(effect.dauc_mean):
        return f"{INCONCLUSIVE} (a test AUC is missing)"
    return f"{INCONCLUSIVE} (mean at -margin: more seeds would not settle it)"


def geometric_mean(ratios: pd.Series) -> float:
    """0 when a ratio is 0 (a peak of 0 MiB), NaN when one is infinite or missing."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.exp(np.log(ratios.to_numpy(float)).mean()))


def comparison(param: str, value: str, baseline: str) -> str:
    """``amp=true vs false``."""
    return f"{short_name(param)}={shown(value)} vs {shown(baseline)}"
