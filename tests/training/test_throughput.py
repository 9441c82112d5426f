"""Throughput as a run can honestly state it: warm-up steps left out, its epochs' median and range, the steps it
timed, and how busy other processes kept the machine (real processes burning real CPU)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import torch

from src.parallel.machine_share import GPU_JOBS_ENV
from src.training import meters
from src.training.meters import RUN_WARMUP, OtherLoad, ThroughputMeter, is_contended
from src.training.step_graph import WARMUP_STEPS
from src.training.trainer import Hooks
from tests.helpers import graph_on_cpu
from tests.training.test_engine import trainer_for

CPU = torch.device("cpu")
BURN = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"


def timed_steps(meter: ThroughputMeter, steps: int) -> float:
    meter.start_epoch(steps)
    for _ in range(steps):
        meter.step_done(4)
    return meter.end_epoch()["perf/steps_timed"]


def test_a_process_does_not_time_its_first_steps_and_each_epoch_its_first():
    meter = ThroughputMeter(CPU)
    assert [timed_steps(meter, 10), timed_steps(meter, 10), timed_steps(meter, 1)] == [10 - RUN_WARMUP, 9, 1]


def test_a_run_logs_its_epochs_median_range_and_steps_timed_and_keeps_them_across_a_resume(shared_data):
    trainer = trainer_for("epochs=3", "limit_batches=6", "batch_size=4", data_root=shared_data)
    trainer.train_epoch(0)
    trainer.epoch = 1  # as fit leaves it after epoch 1
    resumed = trainer_for("epochs=3", "limit_batches=6", "batch_size=4", data_root=shared_data)
    resumed.load_state_dict(trainer.state_dict())  # a new process: its first epoch skips the warm-up again
    final = resumed.fit(lambda metrics, step: None)
    rates = [epoch["perf/samples_per_s"] for epoch in resumed.timed]
    assert len(rates) == 3 and final["perf/steps_timed"] == 2 * (6 - RUN_WARMUP) + (6 - 1)
    assert final["perf/samples_per_s_median"] == sorted(rates)[1]
    assert (final["perf/samples_per_s_lo"], final["perf/samples_per_s_hi"]) == (min(rates), max(rates))


def test_a_run_states_its_seconds_validating_and_checkpointing_and_keeps_them_across_a_resume(tmp_path, shared_data):
    """Parts of ``time/total_s`` on the main rank: what eager validation and the epochs' checkpoints cost a run."""
    path = tmp_path / "checkpoint.pt"
    first = trainer_for("epochs=2", "limit_batches=3", "batch_size=4", data_root=shared_data)
    first.hooks = Hooks(checkpoint_to=path)
    final = first.fit(lambda metrics, step: None)
    assert final["time/validate_s"] > 0 and final["time/checkpoint_s"] > 0
    assert final["time/validate_s"] + final["time/checkpoint_s"] < final["time/total_s"]
    saved = torch.load(path, weights_only=True)["spent_s"]  # written before its own save was counted
    assert saved["time/validate_s"] == final["time/validate_s"]
    assert saved["time/checkpoint_s"] < final["time/checkpoint_s"]
    longer = trainer_for("epochs=3", "limit_batches=3", "batch_size=4", data_root=shared_data)
    longer.load_state_dict(torch.load(path, weights_only=True))
    resumed = longer.fit(lambda metrics, step: None)
    assert resumed["time/validate_s"] > saved["time/validate_s"]


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def burned(load: OtherLoad, burner: int, seconds: float = 1.5) -> tuple[dict[str, float], float]:
    """The load over a window, and the burner's own cores over it."""
    before = cpu_seconds(burner)
    load.start()
    start = time.perf_counter()
    time.sleep(seconds)
    elapsed = time.perf_counter() - start
    return load.stop(elapsed), (cpu_seconds(burner) - before) / elapsed


@pytest.fixture
def burners():
    """A CPU-burning child of this process, and one that is not (started by a shell that exits at once)."""
    child = subprocess.Popen([sys.executable, "-c", BURN])
    detached = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c '{BURN}' >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    stranger = int(detached.stdout)
    yield child.pid, stranger
    child.kill()
    child.wait()
    psutil.Process(stranger).kill()


def test_a_jobs_own_processes_count_as_its_own_cpu_and_others_as_others(burners):
    """One burner runs at a time: the job's own child, then a process outside the job. Whatever else loads the
    machine, the child's CPU is in the job's own use and the other's in ``perf/others_cpu`` (to the kernel's 10 ms
    accounting)."""
    child, stranger = (psutil.Process(pid) for pid in burners)
    load = OtherLoad(psutil.Process(), CPU)
    stranger.suspend()
    with_child, child_cores = burned(load, child.pid)
    stranger.resume()
    child.suspend()
    with_stranger, stranger_cores = burned(load, stranger.pid)
    child.resume()
    assert child_cores > 0.02 and stranger_cores > 0.02  # each ran in its window
    assert with_child["perf/own_cpu"] >= 0.95 * child_cores - 0.02
    assert with_stranger["perf/others_cpu"] >= 0.95 * stranger_cores - 0.02
    assert with_stranger["perf/own_cpu"] < 0.05 + 0.05 * stranger_cores  # this test process only sleeps


@pytest.mark.parametrize(
    "others,own,gpu,cores,expected",
    [
        (0.02, 1.98, 0, 2, False),  # the run alone fills the machine
        (0.6, 1.4, 0, 2, True),  # another job takes a core the run's threads wanted
        (0.3, 0.5, 0, 2, False),  # the machine had cores to spare
        (8.0, 3.0, 0, 16, False),  # other jobs on a big GPU node, cores to spare
        (13.0, 3.0, 0, 16, True),
        (0.0, 1.0, 1, 16, True),  # another process on the run's GPU
    ],
)
def test_a_run_is_contended_when_others_took_cores_it_could_have_used(others, own, gpu, cores, expected):
    assert is_contended(others, own, gpu, cores) is expected


def test_a_loader_batch_that_spans_gpus_counts_whole_in_samples_per_s_and_train_acc(shared_data):
    """parallel=dp: each micro-step trains one loader batch of batch_size x GPUs (build_trainer), all of it counted."""
    trainer = trainer_for("batch_size=4", "limit_batches=5", "epochs=1", data_root=shared_data, width=2)
    metrics = trainer.train_epoch(0)
    assert metrics["perf/samples_per_s"] * metrics["perf/step_ms"] / 1000 == pytest.approx(2 * trainer.cfg.batch_size)
    assert metrics["train/acc"] == trainer.correct.item() / (5 * 2 * trainer.cfg.batch_size) <= 1


class FakeNvml:
    """pynvml's calls ``other_gpu_processes`` makes, listing ``pids`` on the GPU: a stand-in, as NVML needs a GPU
    this machine lacks (the real path runs in the gpu session's sweeps)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list:
        return [type("Process", (), {"pid": pid})() for pid in self.pids]


@pytest.mark.parametrize(
    ("listed", "gpu_jobs", "expected"),
    [
        (["own", 1, 2], None, 2),  # NVML sees this PID namespace: the others are counted
        (["own"], "4", 0),  # the job alone where NVML lists it, whatever the sweep recorded
        ([4_000_001], None, 0),  # a container: NVML's PID is the host's (this job): not another process
        ([4_000_001], "4", 3),  # ... then the sweep's other jobs on this GPU
        ([], "2", 1),  # MPS, or NVML lists nothing here
    ],
)
def test_other_gpu_processes_where_nvml_does_not_list_the_jobs_own_pid(monkeypatch, listed, gpu_jobs, expected):
    job = psutil.Process()
    pids = [job.pid if pid == "own" else pid for pid in listed]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(pids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("Props", (), {"uuid": "x"})())
    if gpu_jobs is None:
        monkeypatch.delenv(GPU_JOBS_ENV, raising=False)
    else:
        monkeypatch.setenv(GPU_JOBS_ENV, gpu_jobs)
    assert meters.other_gpu_processes(torch.device("cuda"), job) == expected


def test_a_graphed_run_does_not_time_the_steps_before_and_of_its_capture(shared_data):
    """The graph's eager steps and the step that captures it (``WARMUP_STEPS + 1``) stay out of the first epoch's
    timing; later epochs leave out one step, as eager runs do."""
    trainer = graph_on_cpu(trainer_for("batch_size=4", "limit_batches=8", "epochs=2", data_root=shared_data))
    for epoch in range(2):
        trainer.train_epoch(epoch)
    timed = [epoch["perf/steps_timed"] for epoch in trainer.timed]
    assert timed == [8 - (WARMUP_STEPS + 1), 8 - 1] and trainer.captures == 1
