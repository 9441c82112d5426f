"""Peak memory, throughput and the peak FLOP/s of a device, measured the same way in every run."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import gc
import os
import platform
import re
import time
from pathlib import Path

import psutil
import torch

from src.caches import CacheFile, Schema, number, text
from src.parallel.machine_share import GPU_JOBS_ENV, recorded_by_sweep

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.M).group(1))


def release_free_heap() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc's ``malloc_trim``), so the resident set
    holds live memory only: else a job would reuse pages an earlier job of the same process freed, unseen."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class MemoryMonitor:
    """Training peak memory in MiB.

    CUDA: ``torch.cuda.max_memory_allocated`` (and reserved) since :meth:`start`.
    CPU: growth of the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``)
    over its resident size at :meth:`start`, so data loading and imports before training do not count;
    freed heap is handed back first, so later jobs of one process (a multirun) measure like the first.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.source = "cuda_max_allocated" if device.type == "cuda" else "cpu_rss_peak_growth"
        self._baseline_kb = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            release_free_heap()
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
            self._baseline_kb = _status_kb("VmRSS")

    def peak(self) -> dict[str, float]:
        """``mem/peak_mb`` (and ``mem/peak_reserved_mb`` on CUDA) since :meth:`start`."""
        if self.device.type == "cuda":
            return {
                "mem/peak_mb": torch.cuda.max_memory_allocated(self.device) / 2**20,
                "mem/peak_reserved_mb": torch.cuda.max_memory_reserved(self.device) / 2**20,
            }
        return {"mem/peak_mb": (_status_kb("VmHWM") - self._baseline_kb) / 1024}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


RUN_WARMUP = 3  # optimizer steps a process does not time at its first epoch: allocator growth, kernel choice
MIN_TIMED_STEPS = 20  # a run that timed fewer is no basis for comparing speed
CONTENDED_CORES = 0.25  # other processes' CPU use (cores' worth) that contends with a run on a full machine


def is_contended(others_cpu: float, own_cpu: float, gpu_processes: float = 0, cores: int | None = None) -> bool:
    """Whether other processes took CPU the job could have used (they used :data:`CONTENDED_CORES` or more, and with
    the job's own use the machine's ``cores`` were full), or shared its GPU."""
    full = others_cpu + own_cpu >= (cores or os.cpu_count() or 1) - CONTENDED_CORES
    return (others_cpu >= CONTENDED_CORES and full) or gpu_processes > 0


def busy_cpu_seconds() -> float:
    """CPU seconds the machine spent busy, all cores, all processes (steal too: another VM had the core)."""
    times = psutil.cpu_times()
    return sum(getattr(times, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq", "steal"))


def tree_cpu_seconds(root: psutil.Process) -> float:
    """CPU seconds of ``root`` and its living descendants (a job's ranks, its data-loader workers)."""
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


class OtherLoad:
    """How busy other processes kept the machine over a window: the CPU cores' worth they used (the machine's busy
    CPU time less the job's process tree's) and the job's own, and on CUDA how many other processes held this GPU."""

    def __init__(self, job: psutil.Process, device: torch.device) -> None:
        self.job, self.device = job, device
        self._busy = self._own = 0.0

    @classmethod
    def for_device(cls, device: torch.device, ranks_on_node: int) -> OtherLoad:
        """The job is this process, or with several ranks on this node the process that started them."""
        this = psutil.Process()
        return cls(this.parent() if ranks_on_node > 1 else this, device)

    def start(self) -> None:
        self._busy, self._own = busy_cpu_seconds(), tree_cpu_seconds(self.job)

    def stop(self, elapsed: float) -> dict[str, float]:
        own = tree_cpu_seconds(self.job) - self._own
        others = (busy_cpu_seconds() - self._busy) - own
        load = {"perf/others_cpu": max(0.0, others) / elapsed, "perf/own_cpu": own / elapsed}
        if self.device.type == "cuda":
            load["perf/others_gpu_procs"] = float(other_gpu_processes(self.device, self.job))
        return load


def other_gpu_processes(device: torch.device, job: psutil.Process) -> int:
    """Processes outside the job holding a context on ``device`` (NVML); 0 where NVML cannot tell.

    Where NVML lists none of the job's own processes, though the job holds a context there, its PIDs are not this
    process's to compare: in a container NVML gives the host's PIDs (the job itself would count as another), under
    MPS the server holds the contexts. Then the other jobs of its sweep on this GPU count (:data:`GPU_JOBS_ENV`)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
        pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    except Exception:  # no NVML, an old driver, a MIG slice: not known
        return 0
    own = {job.pid}
    with contextlib.suppress(psutil.Error):
        own |= {p.pid for p in job.children(recursive=True)}
    if not pids & own:
        return int(recorded_by_sweep(GPU_JOBS_ENV) or 1) - 1
    return len(pids - own)


class ThroughputMeter:
    """Samples/s, ms per optimizer step, the fraction of time spent waiting for data, the steps timed and the load
    of other processes, per epoch.

    The first ``warmup`` optimizer steps of each epoch are not timed, and ``first_warmup`` at the first epoch a
    process meters (one-off allocations, autotuning); an epoch times at least its last step. The device is
    synchronised only at the window's edges.
    """

    def __init__(
        self,
        device: torch.device,
        warmup: int = 1,
        first_warmup: int | None = RUN_WARMUP,
        load: OtherLoad | None = None,
    ) -> None:
        self.device, self.warmup, self._first_warmup = device, warmup, first_warmup
        self.load = load or OtherLoad(psutil.Process(), device)

    def start_epoch(self, steps: int) -> None:
        warmup = self.warmup if self._first_warmup is None else self._first_warmup
        self._first_warmup = None
        self._skip = min(warmup, steps - 1)  # an epoch of one step is timed whole
        self._steps = self._samples = 0
        self._wait = 0.0
        self._t0 = None
        if self._skip == 0:
            self._open_window()

    def _open_window(self) -> None:
        synchronize(self.device)
        self.load.start()
        self._t0 = time.perf_counter()

    def data_wait(self, seconds: float) -> None:
        if self._t0 is not None:
            self._wait += seconds

    def step_done(self, samples: int) -> None:
        if self._t0 is None:
            self._skip -= 1
            if self._skip == 0:
                self._open_window()
            return
        self._steps += 1
        self._samples += samples

    def end_epoch(self) -> dict[str, float]:
        """The epoch's figures; ``perf/steps_timed`` is for the trainer's count, not logged per epoch."""
        synchronize(self.device)
        elapsed = time.perf_counter() - self._t0
        return {
            "perf/samples_per_s": self._samples / elapsed,
            "perf/step_ms": 1000 * elapsed / self._steps,
            "perf/data_wait_frac": self._wait / elapsed,
            "perf/steps_timed": float(self._steps),
            **self.load.stop(elapsed),
        }


# Dense (no sparsity) tensor-core peaks of known GPUs, FLOP/s, from the vendors' data sheets.
KNOWN_PEAKS = {
    "H100 PCIe": {"bfloat16": 756e12, "float16": 756e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12},
}
PEAK_MAX_AGE = datetime.timedelta(days=7)  # a cached probe older than this is taken again (the best one kept)


PEAKS = CacheFile("peak_flops.json", Schema({"flops": number(0, above=True), "source": text}))


def peak_cache_file() -> Path:
    """``peak_flops.json`` in the caches' folder (:func:`src.caches.folder`: ``$MEDSWEEP_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/medsweep``, else ``~/.cache/medsweep``)."""
    return PEAKS.path


@dataclasses.dataclass(frozen=True)
class Peak:
    """One device's peak FLOP/s in one dtype; ``source``: ``table:<gpu>`` (a data sheet), ``probe`` (the best matmul
    probe so far) or ``measured`` (a training rate above every probe); ``at``: when a probe or a training rate last
    set or confirmed it (None for a table)."""

    flops: float
    source: str
    at: datetime.datetime | None = None

    def age(self) -> datetime.timedelta | None:
        return _now() - self.at if self.at else None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    match = (
        re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if Path("/proc/cpuinfo").exists()
        else None
    )
    return match.group(1).strip() if match else platform.processor() or "cpu"


def matmul_flops(device: torch.device, dtype: torch.dtype, windows: int = 10, window_s: float = 0.1) -> float:
    """Best FLOP/s of square matmuls in ``dtype`` on ``device`` over short synchronised windows (the
    best window, so a moment of contention from another process does not lower the peak). Its own generator
    leaves the global RNG, hence a seeded run, as it was."""
    n = 8192 if device.type == "cuda" else 1024
    generator = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=generator).to(dtype) for _ in range(2))
    a @ b
    synchronize(device)
    best = 0.0
    for _ in range(windows):
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < window_s:
            a @ b
            reps += 1
            synchronize(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
    return best


def peak_key(device: torch.device, dtype: torch.dtype, threads: int | None = None) -> str:
    """The cache key of a probe: device name, dtype and CPU threads (default: this process's)."""
    threads = (threads or torch.get_num_threads()) if device.type == "cpu" else "gpu"
    return f"{device_name(device)}|{str(dtype).removeprefix('torch.')}|threads={threads}"


def _table_peak(device: torch.device, dtype: torch.dtype) -> Peak | None:
    name, dtype_name = device_name(device), str(dtype).removeprefix("torch.")
    for key, peaks in KNOWN_PEAKS.items():
        if key in name and dtype_name in peaks:
            return Peak(peaks[dtype_name], f"table:{key}")
    return None


def cached_peaks() -> dict[str, Peak]:
    """The peak cache's entries that fit it (:mod:`src.caches`): one that does not (the first format's bare number,
    one cut short or written by hand) is left out, with one warning naming the file, and probed again."""
    return {
        key: Peak(entry["flops"], entry["source"], datetime.datetime.fromisoformat(entry["at"]))
        for key, entry in PEAKS.entries().items()
    }


def _record(key: str, new: Peak) -> Peak:
    """Stores under ``key`` the higher of ``new`` and the cached peak, stamped with ``new.at``; returns it (also
    where the cache cannot be written: one warning)."""
    old = cached_peaks().get(key)
    best = Peak(old.flops, old.source, new.at) if old and old.flops >= new.flops else new
    PEAKS.update(key, {"flops": best.flops, "source": best.source, "at": best.at.isoformat()})
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> Peak:
    """Peak FLOP/s of one device in ``dtype``: from :data:`KNOWN_PEAKS` for known GPUs, else the best matmul probe
    cached per device, dtype and thread count (:func:`peak_cache_file`); a missing entry, or one older than
    :data:`PEAK_MAX_AGE`, is probed (again), the highest probe kept."""
    if table := _table_peak(device, dtype):
        return table
    cached = cached_peaks().get(peak_key(device, dtype))
    if cached and cached.age() <= PEAK_MAX_AGE:
        return cached
    return _record(peak_key(device, dtype), Peak(matmul_flops(device, dtype), "probe", _now()))


def raise_peak(device: torch.device, dtype: torch.dtype, achieved: float) -> Peak:
    """The peak once a training rate of ``achieved`` FLOP/s exceeded it: probed again (the highest probe kept), or
    ``achieved`` itself (``measured``) when even that is lower, so a utilisation is never above 1. A table peak is
    not probed: ``achieved`` replaces it for this run, not in the cache."""
    if _table_peak(device, dtype):
        return Peak(achieved, "measured", _now())
    probed = matmul_flops(device, dtype)
    best = Peak(probed, "probe", _now()) if probed >= achieved else Peak(achieved, "measured", _now())
    return _record(peak_key(device, dtype), best)
