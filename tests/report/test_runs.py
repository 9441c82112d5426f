"""src/report/runs.py: the runs a report reads: its selectors, the store, skipped jobs, deleted runs and experiments,
metrics as logged, experiment names as folders."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.entities import RunTag
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from src.errors import UsageError
from src.report.analysis import CONFIG_HASH, MIN_TIMED_STEPS
from src.report.runs import FOLDER_NAME_MAX, REPORTS, folder_name, report_store, run_frame
from src.report.writer import report
from src.tracking.identity import ADDED, config_hash
from src.tracking.store import DEFAULT_TRACKING_URI, search_all
from src.tracking.sweep import PARENT_ID_FILE, SKIPPED_TAG
from tests.helpers import alias_bomb, run_cli, runs
from tests.report.helpers import REPORT_FILES, amp_runs, log_run, report_config, store_with, tables

# --- runs logged before a key was added -------------------------------------------------------------------


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


def test_a_param_named_as_a_column_of_the_runs_table_does_not_overwrite_it(tmp_path):
    logged = [({**params, "status": "FAILED", "run_id": "x"}, final, tags) for params, final, tags in amp_runs()]
    client, _, experiment_id = store_with(tmp_path, "medsweep", logged)
    frame = run_frame(client, search_all(client, experiment_id))
    assert set(frame["status"]) == {"FINISHED"}  # not "FAILED": nothing to compare
    assert frame["run_id"].str.fullmatch("[0-9a-f]{32}").all()


# --- selecting the runs: selectors, stores, skipped jobs --------------------------------------------------


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


def test_a_sweep_folders_config_holding_an_alias_bomb_is_one_line_naming_it(tmp_path):
    """A sweep folder may be another's (a shared disk): its ``multirun.yaml`` was loaded unbounded, and an alias
    bomb hung the report."""
    (tmp_path / "multirun.yaml").write_text(alias_bomb())
    with pytest.raises(UsageError, match=f"^{tmp_path / 'multirun.yaml'} holds more than 20000 values once its YAML"):
        report_store(report_config(f"sweep={tmp_path}"))


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
