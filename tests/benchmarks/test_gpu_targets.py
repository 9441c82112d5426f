"""benchmarks/gpu_targets.py: the targets table of a GPU session's files, on records made on the CPU."""

from __future__ import annotations

import argparse
import json

import pandas as pd
import pytest

from benchmarks import gpu_share, gpu_targets
from benchmarks.train_loops import Variant, record


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
    """A mission sweep stopped by gpu_session.sh's timeout took longer than its cap (240 s): missed, not
    unmeasured; a sweep that failed otherwise measured nothing."""
    (tmp_path / "wall.tsv").write_text(rows)
    (row,) = [line for line in gpu_targets.table(tmp_path).splitlines() if line.startswith("| 12-job mission sweep")]
    assert row.endswith(cell)


def test_the_targets_of_a_missing_folder_are_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_targets.main([str(tmp_path / "nothing")])
    assert exit_.value.code == 2 and capsys.readouterr().err == f"error: {tmp_path / 'nothing'}: no such folder\n"


def memory_record(step: str, predicted: float, measured: float | None) -> dict:
    """A ``memory_table.py --gpu-grid --json`` record (``measured`` None: a cell that failed)."""
    cell = ["model=resnet18", "data.size=28", "model.stem=standard", "batch_size=4", "amp=true"]
    cell.append(f"cuda_graphs={str(step == 'graphed').lower()}")
    if measured is None:
        return {"cell": cell, "error": "OutOfMemoryError: CUDA out of memory"}
    return {"cell": cell, "prediction": {"step": step, "total_mb": predicted}, "measured_mb": measured}


def test_the_memory_grid_rows_count_the_cells_within_15_percent_and_name_the_failed(tmp_path):
    records = [
        memory_record("graphed", 1000, 1100),
        memory_record("graphed", 1000, 1400),
        memory_record("graphed", 1000, None),
        memory_record("eager", 500, 520),
        memory_record("eager", 500, 430),
    ]
    (tmp_path / "memory.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    rows = {row.split(" | ")[0].lstrip("| "): row for row in gpu_targets.table(tmp_path).splitlines()[2:]}
    graphed = rows["43: memory predictor, graphed cells within +-15% (GPU grid)"]
    assert graphed.endswith("| all | 1 of 2 cells (ratios 1.10-1.40; 1 failed) | **missed** |")
    eager = rows["43: memory predictor, eager cells within +-15% (GPU grid)"]
    assert eager.endswith("| all | 2 of 2 cells (ratios 0.86-1.04) | met |")
    assert rows["43: densenet121 128^3 under 24 GiB: largest micro-batch trained"].endswith("| not measured | - |")
