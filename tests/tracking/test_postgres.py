"""A team's tracking server: a real PostgreSQL server, a real ``mlflow server`` on it, a parallel sweep into it.

Needs Debian's PostgreSQL (``/usr/lib/postgresql/<version>/bin``; ``.ci/run`` installs it) and the ``psycopg``
driver (the ``dev`` extras). Without them the test skips locally and fails under ``CI=true``. PostgreSQL refuses to
run as root: a root test process runs it as ``nobody``, in a temp dir that user owns.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import pwd
import re
import shlex
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
from omegaconf import OmegaConf

from src.tracking.identity import flatten
from src.tracking.sweep import PARENT_ID_FILE
from tests.helpers import free_port, run_cli, run_process, serve_mlflow, small_run

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
