"""Pure pandas over a sweep's runs: which parameters were swept, means over seeds, the Pareto front, paired effects.

A runs frame has one row per run: its params as strings (columns named like MLflow's, ``amp``,
``model.name``) and its metrics as floats (``test/auc``, ``perf/samples_per_s``, ``mem/peak_mb`` ...).
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from src.tracking import NOT_HASHED

SEED = "seed"
THROUGHPUT, MEMORY, AUC = "perf/samples_per_s", "mem/peak_mb", "test/auc"
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
    kept = [c for c in varying
            if not (c.count(".") and f"{c.split('.')[0]}.name" in varying and not c.endswith(".name")
                    and determined(params, c, [f"{c.split('.')[0]}.name"]))]
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


def pareto_front(throughput: np.ndarray, memory: np.ndarray) -> np.ndarray:
    """Mask of the points no other point beats: none is as fast or faster with as little memory or less,
    and strictly better in one of the two."""
    t, m = np.asarray(throughput, float)[:, None], np.asarray(memory, float)[:, None]
    dominates = (t.T >= t) & (m.T <= m) & ((t.T > t) | (m.T < m))  # [i, j]: j dominates i
    return ~dominates.any(axis=1)


def pairs(runs: pd.DataFrame, swept: list[str], param: str) -> pd.DataFrame:
    """Runs that differ only in ``param``: each value against the baseline (the first in natural order).

    Columns: ``value``, ``baseline``, ``throughput_ratio`` and ``memory_ratio`` (value over baseline),
    ``auc_diff`` (value minus baseline), one row per pair.
    """
    values = sorted(runs[param].unique(), key=natural_key)
    others = [c for c in swept if c != param]
    base = runs[runs[param] == values[0]]
    found = []
    for value in values[1:]:
        joined = (runs[runs[param] == value].merge(base, on=others, suffixes=("", " base")) if others
                  else runs[runs[param] == value].merge(base, how="cross", suffixes=("", " base")))
        found.append(pd.DataFrame({
            "value": value, "baseline": values[0],
            "throughput_ratio": joined[THROUGHPUT] / joined[f"{THROUGHPUT} base"],
            "memory_ratio": joined[MEMORY] / joined[f"{MEMORY} base"],
            "auc_diff": joined[AUC] - joined[f"{AUC} base"]}))
    return pd.concat(found, ignore_index=True)


def paired_effects(runs: pd.DataFrame, swept: list[str]) -> pd.DataFrame:
    """Every swept switch (not ``seed``) with 2+ values: its pairs (:func:`pairs`) with a ``param`` column.

    Seeds pair with their own seed, so a 2-seed sweep gives two pairs per comparison.
    """
    found = [pairs(runs, swept, param).assign(param=param) for param in swept
             if param != SEED and runs[param].nunique() > 1]
    columns = ["param", "value", "baseline", "throughput_ratio", "memory_ratio", "auc_diff"]
    return pd.concat(found, ignore_index=True)[columns] if found else pd.DataFrame(columns=columns)


def summarize_effects(found: pd.DataFrame) -> pd.DataFrame:
    """One row per comparison: ``pairs``, geometric means of the ratios, mean AUC difference."""
    if found.empty:
        return found.assign(pairs=pd.Series(dtype=int))
    grouped = found.groupby(["param", "value", "baseline"], sort=False)
    table = grouped.agg(pairs=("auc_diff", "size"), throughput_ratio=("throughput_ratio", geometric_mean),
                        memory_ratio=("memory_ratio", geometric_mean), auc_diff=("auc_diff", "mean"))
    return table.reset_index()


def geometric_mean(ratios: pd.Series) -> float:
    """0 when a ratio is 0 (a peak of 0 MiB), NaN when one is infinite or missing."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.exp(np.log(ratios.to_numpy(float)).mean()))


def comparison(param: str, value: str, baseline: str) -> str:
    """``amp=true vs false``."""
    return f"{short_name(param)}={shown(value)} vs {shown(baseline)}"
