"""src/tracking/store.py: a store that cannot be used is one ``UsageError`` before any job; stores and experiments
created at once by several processes; where artifacts go; a parallel sweep into PostgreSQL."""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import itertools
import json
import logging
import math
import multiprocessing
import os
import pwd
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow
import psutil
import pytest
from mlflow.entities import RunStatus, ViewType
from mlflow.store.tracking.dbmodels.models import SqlExperiment
from omegaconf import OmegaConf
from sqlalchemy import event

from src.errors import UsageError
from src.tracking import store as store_module
from src.tracking.identity import flatten
from src.tracking.store import (
    DEFAULT_TRACKING_URI,
    HTTP_RETRIES,
    best_metric,
    bound_retries,
    check_store,
    check_usable,
    create_experiment,
    ensure_store,
    experiment_id,
    finished_run,
    tracking_uri,
)
from src.tracking.sweep import PARENT_ID_FILE
from tests.helpers import (
    free_port,
    own_messages,
    run_cli,
    run_process,
    runs,
    serve_mlflow,
    small_run,
    start_command,
    sweep_runs,
    wait_for_text,
)

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


@contextlib.contextmanager
def answering(api_status: int, api_delay_s: float = 0) -> Iterator[str]:
    """A local HTTP server whose ``/health`` answers 200 at once, and everything else ``api_status`` (an empty JSON
    object) after ``api_delay_s``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            api = self.path != "/health"
            if api:
                time.sleep(api_delay_s)
            self.send_response(api_status if api else 200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

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


@pytest.fixture
def answering_503() -> Iterator[str]:
    """A tracking server whose store is down."""
    with answering(503) as uri:
        yield uri


def test_a_server_whose_first_api_call_opens_its_store_is_waited_for(monkeypatch):
    """``/health`` answers at once, the API after the check's timeout for a connection: a server's first call opens
    its backend store (on a fresh PostgreSQL database, MLflow creates its tables), which a loaded machine took more
    than 5 s for; that was refused as unreachable. Now the API has MLflow's own request timeout, the user's if set."""
    monkeypatch.setattr(store_module, "TIMEOUT_S", 1)
    with answering(200, api_delay_s=2) as uri:
        check_usable(uri)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
        with pytest.raises(UsageError, match=r"is unreachable \(.*timed out.* on .*/api/2.0/mlflow/experiments/search"):
            check_usable(uri)


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


def server_process(uri: str) -> psutil.Process:
    """The ``mlflow server`` process :func:`serve_mlflow` started for ``uri``."""
    port = uri.rsplit(":", 1)[1]
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "server" in cmdline and "--port" in cmdline and cmdline[cmdline.index("--port") + 1] == port:
            return process
    raise AssertionError(f"no mlflow server on port {port}")


@pytest.mark.slow
def test_a_server_that_dies_mid_sweep_ends_it_in_one_line_and_the_same_command_loses_and_duplicates_nothing(
    tmp_path, shared_data, monkeypatch
):
    """The server is SIGKILLed while job 0 trains: the sweep ends in one line (exit 2; it ended 0 with a warning of
    Hydra's, after 9 minutes of MLflow's retries), job 0's checkpoint kept; the server started again, the same
    command resumes job 0 and trains job 1, each epoch logged once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a user's own, honoured: each failing call ends in ~2 s
    backend, epochs = f"sqlite:///{tmp_path / 'server.db'}", 4
    sweep = ("seed=0,1", f"epochs={epochs}", "limit_batches=4", "checkpoint.every_s=0")
    with serve_mlflow(backend, tmp_path) as uri:
        args = ("-m", *small_run(tmp_path, uri, shared_data, *sweep))
        process, log = start_command(tmp_path / "first", *args)
        wait_for_text(log, f"epoch 2/{epochs}", process)
        os.killpg(server_process(uri).pid, signal.SIGKILL)  # the server's whole process group, mid-run
        assert process.wait(timeout=900) == 2, log.read_text()[-3000:]  # was 0
    output = log.read_text()
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output and "Callback" not in output, output[-3000:]
    assert "went away" in errors[0] and "the same command again" in errors[0], errors[0]
    assert (tmp_path / "sweep" / "0" / "checkpoint.pt").is_file()

    with serve_mlflow(backend, tmp_path, port=int(uri.rsplit(":", 1)[1])) as again:
        assert again == uri
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr[-3000:]
        parents, jobs = sweep_runs(uri)
        client = mlflow.MlflowClient(uri)
        histories = {
            run.data.params["seed"]: {
                key: sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics
                if not key.startswith(("system/", "time/startup"))  # sampled / one per process
            }
            for run in jobs
        }
    assert sorted(run.info.status for run in parents) == ["FINISHED", "KILLED"]  # the first closed as its process gone
    (parent,) = [run for run in parents if run.info.status == "FINISHED"]
    assert sorted(run.data.params["seed"] for run in jobs) == ["0", "1"]  # each job one run
    assert {run.info.status for run in jobs} == {"FINISHED"}
    assert {run.data.tags["mlflow.parentRunId"] for run in jobs} == {parent.info.run_id}
    assert {run.data.params["seed"]: run.data.tags.get("resumes") for run in jobs} == {"0": "1", "1": None}
    for seed, history in histories.items():
        for key in ("train/loss", "val/auc"):
            assert history[key] == list(range(epochs)), (seed, key, history[key])  # each epoch once
        assert history["test/auc"] == [epochs], seed


def test_mlflows_retries_of_a_server_are_bounded_where_the_user_set_none(monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")  # the user's own
    bound_retries()
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == HTTP_RETRIES["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "4"
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"


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


def damage_page(path: Path, page: int) -> None:
    """Overwrite SQLite page ``page`` (1-based, past the first: the file's header) of ``path`` with bytes no page
    holds."""
    assert page > 1
    with contextlib.closing(sqlite3.connect(path)) as database:
        size = database.execute("PRAGMA page_size").fetchone()[0]
    with path.open("r+b") as file:
        file.seek((page - 1) * size)
        file.write(b"\xa5" * size)


def middle_table_page(path: Path) -> int:
    """The root page of a table or index nearest the middle of the database file: a page in use."""
    with contextlib.closing(sqlite3.connect(path)) as database:
        pages = database.execute("PRAGMA page_count").fetchone()[0]
        roots = [page for (page,) in database.execute("SELECT rootpage FROM sqlite_master WHERE rootpage > 1")]
    return min(roots, key=lambda page: abs(page - pages // 2))


def runs_page(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as database:
        return database.execute("SELECT rootpage FROM sqlite_master WHERE name = 'runs'").fetchone()[0]


DAMAGE = {
    "runs-page": lambda path: damage_page(path, runs_page(path)),
    "middle-page": lambda path: damage_page(path, middle_table_page(path)),
    "cut-short": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_an_sqlite_store_with_damaged_pages_is_one_line_naming_it_and_how_to_recover_it(tmp_path, store, damage):
    """Pages overwritten in a real store, or the file cut short: MLflow met them in a traceback (the store's check
    read only its table list), or trained into a store a page of which no query had read yet."""
    path = Path(store.removeprefix("sqlite:///"))
    client = mlflow.MlflowClient(store)
    client.create_run(client.create_experiment("medsweep"))  # a run's rows on the pages
    DAMAGE[damage](path)
    before = path.read_bytes()
    for check in (ensure_store, check_store):
        with pytest.raises(UsageError) as refused:
            check(store)
        message = str(refused.value)
        assert message.startswith(f"mlflow.tracking_uri={store} is a damaged SQLite database ({path}: "), message
        assert f"sqlite3 {path} .recover | sqlite3 {tmp_path / 'mlflow-recovered.db'}" in message, message
        assert "\n" not in message
    assert path.read_bytes() == before


@pytest.mark.slow
def test_a_run_into_a_damaged_store_or_a_port_nobody_listens_on_is_one_line_leaving_no_folder(
    tmp_path, store, shared_data
):
    """From a folder of its own, with the default folders (``outputs/``, ``sweeps/``) and a given one not there yet:
    none is left behind, and no run made."""
    path = Path(store.removeprefix("sqlite:///"))
    damage_page(path, runs_page(path))
    before = path.read_bytes()
    nobody = f"http://127.0.0.1:{free_port()}"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    common = [a for a in small_run(tmp_path, store, shared_data) if not a.startswith(("hydra.", "mlflow."))]
    cases = {
        "damaged": (f"mlflow.tracking_uri={store}", "is a damaged SQLite database"),
        "nobody": (f"mlflow.tracking_uri={nobody}", "is unreachable"),
    }
    for uri, problem in cases.values():
        for extra in ([], ["-m", "seed=0,1"], [f"hydra.run.dir={tmp_path}/given/run"], ["dry_run=true"]):
            result = run_cli(*extra, *common, uri, cwd=cwd, timeout=600)
            assert problem in one_error(result), (uri, extra)
            assert list(cwd.iterdir()) == [] and not (tmp_path / "given").exists(), (uri, extra)  # was: given/run
    assert path.read_bytes() == before  # no run, nothing written


@pytest.mark.slow
@pytest.mark.parametrize("lock", ["EXCLUSIVE", "IMMEDIATE"])
def test_a_store_another_process_holds_locked_is_one_line_naming_that_process(tmp_path, store, lock):
    """A transaction held open past MLflow's wait (a ``sqlite3`` shell left in one): EXCLUSIVE was refused as no
    SQLite database; IMMEDIATE (a write under way) passed the check, then MLflow failed in a traceback, exit 1."""
    path = Path(store.removeprefix("sqlite:///"))
    holder = (
        "import sqlite3, sys, time\n"
        f"database = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
        f"database.execute('BEGIN {lock}')\n"
        "database.execute('UPDATE experiments SET name = name')\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout.readline() == "held\n"
            message = refusal(store)
        finally:
            process.kill()
    assert f"is locked by pid {process.pid} (python" in message, message
    assert message.endswith("let it end or close it, then run again, or set mlflow.tracking_uri to another store")


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


@pytest.mark.slow
def test_an_sqlite_store_keeps_the_artifacts_beside_it_whatever_the_working_directory(tmp_path, shared_data):
    (tmp_path / "store").mkdir()
    (tmp_path / "cwd").mkdir()
    store = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1"), cwd=tmp_path / "cwd")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    beside = tmp_path / "store" / "mlartifacts" / run.info.experiment_id / run.info.run_id / "artifacts"
    assert run.info.artifact_uri == beside.as_uri()
    assert (beside / "metrics.json").is_file() and (beside / ".hydra" / "config.yaml").is_file()
    assert list((tmp_path / "cwd").iterdir()) == []


def test_an_experiment_with_artifacts_under_the_working_directory_is_used_with_one_warning(
    tmp_path, store, monkeypatch, caplog
):
    client = ensure_store(store)
    created = client.create_experiment("old", artifact_location=str(tmp_path / "mlruns" / "old"))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="src.tracking.store"):
        assert experiment_id(client, "old") == experiment_id(client, "old") == created
    assert own_messages(caplog) == [
        f"experiment old keeps its artifacts in {tmp_path / 'mlruns' / 'old'}, under the working directory "
        f"{tmp_path}: run from another folder, or set mlflow.experiment to a new experiment (its artifacts go "
        "beside the store)"
    ]
    assert client.get_experiment(created).artifact_location == str(tmp_path / "mlruns" / "old")  # left as it is


def test_an_experiment_medsweep_created_beside_the_store_is_used_without_a_warning_from_the_store_folder(
    tmp_path, store, monkeypatch, caplog
):
    """The default store is ``mlflow.db`` at the project root and the docs run from there: the experiment's artifacts
    in ``<root>/mlartifacts/<id>`` are under the working directory, yet where medsweep puts them wherever it runs."""
    client = ensure_store(store)
    created = experiment_id(client, "beside")  # made here: its artifacts in tmp_path / "mlartifacts" / <id>
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="src.tracking.store"):
        assert experiment_id(client, "beside") == created
    assert own_messages(caplog) == []


# -- a team's tracking server: PostgreSQL behind a real mlflow server --------------------------------------


POSTGRES = Path("/usr/lib/postgresql")
PROGRAMS = ("initdb", "pg_ctl", "postgres", "createdb")
USER, DATABASE = "medsweep", "mlflow"
SEEDS, OPTIMIZERS = ("0", "1"), ("adam", "sgd")


@pytest.fixture
def postgres_bin() -> Path:
    """The newest Debian PostgreSQL's ``bin`` folder, with ``psycopg`` (3) for MLflow to reach it: skip when either is
    missing, but fail under ``CI=true`` (CI installs both)."""
    found = [path for path in POSTGRES.glob("[0-9]*/bin") if all((path / name).is_file() for name in PROGRAMS)]
    missing = [
        name
        for name, present in (
            (f"PostgreSQL ({POSTGRES}/<version>/bin/{{{','.join(PROGRAMS)}}})", found),
            ("the psycopg package", importlib.util.find_spec("psycopg")),
        )
        if not present
    ]
    if not missing:
        return max(found, key=lambda path: float(path.parent.name))
    reason = (
        f"{' and '.join(missing)} not installed: apt-get install postgresql; pip install -c constraints.txt -e '.[dev]'"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


class Postgres:
    """A PostgreSQL server of its own in ``folder`` (data, logs, unix socket), run by Debian's programs in
    ``bin_dir``: as ``nobody`` when this process is root (the server refuses root), as this user otherwise."""

    def __init__(self, bin_dir: Path, folder: Path) -> None:
        self.bin_dir, self.folder, self.data = bin_dir, folder, folder / "data"
        self.owner: dict[str, Any] = {}  # subprocess.Popen's user, group
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            self.owner = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
            os.chown(folder, nobody.pw_uid, nobody.pw_gid)

    def program(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = run_process([str(self.bin_dir / name), *args], timeout=600, cwd=self.folder, **self.owner)
        assert not check or result.returncode == 0, f"{name} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        return result

    def start(self, tries: int = 5) -> int:
        """Start the server on a free port of 127.0.0.1 (another when the one picked was taken before the server
        bound it), waiting until it accepts connections (``pg_ctl -w``): its port."""
        for _ in range(tries):
            port = free_port()
            log = self.folder / f"postgres-{port}.log"
            options = {"listen_addresses": "127.0.0.1", "port": port, "unix_socket_directories": self.folder}
            result = self.program(
                "pg_ctl",
                *("start", "-D", str(self.data), "-l", str(log), "-w", "-t", "300"),
                *("-o", " ".join(f"-c {shlex.quote(f'{key}={value}')}" for key, value in options.items())),
                check=False,
            )
            if result.returncode == 0:
                return port
            if "already in use" not in log.read_text():
                raise AssertionError(f"PostgreSQL did not start:\n{result.stderr[-2000:]}\n{log.read_text()[-3000:]}")
        raise AssertionError(f"PostgreSQL never started in {tries} tries:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        """A fast shutdown; if the server still runs after it, SIGKILL to its process group (``pg_ctl`` starts it
        in a session of its own)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.program("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", "300", check=False)
        if (pid_file := self.data / "postmaster.pid").exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid_file.read_text().split()[0]), signal.SIGKILL)


@pytest.fixture
def postgres(postgres_bin: Path) -> Iterator[str]:
    """A real PostgreSQL server on 127.0.0.1 in a temp dir, with an empty database for MLflow: its SQLAlchemy
    URI. Always stopped."""
    with tempfile.TemporaryDirectory(prefix="medsweep-pg-") as name:  # reachable by nobody, unlike pytest's tmp_path
        server = Postgres(postgres_bin, Path(name))
        server.program(
            "initdb", "-D", str(server.data), "-U", USER, "--auth=trust", "--no-locale", "-E", "UTF8", "--no-sync"
        )
        try:
            port = server.start()
            server.program("createdb", "-h", name, "-p", str(port), "-U", USER, DATABASE)  # through the socket
            yield f"postgresql+psycopg://{USER}@127.0.0.1:{port}/{DATABASE}"
        finally:
            server.stop()


def epoch_lines(log: Path) -> dict[int, dict[str, float]]:
    """Each epoch's metrics as the job's log printed them (``epoch 1/2 train/loss=0.6931 ...``, 4 significant
    digits): ``{epoch index: {key: value}}``."""
    epochs = {}
    for match in re.finditer(r"\bepoch (\d+)/\d+ (.+)$", log.read_text(), re.MULTILINE):
        epochs[int(match[1]) - 1] = {key: float(value) for key, value in re.findall(r"(\S+)=(\S+)", match[2])}
    return epochs


@pytest.mark.slow
def test_a_parallel_sweep_into_mlflow_on_postgresql_loses_and_duplicates_nothing(tmp_path, postgres, shared_data):
    with serve_mlflow(postgres, tmp_path) as uri:
        result = run_cli(
            "-m",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            *small_run(tmp_path, uri, shared_data, f"seed={','.join(SEEDS)}", f"optim={','.join(OPTIMIZERS)}"),
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        client = mlflow.MlflowClient(uri)
        everything = client.search_runs([e.experiment_id for e in client.search_experiments()])
        histories = {
            run.info.run_id: {
                key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics
            }
            for run in everything
        }

    import psycopg  # the dev extras' driver, found by the fixture

    with psycopg.connect(postgres.replace("+psycopg", "")) as database:  # the runs are in PostgreSQL, no other store
        assert database.execute("SELECT count(*) FROM runs").fetchone() == (len(everything),)

    for metrics in histories.values():
        for key, points in metrics.items():
            steps = [step for step, _ in points]
            assert len(steps) == len(set(steps)), (key, steps)  # no value logged twice

    sweep = tmp_path / "sweep"
    (parent,) = [run for run in everything if run.data.tags.get("role") == "sweep"]
    assert parent.info.status == "FINISHED" and parent.info.run_id == (sweep / PARENT_ID_FILE).read_text().strip()
    children = [run for run in everything if run is not parent]
    assert len(children) == 4 and {run.info.status for run in children} == {"FINISHED"}
    assert {run.data.tags.get("mlflow.parentRunId") for run in children} == {parent.info.run_id}
    assert sorted((run.data.params["seed"], run.data.params["optim.name"]) for run in children) == sorted(
        itertools.product(SEEDS, OPTIMIZERS)
    )  # every job once

    jobs = {str(folder.resolve()): folder for folder in sweep.iterdir() if folder.is_dir() and folder.name.isdigit()}
    assert sorted(folder.name for folder in jobs.values()) == ["0", "1", "2", "3"]
    assert sorted(run.data.tags["output_dir"] for run in children) == sorted(jobs)  # one run per job folder
    for run in children:
        folder = jobs[run.data.tags["output_dir"]]
        assert run.data.tags["overrides"] == " ".join(OmegaConf.load(folder / ".hydra" / "overrides.yaml"))
        config = flatten(OmegaConf.load(folder / ".hydra" / "config.yaml"))
        epochs = int(config["epochs"])
        effective = int(config["batch_size"]) * int(config["accumulate"])
        assert run.data.params == {**config, "effective_batch_size": str(effective), "world_size": "1"}

        history = histories[run.info.run_id]
        printed = epoch_lines(folder / "train.log")
        assert sorted(printed) == list(range(epochs))
        for key in set().union(*printed.values()):  # each epoch's value once, as the job printed it
            expected = [(epoch, pytest.approx(printed[epoch][key], rel=1e-3, nan_ok=True)) for epoch in range(epochs)]
            assert history[key] == expected, key
        final = json.loads((folder / "metrics.json").read_text())
        assert {key: history[key] for key in final} == {key: [(epochs, value)] for key, value in final.items()}
