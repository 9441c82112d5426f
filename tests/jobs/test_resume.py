"""src/jobs/resume.py: ``resume=``, a command run again going on with its unfinished run, a SIGTERM or SIGKILL,
submitit's requeue: real signals, real processes, a real MLflow store."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import pytest
import torch
from omegaconf import OmegaConf

from src.errors import UsageError
from src.folders import held
from src.jobs.plan import plan_job
from src.jobs.resume import earlier_twin, explicit, log_missing, resumable
from src.parallel.preemption import EXIT_PREEMPTED
from src.tracking.identity import code_fingerprint, config_hash, flatten
from src.tracking.runs import RunLogger, process_tags
from src.tracking.store import ensure_store, experiment_id
from src.training import checkpoint
from tests.helpers import (
    RESULTS,
    ROOT,
    compose_config,
    ended_process,
    history,
    hydra_job,
    kill_group,
    one_error_line,
    run_cli,
    runs,
    small_run,
)
from tests.jobs.helpers import unfinished_run
from tests.training.helpers import NOT_RESULTS, assert_same_weights, trainer

EPOCHS = 4
RUN = (  # train again; compare checkpoints; stop runs after a given epoch's checkpoint
    f"epochs={EPOCHS}",
    "skip_finished=false",
    "checkpoint.keep=always",
    "checkpoint.every_s=0",
)
FINAL = (  # logged once, at step `epochs`
    "test/",
    "model/",
    "time/total_s",
    "time/validate_s",
    "time/checkpoint_s",
    "best_epoch",
    "stopped_epoch",
    "perf/samples_per_s_",
    "perf/steps_timed",
)
STARTUP = "time/startup"  # logged by each start of the run


def results(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    return {key: values for key, values in history(uri, run_id).items() if not key.startswith(NOT_RESULTS)}


def assert_one_value_per_epoch(uri: str, run_id: str) -> None:
    """Epoch metrics once per epoch, final ones once at step ``epochs``, start-up once per start of the run (at the
    epoch it started from: 0, then each resume's)."""
    starts = 1 + int(mlflow.MlflowClient(uri).get_run(run_id).data.tags.get("resumes", 0))
    for key, values in history(uri, run_id).items():
        steps = [step for step, _ in values]
        if key.startswith(STARTUP):
            assert len(steps) == starts and steps[0] == 0 and steps == sorted(steps), key
        else:
            assert steps == ([EPOCHS] if key.startswith(FINAL) else list(range(EPOCHS))), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shared_data) -> tuple[str, str, Path]:
    """One uninterrupted run: (store, run id, its checkpoint)."""
    folder = tmp_path_factory.mktemp("reference")
    store = f"sqlite:///{folder / 'mlflow.db'}"
    result = run_cli(*small_run(folder, store, shared_data, *RUN))
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    return store, run.info.run_id, folder / "run" / checkpoint.FILE


def assert_equals_reference(store: str, run_id: str, folder: Path, reference: tuple[str, str, Path]) -> None:
    ref_store, ref_id, ref_checkpoint = reference
    run = mlflow.MlflowClient(store).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert_one_value_per_epoch(store, run_id)
    assert results(store, run_id) == results(ref_store, ref_id)
    assert set(results(store, run_id)) >= RESULTS
    assert_same_weights(folder / checkpoint.FILE, ref_checkpoint)


# -- metrics a resumed run logs ----------------------------------------------------------------------------


def test_metrics_a_stopped_run_already_logged_are_not_logged_twice(store):
    client = ensure_store(store)
    run = RunLogger.start(client, "medsweep", "r", params={}, tags={})
    run.log_metrics({"val/auc": 0.5}, step=2)
    log_missing(run, {"val/auc": 0.5, "val/acc": 0.75}, step=2)
    log_missing(run, {"val/auc": 0.5, "val/acc": 0.75}, step=2)
    assert history(store, run.run_id) == {"val/auc": [(2, 0.5)], "val/acc": [(2, 0.75)]}


# -- bad resume= values ------------------------------------------------------------------------------------


@pytest.fixture
def unfinished(tmp_path, store, shared_data) -> tuple[Path, str, list[str]]:
    """A RUNNING MLflow run with a real one-epoch checkpoint: (its folder, run id, its overrides)."""
    overrides = [
        "data=adrenalmnist3d",
        f"data.root={shared_data}",
        "data.download=false",
        "device=cpu",
        f"mlflow.tracking_uri={store}",
    ]
    cfg = compose_config(*overrides)
    run = RunLogger.start(ensure_store(store), "medsweep", "r", params={}, tags={"output_dir": str(tmp_path / "run")})
    job = trainer(shared_data, tmp_path / "run", "epochs=1", "limit_batches=2")
    job.saving.meta = {
        "run_id": run.run_id,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "batch_size": 2,
        "accumulate": 2,
        "world": 1,
        "threads": 1,
    }
    job.fit(lambda metrics, step: None)
    return tmp_path / "run", run.run_id, overrides


def resume_error(value: str, overrides: list[str]) -> str:
    with pytest.raises(UsageError) as err:
        explicit(
            compose_config(*overrides, f"resume={value}"),
            [*overrides, f"resume={value}"],
            OmegaConf.select(compose_config(*overrides), "mlflow.tracking_uri"),
        )
    return str(err.value)


def test_bad_resume_values_name_the_value_and_the_fix(tmp_path, store, unfinished):
    folder, run_id, overrides = unfinished
    assert (
        explicit(
            compose_config(*overrides, f"resume={run_id}"),
            [f"resume={run_id}", *overrides[-1:]],
            store,
        )[1].run_id
        == run_id
    )  # the good case, by run id
    assert resume_error("nope", overrides).startswith("resume=nope is neither a folder nor a run id in")
    (tmp_path / "empty").mkdir()
    assert f"no checkpoint.pt in {tmp_path / 'empty'}" in resume_error(str(tmp_path / "empty"), overrides)
    assert "would change epochs=15->5" in resume_error(str(folder), [*overrides, "epochs=5"])
    other = f"sqlite:///{tmp_path / 'other.db'}"
    for value in (str(folder), run_id):  # a store not created yet: refused, and it stays so
        assert f"in {other}: " in resume_error(value, [*overrides[:-1], f"mlflow.tracking_uri={other}"])
        assert not (tmp_path / "other.db").exists()
    ensure_store(other)
    assert f"is not in {other}: set mlflow.tracking_uri" in resume_error(
        str(folder), [*overrides[:-1], f"mlflow.tracking_uri={other}"]
    )
    mlflow.MlflowClient(store).set_terminated(run_id, "FINISHED")
    assert f"run {run_id} is already FINISHED" in resume_error(run_id, overrides)
    (folder / "checkpoint.pt").unlink()  # as a FINISHED run leaves it (checkpoint.keep=last)
    assert f"run {run_id} is already FINISHED" in resume_error(run_id, overrides)


def test_a_bad_resume_value_fails_the_cli_in_one_line(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "resume=0f00ba4"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: resume=0f00ba4 is neither a folder nor a run id")
    assert runs(store) == []


# -- real processes: SIGKILL, SIGTERM, submitit requeue ----------------------------------------------------


def wait_for_checkpoint(path: Path, process: subprocess.Popen, epochs_done: int) -> None:
    deadline = time.monotonic() + 900  # seconds of work; minutes on a loaded machine; a hang fails here
    while not (path.is_file() and checkpoint.load(path, mmap=True)["epoch"] >= epochs_done):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of epoch {epochs_done} in {path}"
        time.sleep(0.02)


@pytest.fixture
def popen() -> Iterator[Callable[..., subprocess.Popen]]:
    """``popen(*args)`` starts ``python -m src.train ARGS`` in a process group of its own; whatever of the group is
    still running when the test ends (a failed assertion included) is killed."""
    started = []

    def start(*args: str) -> subprocess.Popen:
        started.append(
            subprocess.Popen(
                [sys.executable, "-m", "src.train", *args],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        )
        return started[-1]

    yield start
    for process in started:
        kill_group(process)


@pytest.mark.slow
def test_a_run_killed_after_epoch_2_resumes_by_run_id_to_the_uninterrupted_result(
    tmp_path, store, shared_data, reference, popen
):
    process = popen(*small_run(tmp_path, store, shared_data, *RUN))
    wait_for_checkpoint(tmp_path / "run" / checkpoint.FILE, process, epochs_done=2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    (run,) = runs(store)
    assert run.info.status == "RUNNING"  # nobody closed it
    result = run_cli(f"resume={run.info.run_id}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/again")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_equals_reference(store, run.info.run_id, tmp_path / "run", reference)
    tags = mlflow.MlflowClient(store).get_run(run.info.run_id).data.tags
    assert tags["resumes"] == "1" and tags["preempted"] == "false"
    artifacts = {a.path for a in mlflow.MlflowClient(store).list_artifacts(run.info.run_id)}
    assert {".hydra", "metrics.json", "resumes"} <= artifacts and checkpoint.FILE not in artifacts


@pytest.mark.slow
def test_sigterm_mid_epoch_checkpoints_exits_143_and_resumes_to_the_uninterrupted_result(
    tmp_path, store, shared_data, reference
):
    result = run_cli(*small_run(tmp_path, store, shared_data, *RUN, "fault.term_step=4"))  # epoch 2, step 1 of 3
    assert result.returncode == EXIT_PREEMPTED, result.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "KILLED"
    assert run.data.tags["preempted"] == "true" and run.data.tags["resume_with"] == f"resume={run.info.run_id}"
    assert f"is KILLED and resumable: python -m src.train resume={run.info.run_id}" in result.stdout + result.stderr
    state = torch.load(tmp_path / "run" / checkpoint.FILE, weights_only=True)
    assert (state["epoch"], state["step"], state["run_id"]) == (1, 1, run.info.run_id)
    again = run_cli(f"resume={tmp_path / 'run'}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert_equals_reference(store, run.info.run_id, tmp_path / "run", reference)


def submitit_task(sweep: Path) -> int | None:
    """The pid of the process submitit runs the job in (``python -m submitit.core._submit <sweep>/.submitit/...``)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmdline and any(str(sweep).encode() in part for part in cmdline):
            return int(proc.name)
    return None


@pytest.mark.slow
def test_submitit_requeue_resumes_the_job_in_its_own_folder(tmp_path, store, shared_data, reference, popen):
    """submitit's preemption signal (USR2) to the job: checkpoint, requeue by submitit, the new task resumes."""
    process = popen("-m", "hydra/launcher=submitit_local", *small_run(tmp_path, store, shared_data, *RUN))
    wait_for_checkpoint(tmp_path / "sweep" / "0" / checkpoint.FILE, process, epochs_done=1)
    os.kill(submitit_task(tmp_path / "sweep"), signal.SIGUSR2)
    assert process.wait(timeout=900) == 0, process.communicate()[1][-3000:]
    (job,) = [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]
    assert job.data.tags["resumes"] == "1"
    assert_equals_reference(store, job.info.run_id, tmp_path / "sweep" / "0", reference)
    parent = next(r for r in runs(store) if r.data.tags.get("role") == "sweep")
    assert parent.info.status == "FINISHED"


# -- a command run again goes on with its unfinished run, and what a new run would overwrite ---------------


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


def test_a_checkpoint_whose_config_is_a_pickled_alias_bomb_is_one_line(tmp_path, store, shared_data):
    """A checkpoint's config is unpickled with its sharing: a list referred to ten times at each of nine levels is
    a few hundred bytes, and 10^9 values to OmegaConf, which copies each: ``resume=`` gave no answer in 60 s."""
    folder, overrides = tmp_path / "run", [f"data.root={shared_data}", f"mlflow.tracking_uri={store}"]
    folder.mkdir()
    run_id = unfinished_run(ensure_store(store), overrides, folder, "KILLED")
    bomb = ["lol"] * 10
    for _ in range(8):
        bomb = [bomb] * 10
    state = checkpoint.load(folder / checkpoint.FILE)
    checkpoint.save({**state, "config": {**state["config"], "epochs": bomb}}, folder / checkpoint.FILE)
    result = run_cli(f"resume={folder}", *overrides, f"hydra.run.dir={tmp_path}/resumed", timeout=60)
    assert one_error_line(result) == (
        f"error: resume={folder}: run {run_id} was checkpointed with a config that holds more than 20000 values once "
        "its shared references are expanded (an alias bomb: a few hundred bytes, billions of values): not read"
    )
