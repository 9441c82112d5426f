"""src/training/meters.py: throughput a run can honestly state (warm-up left out, epochs' median and range), other
processes' load (real processes burning real CPU), the devices' peak FLOP/s and their cache."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time

import psutil
import pytest
import torch

from src.parallel.machine_share import GPU_JOBS_ENV
from src.training import meters
from src.training.meters import (
    KNOWN_PEAKS,
    PEAK_MAX_AGE,
    RUN_WARMUP,
    OtherLoad,
    ThroughputMeter,
    cached_peaks,
    is_contended,
    peak_cache_file,
    peak_flops,
    peak_key,
)
from tests.training.helpers import now, plant_peak

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


@pytest.mark.parametrize(("planted", "kept"), [(1e6, False), (1e18, True)])
def test_a_stale_probe_is_taken_again_and_the_best_one_kept(tmp_path, monkeypatch, planted, kept):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    key = plant_peak(tmp_path, planted, now() - PEAK_MAX_AGE - datetime.timedelta(days=1))
    peak = peak_flops(CPU, torch.float32)
    assert (peak.flops == planted) == kept and peak.flops > 1e9 and peak.source == "probe"
    assert peak.age() < datetime.timedelta(hours=1) and cached_peaks()[key] == peak  # probed now: fresh again


def test_the_peak_cache_is_in_the_tests_own_folder_or_where_the_environment_says(tmp_path, monkeypatch, cache_dir):
    assert peak_cache_file() == cache_dir / "peak_flops.json"  # tests/conftest.py: never the user's home cache
    monkeypatch.delenv("MEDSWEEP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert peak_cache_file() == tmp_path / "xdg" / "medsweep" / "peak_flops.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert peak_cache_file() == tmp_path / "home" / ".cache" / "medsweep" / "peak_flops.json"


def test_known_gpus_come_from_the_table_and_cpu_from_a_cached_probe(tmp_path, monkeypatch):
    assert KNOWN_PEAKS["H200"]["bfloat16"] == 989e12
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    first = peak_flops(CPU, torch.float32)
    assert first.source == "probe" and first.flops > 1e9 and cached_peaks() == {peak_key(CPU, torch.float32): first}
    assert peak_flops(CPU, torch.float32) == first  # cached, not probed again
