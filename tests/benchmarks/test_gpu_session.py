"""benchmarks/gpu_session.sh on the CPU: its argument checks, its phases' files with real processes and stores, its list
of the gpu-marked test files."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import ROOT, run_process

SESSION = str(ROOT / "benchmarks" / "gpu_session.sh")
CPU_RUN = "device=cpu epochs=1 limit_batches=2 model=resnet10"  # after the phases' own model


@pytest.mark.parametrize(
    "argv", [[], ["tests", "bogus"], ["main", "main"], ["--bogus", "main"], ["main", "--out"], ["--out=", "main"]]
)
def test_the_session_refuses_bad_arguments_before_anything_runs(tmp_path, argv):
    result = run_process(["bash", SESSION, "--out", str(tmp_path / "session"), *argv])
    assert result.returncode == 2 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "session").exists()


def test_the_session_refuses_a_phase_whose_folder_holds_results(tmp_path):
    """A sweep into a store that holds its jobs would skip them as finished: a second ``main`` into the same folder
    is refused, in one line, before anything runs (a relative ``--out`` is the caller's)."""
    (tmp_path / "session" / "main").mkdir(parents=True)
    result = run_process(["bash", SESSION, "--out", "session", "loops", "main"], cwd=tmp_path)
    assert result.returncode == 2
    main = tmp_path / "session" / "main"
    assert result.stderr == f"error: {main} exists: name another --out, or remove that folder\n"
    assert sorted(p.name for p in (tmp_path / "session").iterdir()) == ["main"]


@pytest.mark.slow
def test_the_session_script_on_the_cpu_runs_its_phases_and_writes_their_files(tmp_path, monkeypatch):
    """``main`` then ``startup`` into one ``--out`` folder with CPU overrides: real jobs into a real store, the
    targets table (the start-up job reads the probes ``main`` cached, though it logs to another experiment: it adds
    none), the time parts."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    env = {"PYTHON": sys.executable, "MEDSWEEP_CACHE_DIR": cache, "GPU_SESSION_OVERRIDES": CPU_RUN}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    result = run_process(["bash", SESSION, "--out", str(out), "main"])
    assert result.returncode == 0, result.stdout + result.stderr
    probes = {name: (cache / name).read_bytes() for name in ("memory_predictions.json", "flops_per_sample.json")}
    result = run_process(["bash", SESSION, f"--out={out}", "startup"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert {name: (cache / name).read_bytes() for name in probes} == probes
    walls = [line.split("\t") for line in (out / "wall.tsv").read_text().splitlines()]
    assert [(name, status) for name, _, status in walls] == [("main", "0"), ("startup", "0")]
    written = {"machine.txt", "wall.tsv", "targets.md", "main.log", "main/mlflow.db", "main/report/effects.csv"}
    assert written | {"startup.log", "startup/run"} <= {str(path.relative_to(out)) for path in out.rglob("*")}
    targets = (out / "targets.md").read_text()
    (row,) = [line for line in targets.splitlines() if line.startswith("| fresh process start-up")]
    assert "s, one job alone (" in row and "probes " in row
    parts = [line for line in targets.splitlines() if line.startswith("| main | resnet10 |")]
    assert [line.split(" | ")[2] for line in parts] == ["False", "True"]


def test_the_tests_phase_names_every_file_with_gpu_tests_the_graphs_first():
    """The ``tests`` phase collects named files only: each file holding a ``gpu``-marked test is one of them, and
    the CUDA graph's tests run first (a phase cut at its cap still ran them)."""
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    named = script.split("gpu_tests=(", 1)[1].split(")", 1)[0].split()
    marked = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)$", path.read_text(), re.MULTILINE)
    )
    assert sorted(named) == marked
    assert named[0] == "tests/training/test_cuda.py"
