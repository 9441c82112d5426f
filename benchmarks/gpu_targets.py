"""Issues 21's and 43's GPU targets against what a ``benchmarks/gpu_session.sh`` folder holds: one Markdown table.

    python -m benchmarks.gpu_targets outputs/gpu_session

The folder's parts, each written by one phase of the script (a part that is missing reads "not measured"):
``loops.jsonl`` (``train_loops.py --json``), ``share.jsonl`` (``gpu_share.py --json``), ``main/`` and ``mission/``
(the sweep's MLflow store ``mlflow.db`` and its report in ``report/``; main's store also holds the ``startup`` job,
one job in a fresh process for a model probed before) and ``wall.tsv`` (each phase's wall seconds and exit status);
issue 43's: ``memory.jsonl`` (``memory_table.py --gpu-grid --json``), ``budget/64`` and ``budget/128`` (the 24 GiB
budget's sweeps, store and report) and ``startup4/mlflow.db`` (a job alone and 4 at once, fresh processes). Below the
targets, the budget's jobs one per line.
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


def every_run(store: Path, experiment: str | None = None) -> pd.DataFrame:
    """Every run of a SQLite store (failed ones too: an out of memory; the sweeps' parents), of one experiment or all;
    empty where there is none."""
    if not store.exists():
        return pd.DataFrame()
    import mlflow

    logging.getLogger("mlflow").setLevel(logging.ERROR)
    mlflow.set_tracking_uri(f"sqlite:///{store}")
    chosen = {"experiment_names": [experiment]} if experiment else {"search_all_experiments": True}
    return mlflow.search_runs(**chosen)


def runs(store: Path, experiment: str | None = None) -> pd.DataFrame:
    """The finished job runs (not the sweep's parent) of a SQLite store, of one experiment or all; empty where there
    is none."""
    frame = every_run(store, experiment)
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


def amp_effect(folder: Path, sweep: str = "main") -> Reading | None:
    """A sweep's report (the main command's): ``amp=true`` against ``false``, samples/s ratio, interval and verdict."""
    path = folder / sweep / "report" / "effects.csv"
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


TOLERANCE = 0.15  # the memory predictor's goal (issue 43): every cell's measured peak within 1 +- 15% of it
BUDGET_SIZES = (64, 128)  # the budget phase's sweeps, budget/<size>
STARTUP4 = "startup4"  # the phase's store and its experiments startup4_alone, startup4_four


def memory_cells(folder: Path, step: str) -> Reading | None:
    """The share of the GPU grid's cells of ``step`` (graphed, eager) whose measured peak is within +-15% of the
    prediction, with their range; failed cells (an out of memory, a failed capture) are named, not counted."""
    records = [r for r in read_jsonl(folder / "memory.jsonl") if r.get("cell") and step_of(r) == step]
    done = [r for r in records if "error" not in r]
    if not done:
        return None
    ratios = [r["measured_mb"] / r["prediction"]["total_mb"] for r in done]
    inside = sum(1 - TOLERANCE <= ratio <= 1 + TOLERANCE for ratio in ratios)
    failed = f"; {len(records) - len(done)} failed" if len(records) > len(done) else ""
    return Reading(
        inside / len(done), f"{inside} of {len(done)} cells (ratios {min(ratios):.2f}-{max(ratios):.2f}{failed})"
    )


def step_of(record: dict) -> str:
    """A GPU grid cell's step: what it predicted, else (a failed cell) what it asked for."""
    if "prediction" in record:
        return record["prediction"]["step"]
    return "graphed" if "cuda_graphs=true" in record["cell"] else "eager"


def job_runs(store: Path, experiment: str | None = None) -> pd.DataFrame:
    """Every job run of a SQLite store (failed ones too: an out of memory; not the sweep's parent)."""
    frame = every_run(store, experiment)
    return frame[frame["params.batch_size"].notna()] if "params.batch_size" in frame else pd.DataFrame()


def budget_batch(folder: Path, size: int) -> Reading | None:
    """The largest micro-batch densenet121 trained at ``size``^3 under the budget (finished jobs), with its switches and
    samples/s, and how many of the size's jobs finished."""
    frame = job_runs(folder / "budget" / str(size) / "mlflow.db")
    if frame.empty:
        return None
    done = frame[frame["status"] == "FINISHED"]
    if done.empty:
        return Reading(0, f"none of {len(frame)} jobs finished")
    best = done.loc[done["params.batch_size"].astype(int).idxmax()]
    rate = best.get("metrics.perf/samples_per_s_median", math.nan)
    return Reading(
        int(best["params.batch_size"]),
        f"batch {best['params.batch_size']} x {best['params.accumulate']} ({switches(best)}, {rate:,.0f} samples/s); "
        f"{len(done)} of {len(frame)} jobs finished",
    )


def switches(run: pd.Series) -> str:
    names = ("amp", "model.checkpointing", "model.dsconv")
    return " ".join(f"{name.removeprefix('model.')}={run.get(f'params.{name}', '-')}" for name in names)


def startup_of(folder: Path, experiment: str) -> Reading | None:
    """``time/startup_s`` of the startup4 phase's jobs of ``experiment``: the slowest, with the median and range."""
    frame = job_runs(folder / STARTUP4 / "mlflow.db", experiment)
    if frame.empty or "metrics.time/startup_s" not in frame:
        return None
    seconds = frame["metrics.time/startup_s"].dropna()
    if seconds.empty:
        return None
    if len(seconds) == 1:
        return Reading(seconds.iloc[0], f"{seconds.iloc[0]:.1f} s")
    return Reading(
        seconds.max(), f"slowest {seconds.max():.1f} s (median {seconds.median():.1f}, of {len(seconds)} jobs)"
    )


def issue43(folder: Path) -> list[tuple[str, str, Callable[[float], bool], Reading | None]]:
    grid = "memory predictor, {} cells within +-15% (GPU grid)"
    rows = [
        (f"43: {grid.format(step)}", "all", at_least(1), memory_cells(folder, step)) for step in ("graphed", "eager")
    ]
    for size in BUDGET_SIZES:
        name = f"43: densenet121 {size}^3"
        rows.append(
            (f"{name} under 24 GiB: largest micro-batch trained", ">= 4", at_least(4), budget_batch(folder, size))
        )
        amp = amp_effect(folder, f"budget/{size}")
        rows.append((f"{name} report: amp=true vs false, samples/s", "> 1x", lambda value: value > 1, amp))
    for alone, experiment in (("alone", "startup4_alone"), ("4 at once", "startup4_four")):
        start_up = startup_of(folder, experiment)
        rows.append((f"43: fresh process start-up, probed model, {alone}", "<= 10 s", at_most(10), start_up))
    return rows


BUDGET_COLUMNS = (
    "size", "amp", "checkpointing", "dsconv", "status", "batch x accumulate", "graphed", "samples/s", "peak MiB",
    "predicted MiB", "MFU",
)  # fmt: skip


def budget_table(folder: Path) -> str:
    """The budget's jobs, one per line: switches, how they ended, the batch they trained at, speed, memory, MFU."""
    lines = ["| " + " | ".join(BUDGET_COLUMNS) + " |", "|---" * len(BUDGET_COLUMNS) + "|"]
    for size in BUDGET_SIZES:
        frame = job_runs(folder / "budget" / str(size) / "mlflow.db")
        for _, run in frame.iterrows():

            def metric(name: str, form: str, run=run) -> str:
                value = run.get(f"metrics.{name}", math.nan)
                return "-" if pd.isna(value) else format(value, form)

            status = run["status"] + (f" ({run['tags.status']})" if not pd.isna(run.get("tags.status")) else "")
            cells = [
                f"{size}^3",
                *(str(run.get(f"params.{name}", "-")) for name in ("amp", "model.checkpointing", "model.dsconv")),
                status,
                f"{run['params.batch_size']} x {run.get('params.accumulate', '-')}",
                str(run.get("tags.cuda_graphs", "-")),
                metric("perf/samples_per_s_median", ",.0f"),
                metric("mem/peak_mb", ".0f"),
                metric("mem/predicted_mb", ".0f"),
                metric("perf/mfu", ".1%"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


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
        *issue43(folder),
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
    if budget := budget_table(args.folder):
        print(f"\nThe 24 GiB budget's jobs (densenet121; batch_size=auto, effective batch 16):\n\n{budget}")


if __name__ == "__main__":
    main()
