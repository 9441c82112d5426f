"""The MLflow store: where it is, that it answers, and what it already holds."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import sqlite3
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import psutil
from mlflow.entities import ExperimentTag, LifecycleStage, ViewType
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException
from requests.exceptions import ConnectionError as RequestsConnectionError
from requests.exceptions import RequestException, Timeout
from sqlalchemy.exc import SQLAlchemyError

from src.errors import UsageError
from src.folders import writable
from src.redaction import as_given, reveal_store

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACKING_URI = f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"
SCHEMES = "use sqlite:///<file>, http(s)://<server>, or a database's postgresql://, mysql:// or mssql://"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"  # where MLflow's own tools look for a store: honoured below the config key
EXPERIMENT_KIND, TRAINING = "mlflow.experimentKind", "custom_model_development"  # the UI opens on training runs
ARTIFACTS_FOLDER = "mlartifacts"  # beside an SQLite store, as `mlflow server` keeps ./mlartifacts beside its own
TIMEOUT_S = 5  # for each connection and answer of the store's check
SQLITE_WAIT_S = 20  # for another process's lock on an SQLite store: MLflow's own wait (its busy_timeout)
CONNECT_TIMEOUT_ARG = {"postgresql": "connect_timeout", "mysql": "connect_timeout", "mssql": "timeout"}  # drivers'
SEARCH_EXPERIMENTS = "/api/2.0/mlflow/experiments/search"  # what the check asks a tracking server
CORE_TABLES = ("experiments", "runs", "tags", "params", "metrics", "latest_metrics")  # of MLflow's schema
STORE_ERRORS = (MlflowException, SQLAlchemyError, RequestException, sqlite3.Error)  # what a failing store raises
HTTP_RETRIES = {  # MLflow's retries of a call to a tracking server, where the user set none: ~30 s, not ~4 min
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "4",  # MLflow's 7 ...
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",  # ... waiting 2 x 2^k s (MLflow's factor): 0, 4, 8, 16 s here
}


def tracking_uri(cfg: Any) -> str:
    """``mlflow.tracking_uri``; else MLflow's own environment variable ``MLFLOW_TRACKING_URI``, where set; else the
    SQLite store at the project root: as it is opened, a secret the command concealed put back (:func:`reveal_store`).
    """
    given = cfg.mlflow.tracking_uri or os.environ.get(TRACKING_URI_ENV, "").strip() or DEFAULT_TRACKING_URI
    return reveal_store(given)


def ensure_store(uri: str) -> mlflow.MlflowClient:
    """Check the store (:func:`check_usable`, :func:`probe_tables`) and open it, creating a fresh SQLite database now
    (before any job starts)."""
    one_line_store_errors()
    check_usable(uri)
    with exclusive_open(uri):  # the tables checked while no other process is creating them
        probe_tables(uri)
        try:
            client = mlflow.MlflowClient(uri)
            client.search_experiments(max_results=1)
        except UnsupportedModelRegistryStoreURIException:  # MLflow's, for any store: its innermost error is a KeyError
            raise unusable(uri, "has a scheme no MLflow store serves", SCHEMES) from None
        except Exception as err:  # any store failure is the user's URI to fix
            raise unusable(
                uri, f"cannot be used ({innermost_reason(err)})", "fix or change mlflow.tracking_uri"
            ) from None
    return client


def check_store(uri: str) -> None:
    """What :func:`ensure_store` checks, creating nothing (a dry run): an SQLite database not created yet stays so,
    only its folder is checked."""
    if store_exists(uri):
        ensure_store(uri)
    else:
        check_usable(uri)


def check_usable(uri: str) -> None:
    """Refuse in seconds, creating nothing, a store that cannot be used: a server that does not answer at once (MLflow
    retries for minutes), an SQLite database or folder this process cannot write."""
    if uri.startswith("sqlite:") and sqlite_path(uri) is None:
        raise unusable(
            uri,
            "is an in-memory SQLite database: its runs go when the process ends",
            "name a file, e.g. mlflow.tracking_uri=sqlite:///mlflow.db",
        )
    if uri.startswith(("http://", "https://")):
        bound_retries()
        probe_server(uri)
    elif (path := sqlite_path(uri)) is not None:
        probe_sqlite(uri, path)
    elif (backend := uri.partition(":")[0].partition("+")[0]) in CONNECT_TIMEOUT_ARG:
        probe_database(uri, backend)


def probe_server(uri: str) -> None:
    """The tracking server answers ``/health`` within :data:`TIMEOUT_S`, then its REST API within MLflow's own request
    timeout (``MLFLOW_HTTP_REQUEST_TIMEOUT``, 120 s unless set: a server's first call opens its backend store, on a
    fresh database creating its tables), once each: MLflow's HTTP client with no retry (its credentials and TLS
    settings)."""
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_TIMEOUT
    from mlflow.tracking._tracking_service.utils import get_default_host_creds  # what MLflow's RestStore sends
    from mlflow.utils.rest_utils import http_request

    probes = (
        ("/health", "GET", None, TIMEOUT_S),
        (SEARCH_EXPERIMENTS, "POST", {"max_results": 1}, MLFLOW_HTTP_REQUEST_TIMEOUT.get()),
    )
    for endpoint, method, body, timeout in probes:
        url = f"{uri.rstrip('/')}{endpoint}"
        try:
            reply = http_request(
                get_default_host_creds(uri),
                endpoint,
                method,
                max_retries=0,
                timeout=timeout,
                raise_on_status=False,
                json=body,
            )
        except MlflowException as err:
            reason = innermost_reason(err)
            raise StoreGone(
                unusable(
                    uri,
                    f"is unreachable ({reason} on {url})",
                    "start the server (mlflow server) or set mlflow.tracking_uri to a reachable store",
                ),
                reason,
            ) from None
        if reply.status_code != 200:
            raise unusable(
                uri,
                f"cannot be used: the server answered {reply.status_code} on {url}",
                "see the server's log, or set mlflow.tracking_uri to another store",
            )


def bound_retries() -> None:
    """A tracking server that goes away mid-run fails the job's next call in ~30 s (:data:`HTTP_RETRIES`), not after
    MLflow's ~4 minutes of retries for each call (the job's, its system metrics', the sweep's parent run's: 9 minutes
    and more in all); the job then stops at the checkpoint that holds its epochs' metrics, and the same command
    resumes it. The user's own ``MLFLOW_HTTP_REQUEST_*`` stand; set in the environment, the job's ranks and a sweep's
    workers inherit them."""
    for name, value in HTTP_RETRIES.items():
        os.environ.setdefault(name, value)


class StoreGone(UsageError):
    """The check's line of a store that cannot be reached (:func:`probe_server`, :func:`probe_database`); ``reason``:
    what the connection met (``Connection refused``)."""

    def __init__(self, line: UsageError, reason: str) -> None:
        super().__init__(str(line))
        self.reason = reason


def went_away(error: BaseException) -> bool:
    """Whether ``error`` (a store's) says the store cannot be reached: a tracking server that stopped answering, a
    database server gone (its connection refused, reset or timed out)."""
    while error is not None:
        if isinstance(error, (RequestsConnectionError, Timeout, ConnectionError, TimeoutError, StoreGone)):
            return True
        if isinstance(error, SQLAlchemyError) and getattr(error, "connection_invalidated", False):
            return True
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return False


def probe_database(uri: str, backend: str) -> None:
    """One connection to the database server, given up after :data:`TIMEOUT_S` (MLflow's engine retries for
    minutes)."""
    import sqlalchemy  # for database servers only

    try:
        engine = sqlalchemy.create_engine(
            uri, poolclass=sqlalchemy.pool.NullPool, connect_args={CONNECT_TIMEOUT_ARG[backend]: TIMEOUT_S}
        )
        engine.connect().close()
    except Exception as err:  # the driver's error, a malformed URI, a driver not installed
        refused = unusable(
            uri,
            f"cannot be connected to ({innermost_reason(err)})",
            "start the database server, or fix the URI's host, port, user, password, database or driver",
        )
        raise (StoreGone(refused, innermost_reason(err)) if went_away(err) else refused) from None


def probe_sqlite(uri: str, path: Path) -> None:
    """The database is a file this process can write (a write rolled back), or its folder is, to create it in."""
    if path.is_dir():
        raise unusable(
            uri,
            "is a folder, not an SQLite database file",
            f"name a file in it, e.g. mlflow.tracking_uri=sqlite:///{path / 'mlflow.db'}",
        )
    if not path.parent.is_dir():
        raise unusable(
            uri,
            f"cannot be created: folder {path.parent} does not exist",
            "create it or set mlflow.tracking_uri to another store",
        )
    if not path.exists():
        try:  # a file made and gone: permissions (root passes os.access) and file systems that refuse files (/proc)
            tempfile.TemporaryFile(dir=path.parent).close()
        except OSError:
            raise read_only(uri, path.parent) from None
        return
    if not path.is_file():  # a pipe would block the open, a device is no database
        raise not_sqlite(uri, f"is not a usable SQLite database ({path} is not a regular file)")
    error = write_error(path)
    if error is None:
        return
    if "readonly" in str(error):
        raise read_only(uri, path if os.access(path.parent, os.W_OK) else path.parent)
    if "disk is full" in str(error):
        raise unusable(uri, f"has no space left on its disk ({path.parent})", "free space, or set another store")
    raise sqlite_problem(uri, path, error)


def probe_tables(uri: str) -> None:
    """An existing SQLite database holds no table yet, or MLflow's (``alembic_version``, :data:`CORE_TABLES`), whose
    pages read whole (:func:`damage`), read without writing: MLflow would add its tables to another application's
    database, and fail in tracebacks on a damaged one."""
    path = sqlite_path(uri)
    if path is None or not path.exists():
        return
    try:
        with contextlib.closing(read_only_connection(path)) as connection:
            tables = {name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as err:
        raise sqlite_problem(uri, path, err) from None
    if not tables:
        return
    if "alembic_version" not in tables:
        raise not_sqlite(uri, f"is not an MLflow store: {path} holds {len(tables)} tables, none alembic_version")
    if lost := [name for name in CORE_TABLES if name not in tables]:
        raise not_sqlite(uri, f"is a damaged MLflow store: {path} has no table {', '.join(lost)}")
    if found := damage(str(path.resolve())):
        raise damaged(uri, path, found)


def read_only_connection(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=SQLITE_WAIT_S)


@functools.cache
def damage(path: str) -> str | None:
    """What SQLite's ``PRAGMA quick_check`` finds wrong in the database at ``path`` (pages overwritten, a file cut
    short): its first line, None where every page reads whole. Once per process and file: it reads every page (on
    the 2-core EPYC, ~1 s for 280 MiB in the page cache, 2026-11-29)."""
    try:
        with contextlib.closing(read_only_connection(Path(path))) as connection:
            found = [line for (text,) in connection.execute("PRAGMA quick_check") for line in str(text).splitlines()]
    except sqlite3.Error as err:
        return str(err)
    found = [line for line in found if line.strip() and not line.startswith("*** in database")]
    return None if found == ["ok"] else found[0] if found else None


def sqlite_problem(uri: str, path: Path, error: sqlite3.Error) -> UsageError:
    """The one line of an SQLite database that opening or reading failed on: locked, damaged, or no database."""
    text = str(error)
    if "locked" in text:
        return locked(uri, path)
    if "malformed" in text:
        return damaged(uri, path, text)
    return not_sqlite(uri, f"is not a usable SQLite database ({path}: {text})")


def damaged(uri: str, path: Path, found: str) -> UsageError:
    recovered = path.with_name(f"{path.stem}-recovered{path.suffix}")
    return unusable(
        uri,
        f"is a damaged SQLite database ({path}: {found})",
        f"restore it from a backup, or copy out what it still holds (sqlite3 {path} .recover | sqlite3 {recovered}) "
        f"and set mlflow.tracking_uri=sqlite:///{recovered}, or point mlflow.tracking_uri at a new file",
    )


def locked(uri: str, path: Path) -> UsageError:
    """The one line of a database another process holds locked past MLflow's wait (:data:`SQLITE_WAIT_S`), which
    MLflow met with a traceback; it names the processes that have it open, where this user may see them."""
    holders = [f"pid {process.pid} ({process.name()})" for process in holding(path)]
    by = f" by {', '.join(holders[:3])}" if holders else ""
    return unusable(
        uri,
        f"is locked{by}: another process has held {path} locked for {SQLITE_WAIT_S} s or more (an open transaction)",
        "let it end or close it, then run again, or set mlflow.tracking_uri to another store",
    )


def holding(path: Path) -> list[psutil.Process]:
    """The other processes of this machine that have ``path`` open (those this user may inspect)."""
    target, found = str(path.resolve()), []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and any(f.path == target for f in process.open_files()):
                found.append(process)
    return found


def not_sqlite(uri: str, problem: str) -> UsageError:
    return unusable(uri, problem, "point mlflow.tracking_uri at an MLflow SQLite database or at a new file")


def write_error(path: Path) -> sqlite3.Error | None:
    """What writing the existing SQLite database ``path`` raises, None when it can be written: a write rolled back,
    the file neither created nor changed (a read-only folder refuses the write's journal)."""
    try:
        database = sqlite3.connect(
            f"{path.absolute().as_uri()}?mode=rw", uri=True, isolation_level=None, timeout=SQLITE_WAIT_S
        )
        with contextlib.closing(database) as connection:  # closing rolls the transaction back
            connection.execute("BEGIN IMMEDIATE")  # waits for another process's write as MLflow would
            (version,) = connection.execute("PRAGMA user_version").fetchone()
            connection.execute(f"PRAGMA user_version = {version}")
    except sqlite3.Error as err:
        return err
    return None


def read_only(uri: str, target: Path) -> UsageError:
    kind = "folder" if target.is_dir() else "database"
    return unusable(
        uri,
        f"is read-only: {kind} {target} is read-only for this user",
        "make it writable, or set mlflow.tracking_uri to a store in a writable folder",
    )


@contextlib.contextmanager
def exclusive_open(uri: str) -> Iterator[None]:
    """MLflow's opening of an SQLite store one process at a time (an exclusive lock on its folder): MLflow creates a
    fresh database's tables in steps that break when processes interleave them. A folder that cannot be locked (NFS
    locks only files open for writing) is opened unlocked, as MLflow does."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the lock


def unusable(uri: str, problem: str, fix: str) -> UsageError:
    """The one line that says which store cannot be used, why, and what to do."""
    return UsageError(f"mlflow.tracking_uri={redacted(uri)} {problem}: {fix}")


class OneLine(logging.Filter):
    """A record's error (and its traceback) as the one line :func:`innermost_reason` gives."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg, record.args = (
                f"{record.getMessage().splitlines()[0]} {innermost_reason(record.exc_info[1])}",
                (),
            )
            record.exc_info = record.exc_text = None
        return True


@functools.cache
def one_line_store_errors() -> None:
    """MLflow's SQL store logs each database error with its traceback before it raises the error, which medsweep then
    says in one line: its own log of it keeps one line too."""
    logging.getLogger("mlflow.store.db.utils").addFilter(OneLine())


def innermost_reason(err: BaseException) -> str:
    """The first line of the innermost error behind ``err`` (``Connection refused``, ``file is not a database``), as
    a traceback would show it first; a store the check found gone, what its connection met."""
    while (inner := err.__cause__ or (None if err.__suppress_context__ else err.__context__)) is not None:
        err = inner
    if isinstance(err, StoreGone):
        return err.reason
    text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


def redacted(uri: str) -> str:
    """``uri`` as messages print it: as the user gave it, its secrets, if any, as ``***`` (:mod:`src.redaction`)."""
    return as_given(uri)


def sqlite_path(uri: str) -> Path | None:
    """The database file an SQLite store URI names (relative to the working directory when relative); None for
    other stores and an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    name = uri.removeprefix("sqlite:///").partition("?")[0]
    return Path(name) if name not in ("", ":memory:") else None


def artifact_root(uri: str) -> str | None:
    """Where an SQLite store's new experiments keep their artifacts: ``<store's folder>/mlartifacts`` (the folder
    ``mlflow server`` uses by default), as an absolute file URI, whatever the working directory; None for other
    stores (their server decides)."""
    path = sqlite_path(uri)
    return None if path is None else (path.resolve().parent / ARTIFACTS_FOLDER).as_uri()


def experiment_id(client: mlflow.MlflowClient, name: str) -> str:
    """The id of experiment ``name``, tagged ``mlflow.experimentKind=custom_model_development`` (MLflow's UI then
    opens it on its training runs, not its GenAI overview); created if missing, in an SQLite store with its
    artifacts in ``<artifact_root>/<experiment id>``. One that keeps them under the working directory is used as it
    is, with a warning. Another process creating it at the same moment is no error: its experiment is used. One no
    run can be created in is refused (:func:`usable_experiment`)."""
    experiment = usable_experiment(client, name)
    if experiment is None:
        try:
            return create_experiment(client, name)
        except MlflowException as err:
            if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
                raise
        experiment = client.get_experiment_by_name(name)
    warn_if_under_cwd(experiment.name, experiment.artifact_location, artifact_root(client.tracking_uri))
    if experiment.tags.get(EXPERIMENT_KIND) != TRAINING:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND, TRAINING)
    return experiment.experiment_id


def usable_experiment(client: mlflow.MlflowClient, name: str) -> mlflow.entities.Experiment | None:
    """Experiment ``name`` (None where missing), a :class:`UsageError` where no run can be created in it: deleted, or
    its local artifact folder (a new one's: :func:`artifact_root`) not writable: its deepest existing folder is tried,
    so nothing is created (and removed under a parallel job's feet)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None and experiment.lifecycle_stage == LifecycleStage.DELETED:
        number, uri = experiment.experiment_id, redacted(client.tracking_uri)
        store = "<the server's store>" if uri.startswith(("http://", "https://")) else uri
        raise UsageError(
            f"mlflow.experiment={name} is deleted (experiment {number} of mlflow.tracking_uri={uri}): restore it "
            f"(MLFLOW_TRACKING_URI={uri} mlflow experiments restore --experiment-id {number}), give another "
            f"mlflow.experiment, or delete it for good "
            f"(mlflow gc --backend-store-uri {store} --experiment-ids {number})"
        )
    location = experiment.artifact_location if experiment else artifact_root(client.tracking_uri)
    if location is not None and (folder := local_folder(location)) is not None:
        existing = next(path for path in (folder, *folder.parents) if path.exists())
        shown = folder if existing == folder else f"{folder} ({existing})"
        writable(
            existing,
            f"mlflow.experiment={name}: its artifact folder {shown}",
            "make it a folder this process can write, or set mlflow.experiment or mlflow.tracking_uri to another",
        )
    return experiment


def create_experiment(client: mlflow.MlflowClient, name: str) -> str:
    """A new experiment ``name`` of training runs, in an SQLite store with its artifacts beside the store."""
    root = artifact_root(client.tracking_uri)
    tags = {EXPERIMENT_KIND: TRAINING}
    if root is None:
        return client.create_experiment(name, tags=tags)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore  # what the client opens an SQLite store with

    return SqlAlchemyStore(client.tracking_uri, root).create_experiment(
        name, tags=[ExperimentTag(k, v) for k, v in tags.items()]
    )


@functools.cache
def warn_if_under_cwd(name: str, location: str, own: str | None = None) -> None:
    """Warn once per experiment and location when the artifacts of ``name`` go under the working directory; not when
    they are in the store's own artifact folder (``own``, :func:`artifact_root`): the default store at the project
    root, run from there, keeps them in ``<project>/mlartifacts`` wherever the command runs."""
    folder, cwd = local_folder(location), Path.cwd().resolve()
    own_folder = local_folder(own) if own else None
    if own_folder is not None and folder is not None and folder.resolve().is_relative_to(own_folder.resolve()):
        return
    if folder is not None and folder.resolve().is_relative_to(cwd):
        log.warning(
            "experiment %s keeps its artifacts in %s, under the working directory %s: run from another folder, "
            "or set mlflow.experiment to a new experiment (its artifacts go beside the store)",
            name,
            location,
            cwd,
        )


def local_folder(location: str) -> Path | None:
    """The folder an artifact location names on this machine (a path or a ``file://`` URI); None for remote ones."""
    parsed = urllib.parse.urlparse(location)
    return Path(urllib.parse.unquote(parsed.path)) if parsed.scheme in ("", "file") else None


def store_exists(uri: str) -> bool:
    """False only for an SQLite store whose database file is not there yet (opening it would create it)."""
    path = sqlite_path(uri)
    return path is None or path.exists()


def find_run(uri: str, run_id: str) -> mlflow.entities.Run | None:
    """Run ``run_id`` of the store at ``uri``; None where the store has no such run or is not created yet (it stays
    so)."""
    if not store_exists(uri):
        return None
    try:
        return ensure_store(uri).get_run(run_id)
    except MlflowException:
        return None


def finished_run(uri: str, experiment: str, hashed: str, fingerprint: str) -> mlflow.entities.Run | None:
    """The latest FINISHED run of ``experiment`` tagged ``config_hash=hashed``: the latest with
    ``code_fingerprint=fingerprint`` when there is one, else the latest of any code; a store not created yet has
    none."""
    done = finished_runs(uri, experiment, f"tags.config_hash = '{hashed}'")
    return next((run for run in done if run.data.tags.get("code_fingerprint") == fingerprint), next(iter(done), None))


def finished_runs(uri: str, experiment: str, filter_string: str) -> list[mlflow.entities.Run]:
    """The FINISHED runs of ``experiment`` that match ``filter_string``, latest first (at most 1000, one page); none
    in a store not created yet, which stays so. An experiment no run can be created in is refused
    (:func:`usable_experiment`): the plan's check, before any run."""
    if not store_exists(uri):
        return []
    client = ensure_store(uri)
    found = usable_experiment(client, experiment)
    if found is None:
        return []
    return client.search_runs(
        [found.experiment_id],
        order_by=["attributes.end_time DESC"],
        filter_string=f"{filter_string} and attributes.status = 'FINISHED'",
    )


def best_metric(client: mlflow.MlflowClient, run_id: str, key: str) -> float:
    """The highest value ``key`` reached in the run (the value itself for a metric logged once); NaN where the run
    has none (a run of older code, a hand-edited store)."""
    return max((metric.value for metric in client.get_metric_history(run_id, key)), default=float("nan"))


def search_all(
    client: mlflow.MlflowClient, experiment_id: str, filter_string: str = "", view: int = ViewType.ACTIVE_ONLY
) -> list[mlflow.entities.Run]:
    """Every run of the experiment that ``filter_string`` selects (of ``view``: active runs, or those deleted in the
    UI), page by page."""
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string, view, max_results=1000, page_token=token)
        runs += page
        token = page.token
        if not token:
            return runs
