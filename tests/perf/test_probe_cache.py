"""src/perf/probe_cache.py: the probes' cache files, damaged ones probed again and written anew."""

from __future__ import annotations

import datetime

import pytest
import torch

from src.caches import number
from src.perf.probe_cache import ProbeCache, age
from src.training.meters import cached_peaks, peak_cache_file, peak_flops, peak_key

CPU = torch.device("cpu")


DAMAGED = {  # what a cache file may hold after a hand, another tool or a failing disk: each is probed again
    "random bytes": b"\x9d\xff\x00garbage",
    "JSON cut short": b'{"a": {"at": "2026-11-27T10:00:00+00:00", ',
    "not an object": b"[1, 2]",
    "entries of another shape": b'{"a": 5, "b": {"at": "yesterday"}, "c": {"at": "2026-11-27T10:00:00"}, "d": {}}',
}


@pytest.mark.parametrize("content", DAMAGED.values(), ids=DAMAGED)
def test_a_damaged_cache_file_is_probed_again_and_written_anew(tmp_path, monkeypatch, content):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    peak_cache_file().write_bytes(content)
    assert cached_peaks() == {}
    first = peak_flops(CPU, torch.float32)
    assert first.source == "probe" and cached_peaks() == {peak_key(CPU, torch.float32): first}
    cache = ProbeCache("probes.json", lambda entry: age(entry) < datetime.timedelta(days=1), {"value": number(0)})
    cache.path.write_bytes(content)
    assert cache.get("a") is None and cache.get("c") is None
    cache.put("a", {"value": 1})
    assert cache.get("a")["value"] == 1 and list(cache.entries()) == ["a"]
