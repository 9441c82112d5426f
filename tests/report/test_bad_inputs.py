"""``python -m src.report`` on inputs a tester found wrong: runs of one configuration logged twice, non-finite
metrics, odd experiment and model names, paths too long or in the way, an artifact store that refuses the report."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow.entities import LoggedModelOutput
from mlflow.exceptions import MlflowException
from mlflow.utils import validation
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from src.errors import UsageError
from src.report.analysis import (
    CONFIG_HASH,
    MEMORY_EFFECT,
    PROVENANCE,
    SET_ASIDE,
    SPEED_EFFECT,
    STARTED,
    pareto_front,
    summarize_effects,
    superseded,
    verdict_text,
)
from src.report.analysis import paired_effects as find_pairs
from src.report.runs import FOLDER_NAME_MAX, REPORTS, folder_name, run_frame
from src.report.writer import FILES, mixed_note, report
from src.tracking.identity import ADDED, config_hash
from src.tracking.store import ensure_store, search_all
from src.tracking.sweep import PARENT_ID_FILE
from tests.helpers import run_cli
from tests.report.test_report import MARGINS, log_run, report_config, tables

LONG = "x" * 300


def store_with(tmp_path: Path, experiment: str, runs: list[tuple[dict, dict, dict]], artifacts: str = "artifacts"):
    """A fresh store holding ``experiment`` (its artifacts in ``artifacts`` under ``tmp_path``) with FINISHED
    ``runs`` (params, final metrics, tags); the client, the store's URI and the experiment's id."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = ensure_store(uri)
    experiment_id = client.create_experiment(experiment, artifact_location=str(tmp_path / artifacts))
    for params, final, tags in runs:
        log_run(client, experiment_id, params, [], final, tags=tags)
    return client, uri, experiment_id


def amp_runs(repeats: int = 1, **final) -> list[tuple[dict, dict, dict]]:
    """amp=true,false x seed=0,1, ``repeats`` times (a sweep rerun with skip_finished=false: same config_hash)."""
    return [
        (
            {"amp": amp, "seed": str(seed)},
            {
                "test/auc": 0.8 + 0.01 * (amp == "True") + 0.001 * repeat,
                "perf/samples_per_s_median": 10.0 + seed,
                "mem/peak_mb": 100.0,
                **final,
            },
            {CONFIG_HASH: f"{amp}-{seed}"},
        )
        for repeat in range(repeats)
        for amp in ("True", "False")
        for seed in (0, 1)
    ]


# --- runs of one configuration logged more than once -------------------------------------------------------


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


def test_runs_logged_before_a_key_was_added_pair_with_runs_logged_after_it(tmp_path):
    """A sweep resumed across the addition of ``select_by`` and the other :data:`ADDED` keys: amp=false logged before
    (no such params), amp=true after (at the values that train as before: the same config_hash scheme)."""
    runs = []
    for params, final, tags in amp_runs():
        if params["amp"] == "True":
            params = {**params, **ADDED}
        runs.append((params, final, {**tags, CONFIG_HASH: config_hash(params)}))
    _, uri, _ = store_with(tmp_path, "medsweep", runs)
    out = report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    markdown = (out / "report.md").read_text()
    assert "swept: `amp`, `seed`;" in markdown  # not select_by, data.labels, ...: "" is their ADDED value
    assert [row["pairs"] for row in tables(markdown)["Paired effects"]] == ["2"]
    assert pd.read_csv(out / "effects.csv")["dauc_mean"].tolist() == pytest.approx([0.01])


# --- missing and non-finite metrics -----------------------------------------------------------------------


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


def test_infinite_nan_and_negative_metrics_are_left_out_of_the_figures(tmp_path):
    logged = amp_runs()
    logged[0][1]["test/auc"], logged[1][1]["test/auc"] = float("inf"), float("nan")
    logged[2][1]["perf/samples_per_s_median"] = -5.0
    _, uri, _ = store_with(tmp_path, "bad", logged)
    out = report(report_config("mlflow.experiment=bad", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    assert {path.name for path in out.iterdir()} == set(FILES)
    assert np.isinf(pd.read_csv(out / "runs.csv")["test/auc"]).sum() == 1  # inf as logged, not the store's 1.8e308
    assert "Not drawn: 3 values of pairs (missing, infinite, negative" in (out / "report.md").read_text()


def test_a_nan_or_infinite_best_epoch_is_read_as_missing(tmp_path, store):
    """A damaged ``best_epoch``: ``val/*`` at the first best val/auc, as for a run logged before it."""
    client = mlflow.MlflowClient(store)
    experiment_id = client.create_experiment("damaged", artifact_location=str(tmp_path / "artifacts"))
    epochs = [{"val/auc": auc, "val/acc": acc} for auc, acc in ((0.7, 0.6), (0.9, 0.8), (0.9, 0.5))]
    for case, best in (("not a number", float("nan")), ("infinite", float("inf")), ("third", 3.0)):
        log_run(client, experiment_id, {"case": case}, epochs, {"best_epoch": best, "test/auc": 0.8})
    out = report(report_config("mlflow.experiment=damaged", f"mlflow.tracking_uri={store}", f"out={tmp_path}/r"))
    read = pd.read_csv(out / "runs.csv").set_index("case")["val/acc"].to_dict()
    assert read == {"not a number": 0.8, "infinite": 0.8, "third": 0.5}  # the third epoch's, as logged


# --- names and paths --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "folder"),
    [("..", "__"), (".", "_"), ("/tmp/x", "_tmp_x"), ("../../y", ".._.._y"), ("a\\b", "a_b"), ("medsweep", "medsweep")],
)
def test_an_experiment_name_is_one_folder_under_reports(name, folder):
    assert folder_name(name) == folder


def test_a_long_experiment_name_is_cut_with_a_hash_that_keeps_names_apart():
    first, second = folder_name("é" * 499 + "a"), folder_name("é" * 499 + "b")
    assert first != second and max(len(first.encode()), len(second.encode())) <= FOLDER_NAME_MAX
    assert first.startswith("é" * 40)


def test_an_experiment_named_dot_dot_reports_inside_reports(tmp_path, monkeypatch):
    _, uri, _ = store_with(tmp_path, "../../y", amp_runs())
    monkeypatch.chdir(tmp_path)
    assert report(report_config("mlflow.experiment=../../y", f"mlflow.tracking_uri={uri}")) == REPORTS / ".._.._y"
    assert (tmp_path / "reports" / ".._.._y" / "report.md").is_file()


def test_an_experiment_without_runs_is_one_error(tmp_path):
    _, uri, _ = store_with(tmp_path, "empty", [])
    with pytest.raises(UsageError, match=r"^mlflow.experiment=Default has no runs in sqlite:///.*: give the"):
        report(report_config("mlflow.experiment=Default", f"mlflow.tracking_uri={uri}"))


@pytest.mark.parametrize("name", [".", "..", "..x", ".x", "a..b", "x.", "a/b", "a:b", "best model-1.0"])
def test_the_model_names_register_refuses_are_mlflows(name):
    try:
        validation._validate_model_name(name)
        mlflow_refuses = False
    except MlflowException:
        mlflow_refuses = True
    try:
        report_config(f"register='{name}'")
        refused = False
    except ValueError as err:
        assert str(err).startswith(f"register={name}: MLflow's model names cannot")
        refused = True
    assert refused == mlflow_refuses


@pytest.mark.parametrize("key", ["out", "sweep"])
def test_a_path_too_long_is_one_error(tmp_path, key):
    with pytest.raises(UsageError, match=f"^{key}={tmp_path}/{LONG}: too long for the file system"):
        report(report_config(f"{key}={tmp_path}/{LONG}", f"mlflow.tracking_uri=sqlite:///{tmp_path}/s.db"))


def test_a_path_too_long_is_one_line_and_exit_2(tmp_path):
    result = run_cli("mlflow.experiment=medsweep", f"out={tmp_path}/{LONG}", module="src.report")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: out={tmp_path}/{LONG}: too long for the file system (a name in it over 255 bytes, or over 4096 "
        "in all): give a shorter path"
    ]


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


@pytest.mark.parametrize("deleted", ["run", "experiment"])
def test_a_deleted_parent_run_is_one_line_with_the_command_that_restores_it(tmp_path, deleted):
    client, uri, experiment_id = store_with(tmp_path, "medsweep", [])
    parent = client.create_run(experiment_id, tags={"role": "sweep"}).info.run_id
    for params, final, tags in amp_runs():
        log_run(client, experiment_id, params, [], final, tags={**tags, MLFLOW_PARENT_RUN_ID: parent})
    if deleted == "run":  # in the MLflow UI: the report would be logged where none sees it
        client.delete_run(parent)
        fix = f"mlflow runs restore --run-id {parent}"
    else:  # its children too: "no child runs" would name the wrong cause
        client.delete_experiment(experiment_id)
        fix = f"mlflow experiments restore --experiment-id {experiment_id}: it was deleted with its experiment"
    with pytest.raises(UsageError) as raised:
        report(report_config(f"parent={parent}", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    assert str(raised.value) == f"parent={parent}: run {parent} was deleted from {uri}: restore it to report it ({fix})"
    assert not (tmp_path / "r").exists()


def test_a_deleted_experiment_is_one_line_with_the_command_that_restores_it(tmp_path):
    client, uri, experiment_id = store_with(tmp_path, "medsweep", amp_runs())
    client.delete_experiment(experiment_id)
    with pytest.raises(UsageError) as raised:
        report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    assert str(raised.value) == (
        f"mlflow.experiment=medsweep was deleted from {uri}: restore it (mlflow experiments restore --experiment-id "
        f"{experiment_id}) to report it"
    )


@pytest.mark.parametrize("selector", ["parent", "experiment"])
def test_runs_deleted_in_the_ui_are_left_out_and_counted(tmp_path, caplog, selector):
    client, uri, experiment_id = store_with(tmp_path, "medsweep", [])
    parent = client.create_run(experiment_id, tags={"role": "sweep"}).info.run_id
    for params, final, tags in amp_runs():
        log_run(client, experiment_id, params, [], final, tags={**tags, MLFLOW_PARENT_RUN_ID: parent})
    gone = sorted(r.info.run_id for r in search_all(client, experiment_id) if r.info.run_id != parent)[:1]
    client.delete_run(gone[0])
    given = f"parent={parent}" if selector == "parent" else "mlflow.experiment=medsweep"
    report(report_config(given, f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    what = f"sweep run {parent}" if selector == "parent" else "experiment medsweep"
    assert f"1 run(s) of {what} deleted in the MLflow UI, left out: {gone[0]} (mlflow runs restore" in caplog.text
    assert len(pd.read_csv(tmp_path / "r" / "runs.csv")) == 3


def test_runs_of_other_code_or_machines_are_named_once_at_the_top(tmp_path):
    runs = amp_runs()
    for i, (_, _, tags) in enumerate(runs):  # a sweep resumed after an edit of the code, and over two hosts
        tags.update({"code_fingerprint": "old" if i == 0 else "new", "host": f"node{i % 2}"})
    _, uri, _ = store_with(tmp_path, "medsweep", runs)
    out = report(report_config("mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    markdown = (out / "report.md").read_text()
    assert markdown.count("Not like for like") == 1
    assert (
        "the finished runs differ in `code_fingerprint` new (3 runs), old (1 run); `host` node0 (2 runs), node1 "
        "(2 runs)." in markdown
    )
    assert markdown.index("Not like for like") < markdown.index("## Configurations")
    untagged = pd.DataFrame({tag: ["", ""] for tag in PROVENANCE})  # runs logged before these tags: not told apart
    assert mixed_note(untagged.assign(host="node0")) == ""


def test_a_report_run_again_registers_its_model_once(tmp_path, request):
    request.addfinalizer(lambda: mlflow.set_tracking_uri(None))  # register= sets it (and its variable) in-process
    client, uri, experiment_id = store_with(tmp_path, "medsweep", [])
    run_id = log_run(client, experiment_id, {"amp": "True"}, [{"val/auc": 0.9}], {"test/auc": 0.8})
    model = client.create_logged_model(experiment_id, source_run_id=run_id, name="model")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    for out in ("r1", "r2"):  # the second: rerun as the error of a report that could not be logged says
        report(
            report_config(
                "mlflow.experiment=medsweep", f"mlflow.tracking_uri={uri}", f"out={tmp_path / out}", "register=best"
            )
        )
    (version,) = client.search_model_versions("name = 'best'")
    assert (int(version.version), version.source) == (1, f"models:/{model.model_id}")


def test_a_param_named_as_a_column_of_the_runs_table_does_not_overwrite_it(tmp_path):
    logged = [({**params, "status": "FAILED", "run_id": "x"}, final, tags) for params, final, tags in amp_runs()]
    client, _, experiment_id = store_with(tmp_path, "medsweep", logged)
    frame = run_frame(client, search_all(client, experiment_id))
    assert set(frame["status"]) == {"FINISHED"}  # not "FAILED": nothing to compare
    assert frame["run_id"].str.fullmatch("[0-9a-f]{32}").all()
