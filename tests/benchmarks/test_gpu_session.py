"""benchmarks/gpu_session.sh on the CPU: its argument checks, its phases' files with real processes and stores, its list
of the gpu-marked test files."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.helpers import ROOT, run_process

SESSION = str(ROOT / "benchmarks" / "gpu_session.sh")
CPU_RUN = "device=cpu epochs=1 limit_batches=2 model=resnet10"  # after the phases' own model


BAD_ARGUMENTS = [[], ["tests", "bogus"], ["main", "main"], ["--bogus", "main"], ["main", "--out"], ["--out=", "main"]]


@pytest.mark.parametrize("argv", [*BAD_ARGUMENTS, ["budget", "x"], ["issue43", "memory"]])
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


def session_env(monkeypatch, cache, **variables: str) -> None:
    """The environment of a CPU plumbing run: this interpreter, a cache of its own, caps widened for a slow CPU."""
    env = {"PYTHON": sys.executable, "MEDSWEEP_CACHE_DIR": str(cache), "GPU_SESSION_CAP_FACTOR": "10", **variables}
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def target_rows(out) -> dict[str, str]:
    lines = (out / "targets.md").read_text().splitlines()
    return {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| 43: ")}


@pytest.mark.slow
def test_the_memory_and_startup4_phases_on_the_cpu_write_their_files(tmp_path, monkeypatch):
    """Issue 43's ``memory`` (the grid in one process, a NIfTI folder written for the side MedMNIST lacks; eager only
    on a CPU) and ``startup4`` (a probing job, one alone, 4 joblib workers at once): real processes, stores and
    files, and their rows of the targets table."""
    out = tmp_path / "out"
    session_env(
        monkeypatch,
        tmp_path / "cache",
        GPU_SESSION_OVERRIDES=CPU_RUN,
        GPU_SESSION_MEMORY="--models resnet10 --sizes 28:2 32:2",
        GPU_SESSION_NIFTI="4",
    )
    result = run_process(["bash", SESSION, "--out", str(out), "memory", "startup4"])
    assert result.returncode == 0, result.stdout + result.stderr
    walls = [line.split("\t") for line in (out / "wall.tsv").read_text().splitlines()]
    names = ["nifti", "memory", "startup4/probe", "startup4/alone", "startup4/four"]
    assert [(name, status) for name, _, status in walls] == [(name, "0") for name in names]
    records = [json.loads(line) for line in (out / "memory.jsonl").read_text().splitlines()]
    assert [(r["cell"][1], r["cell"][4], "error" in r) for r in records] == [
        (f"data.size={size}", f"amp={amp}", False) for size in (28, 32) for amp in ("true", "false")
    ]
    table = (out / "memory.md").read_text()
    assert table.count("| resnet10 |") == 4 and "eager: " in table.splitlines()[-1]
    rows = target_rows(out)
    assert "| all | " in rows["43: memory predictor, eager cells within +-15% (GPU grid)"]
    assert " of 4 cells (ratios " in rows["43: memory predictor, eager cells within +-15% (GPU grid)"]
    assert rows["43: memory predictor, graphed cells within +-15% (GPU grid)"].endswith("| not measured | - |")
    assert re.search(
        r"\| [0-9.]+ s \| (met|\*\*missed\*\*) \|$", rows["43: fresh process start-up, probed model, alone"]
    )
    assert "of 4 jobs)" in rows["43: fresh process start-up, probed model, 4 at once"]


@pytest.mark.slow
def test_the_budget_phase_on_the_cpu_lists_what_fits_and_trains_under_the_budget(tmp_path, monkeypatch):
    """``budget``: the dry run's fits listing, then one job a size under ``mem_budget_mb=24576`` with
    ``batch_size=auto`` (the plumbing's switches: float32, an effective batch of 2), their reports and table."""
    out = tmp_path / "out"
    session_env(
        monkeypatch,
        tmp_path / "cache",
        GPU_SESSION_OVERRIDES="device=cpu epochs=1 limit_batches=2 data.size=28",
        GPU_SESSION_BUDGET="amp=false effective_batch_size=2",
        GPU_SESSION_NIFTI="4",
    )
    result = run_process(["bash", SESSION, "--out", str(out), "budget"])
    assert result.returncode == 0, result.stdout + result.stderr
    walls = [line.split("\t") for line in (out / "wall.tsv").read_text().splitlines()]
    names = ["nifti", "budget/dry_run", "budget/64", "budget/128"]
    assert [(name, status) for name, _, status in walls] == [(name, "0") for name in names]
    (listed,) = [line for line in (out / "budget" / "dry_run.log").read_text().splitlines() if line.startswith("job ")]
    assert " | peak " in listed and " at batch 2 | fits 24 GiB: yes | ~" in listed
    for size in (64, 128):
        assert (out / "budget" / str(size) / "report" / "effects.csv").exists()
        row = target_rows(out)[f"43: densenet121 {size}^3 under 24 GiB: largest micro-batch trained"]
        assert "| batch 2 x 1 (amp=False checkpointing=False dsconv=False, " in row and "1 of 1 jobs finished" in row
    budget = (out / "targets.md").read_text().split("The 24 GiB budget's jobs", 1)[1]
    assert [
        line.split(" | ")[:6] for line in budget.splitlines() if line.startswith("| 64^3") or "| 128^3" in line
    ] == [[f"| {size}^3", "False", "False", "False", "FINISHED", "2 x 1"] for size in (64, 128)]


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
