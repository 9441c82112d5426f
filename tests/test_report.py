"""``python -m src.report``: the pure sweep analysis on hand-made frames, the report of hand-logged runs in a
real MLflow store, bad selectors, and a real sweep reported end to end in real processes."""

from __future__ import annotations

import csv

import matplotlib.image
import mlflow
import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from mlflow.entities import Metric, Param
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import OmegaConf
from scipy import stats

from src.errors import UsageError
from src.report.analysis import (
    EFFECT_COLUMNS,
    aggregate,
    auc_interval,
    more_pairs,
    natural_key,
    paired_effects,
    pareto_front,
    summarize_effects,
    swept_columns,
    verdict,
)
from src.report.runs import METRICS, Selection
from src.report.writer import report, write_report
from src.tracking.store import ensure_store
from src.tracking.sweep import PARENT_ID_FILE
from tests.helpers import ROOT, run_cli, runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPORT_FILES = {"report.md", "report.html", "runs.csv", "effects.csv", "throughput_memory.png", "paired_effects.png"}


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
            found[section.splitlines()[0]] = [dict(zip(header, row)) for row in rows[1:]]
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
    summary = summarize_effects(found, 0.01).set_index("param")
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
    summary = summarize_effects(paired_effects(activation_runs(), ["model.activation", "seed"]), 0.01)
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
    assert verdict(-0.009, 0.02, 0.01) == "no loss"
    assert verdict(-0.05, -0.011, 0.01) == "loss"
    assert verdict(-0.011, 0.02, 0.01) == verdict(-0.02, -0.01, 0.01) == "inconclusive"
    assert verdict(np.nan, np.nan, 0.01) == "inconclusive"


def test_one_pair_or_a_mean_at_minus_margin_gives_no_count_of_more_pairs():
    one = auc_interval(pd.Series([0.004]), 0.01)
    assert one["verdict"] == "inconclusive" and np.isnan(one["dauc_lo"]) and one["more_pairs"] is None
    assert auc_interval(pd.Series([-0.02, 0.0]), 0.01)["more_pairs"] is None  # mean -0.01: no number of pairs
    assert more_pairs(4, 0.0, 0.0, 0.01) == 0  # no spread: settled already


def test_effects_csv_has_one_row_per_comparison_through_write_report(tmp_path):
    runs = activation_runs().assign(run_id=lambda f: [f"run{i}" for i in range(len(f))], status="FINISHED")
    runs = runs.reindex(columns=[*runs.columns, *(m for m in METRICS if m not in runs)])
    files = write_report(runs, Selection("constructed", [], None, tmp_path), "sqlite:///none.db", tmp_path, 0.01)
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
    shown = tables((tmp_path / "report.md").read_text())["Paired effects"]
    assert [row["verdict"] for row in shown] == ["no loss", "loss", "inconclusive (~4 more pairs)"]
    assert shown[2]["test AUC [95% CI]"] == "-0.005 [-0.014, +0.004]"
    write_report(
        runs[runs["model.activation"] == "gelu"],
        Selection("no pairs", [], None, tmp_path),
        "sqlite:///none.db",
        tmp_path,
        0.01,
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
                {"val/auc": 0.7, "val/acc": 0.6, "perf/samples_per_s": 18.0 + 4 * fast * 2 + seed},
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
    assert configs["false"]["perf/samples_per_s"] == "20.5 ± 0.7"  # mean over epochs of 20 and 21
    assert configs["true"]["mem/peak_mb"] == "60 ± 0" and configs["true"]["Pareto"] == "yes"
    assert configs["false"]["Pareto"] == ""  # slower and larger than amp=true
    effects = found["Paired effects"]
    assert effects == [
        {
            "comparison": "amp=true vs false",
            "pairs": "2",
            "samples/s": "×1.39",
            "peak memory": "-40%",
            "test AUC [95% CI]": "+0.010 [+0.010, +0.010]",
            "verdict": "no loss",
        }
    ]
    failed = found["Not finished"]
    assert [(row["status"], row["amp"], row["batch_size"], row["mem/peak_mb"]) for row in failed] == [
        ("FAILED (oom)", "true", "64", "5000")
    ]
    assert len(found["Finished runs"]) == 4
    with open(out / "runs.csv") as file:
        assert len(list(csv.DictReader(file))) == 5
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2 and "amp=true vs false" in html
    logged = {a.path for a in client.list_artifacts(parent, "report")}
    assert logged == {f"report/{name}" for name in REPORT_FILES}


def test_an_experiment_is_reported_without_logging_anywhere(logged_sweep, tmp_path, caplog):
    client, parent, _, store = logged_sweep
    caplog.set_level("INFO")
    before = client.list_artifacts(parent, "report")
    out = report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={store}", f"out={tmp_path}/exp"))
    assert out == tmp_path / "exp" and REPORT_FILES <= {p.name for p in out.iterdir()}
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


BAD_SELECTORS = [
    ((), "no selector: give exactly one of sweep=<folder>, parent=<run id> or mlflow.experiment=<name>"),
    (("parent=abc", "mlflow.experiment=medsweep"), "parent=abc and mlflow.experiment=medsweep: give exactly one of"),
    (("sweep={tmp}/nowhere",), "sweep={tmp}/nowhere: no such folder"),
    (("sweep={tmp}",), f"sweep={{tmp}} has no {PARENT_ID_FILE} file"),
    (("parent=0123abc",), "parent=0123abc: run 0123abc is not in sqlite:///"),
    (("mlflow.experiment=nope",), "mlflow.experiment=nope is not in sqlite:///"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_SELECTORS)
def test_bad_selectors_name_the_value_and_the_fix(logged_sweep, tmp_path, overrides, message):
    store = logged_sweep[3]
    with pytest.raises(UsageError) as raised:
        report(report_config(*(o.format(tmp=tmp_path) for o in overrides), f"mlflow.tracking_uri={store}"))
    assert str(raised.value).startswith(message.format(tmp=tmp_path))


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
    result = run_cli(f"sweep={sweep}", f"mlflow.tracking_uri={store}", module="src.report")
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
