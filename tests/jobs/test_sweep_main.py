"""src/jobs/sweep_main.py: a sweep's main process checks its jobs' plans and data before the parent run, and passes stop
signals on to its jobs (real processes, real signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hydra.types import RunMode
from omegaconf import OmegaConf

from src.errors import UsageError
from src.folders import LOCK_FILE
from src.jobs.sweep_checks import SweepJob
from src.training import checkpoint
from tests.helpers import (
    JOBLIB,
    ROOT,
    compose_config,
    kill_group,
    one_error_line,
    run_cli,
    runs,
    small_run,
    sweep_runs,
    wait_for_path,
)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["corrupt file", "download offline"])
def test_a_sweep_whose_data_cannot_be_had_creates_no_parent_run(tmp_path, store, shared_data, case):
    root = tmp_path / "data"
    root.mkdir()
    data = {
        "corrupt file": ("data=adrenalmnist3d", "data.download=false"),
        "download offline": ("data=organmnist3d", "data.url=http://127.0.0.1:9/organmnist3d.npz"),
    }[case]
    if case == "corrupt file":
        (root / "adrenalmnist3d.npz").write_bytes((shared_data / "adrenalmnist3d.npz").read_bytes()[:-100])
    args = [a for a in small_run(tmp_path, store, shared_data, "seed=0,1") if not a.startswith(("data", "data."))]
    line = one_error_line(run_cli("-m", *args, f"data.root={root}", *data))
    assert line.startswith("error: job 0 (seed=0): ")
    assert runs(store) == []


def test_an_optuna_sweeps_fixed_config_is_planned_in_no_trials_folder(tmp_path, store):
    """An Optuna sweep run again in its folder (`hydra.sweep.dir=...`, as docs/sweeps.md says: the seeded study
    proposes the same trials, the finished ones skipped) was refused before any trial: its fixed config, planned in
    folder 0, found trial 0's best.pt there (`error: job 0 (...): .../0 holds the tested weights of an earlier run`)."""
    from src.jobs.sweep_main import check_plan

    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "best.pt").touch()  # trial 0's, which the fixed config's plan is not
    overrides = ["data=synthetic", f"data.root={tmp_path / 'data'}", f"mlflow.tracking_uri={store}"]
    task = compose_config(*overrides)
    hydra_cfg = OmegaConf.create(
        {
            "runtime": {"output_dir": str(sweep / "0")},
            "sweep": {"dir": str(sweep), "subdir": "0"},
            "overrides": {"task": overrides},
            "job": {"name": "train", "num": 0},
            "mode": RunMode.MULTIRUN,
        }
    )
    job = SweepJob(0, "job0", overrides, task, hydra_cfg)
    with pytest.raises(UsageError, match="holds the tested weights of an earlier run"):
        check_plan(job, dry=True)  # a grid sweep's job 0 trains in that folder: refused as before
    check_plan(job, dry=True, trial=True)
    assert sorted(p.name for p in sweep.iterdir()) == ["0"]  # the fixed config's folder is never made


# -- stop signals ------------------------------------------------------------------------------------------


TRAINING = ("epochs=2", "limit_batches=40")  # ~10 s of steps a job on 1 thread: long enough to be stopped in


def start_sweep(tmp_path: Path, *args: str, nohup: bool = False) -> tuple[subprocess.Popen, Path]:
    """``python -m src.train -m ARGS`` (under ``nohup``: SIGHUP ignored; else SIGHUP's default, even where the tests
    themselves run under nohup) in a session of its own, its output in a file."""
    tmp_path.mkdir(exist_ok=True)
    log = tmp_path / "sweep.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [*(["nohup"] if nohup else []), sys.executable, "-m", "src.train", "-m", *args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        )
    return process, log


def wait_for(log: Path, text: str, count: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 900  # seconds of work; minutes on a loaded machine
    while log.read_text().count(text) < count:
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def finish(process: subprocess.Popen, log: Path) -> int:
    """Its exit code; no process of its session is left behind (joblib's resource tracker ends a moment after)."""
    try:
        code = process.wait(timeout=600)
        deadline = time.monotonic() + 60
        while (left := leftovers(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        kill_group(process)
    assert left == [], (left, log.read_text()[-3000:])
    return code


def leftovers(sid: int) -> list[psutil.Process]:
    """The processes of session ``sid`` still running (not zombies: exited, their parent gone, init reaps them)."""
    return [p for p in psutil.process_iter() if p.pid != sid and session(p) == sid and running(p)]


def running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def session(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except OSError:
        return None


@pytest.mark.slow
def test_sigterm_to_a_joblib_sweep_checkpoints_its_jobs_and_the_same_command_resumes_them(tmp_path, store, shared_data):
    args = (*JOBLIB, *small_run(tmp_path, store, shared_data, *TRAINING, "seed=0,1"))
    process, log = start_sweep(tmp_path, *args)
    wait_for(log, "start-up", 2, process)  # both jobs train
    process.send_signal(signal.SIGTERM)  # to the main process only: it passes the stop on
    assert finish(process, log) == 143, log.read_text()[-3000:]
    (parent,), jobs = sweep_runs(store)
    assert parent.info.status == "KILLED" and len(jobs) == 2
    assert {(r.info.status, r.data.tags["preempted"]) for r in jobs} == {("KILLED", "true")}
    assert "Traceback" not in log.read_text()

    again = run_cli("-m", *args)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    parents, after = sweep_runs(store)
    assert sorted(r.info.run_id for r in after) == sorted(r.info.run_id for r in jobs)  # resumed, none duplicated
    assert {(r.info.status, r.data.tags["resumes"]) for r in after} == {("FINISHED", "1")}
    (resumer,) = [p for p in parents if p.info.run_id != parent.info.run_id]
    assert resumer.info.status == "FINISHED"
    assert {r.data.tags["mlflow.parentRunId"] for r in after} == {resumer.info.run_id}
    assert not list((tmp_path / "sweep").glob("*/checkpoint.pt"))


@pytest.mark.slow
def test_a_joblib_sweep_killed_outright_stops_its_workers_and_the_same_command_resumes_its_jobs(
    tmp_path, store, shared_data
):
    """SIGKILL to the main process (the out-of-memory killer's way): joblib's workers trained on unsupervised, then
    idled for ever (~0.9 GB each), and the parent run stayed RUNNING."""
    args = (*JOBLIB, *small_run(tmp_path, store, shared_data, *TRAINING, "seed=0,1"))
    process, log = start_sweep(tmp_path, *args)
    wait_for(log, "start-up", 2, process)  # both jobs train
    workers = [p for p in psutil.Process(process.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
    process.kill()
    process.wait()
    try:
        _, alive = psutil.wait_procs(workers, timeout=300)
    finally:
        kill_group(process)  # joblib's resource tracker
    assert alive == [], log.read_text()[-3000:]
    (parent,), jobs = sweep_runs(store)
    assert {(r.info.status, r.data.tags["preempted"]) for r in jobs} == {("KILLED", "true")}, log.read_text()[-3000:]

    again = run_cli("-m", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    parents, after = sweep_runs(store)
    assert sorted(r.info.run_id for r in after) == sorted(r.info.run_id for r in jobs)  # resumed, none duplicated
    assert {r.info.status for r in after} == {"FINISHED"}
    ended = {p.info.run_id: (p.info.status, p.data.tags.get("status")) for p in parents}
    assert ended.pop(parent.info.run_id) == ("KILLED", "process_gone") and list(ended.values()) == [("FINISHED", None)]


@pytest.mark.slow
def test_two_ctrl_cs_to_a_joblib_sweep_while_its_jobs_checkpoint_end_in_a_resumable_stop(tmp_path, store, shared_data):
    """The second Ctrl-C (to the whole process group, as a terminal sends it) cut a job's checkpoint: that job's run
    ended KILLED with nothing to resume, the parent run FAILED, and the same command trained the job in a new run."""
    args = (*JOBLIB, *small_run(tmp_path, store, shared_data, *TRAINING, "seed=0,1"))
    process, log = start_sweep(tmp_path, *args)
    wait_for(log, "start-up", 2, process)  # both jobs train
    os.killpg(process.pid, signal.SIGINT)
    wait_for_path(tmp_path / "sweep", "*/.checkpoint.pt.*.tmp", process)  # a job's stop writes its checkpoint
    os.killpg(process.pid, signal.SIGINT)
    assert finish(process, log) == 130, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()
    (parent,), jobs = sweep_runs(store)
    assert (parent.info.status, parent.data.tags.get("preempted")) == ("KILLED", "true")
    assert {(r.info.status, r.data.tags["preempted"]) for r in jobs} == {("KILLED", "true")} and len(jobs) == 2
    for run in jobs:
        assert checkpoint.load(Path(run.data.tags["output_dir"]) / checkpoint.FILE)["run_id"] == run.info.run_id
    assert not list((tmp_path / "sweep").glob("**/.*.tmp"))

    again = run_cli("-m", *args)  # the same command
    assert again.returncode == 0, again.stderr[-3000:]
    _, after = sweep_runs(store)
    assert sorted((r.info.run_id, r.info.status) for r in after) == sorted((r.info.run_id, "FINISHED") for r in jobs)


@pytest.mark.slow
def test_a_joblib_worker_killed_outright_stops_the_sweep_resumably_in_one_line(tmp_path, store, shared_data):
    """SIGKILL to one of joblib's workers (the out-of-memory killer's way): loky killed the other worker too, Hydra
    printed a `TerminatedWorkerError` traceback, both runs stayed RUNNING and the parent run FAILED."""
    args = (*JOBLIB, *small_run(tmp_path, store, shared_data, *TRAINING, "epochs=3", "checkpoint.every_s=0"))
    args = (*args, "seed=0,1,2")
    process, log = start_sweep(tmp_path, *args)
    wait_for(log, "start-up", 2, process)
    for job in ("0", "1"):  # both running jobs have something to resume
        wait_for_path(tmp_path / "sweep" / job, checkpoint.FILE, process)
    workers = psutil.Process(process.pid).children()
    (worker, *_) = [p for p in workers if "resource_tracker" not in " ".join(p.cmdline())]
    worker.kill()
    assert finish(process, log) == 128 + signal.SIGKILL, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    (line,) = [line for line in text.splitlines() if line.startswith("error:")]
    assert "was killed (SIGKILL)" in line and "the same command again resumes the sweep" in line
    (parent,), jobs = sweep_runs(store)
    assert parent.info.status == "KILLED" and len(jobs) == 2
    assert {r.info.status for r in jobs} == {"KILLED"}  # none left RUNNING
    assert {r.data.tags.get("status") or r.data.tags["preempted"] for r in jobs} == {"process_gone", "true"}

    again = run_cli("-m", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    _, after = sweep_runs(store)
    resumed = {r.info.run_id: r.info.status for r in after if r.info.run_id in {j.info.run_id for j in jobs}}
    assert resumed == {r.info.run_id: "FINISHED" for r in jobs} and len(after) == 3  # job 2 trained in a new run


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_with_its_resume_command_and_no_job_starts_after_it(tmp_path, store, shared_data):
    """SIGINT to the whole process group, as a terminal sends it."""
    process, log = start_sweep(tmp_path, *small_run(tmp_path, store, shared_data, *TRAINING, "seed=0,1"))
    wait_for(log, "start-up", 1, process)
    os.killpg(process.pid, signal.SIGINT)
    assert finish(process, log) == 130, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and "job 1 not started: SIGINT stopped the sweep" in text
    (parent,), (job,) = sweep_runs(store)
    assert (parent.info.status, job.info.status, job.data.tags["preempted"]) == ("KILLED", "KILLED", "true")
    assert f"is KILLED and resumable: python -m src.train resume={job.info.run_id}" in text


@pytest.mark.slow
def test_a_hangup_stops_a_sweep_as_ctrl_c_does_and_nohup_lets_it_train_on(tmp_path, store, shared_data):
    """SIGHUP to the whole process group, as a closed terminal or SSH connection sends it: checkpointed, KILLED,
    resumable; started under ``nohup`` (SIGHUP ignored), the sweep trains on and finishes."""
    process, log = start_sweep(tmp_path, *small_run(tmp_path, store, shared_data, *TRAINING))
    wait_for(log, "start-up", 1, process)
    os.killpg(process.pid, signal.SIGHUP)
    assert finish(process, log) == 129, log.read_text()[-3000:]
    (parent,), (job,) = sweep_runs(store)
    assert (parent.info.status, job.info.status, job.data.tags["preempted"]) == ("KILLED", "KILLED", "true")
    assert "Traceback" not in log.read_text()

    folder = tmp_path / "nohup"
    process, log = start_sweep(folder, *small_run(folder, store, shared_data, *TRAINING, "seed=1"), nohup=True)
    wait_for(log, "start-up", 1, process)
    os.killpg(process.pid, signal.SIGHUP)
    assert finish(process, log) == 0, log.read_text()[-3000:]
    assert {r.info.status for r in sweep_runs(store)[1] if r.data.params["seed"] == "1"} == {"FINISHED"}


@pytest.mark.slow
def test_a_signal_after_training_lets_the_job_finish_and_no_other_start(tmp_path, store, shared_data):
    """SIGTERM after the last step (fault.term_step): the test runs, the run is FINISHED, job 1 never starts."""
    result = run_cli("-m", *small_run(tmp_path, store, shared_data, "epochs=1", "fault.term_step=3", "seed=0,1"))
    assert result.returncode == 143, result.stderr[-3000:]
    (parent,), (job,) = sweep_runs(store)
    assert (parent.info.status, job.info.status, job.data.params["seed"]) == ("KILLED", "FINISHED", "0")
    text = result.stdout + result.stderr
    assert "SIGTERM came after training" in text and "job 1 not started" in text


@pytest.mark.slow
def test_sigterm_during_start_up_leaves_no_running_run(tmp_path, store, shared_data):
    """Once the run exists, a stop before the first step checkpoints step 0: KILLED and resumable."""
    process, log = start_sweep(tmp_path, *small_run(tmp_path, store, shared_data, *TRAINING))
    wait_for(log, "MLflow run ", 1, process)  # the job's run exists
    process.send_signal(signal.SIGTERM)
    assert finish(process, log) == 143, log.read_text()[-3000:]
    (parent,), (job,) = sweep_runs(store)
    assert (parent.info.status, job.info.status, job.data.tags["preempted"]) == ("KILLED", "KILLED", "true")


def test_a_sweep_whose_data_is_missing_fails_in_one_line_before_any_run(tmp_path, new_store, shared_data):
    """Every job's data is checked before the first job starts: no parent run, no job run."""
    args = [a for a in small_run(tmp_path, new_store, shared_data) if not a.startswith("data=")]
    result = run_cli("-m", "data=adrenalmnist3d,organmnist3d", *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: job 1 (data=organmnist3d): ")
    assert "organmnist3d.npz not found" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "mlflow.db").exists()  # no store created, so no run


@pytest.mark.slow
def test_a_submitit_local_job_killed_outright_ends_the_sweep_resumably_in_one_line(tmp_path, store, shared_data):
    """SIGKILL to a submitit_local job's process (the out-of-memory killer's way): submitit's `UncompletedJobError`
    traceback, the job's run left RUNNING, the parent run FAILED. Now the other job trains to its end, the killed one's
    run is closed resumable, one line; the same command again resumes it."""
    args = ("hydra/launcher=submitit_local", *small_run(tmp_path, store, shared_data, *TRAINING, "epochs=3"))
    args = (*args, "checkpoint.every_s=0", "seed=0,1")
    process, log = start_sweep(tmp_path, *args)
    wait_for_path(tmp_path / "sweep" / "0", checkpoint.FILE, process)
    lock = str(tmp_path / "sweep" / "0" / LOCK_FILE)
    (job,) = [p for p in psutil.Process(process.pid).children(recursive=True) if holds(p, lock)]
    job.kill()
    assert finish(process, log) == 128 + signal.SIGKILL, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    (line,) = [line for line in text.splitlines() if line.startswith("error:")]
    assert "was killed (SIGKILL): job run " in line and "is KILLED (status=process_gone), resumable" in line
    assert line.endswith("the other jobs ran to their end: the same command again resumes the sweep")
    (parent,), jobs = sweep_runs(store)
    assert parent.info.status == "KILLED"
    ended = {r.data.tags["mlflow.runName"].split()[-1]: (r.info.status, r.data.tags.get("status")) for r in jobs}
    assert ended == {"seed=0": ("KILLED", "process_gone"), "seed=1": ("FINISHED", None)}

    again = run_cli("-m", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    _, after = sweep_runs(store)
    assert {r.info.run_id: r.info.status for r in after} == {r.info.run_id: "FINISHED" for r in jobs}


def holds(process: psutil.Process, path: str) -> bool:
    try:
        return any(opened.path == path for opened in process.open_files())
    except psutil.Error:
        return False
