"""src/report/analysis.py: the sweep analysis on hand-made frames: swept columns, Pareto front, pairs and their
verdicts, seeds aggregated, runs logged twice."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from src.report.analysis import (
    AUC_EFFECT,
    CONFIG_HASH,
    CONTENDED,
    MEMORY_EFFECT,
    MIN_TIMED_STEPS,
    SET_ASIDE,
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
    superseded,
    swept_columns,
    verdict,
    verdict_text,
)
from src.report.analysis import paired_effects as find_pairs
from src.report.writer import report
from src.training.meters import MIN_TIMED_STEPS as TRAINER_MIN_TIMED_STEPS
from tests.report.helpers import (
    DIFFERENCES,
    MARGINS,
    RATIOS,
    activation_runs,
    amp_runs,
    block_runs,
    report_config,
    store_with,
    tables,
)

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


def test_the_report_and_the_trainer_agree_on_too_few_timed_steps():
    assert MIN_TIMED_STEPS == TRAINER_MIN_TIMED_STEPS


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


# --- runs logged more than once, missing metrics ----------------------------------------------------------


def test_only_the_latest_finished_run_of_a_configuration_counts():
    runs = pd.DataFrame(
        {
            "status": ["FINISHED", "FINISHED", "FAILED", "FINISHED", "FINISHED", "FINISHED"],
            CONFIG_HASH: ["a", "a", "a", "b", "", ""],  # untagged runs are their own configuration
            STARTED: [2, 1, 3, 0, 0, 0],
        }
    )
    assert superseded(runs).tolist() == [False, True, False, False, False, False]


def test_a_sweep_run_twice_counts_each_configuration_once(tmp_path):
    client, uri, _ = store_with(tmp_path, "medsweep", amp_runs(repeats=2))
    out = report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    markdown = (out / "report.md").read_text()
    found = tables(markdown)
    assert [row["pairs"] for row in found["Paired effects"]] == ["2"]  # not 2 x 2 x 2
    assert [row["n"] for row in found["Configurations"]] == ["2", "2"]
    assert [row["test/auc"] for row in found["Configurations"]] == ["0.801 ± 0.000", "0.811 ± 0.000"]  # the latest
    assert len(found["Finished runs"]) == 4
    assert markdown.count("Set aside: 4 older FINISHED runs of configurations run again") == 1
    listed = pd.read_csv(out / "runs.csv")
    assert len(listed) == 8 and listed[SET_ASIDE].sum() == 4
    assert set(listed.loc[listed[SET_ASIDE], "test/auc"].round(3)) == {0.8, 0.81}  # the first sweep's


def test_a_missing_speed_or_memory_is_the_worst_on_the_pareto_front():
    assert pareto_front([np.nan, 10.0], [50.0, 50.0], [0.8, 0.8]).tolist() == [False, True]
    assert pareto_front([10.0, 10.0], [np.nan, 50.0], [0.8, 0.8]).tolist() == [False, True]


def test_an_effect_no_pair_measured_reads_a_dash():
    runs = pd.DataFrame(
        {
            "amp": ["True", "False"],
            "seed": ["0", "0"],
            "perf/samples_per_s": np.nan,
            "mem/peak_mb": 1.0,
            "test/auc": 0.8,
        }
    )
    summary = summarize_effects(find_pairs(runs, ["amp", "seed"]), MARGINS)
    row = next(summary.itertuples())
    assert verdict_text(row, SPEED_EFFECT) == "-"  # not "inconclusive (1 pair: spread unknown)"
    assert verdict_text(row, MEMORY_EFFECT) == "inconclusive (1 pair: spread unknown)"
