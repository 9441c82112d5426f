"""``python -m src.report``: the pure sweep analysis on hand-made frames, the report of hand-logged runs in a
real MLflow store, bad selectors, and a real sweep reported end to end in real processes."""

from __future__ import annotations

import csv
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import mlflow
import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from mlflow.entities import Metric, Param, RunTag
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import OmegaConf
from scipy import stats

from src.errors import UsageError
from src.report.analysis import (
    AUC_EFFECT,
    CONFIG_HASH,
    CONTENDED,
    DTYPE,
    EFFECT_COLUMNS,
    MEMORY_EFFECT,
    MIN_TIMED_STEPS,
    PROVENANCE,
    SPEED_EFFECT,
    STARTED,
    STEPS_TIMED,
    aggregate,
    interval,
    more_pairs,
    natural_key,
    paired_effects,
    pareto_front,
    summarize_effects,
    swept_columns,
    verdict,
    verdict_text,
)
from src.report.runs import METRICS, Selection, report_store
from src.report.writer import report, write_report
from src.tracking.store import DEFAULT_TRACKING_URI, ensure_store
from src.tracking.sweep import PARENT_ID_FILE, SKIPPED_TAG
from src.training.meters import MIN_TIMED_STEPS as TRAINER_MIN_TIMED_STEPS
from tests.helpers import ROOT, run_cli, runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPORT_FILES = {"report.md", "report.html", "runs.csv", "effects.csv", "throughput_memory.png", "paired_effects.png"}
MARGINS = {"margin": 0.01, "speed_margin": 0.05, "memory_margin": 0.05}  # the defaults


def report_config(*overrides: str):
    """The real composition of ``conf/report.yaml``, typed."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose("report", overrides=list(overrides)))


def tables(markdown: str) -> dict[str, list[dict[str, str]]]:
    """Each ``## section``'s Markdown table as rows of ``{header: cell}``."""
    found = {}
    for section in markdown.split("\n## ")[1:]:
        lines = [line for line in section.splitlines() if line.startswith("| ")]
        if lines:
            header, *rows = ([cell.strip() for cell in line[2:-2].split(" | ")] for line in lines)
            found[section.splitlines()[0]] = [dict(zip(header, row, strict=True)) for row in rows[1:]]
    return found


# --- pure functions on hand-made frames -------------------------------------------------------------------


def test_swept_columns_are_the_params_that_differ_less_derived_and_bookkeeping_ones():
    params = pd.DataFrame(
        {
            "amp": ["True", "False", "True", "False"],
            "seed": ["0", "0", "1", "1"],
            "batch_size": ["4", "4", "4", "4"],  # not swept
            "data.name": ["vesselmnist3d", "vesselmnist3d", "organmnist3d", "organmnist3d"],
            "data.num_classes": ["2", "2", "11", "11"],  # follows data=...: not a column of its own
            "model.name": ["resnet10", "resnet10", "resnet18", "resnet18"],
            "model.stem": ["small", "standard", "small", "standard"],  # swept on its own: kept
            "mlflow.tracking_uri": ["a", "b", "c", "d"],  # where it logged, not what it ran
            "effective_batch_size": ["4", "4", "4", "8"],  # batch_size=auto with effective_batch_size=4,8: kept
        }
    )
    assert swept_columns(params) == ["amp", "seed", "data.name", "model.name", "model.stem", "effective_batch_size"]
    params["batch_size"] = params["effective_batch_size"] = ["4", "4", "8", "8"]  # follows batch_size: dropped
    assert swept_columns(params) == ["amp", "seed", "batch_size", "data.name", "model.name", "model.stem"]


def test_natural_order_puts_false_first_and_numbers_by_value():
    assert sorted(["True", "False"], key=natural_key) == ["False", "True"]
    assert sorted(["16", "4", "8"], key=natural_key) == ["4", "8", "16"]
    assert sorted(["resnet18", "resnet101", "resnet10"], key=natural_key) == ["resnet10", "resnet18", "resnet101"]


def test_pareto_front_keeps_the_points_nothing_beats_on_speed_and_memory_at_equal_accuracy():
    throughput = np.array([10.0, 20.0, 15.0, 20.0, 5.0, 30.0])
    memory = np.array([100.0, 100.0, 50.0, 300.0, 40.0, 400.0])
    # 0 is beaten by 1 (faster, same memory); 3 by 1 (as fast, less memory)
    assert pareto_front(throughput, memory, np.full(6, 0.8)).tolist() == [False, True, True, False, True, True]
    assert pareto_front([1.0, 1.0], [2.0, 2.0], [0.8, 0.8]).tolist() == [True, True]  # ties both stay


def test_pareto_front_counts_accuracy():
    # 0 is faster and smaller, 1 more accurate: neither dominates the other
    assert pareto_front([20.0, 10.0], [50.0, 100.0], [0.80, 0.90]).tolist() == [True, True]
    assert pareto_front([20.0, 10.0], [50.0, 100.0], [0.90, 0.80]).tolist() == [True, False]
    # a missing AUC is the worst: as fast and as small but unmeasured loses to the measured one
    assert pareto_front([20.0, 20.0], [50.0, 50.0], [np.nan, 0.5]).tolist() == [False, True]


def runs_frame() -> pd.DataFrame:
    """amp x batch_size x seed, one run (amp=True batch 8 seed 1) missing; amp doubles throughput,
    takes 40% less memory and adds 0.01 AUC."""
    rows = []
    for amp in ("False", "True"):
        for batch in ("4", "8"):
            for seed in ("0", "1"):
                if (amp, batch, seed) != ("True", "8", "1"):
                    speed = (2.0 if amp == "True" else 1.0) * int(batch) * (1 + int(seed))
                    rows.append(
                        {
                            "amp": amp,
                            "batch_size": batch,
                            "seed": seed,
                            "perf/samples_per_s": speed,
                            "mem/peak_mb": (60.0 if amp == "True" else 100.0) * int(batch),
                            "test/auc": 0.8 + (0.01 if amp == "True" else 0.0) + 0.05 * int(seed),
                        }
                    )
    return pd.DataFrame(rows)


def test_pairs_join_runs_equal_in_every_other_swept_param():
    found = paired_effects(runs_frame(), ["amp", "batch_size", "seed"])
    amp = found[found["param"] == "amp"]
    assert len(amp) == 3  # (4, 0), (4, 1), (8, 0): amp=True batch 8 seed 1 has no partner
    assert set(amp["value"]) == {"True"} and set(amp["baseline"]) == {"False"}
    assert np.allclose(amp["speed_ratio"], 2.0) and np.allclose(amp["memory_ratio"], 0.6)
    assert np.allclose(amp["dauc"], 0.01)
    batch = found[found["param"] == "batch_size"]
    assert len(batch) == 3 and set(batch["value"]) == {"8"} and np.allclose(batch["speed_ratio"], 2.0)
    assert "seed" not in set(found["param"])  # seeds are aggregated, not compared
    summary = summarize_effects(found, MARGINS).set_index("param")
    assert summary.loc["amp", "pairs"] == 3
    assert summary.loc["amp", "speed_ratio"] == pytest.approx(2.0)
    assert summary.loc["amp", "memory_ratio"] == pytest.approx(0.6)


# test AUC of model.activation=<value> minus gelu (the baseline) for seeds 0-3: clearly above, clearly below and
# straddling -0.01
DIFFERENCES = {
    "mish": [0.002, 0.004, 0.003, 0.003],
    "prelu": [-0.05, -0.06, -0.055, -0.055],
    "relu": [0.0, -0.01, 0.0, -0.01],
}


def activation_runs() -> pd.DataFrame:
    """model.activation x seed=0..3 (a run frame as the report reads one), test AUCs differing by DIFFERENCES."""
    rows = [
        {
            "model.activation": value,
            "seed": str(seed),
            "test/auc": 0.8 + 0.01 * seed + difference,
            "perf/samples_per_s": 100.0 - 10 * i,
            "mem/peak_mb": 500.0 + 100 * i,
        }
        for seed in range(4)
        for i, (value, difference) in enumerate([("gelu", 0.0), *((v, d[seed]) for v, d in DIFFERENCES.items())])
    ]
    return pd.DataFrame(rows)


def test_a_switch_is_judged_no_loss_loss_or_inconclusive_against_the_margin():
    summary = summarize_effects(paired_effects(activation_runs(), ["model.activation", "seed"]), MARGINS)
    assert summary[["value", "baseline", "pairs"]].values.tolist() == [
        ["mish", "gelu", 4],
        ["prelu", "gelu", 4],
        ["relu", "gelu", 4],
    ]
    assert summary["verdict"].tolist() == ["no loss", "loss", "inconclusive"]
    for value, differences in DIFFERENCES.items():
        row = summary.set_index("value").loc[value]
        lo, hi = stats.t.interval(0.95, len(differences) - 1, loc=np.mean(differences), scale=stats.sem(differences))
        assert (row["dauc_mean"], row["dauc_lo"], row["dauc_hi"]) == pytest.approx((np.mean(differences), lo, hi))
    # relu: mean -0.005, sd 0.01 / sqrt(3) = 0.00577, so |mean + margin| / sd = 0.866; the interval clears -0.01
    # once t_{.975,N-1} / sqrt(N) < 0.866: N = 7 gives 2.447 / 2.646 = 0.925, N = 8 gives 2.365 / 2.828 = 0.836
    assert summary["more_pairs"].tolist() == [pd.NA, pd.NA, 8 - 4]


def test_the_verdict_needs_the_whole_interval_on_one_side_of_minus_margin():
    assert verdict(-0.009, 0.02, AUC_EFFECT, 0.01) == "no loss"
    assert verdict(-0.05, -0.011, AUC_EFFECT, 0.01) == "loss"
    assert verdict(-0.011, 0.02, AUC_EFFECT, 0.01) == verdict(-0.02, -0.01, AUC_EFFECT, 0.01) == "inconclusive"
    assert verdict(-0.01, -0.01, AUC_EFFECT, 0.01) == "inconclusive"  # on the line: AUC has no band
    assert verdict(np.nan, np.nan, AUC_EFFECT, 0.01) == "inconclusive"


def test_one_pair_or_a_mean_at_minus_margin_gives_no_count_of_more_pairs():
    one = interval(pd.Series([0.004]), AUC_EFFECT, 0.01)
    assert one["verdict"] == "inconclusive" and np.isnan(one["dauc_lo"]) and one["more_pairs"] is None
    assert interval(pd.Series([-0.02, 0.0]), AUC_EFFECT, 0.01)["more_pairs"] is None  # mean -0.01: no number of pairs
    assert more_pairs(4, 0.0, 0.01) == 0  # no spread: settled already


# samples/s and peak memory of model.block=<value> over v0 (the baseline) for seeds 0-3: clearly above the 5% band,
# clearly below it, inside it, straddling its upper edge (mean inside) and its lower edge (mean below)
RATIOS = {
    "v1": [1.50, 1.55, 1.45, 1.52],
    "v2": [0.60, 0.62, 0.58, 0.61],
    "v3": [1.00, 1.01, 0.99, 1.005],
    "v4": [1.00, 1.06, 1.02, 1.08],
    "v5": [0.90, 0.96, 0.92, 0.98],
}


def block_runs(**columns) -> pd.DataFrame:
    """model.block x seed=0..3 with samples/s, peak memory (and test AUC, 0.1 per unit) over v0 as RATIOS;
    ``columns``: the same value in every run."""
    rows = [
        {
            "model.block": value,
            "seed": str(seed),
            "perf/samples_per_s": 100 * ratio,
            "mem/peak_mb": 1000 * ratio,
            "test/auc": 0.8 + 0.1 * (ratio - 1),
            **columns,
        }
        for value, ratios in {"v0": [1.0] * 4, **RATIOS}.items()
        for seed, ratio in enumerate(ratios)
    ]
    return pd.DataFrame(rows)


def pairs_to_settle(logs: np.ndarray, edge: float) -> int:
    """By counting up: the fewest pairs whose 95% interval, at this mean and spread, leaves the band [-edge, edge]'s
    nearer edge."""
    gap = min(abs(logs.mean() - edge), abs(logs.mean() + edge))
    return next(n for n in itertools.count(2) if stats.t.ppf(0.975, n - 1) * logs.std(ddof=1) / np.sqrt(n) < gap)


def test_speed_and_memory_are_judged_on_their_log_ratios_against_their_margins():
    summary = summarize_effects(paired_effects(block_runs(), ["model.block", "seed"]), MARGINS).set_index("value")
    assert summary["speed_verdict"].tolist() == ["faster", "slower", "no difference", "inconclusive", "inconclusive"]
    assert summary["memory_verdict"].tolist() == [
        "more memory",
        "less memory",
        "no difference",
        "inconclusive",
        "inconclusive",
    ]
    assert (summary["speed_pairs"] == 4).all()  # runs logged before steps were counted or runs tagged: all kept
    for value, ratios in RATIOS.items():
        logs = np.log(ratios)
        lo, hi = np.exp(stats.t.interval(0.95, len(logs) - 1, loc=logs.mean(), scale=stats.sem(logs)))
        for name in ("speed", "memory"):
            row = summary.loc[value]
            assert (row[f"{name}_ratio"], row[f"{name}_lo"], row[f"{name}_hi"]) == pytest.approx(
                (np.exp(logs.mean()), lo, hi)
            )
    for value in ("v4", "v5"):  # v4 settles once inside the band (its upper edge), v5 once below it
        more = pairs_to_settle(np.log(RATIOS[value]), np.log(1.05)) - 4
        assert summary.loc[value, "speed_more_pairs"] == summary.loc[value, "memory_more_pairs"] == more > 0
    effect = next(summary.reset_index().itertuples())
    assert verdict_text(effect, SPEED_EFFECT) == "faster" and verdict_text(effect, MEMORY_EFFECT) == "more memory"
    more = summary.loc["v4", "speed_more_pairs"]
    assert (
        verdict_text(list(summary.reset_index().itertuples())[3], SPEED_EFFECT) == f"inconclusive (~{more} more pairs)"
    )


def test_a_ratio_verdict_needs_the_whole_interval_beyond_or_within_the_band():
    assert verdict(1.051, 1.3, SPEED_EFFECT, 0.05) == "faster"
    assert verdict(0.5, 0.95, SPEED_EFFECT, 0.05) == "slower"  # below 1 / 1.05 = 0.952
    assert verdict(1 / 1.05, 1.05, SPEED_EFFECT, 0.05) == "no difference"  # the band's edges belong to it
    assert verdict(1.04, 1.06, SPEED_EFFECT, 0.05) == verdict(0.9, 1.2, SPEED_EFFECT, 0.05) == "inconclusive"
    assert verdict(1.06, 1.3, SPEED_EFFECT, 0.1) == "inconclusive"  # a wider margin: 1.06 is inside its band
    assert verdict(np.nan, np.nan, SPEED_EFFECT, 0.05) == "inconclusive"
    assert verdict(1.2, 1.3, MEMORY_EFFECT, 0.05) == "more memory"
    assert verdict(0.5, 0.6, MEMORY_EFFECT, 0.05) == "less memory"


def test_contended_and_short_runs_leave_the_speed_pairs_but_not_memory_or_auc():
    runs = block_runs(**{STEPS_TIMED: 100.0, CONTENDED: False})
    runs = runs[runs["model.block"].isin(["v0", "v1"])].reset_index(drop=True)
    v1, v0 = runs["model.block"] == "v1", runs["model.block"] == "v0"
    runs.loc[v1 & (runs["seed"] == "0"), CONTENDED] = True
    runs.loc[v0 & (runs["seed"] == "1"), STEPS_TIMED] = MIN_TIMED_STEPS - 1
    runs.loc[v0 & (runs["seed"] == "2"), STEPS_TIMED] = MIN_TIMED_STEPS  # enough
    effect = summarize_effects(paired_effects(runs, ["model.block", "seed"]), MARGINS).iloc[0]
    assert effect[["pairs", "speed_pairs", "contended_pairs", "few_steps_pairs"]].tolist() == [4, 2, 1, 1]
    kept, every = np.log(RATIOS["v1"][2:]), np.log(RATIOS["v1"])
    lo, hi = np.exp(stats.t.interval(0.95, 1, loc=kept.mean(), scale=stats.sem(kept)))
    assert (effect["speed_ratio"], effect["speed_lo"], effect["speed_hi"]) == pytest.approx(
        (np.exp(kept.mean()), lo, hi)
    )
    assert effect["memory_ratio"] == pytest.approx(np.exp(every.mean()))
    assert effect["dauc_mean"] == pytest.approx(0.1 * (np.mean(RATIOS["v1"]) - 1))


def test_a_comparison_whose_pairs_all_left_speed_cannot_judge_it():
    runs = block_runs(**{STEPS_TIMED: 4.0}).assign(**{CONTENDED: lambda f: f["seed"] == "0"})  # smoke runs
    summary = summarize_effects(paired_effects(runs, ["model.block", "seed"]), MARGINS)
    assert set(summary["speed_verdict"]) == {"cannot judge speed"} and (summary["speed_pairs"] == 0).all()
    assert summary[["speed_ratio", "speed_lo", "speed_hi", "speed_more_pairs"]].isna().all().all()
    assert summary["memory_verdict"].iloc[0] == "more memory"  # memory and AUC keep every pair
    effect = next(summary.itertuples())
    assert verdict_text(effect, SPEED_EFFECT) == "cannot judge speed (1 contended, 4 too few timed steps)"


def test_a_report_of_runs_none_fit_to_time_says_so_once_at_the_top(tmp_path):
    runs = as_run_frame(
        block_runs(**{STEPS_TIMED: 4.0, DTYPE: "float32"}).assign(**{CONTENDED: lambda f: f["seed"] == "0"})
    )
    write_report(runs, Selection("smoke", [], None, tmp_path), "sqlite:///none.db", tmp_path, MARGINS)
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.count("Speed cannot be judged") == 1
    note = markdown.index("Speed cannot be judged: of 24 finished runs, 6 were contended (other processes shared")
    assert note < markdown.index("## Configurations")
    assert f"and 24 timed fewer than {MIN_TIMED_STEPS} optimizer steps" in markdown
    found = tables(markdown)
    assert {row["samples/s verdict"] for row in found["Paired effects"]} == {
        "cannot judge speed (1 contended, 4 too few timed steps)"
    }
    assert {row["samples/s [95% CI]"] for row in found["Paired effects"]} == {"-"}
    assert [row["contended"] for row in found["Configurations"]] == ["1"] * 6
    assert "precision" not in found["Configurations"][0]  # one precision, amp not swept
    effects = pd.read_csv(tmp_path / "effects.csv")
    assert effects[["contended_pairs", "few_steps_pairs", "speed_pairs"]].drop_duplicates().values.tolist() == [
        [1, 4, 0]
    ]
    assert (tmp_path / "paired_effects.png").read_bytes()[:8] == PNG_SIGNATURE


def test_the_report_and_the_trainer_agree_on_too_few_timed_steps():
    assert MIN_TIMED_STEPS == TRAINER_MIN_TIMED_STEPS


@pytest.mark.parametrize("key", ["speed_margin", "memory_margin"])
@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan"])
def test_speed_and_memory_margins_outside_their_range_are_refused(key, value):
    message = f"{key}={value} must be in [0, 1] (a fraction of the baseline: 0.05 is 5%)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        report_config(f"{key}={value}")


@pytest.mark.parametrize("value", ["0", "1"])
def test_speed_and_memory_margin_edges_pass(value):
    cfg = report_config(f"speed_margin={value}", f"memory_margin={value}")
    assert cfg.speed_margin == cfg.memory_margin == float(value)
    assert report_config().speed_margin == report_config().memory_margin == 0.05  # the defaults


def as_run_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """Hand-made runs as ``run_frame`` gives them: ids, FINISHED, started in turn, every metric (NaN unless given),
    and as runs logged before steps were counted and runs tagged (not contended, steps, precision and configuration
    unknown) unless given."""
    defaults = {
        **dict.fromkeys(METRICS, np.nan),
        STEPS_TIMED: np.nan,
        CONTENDED: False,
        **dict.fromkeys([DTYPE, CONFIG_HASH, *PROVENANCE], ""),
    }
    return runs.assign(
        run_id=[f"run{i}" for i in range(len(runs))],
        **{STARTED: range(len(runs))},
        status="FINISHED",
        **{key: value for key, value in defaults.items() if key not in runs},
    )


def test_effects_csv_has_one_row_per_comparison_through_write_report(tmp_path):
    runs = as_run_frame(activation_runs())
    files = write_report(runs, Selection("constructed", [], None, tmp_path), "sqlite:///none.db", tmp_path, MARGINS)
    assert tmp_path / "effects.csv" in files
    effects = pd.read_csv(tmp_path / "effects.csv")
    assert effects.columns.tolist() == EFFECT_COLUMNS
    assert effects[["param", "value", "baseline", "pairs", "verdict"]].values.tolist() == [
        ["model.activation", "mish", "gelu", 4, "no loss"],
        ["model.activation", "prelu", "gelu", 4, "loss"],
        ["model.activation", "relu", "gelu", 4, "inconclusive"],
    ]
    assert effects["more_pairs"].isna().tolist() == [True, True, False] and effects["more_pairs"].iloc[2] == 4
    assert effects["speed_ratio"].tolist() == pytest.approx([0.9, 0.8, 0.7]) and set(effects["margin"]) == {0.01}
    assert effects["speed_verdict"].tolist() == ["slower"] * 3  # the same ratio from every seed: no spread
    assert effects["memory_verdict"].tolist() == ["more memory"] * 3
    shown = tables((tmp_path / "report.md").read_text())["Paired effects"]
    assert [row["test AUC verdict"] for row in shown] == ["no loss", "loss", "inconclusive (~4 more pairs)"]
    assert shown[2]["test AUC [95% CI]"] == "-0.005 [-0.014, +0.004]"
    assert shown[0]["samples/s [95% CI]"] == "×0.90 [×0.90, ×0.90]"
    assert shown[0]["peak memory [95% CI]"] == "+20% [+20%, +20%]"
    write_report(
        runs[runs["model.activation"] == "gelu"],
        Selection("no pairs", [], None, tmp_path),
        "sqlite:///none.db",
        tmp_path,
        MARGINS,
    )
    assert (tmp_path / "effects.csv").read_text().strip() == ",".join(EFFECT_COLUMNS)  # the header only


def test_aggregate_gives_mean_std_and_count_per_configuration():
    table = aggregate(runs_frame(), ["amp", "batch_size"], ["perf/samples_per_s"])
    assert table[["amp", "batch_size"]].values.tolist() == [
        ["False", "4"],
        ["False", "8"],
        ["True", "4"],
        ["True", "8"],
    ]
    assert table["n"].tolist() == [2, 2, 2, 1]
    assert table["perf/samples_per_s"].tolist() == [6.0, 12.0, 12.0, 16.0]
    assert table["perf/samples_per_s std"].iloc[0] == pytest.approx(np.std([4.0, 8.0], ddof=1))
    assert np.isnan(table["perf/samples_per_s std"].iloc[3])


def test_a_nan_in_one_seed_makes_its_configuration_nan():
    runs = runs_frame()
    runs.loc[(runs["amp"] == "False") & (runs["batch_size"] == "4") & (runs["seed"] == "1"), "test/auc"] = np.nan
    table = aggregate(runs, ["amp", "batch_size"], ["test/auc"])
    assert table["test/auc"].isna().tolist() == [True, False, False, False]
    assert table["test/auc std"].isna().tolist() == [True, False, False, True]


# --- the report of hand-logged runs in a real store (no training) ------------------------------------------


def log_run(
    client: mlflow.MlflowClient,
    experiment_id: str,
    params: dict[str, str],
    epochs: list[dict[str, float]],
    final: dict[str, float],
    status: str = "FINISHED",
    tags: dict[str, str] | None = None,
) -> str:
    run = client.create_run(experiment_id, tags=tags or {})
    client.log_batch(
        run.info.run_id,
        params=[Param(k, v) for k, v in params.items()],
        metrics=[Metric(k, v, 0, step) for step, values in enumerate(epochs) for k, v in values.items()]
        + [Metric(k, v, 0, len(epochs)) for k, v in final.items()],
    )
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


@pytest.fixture(scope="module")
def logged_sweep(tmp_path_factory):
    """A sweep's parent and its children as ``src.train`` logs them: amp=true,false x seed=0,1 finished, one
    more job out of memory. One store for the module (creating one takes seconds); reports overwrite theirs."""
    tmp_path = tmp_path_factory.mktemp("logged")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = ensure_store(store)
    experiment_id = client.create_experiment("medsweep", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(experiment_id, tags={"role": "sweep", "sweep_dir": str(tmp_path / "sweep")}).info.run_id
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / PARENT_ID_FILE).write_text(parent)
    child = {MLFLOW_PARENT_RUN_ID: parent}
    for amp in ("True", "False"):
        for seed in (0, 1):
            fast = amp == "True"
            epochs = [
                {"val/auc": 0.7, "val/acc": 0.6, "perf/samples_per_s": 6.0 + 4 * fast * 2 + seed},  # slow start
                {"val/auc": 0.9, "val/acc": 0.8, "perf/samples_per_s": 22.0 + 4 * fast * 2 + seed},
                {"val/auc": 0.9, "val/acc": 0.5, "perf/samples_per_s": 20.0 + 4 * fast * 2 + seed},
            ]
            for epoch in epochs:
                epoch.update({"mem/peak_mb": 60.0 if fast else 100.0, "mem/predicted_mb": 80.0})
            log_run(
                client,
                experiment_id,
                {"amp": amp, "seed": str(seed), "batch_size": "4"},
                epochs,
                {"test/acc": 0.7, "test/auc": 0.81 + 0.01 * fast + 0.02 * seed},
                tags=child,
            )
    log_run(
        client,
        experiment_id,
        {"amp": "True", "seed": "0", "batch_size": "64"},
        [],
        {"mem/peak_mb": 5000.0, "mem/predicted_mb": 4800.0},
        "FAILED",
        {**child, "status": "oom", "retried": "false"},
    )
    return client, parent, tmp_path / "sweep", store


def test_report_of_a_sweep_folder_tabulates_plots_and_logs_to_the_parent_run(logged_sweep):
    client, parent, sweep, store = logged_sweep
    out = report(report_config(f"sweep={sweep}", f"mlflow.tracking_uri={store}"))
    assert out == sweep / "report"
    assert {p.name for p in out.iterdir()} == REPORT_FILES
    found = tables((out / "report.md").read_text())
    configs = {row["amp"]: row for row in found["Configurations"]}
    assert set(configs) == {"true", "false"}  # amp swept (so is batch_size, through the failed run), seed aggregated
    assert configs["false"]["batch_size"] == "4" and configs["false"]["n"] == "2"
    assert configs["true"]["test/auc"] == "0.830 ± 0.014"  # mean and sample std of 0.82 and 0.84
    assert configs["true"]["val/auc"] == "0.900 ± 0.000"  # at the first best epoch (1), where val/acc is 0.8
    assert configs["true"]["val/acc"] == "0.800 ± 0.000"
    assert configs["false"]["perf/samples_per_s"] == "20.5 ± 0.7"  # over seeds of the epochs' medians, 20 and 21
    assert "contended" not in configs["false"] and "precision" not in configs["false"]  # runs logged before either
    assert configs["true"]["mem/peak_mb"] == "60 ± 0" and configs["true"]["Pareto"] == "yes"
    assert configs["false"]["Pareto"] == ""  # slower and larger than amp=true
    effects = found["Paired effects"]
    assert effects == [
        {
            "comparison": "amp=true vs false",
            "pairs": "2",
            "samples/s [95% CI]": "×1.39 [×1.27, ×1.52]",  # 28 / 20 and 29 / 21: runs without steps_timed are kept
            "samples/s verdict": "faster",
            "peak memory [95% CI]": "-40% [-40%, -40%]",
            "peak memory verdict": "less memory",
            "test AUC [95% CI]": "+0.010 [+0.010, +0.010]",
            "test AUC verdict": "no loss",
        }
    ]
    assert "Speed cannot be judged" not in (out / "report.md").read_text()
    failed = found["Not finished"]
    assert [(row["status"], row["amp"], row["batch_size"], row["mem/peak_mb"]) for row in failed] == [
        ("FAILED (oom)", "true", "64", "5000")
    ]
    assert [(row["perf/steps_timed"], row["contended"]) for row in found["Finished runs"]] == [("-", "")] * 4
    with open(out / "runs.csv") as file:
        assert len(list(csv.DictReader(file))) == 5
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "amp=true vs false" in html
    logged = {a.path for a in client.list_artifacts(parent, "report")}
    assert logged == {f"report/{name}" for name in REPORT_FILES}


def test_runs_that_log_their_median_steps_and_tags_are_read_from_them(logged_sweep, tmp_path):
    client, _, _, store = logged_sweep
    experiment_id = client.create_experiment("smoke", artifact_location=str(tmp_path / "artifacts"))
    for amp in ("True", "False"):
        for seed in (0, 1):
            log_run(
                client,
                experiment_id,
                {"amp": amp, "seed": str(seed)},
                [{"val/auc": 0.8, "perf/samples_per_s": rate, "perf/others_cpu": 0.0} for rate in (1.0, 2.0, 3.0)],
                {
                    "test/auc": 0.8,
                    "mem/peak_mb": 100.0,
                    "perf/samples_per_s_median": 50.0 * (1 + (amp == "True")) + seed,
                    "perf/steps_timed": 3.0,  # epochs=1 limit_batches=2 and more: a smoke run
                },
                tags={"perf.contended": "false", "amp.dtype": "float32"},  # amp=true fell back on this CPU
            )
    out = report(report_config("mlflow.experiment=smoke", f"mlflow.tracking_uri={store}", f"out={tmp_path}/smoke"))
    frame = pd.read_csv(out / "runs.csv")
    assert sorted(frame["perf/samples_per_s"]) == [50.0, 51.0, 100.0, 101.0]  # the logged median, not the epochs'
    assert set(frame["perf/steps_timed"]) == {3.0} and set(frame["amp.dtype"]) == {"float32"}
    assert not frame["perf.contended"].any()
    markdown = (out / "report.md").read_text()
    assert "swept: `amp`, `seed`;" in markdown  # tags are no params
    assert markdown.count(f"Speed cannot be judged: of 4 finished runs, 4 timed fewer than {MIN_TIMED_STEPS}") == 1
    found = tables(markdown)
    assert [row["precision"] for row in found["Configurations"]] == ["float32", "float32"]  # amp swept: shown
    assert found["Paired effects"][0]["samples/s verdict"] == "cannot judge speed (2 too few timed steps)"
    assert [row["perf/steps_timed"] for row in found["Finished runs"]] == ["3"] * 4


def test_an_experiment_is_reported_without_logging_anywhere(logged_sweep, tmp_path, caplog):
    client, parent, _, store = logged_sweep
    caplog.set_level("INFO")
    before = client.list_artifacts(parent, "report")
    out = report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={store}", f"out={tmp_path}/exp"))
    assert out == tmp_path / "exp" and {p.name for p in out.iterdir()} >= REPORT_FILES
    assert len(tables((out / "report.md").read_text())["Finished runs"]) == 4  # the parent run is not a job
    assert client.list_artifacts(parent, "report") == before
    assert "not logged to MLflow" in caplog.text


def test_a_parent_run_id_selects_the_same_runs_and_writes_beside_the_sweep(logged_sweep):
    _, parent, sweep, store = logged_sweep
    out = report(report_config(f"parent={parent}", f"mlflow.tracking_uri={store}"))
    assert out == sweep / "report"  # the parent's sweep_dir tag names a folder that exists here
    found = tables((out / "report.md").read_text())
    assert len(found["Finished runs"]) == 4 and len(found["Not finished"]) == 1


def test_a_job_run_id_is_not_a_parent(logged_sweep):
    store = logged_sweep[3]
    child = next(r for r in runs(store) if r.data.tags.get(MLFLOW_PARENT_RUN_ID)).info.run_id
    with pytest.raises(UsageError, match=f"^parent={child}: run {child} has no child runs: give a sweep's parent"):
        report(report_config(f"parent={child}", f"mlflow.tracking_uri={store}"))


def test_a_sweep_folder_is_reported_from_the_store_its_jobs_logged_to(logged_sweep):
    client, parent, sweep, store = logged_sweep
    (sweep / "multirun.yaml").write_text(f"hydra:\n  mode: MULTIRUN\nmlflow:\n  tracking_uri: {store}\n")
    try:
        assert report(report_config(f"sweep={sweep}")) == sweep / "report"
    finally:
        (sweep / "multirun.yaml").unlink()


def test_without_a_selector_the_latest_sweep_under_sweeps_is_reported(logged_sweep, tmp_path, monkeypatch):
    client, parent, _, store = logged_sweep
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=f"no selector, and no sweep in {tmp_path}/sweeps: give sweep=<folder>"):
        report(report_config())
    for name, parent_id in (
        ("2026-11-24/23-59-59", "older"),
        ("2026-11-25/09-00-00", parent),
        ("2026-11-25/10-00-00", None),
    ):
        folder = tmp_path / "sweeps" / name
        folder.mkdir(parents=True)
        (folder / "multirun.yaml").write_text(f"mlflow:\n  tracking_uri: {store}\n")
        if parent_id:
            (folder / PARENT_ID_FILE).write_text(parent_id)  # the newest folder has none: not a sweep that started
    assert report(report_config()) == Path("sweeps/2026-11-25/09-00-00/report")


@pytest.mark.parametrize(
    "recorded",
    [
        "mlflow:\n  tracking_uri: sqlite:////elsewhere/mlflow.db\n",  # given on the command line: that one
        "mlflow:\n  tracking_uri: null\n",  # the sweep used the default store
        "mlflow: [1, 2]\n",
        "mlflow:\n  tracking_uri: [1]\n",
        ": : [\n",
        "\x00\xff",
    ],
)
def test_the_store_a_report_reads(tmp_path, recorded):
    (tmp_path / "multirun.yaml").write_bytes(recorded.encode("latin-1"))
    given = report_store(report_config(f"sweep={tmp_path}", "mlflow.tracking_uri=sqlite:////given/mlflow.db"))
    assert given == "sqlite:////given/mlflow.db"
    expected = "sqlite:////elsewhere/mlflow.db" if "elsewhere" in recorded else DEFAULT_TRACKING_URI
    assert report_store(report_config(f"sweep={tmp_path}")) == expected


def test_the_store_an_optuna_sweep_logged_to_is_read_from_its_jobs_configs(tmp_path):
    """Optuna's sweeper writes no ``multirun.yaml``: ``sweep=<folder>`` fell back to the default store."""
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "config.yaml").write_text("mlflow:\n  tracking_uri: sqlite:////elsewhere/mlflow.db\n")
    assert report_store(report_config(f"sweep={tmp_path}")) == "sqlite:////elsewhere/mlflow.db"
    (tmp_path / "multirun.yaml").write_text("mlflow:\n  tracking_uri: sqlite:////recorded/mlflow.db\n")
    assert report_store(report_config(f"sweep={tmp_path}")) == "sqlite:////recorded/mlflow.db"  # the sweep's own first


BAD_SELECTORS = [
    (("parent=abc", "mlflow.experiment=medsweep"), "parent=abc and mlflow.experiment=medsweep: give exactly one of"),
    (("sweep={tmp}/nowhere",), "sweep={tmp}/nowhere: no such folder"),
    (("sweep={tmp}",), f"sweep={{tmp}} has no {PARENT_ID_FILE} file holding a run id"),
    (("parent=0123abc",), "parent=0123abc: run 0123abc is not in sqlite:///"),
    (("mlflow.experiment=nope",), "mlflow.experiment=nope is not in sqlite:///"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_SELECTORS)
def test_bad_selectors_name_the_value_and_the_fix(logged_sweep, tmp_path, overrides, message):
    store = logged_sweep[3]
    with pytest.raises(UsageError) as raised:
        report(report_config(*(o.format(tmp=tmp_path) for o in overrides), f"mlflow.tracking_uri={store}"))
    assert str(raised.value).startswith(message.format(tmp=tmp_path))


def test_an_unknown_experiment_names_ten_of_the_stores_and_how_many_more(store):
    client = mlflow.MlflowClient(store)
    for n in range(12):
        client.create_experiment(f"exp{n:02d}")
    with pytest.raises(UsageError) as raised:
        report(report_config("mlflow.experiment=nope", f"mlflow.tracking_uri={store}"))
    names = ", ".join(["Default"] + [f"exp{n:02d}" for n in range(9)])
    assert str(raised.value) == f"mlflow.experiment=nope is not in {store}: use one of {names} and 3 more"


@pytest.mark.parametrize("damage", ["random bytes", "blank", "a folder"])
def test_a_damaged_parent_id_file_names_the_folder_and_the_fix(logged_sweep, tmp_path, damage):
    path = tmp_path / "sweep" / PARENT_ID_FILE
    path.parent.mkdir()
    if damage == "a folder":
        path.mkdir()
    else:
        path.write_bytes(os.urandom(64) if damage == "random bytes" else b"  \n")
    with pytest.raises(UsageError) as raised:
        report(report_config(f"sweep={path.parent}", f"mlflow.tracking_uri={logged_sweep[3]}"))
    assert str(raised.value).startswith(f"sweep={path.parent} has no {PARENT_ID_FILE} file holding a run id: give")


def test_an_out_folder_that_cannot_be_written_is_refused_before_any_file(logged_sweep, tmp_path):
    (tmp_path / "a-file").touch()
    out = tmp_path / "a-file" / "report"
    with pytest.raises(UsageError) as raised:
        report(report_config(f"sweep={logged_sweep[2]}", f"out={out}", f"mlflow.tracking_uri={logged_sweep[3]}"))
    assert (
        str(raised.value)
        == f"out={out} cannot be written (Not a directory): give out=<a folder this process can write>"
    )


def test_the_report_command_does_not_import_torch():
    """It composes conf/report.yaml only, so it spares the model zoo and torch (~2 s of its start)."""
    code = "import sys, src.report.__main__; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_missing_store_is_one_error_line_and_exit_2(tmp_path):
    result = run_cli(
        "mlflow.experiment=medsweep", f"mlflow.tracking_uri=sqlite:///{tmp_path}/none.db", module="src.report"
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: mlflow.tracking_uri=sqlite:///{tmp_path}/none.db: no such store: "
        f"set it to the store the runs logged to"
    )
    assert not (tmp_path / "none.db").exists()


def test_a_sweep_reports_the_finished_runs_its_skipped_jobs_named(tmp_path, store, caplog):
    """A sweep run again (every job skipped: its config had FINISHED) and a resumed one (some jobs skipped) cover
    the runs their ``skipped.<job>`` tags name, each once; names that are no FINISHED run are left out."""
    client = mlflow.MlflowClient(store)
    experiment_id = client.create_experiment("medsweep", artifact_location=str(tmp_path / "artifacts"))

    def sweep(name: str, skipped: dict[str, str]) -> str:
        (tmp_path / name).mkdir()
        tags = {"role": "sweep", "sweep_dir": str(tmp_path / name)}
        parent = client.create_run(experiment_id, tags=tags).info.run_id
        client.log_batch(parent, tags=[RunTag(f"{SKIPPED_TAG}{job}", value) for job, value in skipped.items()])
        (tmp_path / name / PARENT_ID_FILE).write_text(parent)
        return parent

    def job(parent: str, amp: str, status: str = "FINISHED") -> str:
        epochs = [{"val/auc": 0.9, "perf/samples_per_s": 10.0, "mem/peak_mb": 100.0}]
        return log_run(
            client, experiment_id, {"amp": amp}, epochs, {"test/auc": 0.8}, status, {MLFLOW_PARENT_RUN_ID: parent}
        )

    first = sweep("first", {})
    done = [job(first, "True"), job(first, "False")]
    failed = job(first, "True", "FAILED")
    again = sweep("again", {str(n): f"seed={n} -> {run}" for n, run in enumerate(done)})
    out = report(report_config(f"sweep={tmp_path / 'again'}", f"mlflow.tracking_uri={store}"))
    assert sorted(pd.read_csv(out / "runs.csv")["run_id"]) == sorted(done)
    assert {a.path for a in client.list_artifacts(again, "report")} == {f"report/{n}" for n in REPORT_FILES}

    resumed = sweep("resumed", {})
    retrained = job(resumed, "True")
    named = [done[1], retrained, done[1], failed, "0" * 32, "damaged"]  # itself, twice, not FINISHED, gone, no id
    client.log_batch(resumed, tags=[RunTag(f"{SKIPPED_TAG}{n}", f"seed=0 -> {r}") for n, r in enumerate(named)])
    caplog.set_level("WARNING")
    out = report(report_config(f"parent={resumed}", f"mlflow.tracking_uri={store}"))
    assert sorted(pd.read_csv(out / "runs.csv")["run_id"]) == sorted([retrained, done[1]])
    assert f"3 of the 4 runs the skipped jobs of sweep run {resumed} name are not FINISHED runs" in caplog.text


# --- a real sweep, reported by a real process -------------------------------------------------------------


@pytest.mark.slow
def test_a_real_sweep_is_reported_with_seeds_aggregated(tmp_path, store):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m",
        "data=synthetic",
        "model=resnet10",
        "model.stem=standard",
        "batch_size=4",
        "epochs=1",
        "limit_batches=2",
        "num_threads=1",
        "amp=true,false",
        "seed=0,1",
        f"mlflow.tracking_uri={store}",
        f"hydra.sweep.dir={sweep}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(f"sweep={sweep}", module="src.report")  # the store the sweep logged to, from its folder
    assert result.returncode == 0, result.stderr[-3000:]
    out = sweep / "report"
    found = tables((out / "report.md").read_text())
    children = [r for r in runs(store) if r.data.tags.get(MLFLOW_PARENT_RUN_ID)]
    for row in found["Configurations"]:
        aucs = [r.data.metrics["test/auc"] for r in children if r.data.params["amp"].lower() == row["amp"]]
        assert row["n"] == "2" and row["test/auc"] == f"{np.mean(aucs):.3f} ± {np.std(aucs, ddof=1):.3f}"
    assert sorted(row["amp"] for row in found["Configurations"]) == ["false", "true"]
    assert [(row["comparison"], row["pairs"]) for row in found["Paired effects"]] == [("amp=true vs false", "2")]
    for name in ("throughput_memory.png", "paired_effects.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert width > 1000 and height > 300
    parent = read_parent(sweep)
    logged = {a.path for a in mlflow.MlflowClient(store).list_artifacts(parent, "report")}
    assert logged == {f"report/{name}" for name in REPORT_FILES}


def read_parent(sweep) -> str:
    return (sweep / PARENT_ID_FILE).read_text().strip()


@pytest.mark.slow
def test_a_sweep_run_again_with_every_job_skipped_is_reported(tmp_path, store):
    sweep = ("-m", "data=synthetic", "model=resnet10", "batch_size=4", "epochs=1", "limit_batches=2", "num_threads=1")
    for name in ("first", "again"):
        result = run_cli(*sweep, "seed=0,1", f"mlflow.tracking_uri={store}", f"hydra.sweep.dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
    trained = {r.info.run_id for r in runs(store) if r.data.tags.get(MLFLOW_PARENT_RUN_ID)}
    assert len(trained) == 2  # the second sweep trained nothing
    result = run_cli(f"sweep={tmp_path / 'again'}", module="src.report")
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(pd.read_csv(tmp_path / "again" / "report" / "runs.csv")["run_id"]) == trained
