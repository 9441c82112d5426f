"""Checkpoints, ``resume=``, SIGTERM and submitit requeue: real signals, real processes, a real MLflow store."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from src.data import load_splits, make_loader
from src.errors import UsageError
from src.jobs.resume import explicit, log_missing
from src.parallel.dist import Rank
from src.parallel.preemption import EXIT_PREEMPTED, Preempted, Preemption
from src.tracking.runs import RunLogger
from src.tracking.store import ensure_store
from src.training import checkpoint
from src.training.faults import fault_hooks
from src.training.trainer import Hooks, Trainer
from tests.helpers import RESULTS, ROOT, compose_config, graph_on_cpu, history, kill_group, run_cli, runs, small_run

EPOCHS = 4
RUN = (  # train again; compare checkpoints; stop runs after a given epoch's checkpoint
    f"epochs={EPOCHS}",
    "skip_finished=false",
    "checkpoint.keep=always",
    "checkpoint.every_s=0",
)
NOT_RESULTS = ("perf/", "mem/", "time/")  # measurements of the process, not results
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


def assert_same_weights(path: Path, reference: Path) -> None:
    ours, theirs = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
    for part in ("model", "best_state", "ema"):
        if ours[part] is None and theirs[part] is None:
            continue
        assert ours[part].keys() == theirs[part].keys()
        assert all(torch.equal(ours[part][k], theirs[part][k]) for k in ours[part]), part
    assert all(
        torch.equal(a, b)
        for a, b in zip(ours["optimizer"]["state"][0].values(), theirs["optimizer"]["state"][0].values(), strict=True)
    )


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


# -- the checkpoint file and the Trainer, in this process ---------------------------------------------------


def test_checkpoint_is_atomic_weights_only_and_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = tmp_path / checkpoint.FILE
    checkpoint.save({"rng": checkpoint.rng_state()}, path)
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    assert [p.name for p in tmp_path.iterdir()] == [checkpoint.FILE]  # no temp file left behind
    checkpoint.set_rng_state(torch.load(path, weights_only=True)["rng"])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])


def bn_net() -> nn.Module:
    """Small, with BatchNorm running statistics (buffers must come back too)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, stride=2),
        nn.BatchNorm3d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


def trainer(shared_data, folder: Path, *overrides: str, preemption: Preemption | None = None) -> Trainer:
    """Cyclic LR (stepped per optimizer step) and accumulation: the state a mid-epoch stop must keep. The override
    ``graphed`` steps through the CUDA-graph path with its CPU stand-in (:func:`tests.helpers.graph_on_cpu`)."""
    graphed = "graphed" in overrides
    overrides = tuple(o for o in overrides if o != "graphed")
    cfg = OmegaConf.to_object(
        compose_config(
            "data=adrenalmnist3d",
            f"data.root={shared_data}",
            "data.download=false",
            "device=cpu",
            "batch_size=2",
            "accumulate=2",
            "limit_batches=6",
            "epochs=3",
            "sched=cyclic",
            *overrides,
        )
    )
    cpu = torch.device("cpu")
    loaders = {
        s: make_loader(cfg.data, t, cfg.batch_size, cfg.seed, s == "train", cpu)
        for s, t in load_splits(cfg.data).items()
    }
    folder.mkdir(exist_ok=True)
    hooks = Hooks(
        checkpoint_to=folder / checkpoint.FILE,
        preemption=preemption or Preemption(),
        after_step=fault_hooks(cfg, Rank()),
    )
    made = Trainer(cfg, bn_net(), loaders, cpu, Rank(), hooks)
    return graph_on_cpu(made) if graphed else made


@pytest.mark.parametrize("every_s,saved_at", [(0, [1, 2, 3]), (3600, [3, 3, 3])])
def test_an_epochs_metrics_are_logged_only_after_a_checkpoint_that_holds_it(tmp_path, shared_data, every_s, saved_at):
    """``checkpoint.every_s=0`` saves every epoch; a longer interval than the run saves once, after its last epoch,
    and logs every epoch then. Each log reads the checkpoint on disk at that moment."""
    logged = []

    def log(metrics, step):
        logged.append((step, torch.load(tmp_path / checkpoint.FILE, weights_only=True)["epoch"]))

    trainer(shared_data, tmp_path, f"checkpoint.every_s={every_s}").fit(log)
    assert logged[:-1] == list(zip([0, 1, 2], saved_at, strict=True)) and logged[-1] == (3, 3)  # then the test


def test_a_checkpoint_from_before_2026_11_27_hands_its_last_epochs_metrics_to_check(tmp_path, shared_data):
    """Such a checkpoint holds ``last_metrics`` (the epoch before ``epoch``), not the list of epochs ``pending``."""
    run = trainer(shared_data, tmp_path, "epochs=2")
    run.fit(lambda metrics, step: None)
    state = torch.load(tmp_path / checkpoint.FILE, weights_only=True)
    assert [epoch for epoch, _ in state.pop("pending")] == [0, 1]  # one checkpoint, written before both were logged
    old = trainer(shared_data, tmp_path, "epochs=2")
    old.load_state_dict({**state, "last_metrics": {"val/auc": 0.5}})
    assert old.maybe_unlogged == [(1, {"val/auc": 0.5})]


def test_a_crash_between_checkpoints_logs_none_of_the_epochs_it_retrains(tmp_path, shared_data):
    """A real out-of-memory error in epoch 3 (``fault.oom_step``), no checkpoint written yet: resumed, the run would
    train from its last checkpoint (none: from the start), so nothing was logged."""
    logged = []
    with pytest.raises(torch.OutOfMemoryError):
        trainer(shared_data, tmp_path, "checkpoint.every_s=3600", "fault.oom_step=7").fit(
            lambda metrics, step: logged.append(step)
        )
    assert logged == [] and not (tmp_path / checkpoint.FILE).exists()


@pytest.mark.parametrize("switch", ["aug=none", "aug=standard", "ema_decay=0.9", "graphed"])
def test_a_trainer_stopped_by_sigterm_mid_epoch_resumes_bitwise(tmp_path, shared_data, switch):
    logged = {"whole": [], "parts": []}
    whole = trainer(shared_data, tmp_path / "whole", switch)
    final = whole.fit(lambda metrics, step: logged["whole"].append((step, metrics)))

    preemption = Preemption()
    stopped = trainer(shared_data, tmp_path / "parts", switch, "fault.term_step=4", preemption=preemption)
    with preemption.installed(), pytest.raises(Preempted, match="stopped at epoch 2 step 1/3"):
        stopped.fit(lambda metrics, step: logged["parts"].append((step, metrics)))  # a real SIGTERM after step 4
    state = torch.load(tmp_path / "parts" / checkpoint.FILE, weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 1) and len(state["running"]["loss"]) == 1
    assert (state["ema"] is not None) == switch.startswith("ema_decay")

    resumed = trainer(shared_data, tmp_path / "parts", switch, "fault.term_step=4")
    resumed.load_state_dict(state)
    resumed_final = resumed.fit(lambda metrics, step: logged["parts"].append((step, metrics)))

    def kept(entries):
        return [(step, {k: v for k, v in m.items() if not k.startswith(NOT_RESULTS)}) for step, m in entries]

    assert kept(logged["parts"]) == kept(logged["whole"]) and [s for s, _ in logged["parts"]] == [0, 1, 2, 3]
    assert {k: v for k, v in resumed_final.items() if not k.startswith(NOT_RESULTS)} == {
        k: v for k, v in final.items() if not k.startswith(NOT_RESULTS)
    }
    assert_same_weights(tmp_path / "parts" / checkpoint.FILE, tmp_path / "whole" / checkpoint.FILE)


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
    job.hooks.checkpoint_meta = {
        "run_id": run.run_id,
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "batch_size": 2,
        "accumulate": 2,
        "world": 1,
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
