"""src/training/mfu.py: model FLOPs utilisation against the device's peak, at most 1 whatever the cached peak."""

from __future__ import annotations

import datetime

import pytest
import torch

from src.training.meters import cached_peaks, peak_flops
from src.training.mfu import Mfu
from tests.helpers import run_cli, runs, small_run
from tests.training.helpers import now, plant_peak

CPU = torch.device("cpu")


@pytest.mark.slow
def test_runs_log_mfu_at_most_1_even_against_a_planted_low_peak(tmp_path, store, shared_data, monkeypatch):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))  # inherited by the job's process
    started = now()
    key = plant_peak(tmp_path, 1e6, started, threads=1)  # fresh, so only an epoch above it probes again
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    metrics, tags = run.data.metrics, run.data.tags
    assert 0 < metrics["perf/mfu"] <= 1
    assert metrics["perf/tflops"] == pytest.approx(
        metrics["perf/mfu"] * float(tags["perf.peak_tflops_per_device"]), rel=1e-3
    )
    cached = cached_peaks()[key]
    assert cached.flops > 1e6 and tags["perf.peak_source"] == cached.source in ("probe", "measured")
    assert float(tags["perf.peak_tflops_per_device"]) == pytest.approx(cached.flops / 1e12, rel=1e-5)
    assert datetime.datetime.fromisoformat(tags["perf.peak_updated_at"]) == cached.at >= started
    assert tags["perf.peak_age_days"] == "0.0"


def test_an_epoch_above_the_cached_peak_raises_it_so_mfu_stays_at_most_1(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    key = plant_peak(tmp_path, 1e6, now())
    mfu = Mfu(1e9, peak_flops(CPU, torch.float32), 1, CPU, torch.float32)
    assert mfu.peak.flops == 1e6  # fresh: taken from the cache, not probed
    heard = []
    mfu.on_new_peak = heard.append
    metrics = mfu({"perf/samples_per_s": 0.1})  # 1e8 FLOP/s: above the planted peak, below any real probe
    assert mfu.peak.source == "probe" and mfu.peak.flops > 1e9 and heard == [mfu.peak]
    assert metrics == {"perf/tflops": pytest.approx(1e-4), "perf/mfu": pytest.approx(1e8 / mfu.peak.flops)}
    assert cached_peaks()[key] == mfu.peak  # the low probe is gone from the cache
    # a rate above even a fresh probe (the matmul probe is not a perfect peak) becomes the peak
    assert mfu({"perf/samples_per_s": 1e6}) == {"perf/tflops": 1e3, "perf/mfu": 1.0}
    assert (mfu.peak.flops, mfu.peak.source) == (1e15, "measured") and cached_peaks()[key] == mfu.peak == heard[-1]
    assert mfu.tags()["perf.peak_source"] == "measured" and mfu.tags()["perf.peak_tflops_per_device"] == "1000"
