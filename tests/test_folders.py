"""src/folders.py: each run and sweep claims a folder of its own, one in use or not writable is refused in one line, a
refused command's folders go (real processes, a real MLflow store)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from src.atomic import this_boot
from src.errors import UsageError
from src.folders import check_own_folder, fresh, held, never_release, release
from tests.helpers import ROOT, ended_process, one_error_line, run_cli, runs, slow, small_run, sweep_runs


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
    never_release(made[1])
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


def test_the_next_holder_of_a_folder_removes_the_temp_files_of_writers_that_are_gone(tmp_path):
    """A checkpoint write killed outright (SIGKILL) left its temp file, 0.5 GB, in the run folder for good."""
    gone = ended_process()["pid"].partition("@")[0]
    dead = tmp_path / f".checkpoint.pt.{gone}-{this_boot()}.1.tmp"
    live = tmp_path / f".best.pt.{os.getppid()}-{this_boot()}.2.tmp"  # a live process's write under way
    for path in (dead, live):
        path.write_bytes(b"half")
    with held(tmp_path, "job", "wait"):
        assert not dead.exists() and live.exists()
