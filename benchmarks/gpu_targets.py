"""Issue 21's GPU targets against what a ``benchmarks/gpu_session.sh`` folder holds: one Markdown table.

    python -m benchmarks.gpu_targets outputs/gpu_session

The folder's parts, each written by one phase of the script (a part that is missing reads "not measured"):
``loops.jsonl`` (``train_loops.py --json``), ``share.jsonl`` (``gpu_share.py --json``), ``main/`` and ``mission/``
(the sweep's MLflow store ``mlflow.db`` and its report in ``report/``; main's store also holds the ``startup`` job,
one job in a fresh process for a model probed before) and ``wall.tsv`` (each phase's wall seconds and exit status).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

NOT_MEASURED = "not measured"
MAIN, STARTUP = "medsweep", "startup"  # the main command's experiment (the default), the start-up job's


@dataclass(frozen=True)
class Target:
    name: str
    goal: str
    check: Callable[[float], bool]


@dataclass(frozen=True)
class Reading:
    value: float
    text: str  # the value with its spread or basis

    def verdict(self, target: Target) -> str:
        return "met" if target.check(self.value) else "**missed**"


def at_least(goal: float) -> Callable[[float], bool]:
    return lambda value: value >= goal


def at_most(goal: float) -> Callable[[float], bool]:
    return lambda value: value <= goal


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def loop_rounds(loops: list[dict], model: str, size: int, batch: int, variant: str) -> list[float] | None:
    """Samples/s per round of ``variant`` at that shape, from the last ``train_loops.py --json`` record of it."""
    found = [r for r in loops if (r["model"], r["size"], r["batch"]) == (model, size, batch) and r["device"] == "cuda"]
    return found[-1]["samples_per_s"].get(variant) if found else None


def rounds_reading(rounds: list[float] | None) -> Reading | None:
    """The fastest round (as ``train_loops.py`` reports it), with the median and range of the rounds."""
    if not rounds:
        return None
    best = max(rounds)
    median = statistics.median(rounds)
    return Reading(best, f"{best:,.0f} (rounds: median {median:,.0f}, {min(rounds):,.0f}-{best:,.0f})")


def ratio_reading(own: list[float] | None, reference: list[float] | None) -> Reading | None:
    if not own or not reference:
        return None
    ratio = max(own) / max(reference)
    per_round = [a / b for a, b in zip(own, reference, strict=True)]
    return Reading(ratio, f"{ratio:.2f}x (per round {min(per_round):.2f}-{max(per_round):.2f})")


def runs(store: Path, experiment: str | None = None) -> pd.DataFrame:
    """The finished job runs (not the sweep's parent) of a SQLite store, of one experiment or all; empty where there
    is none."""
    if not store.exists():
        return pd.DataFrame()
    import mlflow

    logging.getLogger("mlflow").setLevel(logging.ERROR)
    mlflow.set_tracking_uri(f"sqlite:///{store}")
    chosen = {"experiment_names": [experiment]} if experiment else {"search_all_experiments": True}
    frame = mlflow.search_runs(**chosen)
    if frame.empty or "metrics.perf/samples_per_s_median" not in frame:
        return pd.DataFrame()
    return frame[(frame["status"] == "FINISHED") & frame["metrics.perf/samples_per_s_median"].notna()]


def main_job(folder: Path) -> Reading | None:
    """The main command's bf16 densenet121 job: its median samples/s over epochs, with the range and its tags."""
    frame = runs(folder / "main" / "mlflow.db", experiment=MAIN)
    if frame.empty:
        return None
    jobs = frame[(frame["params.model.name"] == "densenet121") & (frame["params.amp"] == "True")]
    if jobs.empty:
        return None
    job = jobs.iloc[-1]
    median = job["metrics.perf/samples_per_s_median"]
    tags = ", ".join(
        f"{name}={job.get(f'tags.{name}')}" for name in ("device", "amp.dtype", "cuda_graphs") if f"tags.{name}" in job
    )
    spread = f"{job['metrics.perf/samples_per_s_lo']:,.0f}-{job['metrics.perf/samples_per_s_hi']:,.0f}"
    return Reading(median, f"{median:,.0f} (epochs: {spread}; {tags})")


def amp_effect(folder: Path) -> Reading | None:
    """The main command's report: ``amp=true`` against ``false``, samples/s ratio, interval and verdict."""
    path = folder / "main" / "report" / "effects.csv"
    if not path.exists():
        return None
    effects = pd.read_csv(path)
    amp = effects[effects["param"] == "amp"]
    if amp.empty or math.isnan(amp.iloc[0]["speed_ratio"]):
        return None
    row = amp.iloc[0]
    interval = "" if math.isnan(row["speed_lo"]) else f", 95% {row['speed_lo']:.2f}-{row['speed_hi']:.2f}"
    return Reading(row["speed_ratio"], f"x{row['speed_ratio']:.2f}{interval}: {row['speed_verdict']}")


def share_ratio(folder: Path) -> Reading | None:
    """4 processes sharing the GPU against 1 alone (``gpu_share.py``), summed samples/s, medians of the rounds."""
    for record in reversed(read_jsonl(folder / "share.jsonl")):
        by_jobs = {row["jobs"]: row for row in record["rows"]}
        if 1 in by_jobs and 4 in by_jobs:
            one, four = (by_jobs[n]["summed_per_round"] for n in (1, 4))
            ratio = statistics.median(four) / statistics.median(one)
            per_round = [a / b for a, b in zip(four, one, strict=True)]
            mps = "with MPS" if by_jobs[4]["mps"] else "without MPS"
            return Reading(
                ratio,
                f"{ratio:.2f}x (per round {min(per_round):.2f}-{max(per_round):.2f}; {record['model']} "
                f"{record['size']}^3 b{record['batch']}, {statistics.median(four):,.0f} against "
                f"{statistics.median(one):,.0f} samples/s, {mps})",
            )
    return None


def startup(folder: Path) -> Reading | None:
    """``time/startup_s`` of the ``startup`` phase's job, else of the mission's densenet121 jobs that began a fresh
    process (those ``main`` probed): median and range."""
    alone = runs(folder / "main" / "mlflow.db", experiment=STARTUP)
    if not alone.empty:
        job = alone.iloc[-1]
        phases = sorted(c for c in alone.columns if c.startswith("metrics.time/startup/") and not pd.isna(job[c]))
        parts = ", ".join(f"{c.removeprefix('metrics.time/startup/').removesuffix('_s')} {job[c]:.1f}" for c in phases)
        return Reading(job["metrics.time/startup_s"], f"{job['metrics.time/startup_s']:.1f} s, one job alone ({parts})")
    mission = runs(folder / "mission" / "mlflow.db")
    if mission.empty or "metrics.time/startup/imports_s" not in mission:
        return None
    fresh = mission[mission["metrics.time/startup/imports_s"].notna() & (mission["params.model.name"] == "densenet121")]
    if fresh.empty:
        return None
    seconds = fresh["metrics.time/startup_s"]
    return Reading(
        seconds.median(),
        f"{seconds.median():.1f} s (median of {len(seconds)} fresh joblib workers starting together, "
        f"{seconds.min():.1f}-{seconds.max():.1f})",
    )


CUT = {"124", "137"}  # gpu_session.sh's ``timeout -k``: the phase ran past its time cap and was stopped


def wall(folder: Path, phase: str) -> Reading | None:
    """A phase's wall seconds from ``wall.tsv``, from its last run that exited 0 or was cut at its time cap: a cut
    run's seconds are a lower bound (it would have taken longer), so an ``at_most`` goal below them is missed, not
    unmeasured. A run that failed otherwise measures nothing."""
    path = folder / "wall.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.exists() else []
    ended = [(float(seconds), status) for name, seconds, status in rows if name == phase and status in {"0", *CUT}]
    if not ended:
        return None
    seconds, status = ended[-1]
    if status in CUT:
        return Reading(seconds, f"> {seconds:.0f} s (cut at its time cap, exit {status})")
    return Reading(seconds, f"{seconds:.0f} s")


def readings(folder: Path) -> list[tuple[Target, Reading | None]]:
    loops = read_jsonl(folder / "loops.jsonl")

    def graphed(model: str, size: int, batch: int) -> Reading | None:
        return rounds_reading(loop_rounds(loops, model, size, batch, "medsweep-graphed"))

    resnet64 = [loop_rounds(loops, "resnet18", 64, 16, v) for v in ("medsweep-graphed", "plain")]
    goals = [
        ("main command: densenet121 28^3 b32, bf16 job, samples/s", ">= 2,700", at_least(2700), main_job(folder)),
        ("densenet121 28^3 b32, graphed (train_loops)", ">= 2,700", at_least(2700), graphed("densenet121", 28, 32)),
        ("resnet18 28^3 b32, graphed (train_loops)", ">= 10,000", at_least(10000), graphed("resnet18", 28, 32)),
        ("resnet18 64^3 b16, graphed (train_loops)", ">= 2,100", at_least(2100), graphed("resnet18", 64, 16)),
        ("resnet18 64^3 b16, graphed / tutorial loop", ">= 3x", at_least(3), ratio_reading(*resnet64)),
        ("densenet121 64^3 b16, graphed (train_loops)", ">= 680", at_least(680), graphed("densenet121", 64, 16)),
        ("main command's report: amp=true vs false, samples/s", ">= 1.3x", at_least(1.3), amp_effect(folder)),
        ("4 jobs sharing one GPU vs one graphed job", ">= 1.4x", at_least(1.4), share_ratio(folder)),
        ("fresh process start-up, model probed before", "<= 10 s", at_most(10), startup(folder)),
        ("12-job mission sweep, wall", "<= 60 s", at_most(60), wall(folder, "mission")),
    ]
    return [(Target(name, goal, check), reading) for name, goal, check, reading in goals]


def table(folder: Path) -> str:
    lines = ["| target | goal | measured | met |", "|---|---|---|---|"]
    for target, reading in readings(folder):
        measured, met = (reading.text, reading.verdict(target)) if reading else (NOT_MEASURED, "-")
        lines.append(f"| {target.name} | {target.goal} | {measured} | {met} |")
    return "\n".join(lines)


PARTS = ("time/startup_s", "time/total_s", "time/validate_s", "time/checkpoint_s")


def time_parts(folder: Path) -> str:
    """Where the sweeps' jobs spent their time, seconds (medians over a sweep's jobs of one model and precision)."""
    lines = [
        "| sweep | model | amp | jobs | start-up | training to test end | of it validating | of it checkpointing |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sweep in ("main", "mission"):
        frame = runs(folder / sweep / "mlflow.db", experiment=MAIN)
        if frame.empty or not all(f"metrics.{part}" in frame for part in PARTS):
            continue
        for (model, amp), jobs in frame.groupby(["params.model.name", "params.amp"]):
            cells = [f"{jobs[f'metrics.{part}'].median():.1f}" for part in PARTS]
            lines.append(f"| {sweep} | {model} | {amp} | {len(jobs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the folder benchmarks/gpu_session.sh wrote")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.exit(2, f"error: {args.folder}: no such folder\n")
    machine = args.folder / "machine.txt"
    if machine.exists():
        print(machine.read_text().strip().replace("\n", "; "))
    print(table(args.folder))
    if parts := time_parts(args.folder):
        print(f"\n{parts}")


if __name__ == "__main__":
    main()
