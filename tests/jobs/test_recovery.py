"""Interrupted and failed runs recover with nothing lost and nothing duplicated: a command run again resumes them,
``resume=`` refuses a duplicate, a diverged loss, a full disk or store and a corrupt checkpoint end in one line
(real stores, real processes, a real tmpfs where the case is a full disk)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest
import torch
from hydra.types import RunMode
from omegaconf import OmegaConf

from src.errors import UsageError
from src.folders import held
from src.jobs.plan import plan_job
from src.jobs.resume import earlier_twin, resumable
from src.tracking.identity import code_fingerprint, config_hash, flatten
from src.tracking.runs import process_gone, process_tags
from src.tracking.store import ensure_store, experiment_id
from src.training import checkpoint
from tests.helpers import ROOT, compose_config, history, kill_group, run_cli, runs, small_run


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return line


# -- a command run again goes on with its unfinished run ----------------------------------------------------


@pytest.mark.slow
def test_the_same_command_after_a_sigterm_resumes_the_run_and_keeps_its_peak_memory(tmp_path, store, shared_data):
    args = small_run(tmp_path, store, shared_data, "epochs=3", "fault.term_step=4")  # epoch 2, step 1 of 3
    assert run_cli(*args).returncode == 143
    (stopped,) = runs(store)
    state = checkpoint.load(tmp_path / "run" / checkpoint.FILE)
    assert state["memory_peak"]["mem/peak_mb"] >= history(store, stopped.info.run_id)["mem/peak_mb"][0][1]

    moved = [a if not a.startswith("hydra.run.dir=") else f"hydra.run.dir={tmp_path}/again" for a in args]
    again = run_cli(*moved)  # the same config, another job folder
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = runs(store)  # the same run, not a second one
    assert (run.info.run_id, run.info.status, run.data.tags["resumes"]) == (stopped.info.run_id, "FINISHED", "1")
    assert "resuming run" in again.stdout + again.stderr
    peaks = [value for _, value in history(store, run.info.run_id)["mem/peak_mb"]]
    assert peaks == sorted(peaks) and peaks[-1] >= state["memory_peak"]["mem/peak_mb"]  # the run's, not the process's
    assert not (tmp_path / "run" / checkpoint.FILE).exists()


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


def unfinished_run(client, overrides: list[str], folder: Path, ending: str, weights=None, **tags: str) -> str:
    """A run of the config of ``overrides`` ended ``ending``, whose folder holds its checkpoint (metadata, and
    ``weights`` where given)."""
    cfg = compose_config(*overrides)
    tags = {"config_hash": config_hash(flatten(cfg)), "code_fingerprint": code_fingerprint(), **tags}
    run_id = client.create_run(experiment_id(client, "medsweep"), tags={"output_dir": str(folder), **tags}).info.run_id
    client.set_terminated(run_id, ending)
    stored = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    state = {"run_id": run_id, "epoch": 1, "step": 2, "batch_size": 4, "accumulate": 1, "world": 1, "config": stored}
    checkpoint.save({**state, **({"weights": weights} if weights is not None else {})}, folder / checkpoint.FILE)
    return run_id


def test_an_unfinished_run_of_the_same_config_and_code_is_resumed_others_are_named(tmp_path, store, caplog):
    client = ensure_store(store)
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    typed = OmegaConf.to_object(compose_config(*overrides))
    hashed = config_hash(flatten(compose_config(*overrides)))
    other_code = unfinished_run(client, overrides, tmp_path / "a", "KILLED", code_fingerprint="0ld")
    oom = unfinished_run(client, overrides, tmp_path / "b", "FAILED", status="oom")
    assert resumable(client, typed, hashed) == (None, None)
    assert f"run {other_code} (KILLED) of this config left" in caplog.text and "other code trained it" in caplog.text
    assert f"run {oom} (FAILED) of this config left" in caplog.text and "status=oom" in caplog.text

    killed = unfinished_run(client, overrides, tmp_path / "c", "KILLED")
    resume, busy = resumable(client, typed, hashed)
    assert (resume.run_id, resume.folder, resume.epoch, busy) == (killed, tmp_path / "c", 1, None)
    plan = plan_job(compose_config(*overrides), hydra_job(tmp_path / "job", overrides))
    assert (plan.resume.run_id, plan.output_dir) == (killed, tmp_path / "c")

    with held(tmp_path / "c", "job", "wait"):  # a live process trains it: this job trains nothing
        assert resumable(client, typed, hashed) == (None, killed)
    skipped = plan_job(compose_config(*overrides, "skip_finished=false"), hydra_job(tmp_path / "job", overrides))
    assert skipped.resume is None


def test_a_live_run_of_the_same_config_without_a_checkpoint_yet_is_not_trained_twice(tmp_path, store):
    """The same sweep started twice: the second command's job finds the first's run training (its folder held)
    before that run wrote any checkpoint; it trained the config again."""
    client = ensure_store(store)
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    typed, hashed = OmegaConf.to_object(compose_config(*overrides)), config_hash(flatten(compose_config(*overrides)))
    tags = {"output_dir": str(tmp_path / "live"), "config_hash": hashed, "code_fingerprint": code_fingerprint()}
    live = client.create_run(experiment_id(client, "medsweep"), tags=tags).info.run_id  # RUNNING, nothing on disk
    assert resumable(client, typed, hashed) == (None, None)  # its process is gone: a new run trains it
    with held(tmp_path / "live", "job", "wait"):
        assert resumable(client, typed, hashed) == (None, live)


def ended_process() -> dict[str, str]:
    """:func:`process_tags` of a process of this machine that has ended."""
    with subprocess.Popen(["sleep", "60"]) as child:
        started = psutil.Process(child.pid).create_time()
        child.kill()
    return {**process_tags(), "pid": f"{child.pid}@{started:.2f}"}


def test_a_process_is_gone_on_this_machine_only_when_no_process_has_its_pid_and_start_time():
    assert not process_gone(process_tags())
    assert process_gone(ended_process())
    assert process_gone({**process_tags(), "pid": f"{os.getpid()}@1.00"})  # its pid taken by another process since
    assert not process_gone({**ended_process(), "host": "another-node"})
    assert not process_gone({**ended_process(), "boot_id": "an-earlier-boot"})
    assert not process_gone({"host": process_tags()["host"]})  # a run logged before the tags


def test_a_run_left_running_by_a_process_that_died_is_closed_by_the_next_command(tmp_path, store, caplog):
    """A run killed (SIGKILL, the out-of-memory killer) before its first checkpoint stayed RUNNING for good."""
    client = ensure_store(store)
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    typed, hashed = OmegaConf.to_object(compose_config(*overrides)), config_hash(flatten(compose_config(*overrides)))
    ran = {"config_hash": hashed, "code_fingerprint": code_fingerprint()}

    def running(name: str, process: dict[str, str]) -> str:
        tags = {**ran, **process, "output_dir": str(tmp_path / name)}
        return client.create_run(experiment_id(client, "medsweep"), tags=tags).info.run_id

    orphan, alive = running("a", ended_process()), running("c", process_tags())
    elsewhere = running("b", {**ended_process(), "host": "another-node"})
    assert resumable(client, typed, hashed) == (None, None)
    ended = [client.get_run(run) for run in (orphan, elsewhere, alive)]
    assert [(run.info.status, run.data.tags.get("status")) for run in ended] == [
        ("KILLED", "process_gone"),
        ("RUNNING", None),
        ("RUNNING", None),
    ]
    assert f"run {orphan} of this config was RUNNING, its process gone: closed KILLED" in caplog.text

    held_by_another = running("d", ended_process())  # its folder held: a process of the run's lives on
    with held(tmp_path / "d", "job", "wait"):
        assert resumable(client, typed, hashed) == (None, held_by_another)
    assert client.get_run(held_by_another).info.status == "RUNNING"


@pytest.mark.slow
def test_a_sweep_killed_before_its_first_checkpoint_leaves_no_run_running_once_run_again(tmp_path, store, shared_data):
    """SIGKILL to a sweep (one process: Hydra's basic launcher) while its job trains its first epoch: its parent run
    and its job's run stayed RUNNING, and the same command trained a third and fourth run beside them."""
    args = ["-m", *small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=200", "seed=0")]
    with subprocess.Popen(
        [sys.executable, "-m", "src.train", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    ) as process:
        deadline = time.monotonic() + 600
        while len(runs(store)) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        kill_group(process)
    killed = {run.info.run_id for run in runs(store)}
    assert len(killed) == 2 and {run.info.status for run in runs(store)} == {"RUNNING"}
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    ended = {run.info.run_id: (run.info.status, run.data.tags.get("status")) for run in runs(store)}
    assert [ended[run] for run in killed] == [("KILLED", "process_gone")] * 2
    assert sorted(status for run, status in ended.items() if run not in killed) == [("FINISHED", None)] * 2


def test_resume_of_a_config_that_already_finished_is_refused(tmp_path, store):
    client = ensure_store(store)
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    killed = unfinished_run(client, overrides, tmp_path / "a", "KILLED")
    finished = unfinished_run(client, overrides, tmp_path / "b", "FINISHED")
    command = [f"resume={killed}", f"mlflow.tracking_uri={store}"]
    with pytest.raises(UsageError) as refused:
        plan_job(compose_config(*command), hydra_job(tmp_path / "job", command))
    assert str(refused.value) == (
        f"resume={killed}: run {finished} already FINISHED with this config, so resuming run {killed} would train it "
        f"twice: rerun={finished} trains it again, or skip_finished=false resumes anyway"
    )
    anyway = [*command, "skip_finished=false"]
    assert plan_job(compose_config(*anyway), hydra_job(tmp_path / "j", anyway)).resume.run_id == killed


@pytest.mark.slow
def test_a_run_in_use_is_not_resumed_by_another_process(tmp_path, store, shared_data):
    client = ensure_store(store)
    killed = unfinished_run(client, ["model=resnet10"], tmp_path / "run", "KILLED")
    with held(tmp_path / "run", "job", "wait"):
        result = run_cli(f"resume={tmp_path / 'run'}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/x")
    line = one_error_line(result)
    assert line.startswith(f"error: {tmp_path / 'run'} is in use by another job (pid ")
    assert line.endswith("): it trains the run to resume now: wait for it to end")
    assert mlflow.MlflowClient(store).get_run(killed).info.status == "KILLED"


def test_a_new_run_never_overwrites_the_tested_weights_an_earlier_run_left_in_its_folder(tmp_path, store):
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / checkpoint.BEST_FILE).write_bytes(b"weights")
    with pytest.raises(UsageError) as refused:
        plan_job(compose_config(*overrides), hydra_job(tmp_path / "run", overrides))
    assert str(refused.value) == (
        f"{tmp_path / 'run'} holds the tested weights of an earlier run (best.pt), which a new run there would "
        "overwrite: give this job another folder (hydra.run.dir, or hydra.sweep.dir with -m)"
    )


def test_a_checkpoint_a_new_run_would_overwrite_is_refused_naming_its_run(tmp_path, store):
    """A job folder holding an unfinished run's checkpoint that this job does not resume: the run is in another store,
    deleted, of another config, or of a config today's schema refuses. A new run there overwrote it."""
    client = ensure_store(store)
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    elsewhere = f"sqlite:///{tmp_path / 'other.db'}"
    ran = unfinished_run(
        ensure_store(elsewhere), [*overrides[:1], f"mlflow.tracking_uri={elsewhere}"], tmp_path / "a", "KILLED"
    )
    deleted = unfinished_run(client, overrides, tmp_path / "b", "KILLED")
    client.delete_run(deleted)
    seeded = unfinished_run(client, [*overrides, "seed=5"], tmp_path / "c", "KILLED")
    outdated = unfinished_run(client, overrides, tmp_path / "d", "KILLED")
    state = checkpoint.load(tmp_path / "d" / checkpoint.FILE)
    state["config"]["model"]["old_key"] = 1
    checkpoint.save(state, tmp_path / "d" / checkpoint.FILE)
    for folder, run, why in [
        ("a", ran, f"is not in {store}: set mlflow.tracking_uri to the store it logged to"),
        ("b", deleted, f"is deleted in {store}: restore it (mlflow runs restore --run-id {deleted})"),
        ("c", seeded, f"was trained with seed=5->0: resume it alone (resume={tmp_path / 'c'})"),
        ("d", outdated, "was checkpointed with a config that does not fit today's schema (Key 'old_key' not in"),
    ]:
        with pytest.raises(UsageError) as refused:
            plan_job(compose_config(*overrides), hydra_job(tmp_path / folder, overrides))
        assert str(refused.value).startswith(
            f"{tmp_path / folder / checkpoint.FILE} holds the checkpoint of run {run}, which a new run in this folder "
            f"would overwrite; the run {why}"
        )
        assert str(refused.value).endswith(
            ", or give this job another folder (hydra.run.dir, or hydra.sweep.dir with -m)"
        )

    for value, run, why in [
        (deleted, deleted, f"of {tmp_path / 'b' / checkpoint.FILE} is deleted in {store}: restore it"),
        (outdated, outdated, "was checkpointed with a config that does not fit today's schema (Key 'old_key' not in"),
    ]:
        command = [f"resume={value}", f"mlflow.tracking_uri={store}"]
        with pytest.raises(UsageError) as refused:
            plan_job(compose_config(*command), hydra_job(tmp_path / "job", command))
        assert str(refused.value).startswith(f"resume={value}: run {run} {why}")


# -- corrupt checkpoints ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kept", [200, 5000, None], ids=["its-header", "into-its-tensors", "a-flipped-byte"]
)  # a zip error, an OSError, a CRC mismatch torch.load alone does not see
def test_a_corrupt_checkpoint_is_one_line_for_resume_and_a_warning_for_a_new_run(tmp_path, store, caplog, kept):
    client = ensure_store(store)
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    killed = unfinished_run(client, overrides, tmp_path / "run", "KILLED", weights=torch.zeros(100_000))
    path = tmp_path / "run" / checkpoint.FILE
    data = bytearray(path.read_bytes())
    if kept is None:  # the file whole, one byte of the weights' zeros changed
        data[data.index(bytes(4096)) + 2048] ^= 0xFF
    path.write_bytes(data if kept is None else data[:kept])  # truncated, or corrupt
    command = [f"resume={killed}", f"mlflow.tracking_uri={store}"]
    with pytest.raises(UsageError) as refused:
        plan_job(compose_config(*command), hydra_job(tmp_path / "job", command))
    assert str(refused.value).startswith(f"resume={killed}: {path} is unreadable (truncated or corrupt: ")
    assert str(refused.value).endswith(": the run cannot go on from it; start a new run")

    plan = plan_job(compose_config(*overrides), hydra_job(tmp_path / "run", overrides))  # a requeued job's folder
    assert plan.resume is None and f"{path} is unreadable" in caplog.text


# -- a loss that turns NaN ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_diverged_run_ends_failed_in_one_line(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1", "optim.lr=1e30"))
    (run,) = runs(store)
    assert one_error_line(result) == (
        f"error: training diverged: train/loss is nan at epoch 1 step 3 (run {run.info.run_id} FAILED): lower "
        "optim.lr, set grad_clip, or amp=false"
    )
    assert (run.info.status, run.data.tags["status"]) == ("FAILED", "diverged")
    assert "test/auc" not in run.data.metrics


# -- full disks ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    """A small tmpfs mounted at ``folder`` (root only); the test skips with the reason where none can be mounted."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.slow
def test_a_full_output_disk_is_one_line_and_the_run_resumes_once_there_is_space(tmp_path, store, shared_data):
    """resnet10's checkpoint is ~230 MB: the first fits in 300 MB, the second (written beside it) does not."""
    with tmpfs(tmp_path / "disk", "300m") as disk:
        every_epoch = ("epochs=2", "checkpoint.every_s=0")
        args = [a for a in small_run(tmp_path, store, shared_data, *every_epoch) if not a.startswith("hydra.run")]
        result = run_cli(*args, f"hydra.run.dir={disk}/run")
        (run,) = runs(store)
        assert one_error_line(result) == (
            f"error: no space left on {disk}/run (writing checkpoint.pt): run {run.info.run_id} FAILED; its last "
            f"checkpoint is kept: free space, then resume it: python -m src.train resume={run.info.run_id}"
        )
        assert (run.info.status, run.data.tags["status"]) == ("FAILED", "no_space")
        assert checkpoint.load(disk / "run" / checkpoint.FILE)["epoch"] == 1
        subprocess.run(["mount", "-o", "remount,size=800m", str(disk)], check=True)
        again = run_cli(*args, f"hydra.run.dir={tmp_path}/again")  # the same command: it goes on from epoch 2
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = runs(store)
    assert (run.info.status, run.data.tags["resumes"], run.data.tags.get("status")) == ("FINISHED", "1", None)


@pytest.mark.slow
def test_a_store_whose_disk_fills_mid_run_is_one_line_naming_the_run_to_resume(tmp_path, shared_data):
    with tmpfs(tmp_path / "disk", "8m") as disk:
        store = f"sqlite:///{disk / 'mlflow.db'}"
        ensure_store(store)
        args = small_run(tmp_path, store, shared_data, "epochs=20", "mlflow.system_metrics=false")
        process = subprocess.Popen(
            [sys.executable, "-m", "src.train", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 900
            while not (started := runs(store)):  # the run exists: now fill the store's disk
                assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
                time.sleep(0.2)
            with contextlib.suppress(OSError), (disk / "filler").open("wb") as out:
                out.write(b"\0" * (64 << 20))
            stdout, stderr = process.communicate(timeout=900)
        finally:
            kill_group(process)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    run_id = started[0].info.run_id
    go_on = (  # the store failed at the run's first writes, or at an epoch's metrics after its checkpoint
        f"its last checkpoint is kept: fix the store, then resume it: python -m src.train resume={run_id} (or the same "
        "command again)"
        if (tmp_path / "run" / checkpoint.FILE).is_file()
        else "it wrote no checkpoint yet: fix the store, then run the same command again (a new run trains it)"
    )
    assert one_error_line(result) == (
        f"error: the MLflow store {store} failed (no space left on its disk) with run {run_id}, which may stay "
        f"RUNNING; {go_on}"
    )


def test_of_two_runs_of_one_config_planned_at_once_the_later_one_goes(tmp_path, store):
    client = ensure_store(store)
    overrides = ["model=resnet10", f"mlflow.tracking_uri={store}"]
    typed, hashed = OmegaConf.to_object(compose_config(*overrides)), config_hash(flatten(compose_config(*overrides)))

    def new_run(folder: str, **tags: str) -> str:
        tags = {
            "output_dir": str(tmp_path / folder),
            "config_hash": hashed,
            "code_fingerprint": code_fingerprint(),
            **tags,
        }
        return client.create_run(experiment_id(client, "medsweep"), tags=tags).info.run_id

    first = new_run("first")
    time.sleep(0.01)  # MLflow's start times are in milliseconds
    second = new_run("second")
    assert earlier_twin(client, typed, second) is None  # the first's process is gone: nothing trains it
    with held(tmp_path / "first", "job", "wait"), held(tmp_path / "second", "job", "wait"):
        assert earlier_twin(client, typed, second) == first and earlier_twin(client, typed, first) is None
    client.set_terminated(first, "FINISHED")  # it finished while the second planned
    assert earlier_twin(client, typed, second) == first
    client.set_tag(first, "code_fingerprint", "0ld")  # skip_finished=true skips only a run of this code
    assert earlier_twin(client, typed, second) is None
    assert earlier_twin(client, dataclasses.replace(typed, skip_finished="config"), second) == first


@pytest.mark.slow
def test_the_same_command_started_twice_at_once_trains_once(tmp_path, store, shared_data):
    """Two identical commands planning at once (``batch_size=auto``'s probes keep each seconds from its run): each
    found no run of the config when it planned; the later run to start goes."""
    path = ":".join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0"}
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "src.train",
                *small_run(tmp_path / str(n), store, shared_data, "batch_size=auto", "epochs=1"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(2)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    assert [run.info.status for run in runs(store)] == ["FINISHED"], outputs
    assert sum("this job trains nothing" in output for output in outputs) == 1
