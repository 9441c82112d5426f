"""The GPU session's tools on the CPU: benchmarks/gpu_session.sh, gpu_share.py and gpu_targets.py. Their figures
mean something on the GPU machine only; here they check the plumbing with real processes, stores and files."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile

import pandas as pd
import pytest

from benchmarks import gpu_share, gpu_targets
from benchmarks.train_loops import Variant, record
from tests.helpers import ROOT, run_process

SESSION = str(ROOT / "benchmarks" / "gpu_session.sh")
CPU_RUN = "device=cpu epochs=1 limit_batches=2 model=resnet10"  # after the phases' own model


def loops_line(model: str, size: int, batch: int, rounds: dict[str, list[float]]) -> str:
    """``train_loops.py --json``'s record of a CUDA table (built on the CPU: its device set as the GPU's would be)."""
    args = argparse.Namespace(device="cpu", model=model, size=size, batch=batch, steps=10)
    variants = [Variant(name, model, "standard", round=lambda: 0.0) for name in rounds]
    for variant in variants:
        variant.seconds = [batch * 10 / samples for samples in rounds[variant.name]]
        variant.peak_mb = 100.0
    return json.dumps(record(variants, args) | {"device": "cuda"})


def share_line(one: list[float], four: list[float]) -> str:
    args = argparse.Namespace(device="cuda", model="resnet18", size=28, batch=32)
    rows = [{"jobs": n, "mps": n > 1, "summed_per_round": r, "machine": ""} for n, r in ((1, one), (4, four))]
    return json.dumps(gpu_share.record(args, rows))


def test_the_targets_table_reads_each_part_and_says_what_was_not_measured(tmp_path):
    (tmp_path / "loops.jsonl").write_text(
        "\n".join(
            [
                loops_line("resnet18", 28, 32, {"plain": [3000, 3100], "medsweep-graphed": [10500, 9900]}),
                loops_line("resnet18", 64, 16, {"plain": [600, 650], "medsweep-graphed": [2000, 2050]}),
            ]
        )
    )
    (tmp_path / "share.jsonl").write_text(share_line([10000, 10400], [16000, 15000]))
    (tmp_path / "wall.tsv").write_text("mission\t48\t0\n")
    (tmp_path / "main" / "report").mkdir(parents=True)
    effects = {"param": "amp", "speed_ratio": 1.41, "speed_lo": 1.2, "speed_hi": 1.6, "speed_verdict": "faster"}
    pd.DataFrame([effects]).to_csv(tmp_path / "main" / "report" / "effects.csv", index=False)
    rows = {row.split(" | ")[0].lstrip("| "): row for row in gpu_targets.table(tmp_path).splitlines()[2:]}
    assert rows["resnet18 28^3 b32, graphed (train_loops)"].endswith(
        "| >= 10,000 | 10,500 (rounds: median 10,200, 9,900-10,500) | met |"
    )
    resnet64 = rows["resnet18 64^3 b16, graphed (train_loops)"]
    assert "| 2,050 (rounds: median 2,025, 2,000-2,050) | **missed** |" in resnet64
    assert "| 3.15x (per round 3.15-3.33) | met |" in rows["resnet18 64^3 b16, graphed / tutorial loop"]
    assert "| x1.41, 95% 1.20-1.60: faster | met |" in rows["main command's report: amp=true vs false, samples/s"]
    assert (
        "| 1.52x (per round 1.44-1.60; resnet18 28^3 b32, 15,500 against 10,200 samples/s, with MPS) | met |"
        in (rows["4 jobs sharing one GPU vs one graphed job"])
    )
    assert rows["12-job mission sweep, wall"].endswith("| <= 60 s | 48 s | met |")
    for name in ("densenet121 28^3 b32, graphed (train_loops)", "fresh process start-up, model probed before"):
        assert rows[name].endswith("| not measured | - |")


@pytest.mark.parametrize(
    ("rows", "cell"),
    [
        ("mission\t48\t0\n", "| 48 s | met |"),
        ("mission\t240\t124\n", "| > 240 s (cut at its time cap, exit 124) | **missed** |"),
        ("mission\t250\t137\n", "| > 250 s (cut at its time cap, exit 137) | **missed** |"),
        ("mission\t30\t1\n", "| not measured | - |"),
        ("mission\t48\t0\nmission\t240\t124\n", "| > 240 s (cut at its time cap, exit 124) | **missed** |"),
    ],
)
def test_a_sweep_cut_at_its_time_cap_misses_the_wall_target(tmp_path, rows, cell):
    """A mission sweep stopped by gpu_session.sh's timeout took longer than its cap (at least 90 s): missed, not
    unmeasured; a sweep that failed otherwise measured nothing."""
    (tmp_path / "wall.tsv").write_text(rows)
    (row,) = [line for line in gpu_targets.table(tmp_path).splitlines() if line.startswith("| 12-job mission sweep")]
    assert row.endswith(cell)


def test_the_targets_of_a_missing_folder_are_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_targets.main([str(tmp_path / "nothing")])
    assert exit_.value.code == 2 and capsys.readouterr().err == f"error: {tmp_path / 'nothing'}: no such folder\n"


@pytest.mark.parametrize("phases", [[], ["tests", "bogus"]])
def test_the_session_refuses_an_unknown_or_missing_phase_before_anything_runs(tmp_path, monkeypatch, phases):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("GPU_SESSION_DIR", str(tmp_path / "session"))
    result = run_process(["bash", SESSION, *phases])
    assert result.returncode == 2 and result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "session").exists()


@pytest.mark.parametrize("argv", [["--jobs", "1,x"], ["--jobs", "0"], ["--device", "cuda", "--warmup", "1"]])
def test_gpu_share_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_share.parse_args(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_share_on_the_cpu_sums_the_processes_per_round(tmp_path):
    tiny = "--device cpu --model resnet10 --batch 2 --steps 1 --warmup 0 --rounds 2 --jobs 1,2 --mps auto"
    result = run_process([sys.executable, "-m", "benchmarks.gpu_share", *tiny.split(), "--json", str(tmp_path / "j")])
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| jobs at once | MPS | samples/s summed")
    assert rows[1].startswith("| 1 | no | ") and rows[1].endswith("| **1.00x** (1.00-1.00) |")
    assert rows[2].startswith("| 2 | no | ")  # the CPU: no MPS
    (figures,) = [json.loads(line) for line in (tmp_path / "j").read_text().splitlines()]
    assert [row["jobs"] for row in figures["rows"]] == [1, 2]
    assert all(len(row["summed_per_round"]) == 2 and min(row["summed_per_round"]) > 0 for row in figures["rows"])


@pytest.mark.slow
def test_the_session_script_on_the_cpu_runs_its_phases_and_brings_back_their_files(tmp_path, monkeypatch):
    """``main`` then ``startup`` with CPU overrides: real jobs into a real store, the targets table (the start-up job
    reads the probes ``main`` cached, though it logs to another experiment: it adds none), the time parts, the
    bundle."""
    out, session, cache = tmp_path / "out", tmp_path / "session", tmp_path / "cache"
    out.mkdir()
    env = {"OUT": out, "GPU_SESSION_DIR": session, "PYTHON": sys.executable, "MEDSWEEP_CACHE_DIR": cache}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("GPU_SESSION_OVERRIDES", CPU_RUN)
    result = run_process(["bash", SESSION, "main"])
    assert result.returncode == 0, result.stdout + result.stderr
    probes = {name: (cache / name).read_bytes() for name in ("memory_predictions.json", "flops_per_sample.json")}
    result = run_process(["bash", SESSION, "startup"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert {name: (cache / name).read_bytes() for name in probes} == probes
    walls = [line.split("\t") for line in (out / "wall.tsv").read_text().splitlines()]
    assert [(name, status) for name, _, status in walls] == [("main", "0"), ("startup", "0")]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_results.tar.gz", "targets.md", "wall.tsv"]
    targets = (out / "targets.md").read_text()
    (row,) = [line for line in targets.splitlines() if line.startswith("| fresh process start-up")]
    assert "s, one job alone (" in row and "probes " in row
    parts = [line for line in targets.splitlines() if line.startswith("| main | resnet10 |")]
    assert [line.split(" | ")[2] for line in parts] == ["False", "True"]
    with tarfile.open(out / "gpu_results.tar.gz") as bundle:
        names = bundle.getnames()
    assert {"./main/mlflow.db", "./main/report/effects.csv", "./startup.log"} <= set(names)
    assert not [name for name in names if name.endswith((".pt", ".pth"))]


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
