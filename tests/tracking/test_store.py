"""The store's check and its creation: a store that cannot be used is one ``UsageError`` naming it, what is wrong and
the fix, before any job and without MLflow's minutes of retries; processes creating one store and one experiment at
the same moment all succeed. Real stores, real servers, real processes."""

from __future__ import annotations

import http.server
import math
import multiprocessing
import os
import pwd
import re
import sqlite3
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
from mlflow.entities import RunStatus, ViewType
from mlflow.store.tracking.dbmodels.models import SqlExperiment
from sqlalchemy import event

from src.errors import UsageError
from src.tracking.store import (
    DEFAULT_TRACKING_URI,
    best_metric,
    check_store,
    create_experiment,
    ensure_store,
    experiment_id,
    finished_run,
    tracking_uri,
)
from tests.helpers import free_port, run_cli, run_process, runs, small_run

PROCESSES = 4
READ_ONLY = (  # a folder, its database's mode (None: no database yet), the folder's mode, what is read-only
    ("no-database", None, 0o555, "folder"),
    ("database", 0o444, 0o755, "database"),
    ("journal", 0o644, 0o555, "folder"),  # the database is writable, but the write's journal cannot be created
)
RESTRICTED = """
import os, pwd, sys
from src.errors import UsageError
from src.tracking.store import ensure_store
if os.geteuid() == 0:  # root writes anything: check as nobody, once the imports are done (root's Python is not theirs)
    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)
for uri in sys.argv[1:]:
    try:
        ensure_store(uri)
        print("usable")
    except UsageError as err:
        print(err)
"""


def refusal(uri: str) -> str:
    """What :func:`ensure_store` refuses ``uri`` with: one line naming it."""
    with pytest.raises(UsageError) as refused:
        ensure_store(uri)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("mlflow.tracking_uri="), message
    return message


def sqlite_file(path: Path) -> Path:
    """An SQLite database of one table (not MLflow's: the check refuses before MLflow opens it)."""
    with sqlite3.connect(path) as database:
        database.execute("CREATE TABLE t (x)")
    return path


@pytest.fixture
def reachable_folder() -> Iterator[Path]:
    """A temp folder that the user the read-only checks run as (``nobody`` when this process is root) reaches, unlike
    pytest's ``tmp_path``."""
    with tempfile.TemporaryDirectory(prefix="medsweep-store-") as name:
        folder = Path(name)
        folder.chmod(0o755)
        yield folder


def owned(path: Path, mode: int) -> Path:
    """``path`` given to the user the checks run as, with ``mode``."""
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    path.chmod(mode)
    return path


@pytest.fixture
def answering_503() -> Iterator[str]:
    """A server whose ``/health`` answers 200 and everything else 503 (a tracking server whose store is down)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_file_of_random_bytes_is_refused_and_left_as_it_is(tmp_path):
    path = tmp_path / "mlflow.db"
    path.write_bytes(os.urandom(8192))
    before = path.read_bytes()
    message = refusal(f"sqlite:///{path}")
    assert "is not a usable SQLite database" in message and "file is not a database" in message
    with pytest.raises(UsageError, match="file is not a database"):
        check_store(f"sqlite:///{path}")
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_a_folder_is_refused_with_a_file_in_it_suggested(tmp_path):
    message = refusal(f"sqlite:///{tmp_path}")
    assert "is a folder, not an SQLite database file" in message
    assert f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}" in message


def test_a_missing_folder_is_refused_and_not_created(tmp_path):
    message = refusal(f"sqlite:///{tmp_path / 'no' / 'mlflow.db'}")
    assert f"folder {tmp_path / 'no'} does not exist: create it" in message
    assert not (tmp_path / "no").exists()


def test_a_scheme_no_store_serves_is_named_with_those_that_do():
    assert refusal("garbage://x") == (
        "mlflow.tracking_uri=garbage://x has a scheme no MLflow store serves: use sqlite:///<file>, "
        "http(s)://<server>, or a database's postgresql://, mysql:// or mssql://"
    )


def test_a_store_not_created_yet_is_checked_by_a_dry_run_creating_nothing(tmp_path):
    check_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_store_is_refused_even_to_root(reachable_folder):
    """Checked as ``nobody`` when the tests run as root (root writes whatever the file modes say)."""
    paths = []
    for name, database_mode, folder_mode, _ in READ_ONLY:
        folder = reachable_folder / name
        folder.mkdir()
        if database_mode is not None:
            owned(sqlite_file(folder / "mlflow.db"), database_mode)
        paths.append(owned(folder, folder_mode) / "mlflow.db")
    result = run_process([sys.executable, "-c", RESTRICTED, *(f"sqlite:///{path}" for path in paths)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"mlflow.tracking_uri=sqlite:///{path} is read-only: {kind} {path if kind == 'database' else path.parent} is "
        "read-only for this user: make it writable, or set mlflow.tracking_uri to a store in a writable folder"
        for path, (*_, kind) in zip(paths, READ_ONLY, strict=True)
    ]
    assert [sorted(path.parent.iterdir()) for path in paths] == [[], [paths[1]], [paths[2]]]  # nothing created


def test_a_server_whose_api_fails_is_refused_at_once(answering_503):
    message = refusal(answering_503)
    assert f"the server answered 503 on {answering_503}/api/2.0/mlflow/experiments/search" in message
    assert message.endswith("see the server's log, or set mlflow.tracking_uri to another store")


def test_a_server_nobody_listens_for_is_refused_at_once():
    uri = f"http://127.0.0.1:{free_port()}"
    message = refusal(uri)
    assert message.startswith(f"mlflow.tracking_uri={uri} is unreachable (")
    assert f"connection refused on {uri}/health" in message.lower() and "start the server" in message


def test_a_database_server_that_is_down_is_refused_at_once_its_password_hidden():
    pytest.importorskip("psycopg")  # MLflow's PostgreSQL driver (the dev extras)
    port = free_port()
    message = refusal(f"postgresql+psycopg://medsweep:s3cret@127.0.0.1:{port}/mlflow")
    assert message.startswith(f"mlflow.tracking_uri=postgresql+psycopg://medsweep:***@127.0.0.1:{port}/mlflow ")
    assert "cannot be connected to" in message and "connection refused" in message.lower()
    assert "s3cret" not in message


def create_at_once(uri: str, start: threading.Barrier) -> str:
    """One process of the concurrency test: the store, then the experiment, all processes at the same moment."""
    start.wait(timeout=300)
    return experiment_id(ensure_store(uri), "medsweep")


def test_processes_creating_one_store_and_experiment_at_once_all_succeed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spawn = multiprocessing.get_context("spawn")
    with spawn.Manager() as manager, spawn.Pool(PROCESSES) as pool:  # each task in a worker of its own (the barrier)
        ids = pool.starmap(create_at_once, [(uri, manager.Barrier(PROCESSES))] * PROCESSES, chunksize=1)
    client = mlflow.MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "medsweep"]
    assert ids == [experiment.experiment_id] * PROCESSES


def test_an_experiment_created_by_another_process_meanwhile_is_used(store):
    """The race, made to happen every time: just before this client inserts the experiment (it looked it up and
    found none), another creates it."""
    client, other = ensure_store(store), mlflow.MlflowClient(store)
    raced = []

    def other_first(mapper, connection, target):
        if not raced:
            raced.append(target.name)
            create_experiment(other, target.name)

    event.listen(SqlExperiment, "before_insert", other_first)
    try:
        created = experiment_id(client, "medsweep")
    finally:
        event.remove(SqlExperiment, "before_insert", other_first)
    assert raced == ["medsweep"]
    assert created == other.get_experiment_by_name("medsweep").experiment_id


def test_mlflows_environment_variable_names_the_store_below_the_config_key(tmp_path, monkeypatch, store, shared_data):
    given, env = SimpleNamespace(mlflow=SimpleNamespace(tracking_uri=store)), f"sqlite:///{tmp_path / 'env.db'}"
    unset = SimpleNamespace(mlflow=SimpleNamespace(tracking_uri=None))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(unset) == DEFAULT_TRACKING_URI
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env)
    assert (tracking_uri(given), tracking_uri(unset)) == (store, env)
    args = [a for a in small_run(tmp_path, store, shared_data, "epochs=1") if not a.startswith("mlflow.tracking_uri=")]
    assert run_cli(*args).returncode == 0  # a real job, its process started with the variable set
    assert [run.info.status for run in runs(env)] == ["FINISHED"] and runs(store) == []


def no_runs(uri: str) -> bool:
    """Whether the store holds no run at all, deleted ones included."""
    client = mlflow.MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return client.search_runs(ids, run_view_type=ViewType.ALL) == []


def one_error(result) -> str:
    """The one ``error:`` line a refused command ends with (exit 2, no traceback)."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def test_another_applications_database_is_refused_and_left_as_it_is(tmp_path):
    path = sqlite_file(tmp_path / "app.db")
    with sqlite3.connect(path) as database:
        database.execute("CREATE TABLE runs (x)")  # a name MLflow's tables share
    before = path.read_bytes()
    for check in (ensure_store, check_store):
        with pytest.raises(UsageError, match=f"is not an MLflow store: {path} holds 2 tables, none alembic_version"):
            check(f"sqlite:///{path}")
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_a_damaged_mlflow_store_is_refused_and_an_empty_file_is_used(tmp_path, store):
    path = Path(store.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as database:
        database.execute("DROP TABLE runs")
    assert f"is a damaged MLflow store: {path} has no table runs: point" in refusal(store)
    empty = tmp_path / "empty.db"
    empty.touch()
    ensure_store(f"sqlite:///{empty}").search_experiments()  # no table yet: MLflow creates its own


def test_a_deleted_experiment_is_refused_before_any_run(store):
    client = ensure_store(store)
    client.delete_experiment(experiment_id(client, "medsweep"))
    for check in (lambda: experiment_id(client, "medsweep"), lambda: finished_run(store, "medsweep", "h", "f")):
        with pytest.raises(UsageError) as refused:
            check()
        message = str(refused.value)
        assert message.startswith(f"mlflow.experiment=medsweep is deleted (experiment 1 of mlflow.tracking_uri={store}")
        assert f"MLFLOW_TRACKING_URI={store} mlflow experiments restore --experiment-id 1" in message
        assert f"mlflow gc --backend-store-uri {store} --experiment-ids 1" in message


def test_a_sweep_into_a_deleted_experiment_is_one_error_line_and_no_run(tmp_path, store, shared_data):
    client = ensure_store(store)
    client.delete_experiment(experiment_id(client, "medsweep"))
    result = run_cli("-m", *small_run(tmp_path, store, shared_data, "seed=3,4"))
    assert "mlflow.experiment=medsweep is deleted" in one_error(result)
    assert no_runs(store)


def test_an_artifact_folder_that_cannot_be_made_is_refused_creating_nothing(tmp_path, store):
    client = ensure_store(store)
    experiment_id(client, "medsweep")
    assert sorted(tmp_path.iterdir()) == [tmp_path / "mlflow.db"]  # the check made and left no folder
    artifacts = tmp_path / "mlartifacts"
    artifacts.write_text("x")
    for name, shown in (("medsweep", f"{artifacts / '1'} ({artifacts})"), ("new", f"{artifacts}")):
        with pytest.raises(UsageError, match=re.escape(f"={name}: its artifact folder {shown} cannot be written")):
            experiment_id(client, name)
    assert client.get_experiment_by_name("new") is None


def test_a_run_into_an_unwritable_artifact_folder_is_one_error_line_and_no_run(tmp_path, store, shared_data):
    experiment_id(ensure_store(store), "medsweep")
    (tmp_path / "mlartifacts").write_text("x")
    result = run_cli(*small_run(tmp_path, store, shared_data, "skip_finished=false"))  # refused at run creation
    assert f"its artifact folder {tmp_path / 'mlartifacts' / '1'} (" in one_error(result)
    assert no_runs(store)


def test_the_best_value_of_a_run_without_the_metric_is_nan(store):
    client = ensure_store(store)
    run = client.create_run(experiment_id(client, "medsweep")).info.run_id
    client.set_terminated(run, RunStatus.to_string(RunStatus.FINISHED))
    assert math.isnan(best_metric(client, run, "val/auc"))
    for step, value in enumerate((0.5, 0.7, 0.6)):
        client.log_metric(run, "val/auc", value, step=step)
    assert best_metric(client, run, "val/auc") == 0.7
