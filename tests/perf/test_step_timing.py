"""src/perf/step_timing.py: when a timing of a job's step stops, and its cache per shape and its expiry."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import torch

from src.perf import step_timing
from src.perf.probe_cache import now


def test_a_timing_stops_at_its_target_interval_or_its_caps():
    steady = [0.5] * step_timing.MIN_STEPS
    assert step_timing.spread(steady) == 0 and step_timing.timing_done(steady)
    assert not step_timing.timing_done(steady[:-1])  # too few for an interval, however close
    noisy = [0.5, 0.7] * 2  # the 95% interval of their mean: ±31%
    assert step_timing.spread(noisy) == pytest.approx(0.3062, abs=1e-4) and not step_timing.timing_done(noisy)
    # a slow shape: two steps, once past MAX_SECONDS
    assert not step_timing.timing_done([5.0]) and step_timing.timing_done([5.0, 7.0])
    assert step_timing.timing_done([0.01, 0.02] * (step_timing.MAX_STEPS // 2))


def test_a_step_time_is_cached_per_shape_and_expires_sooner_when_the_machine_was_busy(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    built = []

    def prepare():
        built.append(1)
        return lambda: time.sleep(0.002) or 0.002

    cpu = torch.device("cpu")
    first = step_timing.step_time({"model.name": "a"}, cpu, 1, prepare)
    assert step_timing.step_time({"model.name": "a"}, cpu, 1, prepare) == first and len(built) == 1
    step_timing.step_time({"model.name": "b"}, cpu, 1, prepare)
    step_timing.step_time({"model.name": "a"}, cpu, 2, prepare)  # another thread count: another key
    assert len(built) == 3 and len(json.loads((tmp_path / step_timing.CACHE.name).read_text())) == 3

    def taken(ago: datetime.timedelta, busy: bool) -> dict:
        return {"at": (now() - ago).isoformat(), "busy": busy}

    hour, week = datetime.timedelta(hours=1), step_timing.MAX_AGE
    assert step_timing.fresh(taken(week - hour, busy=False)) and not step_timing.fresh(taken(week + hour, busy=False))
    assert step_timing.fresh(taken(hour / 2, busy=True)) and not step_timing.fresh(taken(2 * hour, busy=True))
