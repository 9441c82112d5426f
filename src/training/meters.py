"""Peak memory and throughput, measured the same way in every run."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import platform
import re
import time
from pathlib import Path

import torch

from src.atomic import atomic_path

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


class ThroughputMeter:
    """Samples/s, ms per optimizer step and the fraction of time spent waiting for data, per epoch.

    The first ``warmup`` optimizer steps of each epoch are not timed (one-off allocations, autotuning);
    the device is synchronised only at the window's edges.
    """

    def __init__(self, device: torch.device, warmup: int = 1) -> None:
        self.device, self.warmup = device, warmup

    def start_epoch(self, steps: int) -> None:
        self._skip = min(self.warmup, steps - 1)  # an epoch of one step is timed whole
        self._steps = self._samples = 0
        self._wait = 0.0
        self._t0 = None
        if self._skip == 0:
            self._open_window()

    def _open_window(self) -> None:
        synchronize(self.device)
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
        synchronize(self.device)
        elapsed = time.perf_counter() - self._t0
        return {
            "perf/samples_per_s": self._samples / elapsed,
            "perf/step_ms": 1000 * elapsed / self._steps,
            "perf/data_wait_frac": self._wait / elapsed,
        }


# Dense (no sparsity) tensor-core peaks of known GPUs, FLOP/s, from the vendors' data sheets.
KNOWN_PEAKS = {
    "H100 PCIe": {"bfloat16": 756e12, "float16": 756e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12},
}
PEAK_CACHE = Path.home() / ".cache" / "medsweep" / "peak_flops.json"


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
    best window, so a moment of contention from another process does not lower the peak)."""
    n = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
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


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s of one device in ``dtype`` and where it comes from: ``table:<gpu>`` for known GPUs,
    else ``probe``: a matmul probe, measured once per device, dtype and thread count and cached in
    ``~/.cache/medsweep/peak_flops.json``."""
    name, dtype_name = device_name(device), str(dtype).removeprefix("torch.")
    for key, peaks in KNOWN_PEAKS.items():
        if key in name and dtype_name in peaks:
            return peaks[dtype_name], f"table:{key}"
    key = f"{name}|{dtype_name}|threads={torch.get_num_threads() if device.type == 'cpu' else 'gpu'}"
    cache = json.loads(PEAK_CACHE.read_text()) if PEAK_CACHE.exists() else {}
    if key not in cache:
        cache[key] = matmul_flops(device, dtype)
        with atomic_path(PEAK_CACHE) as partial:
            partial.write_text(json.dumps(cache, indent=2))
    return cache[key], "probe"
