"""Jobs sharing a GPU (``gpu_share``): the decision, an MPS daemon started and stopped for a sweep, the warning
without one, ``gpu_share=mps`` refused where MPS cannot be had.

No GPU runs here: a stand-in ``nvidia-cuda-mps-control`` (a script first on ``PATH`` that records its arguments,
stdin and MPS folders) takes the place of NVIDIA's daemon, run through a real subprocess. The real daemon runs in the
``gpu`` test."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from src.config import GpuShare
from src.errors import UsageError
from src.parallel import mps
from src.parallel.mps import Action, Sharing
from tests.helpers import JOBLIB, one_error_line, run_cli, run_process, runs, small_run

auto, use_mps, none = GpuShare.auto, GpuShare.mps, GpuShare.none
nothing, use, start, warn, refuse = Action.nothing, Action.use, Action.start, Action.warn, Action.refuse

STAND_IN = """#!{python}
import glob, json, os, sys
record = {{"argv": sys.argv[1:], "stdin": sys.stdin.read(), "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
          "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY")}}
if record["stdin"] == "quit\\n":  # the caller's joblib workers still alive: the real quit waits for them
    workers = 0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            if int(open(stat).read().rsplit(")", 1)[1].split()[1]) == os.getppid():
                workers += b"LokyProcess" in open(stat[:-4] + "cmdline", "rb").read()
        except (OSError, IndexError):
            pass
    record["workers"] = workers
with open({calls!r}, "a") as file:
    file.write(json.dumps(record) + "\\n")
if os.environ.get("STAND_IN_FAILS"):
    print("An instance of this daemon is already running")
    sys.exit(1)
"""


@pytest.mark.parametrize(
    ("setting", "jobs", "gpus", "binary", "serving", "action"),
    [
        (auto, 1, 1, True, False, nothing),  # one job at a time
        (use_mps, 1, 0, False, False, nothing),
        (auto, 2, 2, True, False, nothing),  # one job per GPU
        (use_mps, 4, 8, False, False, nothing),  # several GPUs per job
        (auto, 2, 0, True, False, nothing),  # on the CPU
        (use_mps, 2, 0, True, False, refuse),
        (none, 4, 1, True, False, nothing),  # gpu_share=none: not even a warning
        (none, 4, 1, False, False, nothing),
        (auto, 4, 1, True, True, use),  # a daemon serves already
        (use_mps, 3, 2, False, True, use),
        (auto, 4, 1, True, False, start),
        (use_mps, 4, 1, True, False, start),
        (auto, 4, 1, False, False, warn),  # no binary: time-slicing, one warning
        (use_mps, 4, 1, False, False, refuse),
    ],
)
def test_what_a_sweep_does_about_mps(setting, jobs, gpus, binary, serving, action):
    assert mps.decide(setting, jobs, gpus, binary, serving) is action


@pytest.fixture
def calls(tmp_path, monkeypatch) -> Path:
    """The stand-in daemon first on ``PATH``; the file where it records each call (one JSON line)."""
    folder, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    folder.mkdir()
    script = folder / mps.CONTROL
    script.write_text(STAND_IN.format(python=sys.executable, calls=str(calls)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    for key in (mps.PIPE_ENV, mps.LOG_ENV, mps.SHARE_ENV):
        monkeypatch.delenv(key, raising=False)
    return calls


def recorded(calls: Path) -> list[dict]:
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


@pytest.fixture
def short_folder() -> Iterator[Path]:
    """A temp folder whose path leaves a socket's name room (a test's ``tmp_path`` under ``pytest -n`` may not)."""
    with tempfile.TemporaryDirectory(prefix="mps-", dir="/tmp") as folder:
        yield Path(folder)


def test_a_daemon_starts_for_the_sweep_and_stops_at_its_end(calls, short_folder, caplog):
    folder = short_folder / "sweep" / ".mps"
    pipe, log = str(folder / "pipe"), str(folder / "log")
    with caplog.at_level(logging.INFO, "src.parallel.mps"), mps.shared(Sharing(auto, 4, 1, start), folder):
        assert recorded(calls) == [{"argv": ["-d"], "stdin": "", "pipe": pipe, "log": log}]
        assert (os.environ[mps.PIPE_ENV], os.environ[mps.LOG_ENV]) == (pipe, log)  # the launcher's workers inherit
        assert mps.run_tags() == {"gpu_share": "mps"}
        assert Path(pipe).is_dir() and Path(log).is_dir()
    assert recorded(calls)[1:] == [{"argv": [], "stdin": "quit\n", "pipe": pipe, "log": log, "workers": 0}]
    assert not {mps.PIPE_ENV, mps.LOG_ENV, mps.SHARE_ENV} & set(os.environ)
    assert caplog.messages == [
        f"4 jobs at once share 1 GPU(s): started an MPS daemon for the sweep (pipes in {pipe})",
        "stopped the sweep's MPS daemon",
    ]


def test_a_pipe_folder_too_long_for_a_socket_goes_to_a_short_temp_folder(calls, tmp_path):
    folder = tmp_path / ("deep" * 20) / ".mps"
    with mps.shared(Sharing(GpuShare.mps, 2, 1, start), folder):
        pipe = Path(os.environ[mps.PIPE_ENV])
        assert pipe.parent == Path("/tmp") and pipe.is_dir() and len(os.fsencode(pipe / "control")) < 107
        assert os.environ[mps.LOG_ENV] == str(folder / "log")
    assert [call["pipe"] for call in recorded(calls)] == [str(pipe)] * 2 and not pipe.exists()


def test_a_daemon_that_fails_to_start_leaves_one_warning_with_the_cost(calls, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("STAND_IN_FAILS", "1")
    with caplog.at_level(logging.INFO, "src.parallel.mps"), mps.shared(Sharing(auto, 4, 1, start), tmp_path):
        assert mps.PIPE_ENV not in os.environ and mps.run_tags() == {"gpu_share": "none"}
    assert len(recorded(calls)) == 1  # no quit: nothing to stop
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert record.getMessage() == (
        f"gpu_share=auto: 4 jobs at once share 1 GPU(s) without MPS ({mps.CONTROL} -d failed: exit 1: An instance of "
        "this daemon is already running): graphed jobs time-slice a GPU without MPS: 4 jobs gave 0.90x the samples/s "
        f"of one on an H100 (2026-11-24); start a daemon ({mps.CONTROL} -d) before the sweep, or set gpu_share=none"
    )
    refused = r"^gpu_share=mps: nvidia-cuda-mps-control -d failed: exit 1: An instance"
    with pytest.raises(UsageError, match=refused), mps.shared(Sharing(GpuShare.mps, 4, 1, start), tmp_path):
        pass
    assert mps.SHARE_ENV not in os.environ


def test_without_the_binary_auto_warns_once_and_none_says_nothing(calls, caplog):
    with caplog.at_level(logging.INFO, "src.parallel.mps"), mps.shared(Sharing(auto, 4, 1, warn), Path("unused")):
        assert mps.run_tags() == {"gpu_share": "none"}
    assert [r.getMessage().partition(" (")[0] for r in caplog.records] == [
        "gpu_share=auto: 4 jobs at once share 1 GPU(s) without MPS"
    ]
    assert "is not on PATH" in caplog.records[0].getMessage() and "0.90x" in caplog.records[0].getMessage()
    caplog.clear()
    with mps.shared(Sharing(none, 4, 1, nothing), Path("unused")):
        assert mps.run_tags() == {"gpu_share": "none"}
    with mps.shared(Sharing(auto, 1, 1, nothing), Path("unused")):
        assert mps.run_tags() == {}
    assert caplog.records == [] and recorded(calls) == []


def test_a_serving_daemon_is_used_and_left_running(calls, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(mps.PIPE_ENV, str(tmp_path))
    with caplog.at_level(logging.INFO, "src.parallel.mps"), mps.shared(Sharing(auto, 4, 1, use), tmp_path / "unused"):
        assert mps.run_tags() == {"gpu_share": "mps"} and os.environ[mps.PIPE_ENV] == str(tmp_path)
    assert caplog.messages == [f"4 jobs at once share 1 GPU(s): using the MPS daemon serving {tmp_path}"]
    assert recorded(calls) == [] and not (tmp_path / "unused").exists()


def test_gpu_share_mps_on_the_cpu_is_refused_in_one_line_before_any_run(tmp_path, store, shared_data):
    result = run_cli("-m", *small_run(tmp_path, store, shared_data, "seed=0,1", "gpu_share=mps", *JOBLIB), timeout=300)
    assert one_error_line(result) == (
        "error: gpu_share=mps needs an MPS daemon for the jobs sharing a GPU: this sweep runs on the CPU; "
        "use gpu_share=auto"
    )
    assert runs(store) == [] and not (tmp_path / "sweep" / ".mps").exists()


ONE_GPU = """import torch
torch.cuda.device_count = lambda: 1  # this main process decides as if it saw one GPU; its jobs train on the CPU
from src.train import main
main()
"""


@pytest.mark.slow
def test_a_sweep_sharing_a_gpu_starts_the_daemon_tags_its_jobs_and_stops_it_when_stopped(
    calls, short_folder, store, shared_data
):
    """A real joblib sweep whose main process counts one GPU (patched: no GPU here) and whose jobs train on the
    CPU: the stand-in daemon starts before the jobs, they inherit its pipe folder and tag their runs, and it is
    stopped at the end of a sweep a job's SIGTERM stopped."""
    script = short_folder / "one_gpu.py"
    script.write_text(ONE_GPU)
    overrides = small_run(short_folder, store, shared_data, "device=auto", "fault.term_step=1,null", *JOBLIB)
    result = run_process([sys.executable, str(script), "-m", *overrides], timeout=600)
    assert result.returncode == 143, result.stderr[-3000:]
    pipe = str(short_folder / "sweep" / ".mps" / "pipe")
    assert [(call["argv"], call["stdin"], call["pipe"], call.get("workers")) for call in recorded(calls)] == [
        (["-d"], "", pipe, None),
        ([], "quit\n", pipe, 0),  # joblib's idle workers ended first: the real quit waits for its clients
    ]
    assert "2 jobs at once share 1 GPU(s): started an MPS daemon for the sweep" in result.stdout
    jobs = [run for run in runs(store) if run.data.tags.get("role") != "sweep"]
    assert len(jobs) == 2 and {run.data.tags.get("gpu_share") for run in jobs} == {"mps"}


@pytest.mark.gpu
def test_two_cuda_processes_run_through_a_real_daemon(tmp_path):
    if shutil.which(mps.CONTROL) is None:
        pytest.skip(f"{mps.CONTROL} is not on PATH")
    daemon = mps.start(tmp_path / ".mps")
    try:
        env = {**os.environ, **daemon.env}
        work = "import torch; x = torch.randn(2048, 2048, device='cuda'); print(float((x @ x).sum()))"
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(lambda _: cuda_client(work, env), range(2)))
        said = (daemon.log / "control.log").read_text()
        assert [d.returncode for d in done] == [0, 0], ([d.stderr[-2000:] for d in done], said[-2000:])
        assert "new client" in said.lower() or "new server" in said.lower(), said[-2000:]  # they went through MPS
    finally:
        mps.stop(daemon)


def cuda_client(work: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -c work``; a client that hangs (an MPS server that never answers, as in some containers) is killed
    after 60 s and reported as failed, rather than holding the GPU session's ``tests`` phase to its cap."""
    try:
        return subprocess.run([sys.executable, "-c", work], env=env, text=True, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired as hung:
        return subprocess.CompletedProcess(hung.cmd, -9, "", f"hung past {hung.timeout} s under MPS")
