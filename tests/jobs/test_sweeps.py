"""Sweeps that lose and duplicate nothing: a folder of their own, every job checked before the first starts, stop
signals passed on to the jobs (real processes, real signals, a real MLflow store)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest
from hydra.types import RunMode
from omegaconf import OmegaConf

from src.errors import UsageError
from src.folders import check_own_folder, fresh, held, keep, release
from src.jobs.sweep import check_job_folders
from src.jobs.sweep_checks import SweepJob, check_launcher, check_sweeper
from src.parallel.preemption import Preemption
from tests.helpers import ROOT, compose_config, kill_group, run_cli, runs, small_run

JOBLIB = ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
TRAINING = ("epochs=2", "limit_batches=40")  # ~10 s of steps a job on 1 thread: long enough to be stopped in


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


# -- folders ------------------------------------------------------------------------------------------------


def claim(path: str, queue) -> None:
    queue.put(fresh(path))


def test_a_fresh_folder_is_claimed_once_even_by_processes_asking_at_once(tmp_path):
    base = str(tmp_path / "sweeps" / "12-00-00")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    claimers = [context.Process(target=claim, args=(base, queue)) for _ in range(4)]
    for process in claimers:
        process.start()
    got = sorted(queue.get(timeout=120) for _ in claimers)
    for process in claimers:
        process.join()
    assert got == sorted([base, f"{base}-2", f"{base}-3", f"{base}-4"])
    assert fresh(base) == f"{base}-5" and all(Path(path).is_dir() for path in got)


@pytest.mark.slow
def test_two_sweeps_started_in_the_same_second_keep_their_own_folders_runs_and_weights(tmp_path, store, shared_data):
    """The default folders (``sweeps/<date>/<time>``, under the working directory): each sweep gets its own."""
    (tmp_path / "cwd").mkdir()
    args = [a for a in small_run(tmp_path, store, shared_data, "epochs=1") if not a.startswith("hydra.")]
    commands = [
        [sys.executable, "-m", "src.train", "-m", *args, f"model={model}", f"seed={seeds}"]
        for model, seeds in (("resnet10", "0,1"), ("resnet18", "2,3"))
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = [
        subprocess.Popen(c, cwd=tmp_path / "cwd", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    for process in started:
        assert process.wait(timeout=900) == 0, process.communicate()[1][-3000:]
    parents, jobs = sweep_runs(store)
    assert len(parents) == 2 and {p.info.status for p in parents} == {"FINISHED"}
    folders = {p.data.tags["sweep_dir"] for p in parents}
    assert len(folders) == 2
    assert {str(f.resolve()) for f in (tmp_path / "cwd" / "sweeps").glob("*/*")} == folders  # and no other
    for parent in parents:
        children = [r for r in jobs if r.data.tags["mlflow.parentRunId"] == parent.info.run_id]
        assert len(children) == 2 and {r.info.status for r in children} == {"FINISHED"}
        assert len({r.data.params["model.name"] for r in children}) == 1
        for run in children:
            best = Path(run.data.tags["best_weights"])
            assert best.parent.parent == Path(parent.data.tags["sweep_dir"]) and best.is_file()


def test_a_sweep_folder_in_use_is_refused_in_one_line_before_any_run(tmp_path, store, shared_data):
    with held(tmp_path / "sweep", "sweep", "wait"):
        result = run_cli("-m", *small_run(tmp_path, store, shared_data, "seed=0,1"))
    line = one_error_line(result)
    assert line.startswith(f"error: {tmp_path / 'sweep'} is in use by another sweep (pid {os.getpid()}): wait for it")
    assert runs(store) == []


@pytest.mark.parametrize("flag,key", [((), "hydra.run.dir"), (("-m",), "hydra.sweep.dir")], ids=["run", "sweep"])
def test_an_output_folder_that_cannot_be_written_is_one_line_before_any_run(tmp_path, store, shared_data, flag, key):
    (tmp_path / "a-file").touch()
    folder = tmp_path / "a-file" / "outputs"
    sweep = ["seed=0,1"] if flag else []
    args = [a for a in small_run(tmp_path, store, shared_data, *sweep) if not a.startswith(key)]
    result = run_cli(*flag, *args, f"{key}={folder}")
    assert one_error_line(result) == (
        f"error: {key}={folder} cannot be written (Not a directory): give a folder this process can write"
    )
    assert runs(store) == []


@pytest.mark.parametrize("flag,epochs", [((), "epochs=0"), (("-m",), "epochs=1,0")], ids=["run", "sweep"])
def test_a_refused_command_leaves_no_folder_of_its_own(tmp_path, store, shared_data, flag, epochs):
    """The default folders (``outputs/<date>/<time>``, ``sweeps/...``, claimed by ``${fresh:...}``) of a refused
    command go, with the parents they made; an earlier command's stay."""
    cwd = tmp_path / "cwd"
    (cwd / "outputs" / "earlier").mkdir(parents=True)
    args = [a for a in small_run(tmp_path, store, shared_data, epochs) if not a.startswith("hydra.")]
    assert one_error_line(run_cli(*flag, *args, cwd=cwd)).endswith("epochs=0 must be in [1, 2147483647]")
    assert sorted(cwd.rglob("*")) == [cwd / "outputs", cwd / "outputs" / "earlier"]


@pytest.mark.parametrize(
    "overrides,refused",
    [(("batch_size=10000",), True), slow(("epochs=1", "optim.lr=1e30"), False)],
    ids=["refused", "diverged"],
)
def test_a_single_run_refused_after_hydra_made_its_folder_leaves_none_and_a_failed_run_keeps_its(
    tmp_path, new_store, shared_data, overrides, refused
):
    """A refusal that needs the data (the batch against the training set) comes once Hydra made the folder and wrote
    its log and lock there: they go, and the fresh store is not created; a run's folder stays, whatever ends the
    run."""
    cwd, store = tmp_path / "cwd", new_store
    cwd.mkdir()
    args = [a for a in small_run(tmp_path, store, shared_data, *overrides) if not a.startswith("hydra.")]
    line = one_error_line(run_cli(*args, cwd=cwd))
    if refused:
        assert "exceeds the 1188 training samples" in line
        assert list(cwd.iterdir()) == [] and list(tmp_path.iterdir()) == [cwd]
    else:
        (run,) = runs(store)
        assert run.info.status == "FAILED"
        assert Path(run.data.tags["output_dir"], "train.log").is_file()


def test_a_refused_runs_log_and_lock_go_only_with_a_folder_no_run_was_made_for(tmp_path):
    made = [Path(fresh(str(tmp_path / "outputs" / name))) for name in ("refused", "kept", "plain")]
    for folder in made:
        (folder / "train.log").write_text("[INFO] checking ...\n")
        (folder / ".medsweep.lock").write_text("123")
    keep(made[1])
    release(made[0], refused=True)
    release(made[1], refused=True)
    release(made[2])
    assert sorted(path.name for path in (tmp_path / "outputs").iterdir()) == ["kept", "plain"]


def test_a_released_folder_goes_only_when_fresh_claimed_it_and_it_holds_no_more_than_hydra_writes(tmp_path):
    started = Path(fresh(str(tmp_path / "outputs" / "started")))
    (started / "train.log").write_text("MLflow run ...\n")
    refused = Path(fresh(str(tmp_path / "outputs" / "refused")))
    (refused / ".hydra").mkdir()
    (refused / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (refused / "train.log").touch()
    given = tmp_path / "given"
    given.mkdir()
    for folder in (started, refused, given):
        release(folder)
    assert sorted(tmp_path.rglob("*")) == [given, tmp_path / "outputs", started, started / "train.log"]


@pytest.mark.parametrize("run_dir", ["", "."], ids=["empty", "dot"])
def test_a_run_folder_holding_other_files_is_refused_before_hydra_writes_there(tmp_path, store, shared_data, run_dir):
    """A run logs its folder to MLflow: the working directory (a project's, a home folder) would go with it."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").touch()
    args = [a for a in small_run(tmp_path, store, shared_data) if not a.startswith("hydra.run.dir=")]
    result = run_cli(*args, f"hydra.run.dir={run_dir}", cwd=project)
    working = " (the working directory)" if not run_dir else ""
    assert one_error_line(result) == (
        f"error: hydra.run.dir={run_dir}{working} holds files no run writes (pyproject.toml), and a run logs its "
        "folder to MLflow: give an empty folder"
    )
    assert [path.name for path in project.iterdir()] == ["pyproject.toml"]
    assert runs(store) == []


def test_a_folder_a_run_wrote_is_its_own_and_any_other_file_is_named(tmp_path):
    for name in (".hydra", "eval"):
        (tmp_path / name).mkdir()
    for name in ("train.log", "checkpoint.pt", "best.pt", "metrics.json", "oom_rank1.json", ".medsweep.lock"):
        (tmp_path / name).touch()
    (tmp_path / ".best.pt.123.456.tmp").touch()  # an atomic write in progress
    check_own_folder(tmp_path, "it")
    check_own_folder(tmp_path / "absent", "it")
    for name in ("notes.txt", "data", "src", "mlflow.db"):
        (tmp_path / name).touch()
    with pytest.raises(UsageError, match=r"^it holds files no run writes \(data, mlflow.db, notes.txt and 1 more\)"):
        check_own_folder(tmp_path, "it")


def sweep_job(num: int, sweep: Path, subdir: str) -> SweepJob:
    hydra_cfg = OmegaConf.create(
        {"runtime": {"output_dir": str((sweep / subdir).resolve())}, "sweep": {"subdir": subdir}}
    )
    return SweepJob(num, f"job{num}", [], OmegaConf.create(), hydra_cfg)


@pytest.mark.parametrize(
    "subdirs,error",
    [
        (["0", "1", "10", "1-0"], None),
        (["0", "0"], "hydra.sweep.subdir=0 (job 1's folder {sweep}/0) is job 0's folder"),
        (["a", "a/b"], "job 0's folder {sweep}/a holds job 1's folder {sweep}/a/b"),
        (["a/b/c", "x", "a"], "job 2's folder {sweep}/a holds job 0's folder {sweep}/a/b/c"),
        (["0", "."], "hydra.sweep.subdir=. (job 1's folder {sweep}) is or holds the sweep's folder {sweep}"),
        (["0", ".."], "hydra.sweep.subdir=.. (job 1's folder {tmp}) is or holds the sweep's folder {sweep}"),
    ],
)
def test_each_job_of_a_sweep_has_a_folder_apart_from_the_sweeps_and_the_others(tmp_path, subdirs, error):
    sweep = tmp_path / "sweep"
    jobs = [sweep_job(num, sweep, subdir) for num, subdir in enumerate(subdirs)]
    if error is None:
        check_job_folders(sweep, jobs)
        return
    with pytest.raises(UsageError) as refused:
        check_job_folders(sweep, jobs)
    assert str(refused.value).startswith(error.format(sweep=sweep, tmp=tmp_path))
    assert str(refused.value).endswith(
        "give each job a folder of its own in the sweep's (hydra.sweep.subdir, default ${hydra.job.num})"
    )


# -- every job checked before the first starts --------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,error",
    [
        (("batch_size=4,0,8",), "error: job 1 (batch_size=0): batch_size=0 must be in [1, 2147483647]"),
        (("model=resnet10,resnet7",), "error: job 1 (model=resnet7): model=resnet7 is not an option of model"),
        slow(("optim.lr=0.001,-1",), "error: job 1 (optim.lr=-1): optim.lr=-1.0 must be >= 0"),
        slow(("hydra.launcher.n_jobs=0", "seed=0,1"), "error: hydra.launcher.n_jobs=0 must be a number >= 1 or -1"),
        slow(
            ("preset=optuna", "hydra.sweeper.n_trials=0"), "error: hydra.sweeper.n_trials=0 must be a whole number >= 1"
        ),
        slow(("hydra.launcher.timeout=30", "seed=0,1"), "error: hydra.launcher.timeout=30.0: joblib kills the jobs"),
        slow(("tags=[status]", "seed=0,1"), "error: job 0 (seed=0): tags: status is a tag medsweep sets itself"),
    ],
)
def test_a_bad_job_anywhere_in_a_sweep_stops_it_before_any_job_and_any_run(
    tmp_path, store, shared_data, overrides, error
):
    """Under joblib a bad job used to fail beside a job already training, killing it and leaving it RUNNING."""
    result = run_cli("-m", *JOBLIB, *small_run(tmp_path, store, shared_data, *overrides))
    assert one_error_line(result).startswith(error)
    assert len(result.stderr.strip().splitlines()) == 1  # not Hydra's notice that the launcher's file is validated
    assert runs(store) == [] and not (tmp_path / "sweep" / "0").exists()


@pytest.mark.parametrize(
    "key,value", [("n_trials", 0), ("n_trials", -3), ("n_jobs", 0), ("n_jobs", -1), ("n_jobs", "2")]
)
def test_an_optuna_sweep_of_no_trial_or_no_trial_at_a_time_is_refused(key, value):
    """n_trials=0 ended in Optuna's `ValueError: No trials are completed yet`, n_jobs=-1 in a ZeroDivisionError: both
    tracebacks after the parent run was made."""
    optuna = {"_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper", "n_trials": 3, "n_jobs": 1}
    with pytest.raises(UsageError, match=rf"^hydra\.sweeper\.{key}={value} must be a whole number >= 1$"):
        check_sweeper(OmegaConf.create({"hydra": {"sweeper": {**optuna, key: value}}}))
    check_sweeper(OmegaConf.create({"hydra": {"sweeper": optuna}}))
    grid = {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "n_jobs": 0}
    check_sweeper(OmegaConf.create({"hydra": {"sweeper": grid}}))  # Hydra's grid sweeper reads no such count


@pytest.mark.parametrize("timeout,refused", [(None, False), (30, True), (0.5, True)])
def test_a_joblib_timeout_is_refused_as_it_kills_the_jobs_running_past_it(timeout, refused):
    """`hydra.launcher.timeout=30`: after 30 s joblib raised multiprocessing's TimeoutError in the main process (exit 1,
    a traceback) and killed its workers mid-step, both jobs' runs left RUNNING and the parent run FAILED."""
    joblib = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 2}
    config = OmegaConf.create({"hydra": {"launcher": {**joblib, "timeout": timeout}}})
    if refused:
        with pytest.raises(UsageError, match=rf"^hydra\.launcher\.timeout={timeout}: joblib kills the jobs"):
            check_launcher(config)
    else:
        check_launcher(config)


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


def test_the_slurm_launcher_on_a_machine_without_slurm_is_one_line_before_any_run(
    tmp_path, store, shared_data, monkeypatch
):
    """Where SLURM's commands are not on the PATH (an empty folder here, so the test holds on a SLURM node too)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    result = run_cli("-m", "hydra/launcher=submitit_slurm", *small_run(tmp_path, store, shared_data, "seed=0,1"))
    assert one_error_line(result) == (
        "error: hydra/launcher=submitit_slurm needs SLURM (sbatch and srun on the PATH), and this machine lacks sbatch "
        "and srun: start the sweep on a SLURM login node, or use hydra/launcher=joblib or submitit_local here"
    )
    assert runs(store) == []


def test_a_one_job_sweep_is_named_by_what_changes_results_its_stores_password_left_out(tmp_path):
    uri = "postgresql+psycopg://u:secret@127.0.0.1:9/mlflow"
    result = run_cli("-m", "optim.lr=-1", f"mlflow.tracking_uri={uri}", f"hydra.sweep.dir={tmp_path}/sweep")
    assert one_error_line(result) == "error: job 0 (optim.lr=-1): optim.lr=-1.0 must be >= 0 (0 freezes the weights)"


# -- stop signals -------------------------------------------------------------------------------------------


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


def test_a_second_ctrl_c_stops_at_once():
    preemption = Preemption()
    with preemption.installed(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.signum == signal.SIGINT  # the first: recorded only
        os.kill(os.getpid(), signal.SIGINT)


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
