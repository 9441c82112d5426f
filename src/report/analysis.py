"""Pure pandas over a sweep's runs: which parameters were swept, means over seeds, the Pareto front, paired effects
and whether a switch buys speed or memory and whether it costs accuracy.

A runs frame has one row per run: its params as strings (columns named like MLflow's, ``amp``,
``model.name``), its metrics as floats (``test/auc``, ``perf/samples_per_s``, ``mem/peak_mb`` ...) and, where
recorded, whether it was contended and its precision (:data:`CONTENDED`, :data:`DTYPE`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from src.tracking.identity import NOT_HASHED

SEED = "seed"
THROUGHPUT, MEMORY, AUC = "perf/samples_per_s", "mem/peak_mb", "test/auc"
STEPS_TIMED, CONTENDED, DTYPE = "perf/steps_timed", "perf.contended", "amp.dtype"  # a metric, two tags
CONFIG_HASH, STARTED, SET_ASIDE = "config_hash", "start_time", "set_aside"  # a tag, the run's start (ms), a flag
PROVENANCE = ("code_fingerprint", "torch_version", "host")  # tags: runs that differ in one are not like for like
MIN_TIMED_STEPS = 20  # a run that timed fewer steps (a smoke run) is no basis for speed; as the trainer's warning
NO_LOSS, LOSS, INCONCLUSIVE, NO_DIFFERENCE = "no loss", "loss", "inconclusive", "no difference"
CANNOT_JUDGE_SPEED = "cannot judge speed"
NOT_MEASURED = "-"  # the verdict of an effect no pair measured (no run logged samples/s, say)
MAX_PAIRS = 10**9  # more_pairs beyond this: the mean sits at a boundary (to float rounding), no sweep would settle it


@dataclass(frozen=True)
class Effect:
    """What a switch is judged on: the column of its pairs (:func:`pairs`), its columns in :data:`EFFECT_COLUMNS`
    (``margin`` is also its ``ReportConfig`` key) and its verdicts (:func:`verdict`). A ratio is judged on its logs
    and shown as a geometric mean; ``timed`` effects count only the pairs whose runs were timed fairly."""

    pair: str
    mean: str
    lo: str
    hi: str
    verdict: str
    more_pairs: str
    margin: str
    above: str
    below: str
    inside: str
    undefined: str  # why a bound is NaN from 2+ pairs
    label: str
    show: Callable[[float], str]
    ratio: bool = False
    timed: bool = False
    pairs: str = "pairs"

    def edges(self, margin: float) -> tuple[float, float]:
        """The band of ``no difference``: [1/(1 + margin), 1 + margin] for a ratio; the line at -margin for a
        difference (no band: an interval exactly on it stays inconclusive)."""
        return (1 / (1 + margin), 1 + margin) if self.ratio else (-margin, -margin)

    def scale(self, values: np.ndarray) -> np.ndarray:
        """Where the interval is taken: the log of a ratio (0 -> -inf), a difference as it is."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(values) if self.ratio else values

    def unscale(self, value: float) -> float:
        return float(np.exp(value)) if self.ratio else float(value)

    def text(self, value: float) -> str:
        """``×1.39``, ``-40%``, ``+0.004``; ``-`` when undefined."""
        return self.show(value) if np.isfinite(value) else "-"


def ratio_effect(name: str, above: str, below: str, undefined: str, label: str, show, **extra) -> Effect:
    """A switch's effect as a geometric-mean ratio, its columns named ``<name>_ratio``, ``<name>_lo``, ..."""
    return Effect(
        pair=f"{name}_ratio",
        mean=f"{name}_ratio",
        lo=f"{name}_lo",
        hi=f"{name}_hi",
        verdict=f"{name}_verdict",
        more_pairs=f"{name}_more_pairs",
        margin=f"{name}_margin",
        above=above,
        below=below,
        inside=NO_DIFFERENCE,
        undefined=undefined,
        label=label,
        show=show,
        ratio=True,
        **extra,
    )


SPEED_EFFECT = ratio_effect(
    "speed",
    "faster",
    "slower",
    "a samples/s is missing",
    "samples/s",
    lambda r: f"×{r:.2f}",
    timed=True,
    pairs="speed_pairs",
)
MEMORY_EFFECT = ratio_effect(
    "memory",
    "more memory",
    "less memory",
    "a peak memory is missing or 0",
    "peak memory",
    lambda r: f"{(r - 1) * 100:+.0f}%",
)
AUC_EFFECT = Effect(
    pair="dauc",
    mean="dauc_mean",
    lo="dauc_lo",
    hi="dauc_hi",
    verdict="verdict",
    more_pairs="more_pairs",
    margin="margin",
    above=NO_LOSS,
    below=LOSS,
    inside=INCONCLUSIVE,
    undefined="a test AUC is missing",
    label="test AUC",
    show=lambda d: f"{d:+.3f}",
)
EFFECTS = (SPEED_EFFECT, MEMORY_EFFECT, AUC_EFFECT)
LEFT_OUT = {"contended": "contended", "few_steps": "too few timed steps"}  # pair column: why it left speed out
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
    "speed_lo",
    "speed_hi",
    "speed_verdict",
    "speed_more_pairs",
    "speed_pairs",
    "contended_pairs",
    "few_steps_pairs",
    "speed_margin",
    "memory_lo",
    "memory_hi",
    "memory_verdict",
    "memory_more_pairs",
    "memory_margin",
]
DERIVED = {"effective_batch_size": ["batch_size", "accumulate", "world_size"]}  # a param: the params it follows


def implied_by(frame: pd.DataFrame, column: str, by: list[str]) -> bool:
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
            and implied_by(params, c, [f"{c.split('.')[0]}.name"])
        )
    ]
    return [c for c in kept if not implied_by(params, c, [k for k in DERIVED.get(c, []) if k in params])]


def natural_key(value: str) -> tuple:
    """Sort key: ``False`` before ``True``, numbers by value, then text (``4 < 8 < 16``, ``resnet10 < resnet18``)."""
    if value in ("False", "True"):
        return (0, value == "True", "")
    try:
        return (1, float(value), "")
    except ValueError:
        return (2, 0.0, [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", value)])


def as_override(value: str) -> str:
    """A param value as an override spells it (``True`` -> ``true``)."""
    return value.lower() if value in ("False", "True") else value


def short_name(param: str) -> str:
    """``model.dsconv`` -> ``dsconv``; a group's ``model.name`` -> ``model``."""
    head, _, tail = param.rpartition(".")
    return head if tail == "name" else tail


def aggregate(runs: pd.DataFrame, keys: list[str], metrics: list[str]) -> pd.DataFrame:
    """One row per combination of ``keys``: ``n`` runs, each metric's mean and std (``<metric> std``) and, where the
    runs carry them, how many were contended (:data:`CONTENDED`) and the precisions used (:data:`DTYPE`, ``a/b``).

    A NaN in any run (a diverged seed, an AUC undefined on a one-class split) makes its combination's mean and
    std NaN rather than a mean of the other runs that ``n`` would misstate.
    """
    if not keys:
        runs, keys = runs.assign(_all=""), ["_all"]
    grouped = runs.groupby(keys, dropna=False, sort=False)
    table = grouped[metrics].mean(skipna=False).join(grouped[metrics].std(skipna=False).add_suffix(" std"))
    table.insert(0, "n", grouped.size())
    if CONTENDED in runs:
        table[CONTENDED] = grouped[CONTENDED].sum()
    if DTYPE in runs:
        table[DTYPE] = grouped[DTYPE].agg(lambda dtypes: "/".join(sorted(set(dtypes) - {""})))
    table = table.reset_index().drop(columns="_all", errors="ignore")
    order = sorted(range(len(table)), key=lambda i: [natural_key(str(table.at[i, k])) for k in keys if k != "_all"])
    return table.iloc[order].reset_index(drop=True)


def superseded(runs: pd.DataFrame) -> pd.Series:
    """Per run, whether it is set aside: a configuration (its :data:`CONFIG_HASH` tag, seed included; a run without
    one is its own) run again counts once, by its latest FINISHED run (by :data:`STARTED`), so a rerun sweep adds no
    pairs that are not independent."""
    finished = runs[(runs["status"] == "FINISHED") & (runs[CONFIG_HASH] != "")]
    latest = finished.sort_values(STARTED, kind="stable").groupby(CONFIG_HASH).tail(1).index
    return pd.Series(runs.index.isin(finished.index) & ~runs.index.isin(latest), index=runs.index)


def pareto_front(throughput: np.ndarray, memory: np.ndarray, auc: np.ndarray) -> np.ndarray:
    """Mask of the points no other point dominates: none is at least as fast, as small and as accurate, and
    strictly better in one of the three. A missing (NaN) samples/s, peak memory or AUC counts as the worst."""
    better = np.column_stack([np.asarray(throughput, float), -np.asarray(memory, float), np.asarray(auc, float)])
    better[np.isnan(better)] = -np.inf  # higher is better in each column; missing is worst
    mine, theirs = better[:, None, :], better[None, :, :]
    dominates = (theirs >= mine).all(axis=2) & (theirs > mine).any(axis=2)  # [i, j]: j dominates i
    return ~dominates.any(axis=1)


def unfit_for_speed(runs: pd.DataFrame) -> pd.DataFrame:
    """Per run, why its samples/s is no basis for comparison (:data:`LEFT_OUT`): ``contended`` (tagged
    ``perf.contended=true``), ``few_steps`` (fewer than :data:`MIN_TIMED_STEPS` steps timed). A run logged before
    these were recorded is neither."""
    return pd.DataFrame(
        {"contended": runs.get(CONTENDED, False), "few_steps": runs.get(STEPS_TIMED, np.nan) < MIN_TIMED_STEPS},
        index=runs.index,
    )


def pairs(runs: pd.DataFrame, swept: list[str], param: str) -> pd.DataFrame:
    """Runs that differ only in ``param``: each value against the baseline (the first in natural order).

    Columns: ``value``, ``baseline``, ``speed_ratio`` (samples/s) and ``memory_ratio`` (peak memory), value over
    baseline, ``dauc`` (test AUC, value minus baseline), and ``contended``, ``few_steps``: whether either run is
    (:func:`unfit_for_speed`); one row per pair.
    """
    runs = runs.join(unfit_for_speed(runs))
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
                    **{flag: joined[flag] | joined[f"{flag} base"] for flag in LEFT_OUT},
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
    columns = ["param", "value", "baseline", "speed_ratio", "memory_ratio", "dauc", *LEFT_OUT]
    return pd.concat(found, ignore_index=True)[columns] if found else pd.DataFrame(columns=columns)


def summarize_effects(found: pd.DataFrame, margins: Mapping[str, float]) -> pd.DataFrame:
    """One row per comparison, :data:`EFFECT_COLUMNS`: ``pairs``, the pairs left out of speed (``contended_pairs``,
    ``few_steps_pairs``; one pair may count in both) and each of :data:`EFFECTS` judged against its margin
    (:func:`judge`; ``margins`` by :attr:`Effect.margin`: ``margin``, ``speed_margin``, ``memory_margin``)."""
    rows = [
        {
            "param": param,
            "value": value,
            "baseline": baseline,
            "pairs": len(group),
            **{f"{flag}_pairs": int(group[flag].sum()) for flag in LEFT_OUT},
            **{key: v for effect in EFFECTS for key, v in judge(group, effect, margins[effect.margin]).items()},
            **{effect.margin: margins[effect.margin] for effect in EFFECTS},
        }
        for (param, value, baseline), group in found.groupby(["param", "value", "baseline"], sort=False)
    ]
    counts = {"pairs": int, "speed_pairs": int, "contended_pairs": int, "few_steps_pairs": int}
    return pd.DataFrame(rows, columns=EFFECT_COLUMNS).astype(
        {**counts, **{effect.more_pairs: "Int64" for effect in EFFECTS}}
    )


def judge(group: pd.DataFrame, effect: Effect, margin: float) -> dict:
    """``effect`` over a comparison's pairs, counted in :attr:`Effect.pairs`: :func:`interval`; a timed one (speed)
    only over the pairs whose runs are fit to time (:func:`unfit_for_speed`), ``cannot judge speed`` when none is;
    ``-`` (:data:`NOT_MEASURED`) when no pair has a value (no run logged samples/s, say)."""
    kept = group[~group[list(LEFT_OUT)].any(axis=1)] if effect.timed else group
    if kept.empty:
        return {effect.pairs: 0, effect.verdict: CANNOT_JUDGE_SPEED}
    if kept[effect.pair].isna().all():
        return {effect.pairs: len(kept), effect.verdict: NOT_MEASURED}
    return {effect.pairs: len(kept), **interval(kept[effect.pair], effect, margin)}


def verdict(lo: float, hi: float, effect: Effect, margin: float) -> str:
    """Where the interval [lo, hi] lies against :meth:`Effect.edges`: wholly above the band (``effect.above``:
    ``faster``, ``no loss``), below it (``effect.below``), inside it (``effect.inside``: ``no difference``), else
    ``inconclusive`` (NaN bounds included)."""
    low, high = effect.edges(margin)
    if lo > high:
        return effect.above
    if hi < low:
        return effect.below
    return effect.inside if low <= lo and hi <= high else INCONCLUSIVE


def interval(values: pd.Series, effect: Effect, margin: float) -> dict:
    """The mean of paired values (geometric for ratios) with its 95% Student-t interval (taken on the log ratios;
    NaN bounds from one pair, all NaN when a value is), the :func:`verdict` and, when inconclusive,
    :func:`more_pairs` to clear the nearest edge of the band."""
    x = effect.scale(values.to_numpy(float))
    n = len(x)
    with np.errstate(invalid="ignore"):  # inf - inf: a ratio with a 0 peak
        mean, sd = x.mean(), x.std(ddof=1) if n > 1 else np.nan
        half = stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n)
        gap = np.abs(mean - effect.scale(np.array(effect.edges(margin)))).min()
    lo, hi = effect.unscale(mean - half), effect.unscale(mean + half)
    found = verdict(lo, hi, effect, margin)
    return {
        effect.mean: effect.unscale(mean),
        effect.lo: lo,
        effect.hi: hi,
        effect.verdict: found,
        effect.more_pairs: more_pairs(n, sd, gap) if found == INCONCLUSIVE else None,
    }


def more_pairs(n: int, sd: float, gap: float) -> int | None:
    """Pairs to add to ``n`` for the 95% interval to clear an edge ``gap`` from the mean if mean and sd stay: the
    smallest N with t_{0.975,N-1} * sd / sqrt(N) < gap, less n (0: it already does). None when no number can be
    said: one pair (sd unknown), a NaN, or a mean on the edge (beyond :data:`MAX_PAIRS`: none would do)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        enough = (stats.t.ppf(0.975, n - 1) * np.float64(sd) / gap) ** 2  # any N above it will do: t falls with N
    if not enough < MAX_PAIRS:
        return None
    few, many = n - 1, max(n, int(enough) + 1)  # bisect: `many` pairs do, `few` are not known to
    while many - few > 1:
        mid = (few + many) // 2
        few, many = (few, mid) if stats.t.ppf(0.975, mid - 1) * sd / np.sqrt(mid) < gap else (mid, many)
    return many - n


def left_out(effect_row) -> str:
    """The pairs a :func:`summarize_effects` row (``itertuples``) left out of speed, and why: ``2 contended``."""
    return ", ".join(f"{n} {why}" for flag, why in LEFT_OUT.items() if (n := getattr(effect_row, f"{flag}_pairs")))


def verdict_text(effect_row, effect: Effect) -> str:
    """``effect``'s verdict in a :func:`summarize_effects` row (``itertuples``); why speed cannot be judged, or if
    inconclusive, what would settle it."""
    found = getattr(effect_row, effect.verdict)
    if found == CANNOT_JUDGE_SPEED:
        return f"{found} ({left_out(effect_row)})"
    if found != INCONCLUSIVE:
        return found
    more = getattr(effect_row, effect.more_pairs)
    if not pd.isna(more):
        return f"{INCONCLUSIVE} (~{more} more pairs)"
    if getattr(effect_row, effect.pairs) < 2:
        return f"{INCONCLUSIVE} (1 pair: spread unknown)"
    if pd.isna(getattr(effect_row, effect.lo)):
        return f"{INCONCLUSIVE} ({effect.undefined})"
    return f"{INCONCLUSIVE} (mean on the margin: more seeds would not settle it)"


def comparison(param: str, value: str, baseline: str) -> str:
    """``amp=true vs false``."""
    return f"{short_name(param)}={as_override(value)} vs {as_override(baseline)}"
