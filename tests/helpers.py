"""Helpers the tests share: paths, real Hydra composition, real processes, a real MLflow store's runs, a refused
command's error line."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins import basic_sweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

from src.config import Config, Device
from src.execution import Execution, resolve
from src.tracking.runs import process_tags

ROOT = Path(__file__).resolve().parent.parent


RESULTS = {"train/loss", "train/acc", "val/loss", "val/acc", "val/auc", "test/acc", "test/auc", "model/params"}


def small_run(tmp_path, store, shared_data, *overrides: str) -> tuple[str, ...]:
    """A quick job on the real AdrenalMNIST3D file on the CPU (whatever GPU the machine has), outputs and store
    under ``tmp_path``."""
    return (
        "device=cpu",
        "data=adrenalmnist3d",
        f"data.root={shared_data}",
        "data.download=false",
        "model=resnet10",
        "model.stem=standard",
        "batch_size=4",
        "epochs=2",
        "limit_batches=3",
        "num_threads=1",
        f"mlflow.tracking_uri={store}",
        f"hydra.run.dir={tmp_path}/run",
        f"hydra.sweep.dir={tmp_path}/sweep",
        *overrides,
    )


def history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric medsweep logged to the run, as (step, value) by step; MLflow's ``system/`` samples of the
    machine (their own steps, one per interval) left out."""
    client = mlflow.MlflowClient(uri)
    return {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
        for key in client.get_run(run_id).data.metrics
        if not key.startswith("system/")
    }


def own_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The messages of medsweep's own records (loggers under ``src``), MLflow's and other libraries' left out."""
    return [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "src"]


def compose_config(*overrides: str):
    """The real Hydra composition of ``conf/config.yaml`` with ``overrides``."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def compose_report(*overrides: str):
    """The real Hydra composition of ``conf/report.yaml`` (``python -m src.report``) with ``overrides``."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("report", overrides=list(overrides))


def on_cpu(cfg: Config) -> Execution:
    """``cfg``'s execution on the CPU, whatever GPU the machine has."""
    return resolve(dataclasses.replace(cfg, device=Device.cpu))


def graph_on_cpu(trainer: Any) -> Any:
    """``trainer`` stepping through its :class:`GraphedStep` on the CPU, where no CUDA graph runs: a stand-in capture
    records the step and each replay runs it again on the static tensors, into the output tensor it returned. It
    tests what a graphed trainer does around the graph (static batches, warm-up, running sums, learning-rate tensors
    the schedule fills, the EMA's count, resume); the real capture runs in the ``gpu`` tests."""

    def capture(run: Any) -> tuple[Any, Any]:
        trainer.captures += 1
        loss = torch.zeros((), device=trainer.device)
        return lambda: loss.copy_(run()), loss

    trainer.captures = 0
    trainer.graph_steps(warm=lambda run: run(), capture=capture)
    return trainer


def run_cli(*args: str, module: str = "src.train", timeout: int = 900, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m src.train ARGS`` in a real process from ``cwd`` (the project root, a copy of it, or another
    folder: the project's code is on ``PYTHONPATH`` after the folder's own)."""
    return run_process([sys.executable, "-m", module, *args], timeout, cwd)


def run_process(argv: list[str], timeout: int = 900, cwd: Path = ROOT, **popen: Any) -> subprocess.CompletedProcess:
    """``argv`` from ``cwd`` in a process group of its own, output captured: past ``timeout`` (a hang; generous,
    for a loaded machine) the whole group is killed, ranks and workers included. ``popen``: more of
    :class:`subprocess.Popen`'s arguments (``user``, ``group``, ...)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": path}
    with subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **popen,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(process)
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def unprivileged(argv: list[str]) -> list[str]:
    """``argv`` run without the capabilities that let root write whatever the file modes say (``setpriv``), so a
    read-only folder is read-only to it as to any user; as another user, ``argv`` itself. Skips the test where
    root has no ``setpriv``."""
    if os.geteuid() != 0:
        return argv
    if shutil.which("setpriv") is None:
        pytest.skip("root writes read-only folders, and setpriv (util-linux), which drops that, is not installed")
    return ["setpriv", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--", *argv]


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s whole process group (it was started with ``start_new_session=True``) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


def free_port() -> int:
    """A TCP port free now (bind port 0); another process may take it before it is bound again: retry then."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_mlflow(backend_uri: str, folder: Path, tries: int = 5, port: int | None = None) -> Iterator[str]:
    """A real ``mlflow server`` on ``backend_uri``, artifacts and log in ``folder``, on ``port`` (a server started
    again where one was), else a free local port (another port when the one picked was taken before the server bound
    it); its whole process group stopped at the end."""
    given = port
    for _ in range(tries):
        port, log_path = given or free_port(), folder / "server.log"
        with log_path.open("w") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri]
                + ["--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1"]
                + ["--port", str(port), "--workers", "1"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
                start_new_session=True,
            )
        try:
            if serving(server, port, log_path):
                yield f"http://127.0.0.1:{port}"
                return
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(server)
    raise AssertionError(f"mlflow server never started in {tries} tries:\n{log_path.read_text()[-3000:]}")


def serving(server: subprocess.Popen, port: int, log: Path, attempts: int = 600) -> bool:
    """True once ``server`` itself answers ``/health`` on ``port``; False when it exited because the port was taken."""
    for _ in range(attempts):
        if server.poll() is not None:
            if "address already in use" in log.read_text().lower():
                return False
            raise AssertionError(f"mlflow server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                if reply.status == 200 and server.poll() is None and f":{port}" in log.read_text():
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"mlflow server on port {port} never answered /health:\n{log.read_text()[-3000:]}")


def runs(uri: str, experiment: str = "medsweep") -> list[mlflow.entities.Run]:
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def children(store):
    return [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]


def jobs(*overrides: str) -> list[Config]:
    """The typed config of every job of ``python -m src.train -m OVERRIDES``, split by Hydra's BasicSweeper."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        hydra_cfg = compose("config", overrides=list(overrides), return_hydra_config=True).hydra
    sweeper_class = basic_sweeper.BasicSweeper  # looked up now: Hydra's plugin scan re-imports the module
    sweeper = sweeper_class(max_batch_size=None, params=hydra_cfg.sweeper.params)
    parsed = OverridesParser.create().parse_overrides([*sweeper._parse_config(), *overrides])
    (batch,) = sweeper_class.split_arguments(parsed, max_batch_size=None)
    return [OmegaConf.to_object(compose_config(*job)) for job in batch]


BAD_INPUTS = [
    (("model.name=resnet7",), "model.name=resnet7 is not a registered model: use one of"),
    (("batch_size=0",), "batch_size=0 must be in [1, 2147483647]"),
    (("accumulate=0",), "accumulate=0 must be in [1, 2147483647]"),
    (("amp_dtype=float16",), "amp_dtype=float16 needs a CUDA device"),
    (("data.root=/nonexistent",), "/nonexistent/adrenalmnist3d.npz not found and data.download=false"),
    (("mlflow.tracking_uri=http://127.0.0.1:9",), "mlflow.tracking_uri=http://127.0.0.1:9 is unreachable"),
    (("batch_size=2000",), "batch_size x accumulate x ranks = 2000 exceeds the 1188 training samples"),
]


def clean_error_line(result: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a command that failed cleanly: exit 2, no traceback in its output at all."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return line


def hydra_job(folder: Path, overrides: list[str]):
    """What ``plan_job`` reads of Hydra's job config."""
    return OmegaConf.create(
        {
            "runtime": {"output_dir": str(folder)},
            "overrides": {"task": overrides},
            "job": {"name": "train", "num": 0},
            "mode": RunMode.RUN,
        }
    )


def ended_process() -> dict[str, str]:
    """:func:`process_tags` of a process of this machine that has ended."""
    with subprocess.Popen(["sleep", "60"]) as child:
        started = psutil.Process(child.pid).create_time()
        child.kill()
    return {**process_tags(), "pid": f"{child.pid}@{started:.2f}"}


JOBLIB = ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")


def sweep_runs(store: str) -> tuple[list[mlflow.entities.Run], list[mlflow.entities.Run]]:
    """The parent runs and the job runs of the store."""
    every = runs(store)
    return [r for r in every if r.data.tags.get("role") == "sweep"], [r for r in every if "role" not in r.data.tags]


def slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a refused command (exit 2, no traceback)."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return line


def only_run(uri: str) -> mlflow.entities.Run:
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("medsweep").experiment_id])
    return run


def job_overrides(tmp_path: Path, store: str, shared_data: Path, *overrides: str) -> list[str]:
    """A job's overrides in ``small_run``, Hydra's own settings left out."""
    return [o for o in small_run(tmp_path, store, shared_data, *overrides) if not o.startswith("hydra.")]


def start_command(folder: Path, *args: str, module: str = "src.train") -> tuple[subprocess.Popen, Path]:
    """``python -m src.train ARGS`` in a session of its own (SIGHUP at its default), its output in
    ``folder/command.log``: a test signals it once a line or a file says it is where the signal should land."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "command.log"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", "PYTHONPATH": path},
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )
    return process, log


def wait_for_text(log: Path, text: str, process: subprocess.Popen, count: int = 1) -> None:
    """Until ``log`` holds ``text`` ``count`` times; the process must not end first (a hang fails after 900 s)."""
    deadline = time.monotonic() + 900  # seconds of work; minutes on a loaded machine
    while log.read_text().count(text) < count:
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def wait_for_path(folder: Path, pattern: str, process: subprocess.Popen) -> Path:
    """The first path under ``folder`` that matches ``pattern`` (``glob``), once one exists: an atomic write's temp
    file says the write is under way. Polled often: a write takes a fraction of a second."""
    deadline = time.monotonic() + 900
    while not (found := sorted(folder.glob(pattern))):
        assert process.poll() is None, f"ended before {folder}/{pattern} appeared"
        assert time.monotonic() < deadline, f"no {folder}/{pattern}"
        time.sleep(0.002)
    return found[0]


def alias_bomb(levels: int = 9, width: int = 10) -> str:
    """A YAML "billion laughs": each anchor a list of ``width`` aliases of the one before, ``width ** levels``
    strings in all once expanded, in a few hundred bytes; ``epochs`` names the last."""
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join([*lines, f"epochs: *a{levels - 1}", ""])
