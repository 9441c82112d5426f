"""src/report/writer.py: the report's files (report.md and .html, the CSVs, the figures) written in place and logged to
the sweep's parent run."""

from __future__ import annotations

import csv

import pandas as pd
import pytest
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from src.errors import UsageError
from src.report.analysis import CONTENDED, DTYPE, EFFECT_COLUMNS, MIN_TIMED_STEPS, STEPS_TIMED
from src.report.runs import Selection
from src.report.writer import FILES, report, write_report
from src.tracking.sweep import PARENT_ID_FILE
from tests.report.helpers import (
    LONG,
    MARGINS,
    PNG_SIGNATURE,
    REPORT_FILES,
    activation_runs,
    amp_runs,
    as_run_frame,
    block_runs,
    log_run,
    report_config,
    store_with,
    tables,
)


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


def test_an_experiment_is_reported_without_logging_anywhere(logged_sweep, tmp_path, caplog):
    client, parent, _, store = logged_sweep
    caplog.set_level("INFO")
    before = client.list_artifacts(parent, "report")
    out = report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={store}", f"out={tmp_path}/exp"))
    assert out == tmp_path / "exp" and {p.name for p in out.iterdir()} >= REPORT_FILES
    assert len(tables((out / "report.md").read_text())["Finished runs"]) == 4  # the parent run is not a job
    assert client.list_artifacts(parent, "report") == before
    assert "not logged to MLflow" in caplog.text


def test_an_out_folder_that_cannot_be_written_is_refused_before_any_file(logged_sweep, tmp_path):
    (tmp_path / "a-file").touch()
    out = tmp_path / "a-file" / "report"
    with pytest.raises(UsageError) as raised:
        report(report_config(f"sweep={logged_sweep[2]}", f"out={out}", f"mlflow.tracking_uri={logged_sweep[3]}"))
    assert (
        str(raised.value)
        == f"out={out} cannot be written (Not a directory): give out=<a folder this process can write>"
    )


@pytest.mark.parametrize("key", ["out", "sweep"])
def test_a_path_too_long_is_one_error(tmp_path, key):
    with pytest.raises(UsageError, match=f"^{key}={tmp_path}/{LONG}: too long for the file system"):
        report(report_config(f"{key}={tmp_path}/{LONG}", f"mlflow.tracking_uri=sqlite:///{tmp_path}/s.db"))


@pytest.mark.parametrize("name", ["report.md", "effects.csv", "paired_effects.png"])
def test_a_folder_where_a_report_file_goes_is_refused_before_any_file(tmp_path, name):
    _, uri, _ = store_with(tmp_path, "medsweep", amp_runs())
    (tmp_path / "r" / name).mkdir(parents=True)
    with pytest.raises(UsageError, match=f"^{tmp_path}/r/{name} is not a file, and the report writes {name} there"):
        report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    assert [path.name for path in (tmp_path / "r").iterdir()] == [name]


def test_an_artifact_store_that_refuses_the_report_is_one_error_after_writing_it(tmp_path):
    (tmp_path / "a-file").touch()  # the artifacts would go under a file: refused, as root too (unlike chmod)
    client, uri, experiment_id = store_with(tmp_path, "medsweep", [], artifacts="a-file/artifacts")
    parent = client.create_run(experiment_id, tags={"role": "sweep"}).info.run_id
    for params, final, tags in amp_runs():
        log_run(client, experiment_id, params, [], final, tags={**tags, MLFLOW_PARENT_RUN_ID: parent})
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / PARENT_ID_FILE).write_text(parent)
    with pytest.raises(UsageError) as raised:
        report(report_config(f"sweep={tmp_path / 'sweep'}", f"mlflow.tracking_uri={uri}"))
    out = tmp_path / "sweep" / "report"
    assert str(raised.value).startswith(f"the report was written to {out} but could not be logged to run {parent} (")
    assert "\n" not in str(raised.value) and {path.name for path in out.iterdir()} == set(FILES)


def test_a_link_in_place_of_a_report_file_is_replaced_not_written_through(tmp_path):
    _, uri, _ = store_with(tmp_path, "medsweep", amp_runs())
    out, kept = tmp_path / "r", tmp_path / "kept.csv"
    out.mkdir()
    kept.write_text("not the report's\n")
    (out / "runs.csv").symlink_to(kept)
    (out / "report.md").symlink_to(tmp_path / "gone" / "report.md")  # dangling: writing through it fails
    report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={out}"))
    assert kept.read_text() == "not the report's\n"
    assert sorted(path.name for path in out.iterdir()) == sorted(FILES)  # no temporary file left
    assert not any(path.is_symlink() for path in out.iterdir())


FORMULAS = ["=1+1", "+1+1", "-2+3+cmd|' /C calc'!A0", "@SUM(1+1)", "\t=1+1", "\r=1+1", " =1+1", "\uff1d1+1"]


def test_no_cell_of_the_report_csvs_runs_as_a_spreadsheet_formula(tmp_path):
    """Params, tags and a swept value beginning with each character a spreadsheet starts a formula with are written
    after a ``'`` (OWASP's advice against CSV injection); numbers, in number columns or as text, stay numbers."""
    hostile = {f"note{i}": text for i, text in enumerate(FORMULAS)}
    runs = [
        (
            {"model.activation": value, "seed": str(seed), **hostile, "optim.lr": "-0.5", "optim.wd": "1e-3"},
            {"test/auc": 0.8 + 0.01 * seed + 0.02 * (value == FORMULAS[0]), "perf/samples_per_s_median": 10.0},
            {"config_hash": f"{value}-{seed}", "host": '=HYPERLINK("http://evil","x")', "torch_version": "-1+1"},
        )
        for value in FORMULAS[:2]
        for seed in (0, 1, 2)
    ]
    _, uri, _ = store_with(tmp_path, "medsweep", runs)
    out = report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    with open(out / "runs.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 6
    for row in rows:
        assert [row[f"note{i}"] for i in range(len(FORMULAS))] == [f"'{text}" for text in FORMULAS]
        assert (row["host"], row["torch_version"]) == ('\'=HYPERLINK("http://evil","x")', "'-1+1")
        assert (row["optim.lr"], row["optim.wd"]) == ("-0.5", "1e-3")  # numbers, not text
        assert row["model.activation"] in (f"'{FORMULAS[0]}", f"'{FORMULAS[1]}")
    effects = pd.read_csv(out / "effects.csv", dtype=str, keep_default_na=False)
    assert effects[["param", "value", "baseline"]].values.tolist() == [
        ["model.activation", f"'{FORMULAS[0]}", f"'{FORMULAS[1]}"]
    ]
    assert float(effects["speed_ratio"].iloc[0]) == 1.0  # a number column, written as a number
