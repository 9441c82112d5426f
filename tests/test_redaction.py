"""src/redaction.py: a secret in a URI (a password in its user part, a token in its query) is shown and stored only
as ``***``: on the console, in the log, in MLflow's params and tags, in the files Hydra and medsweep write and
upload; the real one is kept in the environment and put back only where the store or file is opened. Proven against
a real ``mlflow server`` behind a real proxy that demands the password (HTTP basic auth, as a team server does)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import logging
import os
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from src.redaction import (
    CONCEALED_ENV,
    MASK,
    PASSWORD_ENV,
    USERNAME_ENV,
    as_given,
    conceal_arguments,
    redact,
    reveal,
    reveal_store,
)
from tests.helpers import JOBLIB, clean_error_line, run_cli, serve_mlflow, small_run

USER, PASSWORD = "alice", "S3cr3t p@ss:w/rd"  # a space, an @, a colon and a slash: percent-encoded in the URI
ENCODED = urllib.parse.quote(PASSWORD, safe="")


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://alice:pw@host:5000", "http://alice:***@host:5000"),
        ("https://alice:pw@host:5000/mlflow?x=1#f", "https://alice:***@host:5000/mlflow?x=1#f"),
        (f"http://alice:{ENCODED}@127.0.0.1:5000", "http://alice:***@127.0.0.1:5000"),
        ("http://alice:p@ss@host/", "http://alice:***@host/"),  # an @ left unencoded: the last one ends it
        ("http://alice:pa/ss@host", "http://alice:***@host"),  # a / left unencoded
        ("http://alice:p w@host", "http://alice:***@host"),  # a whole value: a space left unencoded
        ("http://:pw@host", "http://:***@host"),  # a password, no user
        ("http\\://alice\\:pw@127.0.0.1\\:5000 seed=0", "http\\://alice\\:***@127.0.0.1\\:5000 seed=0"),  # Hydra's
        ("mlflow.tracking_uri=http://a:pw@h1,http://b:qw@h2", "mlflow.tracking_uri=http://a:***@h1,http://b:***@h2"),
        ("x=http://a:pw@h1,y=http://b:qw@h2", "x=http://a:***@h1,y=http://b:***@h2"),
        ("mlflow.tracking_uri='http://a:p w@h'", "mlflow.tracking_uri='http://a:***@h'"),  # quoted, with a space
        (
            "override_dirname: a=1,mlflow.tracking_uri=http://u:pw@h:1,seed=0",
            "override_dirname: a=1,mlflow.tracking_uri=http://u:***@h:1,seed=0",
        ),
        (
            "  tracking_uri: postgresql+psycopg://u:pw@127.0.0.1:5432/db\n",
            "  tracking_uri: postgresql+psycopg://u:***@127.0.0.1:5432/db\n",
        ),
        ("postgresql://u@h/db?password=pw&sslmode=require", "postgresql://u@h/db?password=***&sslmode=require"),
        ("https://h/f.npz?token=abc&x=1", "https://h/f.npz?token=***&x=1"),
        (
            "https://h/f?X-Amz-Signature=abc&X-Amz-Security-Token=def",
            "https://h/f?X-Amz-Signature=***&X-Amz-Security-Token=***",
        ),
        ("https://h/f?sig=abc;api_key=k", "https://h/f?sig=***;api_key=***"),
        (
            "error: mlflow.tracking_uri=http://a:pw@127.0.0.1:9 is unreachable (refused on http://a:pw@127.0.0.1:9/health)",
            "error: mlflow.tracking_uri=http://a:***@127.0.0.1:9 is unreachable (refused on http://a:***@127.0.0.1:9/health)",
        ),
    ],
)
def test_a_secret_in_a_uri_is_shown_as_stars(text, shown):
    assert redact(text) == shown
    assert redact(shown) == shown  # shown as it is: nothing left to redact


@pytest.mark.parametrize(
    "text",
    [
        "http://alice@host:5000",  # a user, no password
        "http://127.0.0.1:5000/#/experiments/1/runs/abc",
        "MLflow run abc in http://host:5000; output /tmp/run",
        "sqlite:////tmp/a b/mlflow.db",
        "pid=123@1700000000.25 host=node1",
        "model=resnet10 optim.lr=-0.5 tags=[a,b]",
        "postgresql://u@h/db?sslmode=require&application_name=medsweep",
        "",
    ],
)
def test_text_without_a_secret_is_shown_unchanged(text):
    assert redact(text) == text


def test_a_log_record_of_any_logger_is_redacted(caplog):
    caplog.set_level(logging.INFO)
    logging.getLogger("hydra.core.utils").info("\t#0 : mlflow.tracking_uri=%s seed=0", "http\\://a\\:pw@h\\:1")
    logging.getLogger("src.jobs.job").info("MLflow run %s in %s", "abc", "postgresql://u:pw@h/db")
    assert [r.getMessage() for r in caplog.records] == [
        "\t#0 : mlflow.tracking_uri=http\\://a\\:***@h\\:1 seed=0",
        "MLflow run abc in postgresql://u:***@h/db",
    ]


def test_a_concealed_uri_is_revealed_only_where_it_is_opened(monkeypatch):
    for name in (CONCEALED_ENV, USERNAME_ENV, PASSWORD_ENV):
        monkeypatch.delenv(name, raising=False)
    argv = [
        "-m",
        f"mlflow.tracking_uri=http://{USER}:{ENCODED}@127.0.0.1:5000",
        "data.url='https://h/f.npz?token=tok'",
        "seed=0,1",
        "hydra.launcher.n_jobs=2",
    ]
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", ["train", *argv])
        concealed = conceal_arguments(argv)
    assert concealed == [
        "-m",
        "mlflow.tracking_uri=http://alice:***@127.0.0.1:5000",
        "data.url='https://h/f.npz?token=***'",
        "seed=0,1",
        "hydra.launcher.n_jobs=2",
    ]
    # an HTTP store: MLflow sends the user and password it reads from its own variables; no URI holds them
    assert reveal_store("http://alice:***@127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert as_given("http://127.0.0.1:5000") == "http://alice:***@127.0.0.1:5000"  # as messages name it
    assert (os.environ[USERNAME_ENV], os.environ[PASSWORD_ENV]) == (USER, PASSWORD)
    assert reveal("https://h/f.npz?token=***") == "https://h/f.npz?token=tok"
    assert reveal("https://other/f.npz?token=***") == "https://other/f.npz?token=***"  # not one concealed here
    assert MASK == "***"


class AuthProxy(http.server.ThreadingHTTPServer):
    """A real HTTP proxy on 127.0.0.1 that passes a request to ``upstream`` only with the basic-auth header of
    ``user``/``password`` (401 without it), as a team's MLflow behind a reverse proxy does; it counts both."""

    def __init__(self, upstream: str, user: str, password: str) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.passed = self.refused = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), ProxyHandler)


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: AuthProxy

    def log_message(self, *_) -> None:  # quiet
        pass

    def relay(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Authorization") != self.server.expected:
            with self.server.lock:
                self.server.refused += 1
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with self.server.lock:
            self.server.passed += 1
        upstream = http.client.HTTPConnection(self.server.upstream.hostname, self.server.upstream.port, timeout=120)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("authorization", "host", "connection")}
        upstream.request(self.command, self.path, body=body, headers=headers)
        reply = upstream.getresponse()
        data = reply.read()
        self.send_response(reply.status)
        for key, value in reply.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        upstream.close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = relay


@contextlib.contextmanager
def auth_proxy(upstream: str) -> Iterator[AuthProxy]:
    proxy = AuthProxy(upstream, USER, PASSWORD)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.fixture
def guarded_server(tmp_path: Path) -> Iterator[tuple[str, AuthProxy]]:
    """A real ``mlflow server`` (SQLite store and artifacts in ``tmp_path``) behind :class:`AuthProxy`: the URI with
    the password, and the proxy."""
    with serve_mlflow(f"sqlite:///{tmp_path / 'server.db'}", tmp_path) as upstream, auth_proxy(upstream) as proxy:
        yield f"http://{USER}:{ENCODED}@127.0.0.1:{proxy.server_address[1]}", proxy


def leaks(tmp_path: Path, *outputs: str) -> list[str]:
    """Where the password (as given, percent-encoded, or base64 in a basic-auth header) shows: the commands' outputs,
    then every file under ``tmp_path`` (the store's database and artifacts, the sweep and report folders)."""
    forms = [PASSWORD, ENCODED, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()]
    found = [f"output {i}" for i, text in enumerate(outputs) if any(form in text for form in forms)]
    for path in sorted(tmp_path.rglob("*")):
        if path.is_file() and any(form.encode() in path.read_bytes() for form in forms):
            found.append(str(path.relative_to(tmp_path)))
    return found


@pytest.mark.slow
def test_a_password_in_the_tracking_uri_reaches_the_server_and_nothing_else(
    tmp_path, guarded_server, shared_data, monkeypatch
):
    uri, proxy = guarded_server
    sweep = run_cli("-m", *JOBLIB, *small_run(tmp_path, uri, shared_data, "epochs=1", "seed=0,1"))
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    report = run_cli(f"sweep={tmp_path}/sweep", f"mlflow.tracking_uri={uri}", module="src.report")
    assert report.returncode == 0, report.stderr[-3000:]
    assert proxy.refused == 0 and proxy.passed > 20  # every request of every process carried the password
    assert leaks(tmp_path, sweep.stdout, sweep.stderr, report.stdout, report.stderr) == []
    shown = uri.replace(ENCODED, MASK)
    monkeypatch.setenv(USERNAME_ENV, USER)  # now, not for the commands: MLflow's own way to give the credentials
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    client = mlflow.MlflowClient(reveal_store(shown))
    runs = client.search_runs([client.get_experiment_by_name("medsweep").experiment_id])
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}
    for run in runs:  # a job's overrides as Hydra escapes them (http\://alice\:***@...), the sweep's as given
        assert redact(run.data.tags["overrides"]) == run.data.tags["overrides"]
        assert f"{USER}:{MASK}@" in run.data.tags["overrides"].replace("\\:", ":")
    assert {r.data.params["mlflow.tracking_uri"] for r in runs if "role" not in r.data.tags} == {shown}
    assert {a.path for a in client.list_artifacts(next(r.info.run_id for r in runs if "role" in r.data.tags))} == {
        "report"
    }
    assert f"mlflow.tracking_uri={shown}" in (tmp_path / "sweep" / "multirun.yaml").read_text()


@pytest.mark.slow
def test_a_password_in_mlflow_tracking_uri_of_the_environment_stays_out_of_everything(
    tmp_path, guarded_server, shared_data, monkeypatch
):
    uri, proxy = guarded_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    args = [arg for arg in small_run(tmp_path, uri, shared_data, "epochs=1") if "tracking_uri" not in arg]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert proxy.refused == 0 and proxy.passed > 5
    assert leaks(tmp_path, result.stdout, result.stderr) == []


def test_an_unreachable_store_with_a_password_is_one_line_without_it(tmp_path, shared_data):
    uri = f"http://{USER}:{ENCODED}@127.0.0.1:9"
    result = run_cli(*small_run(tmp_path, uri, shared_data))
    line = clean_error_line(result)
    assert line.startswith(f"error: mlflow.tracking_uri=http://{USER}:***@127.0.0.1:9 is unreachable"), line
    assert leaks(tmp_path, result.stdout, result.stderr) == []
