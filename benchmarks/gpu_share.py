"""Jobs sharing one device: medsweep's training step in N processes at once against one process alone.

    python -m benchmarks.gpu_share --device cuda --model resnet18 --size 28 --batch 32 --jobs 1,4
    python -m benchmarks.gpu_share --device cuda --jobs 4 --mps none     # the same GPU time-sliced, no MPS
    python -m benchmarks.gpu_share --device cpu --model resnet10 --batch 4 --steps 2 --rounds 2 --jobs 1,2

For each count in ``--jobs``, that many fresh processes (``spawn``) each build the ``Trainer`` of
``benchmarks/train_loops.py``'s medsweep variant (on CUDA: bf16 and ``cuda_graphs=true``, as a sweep job trains),
run one untimed round (the graph's eager steps and its capture), wait for each other at a barrier, then run
``--rounds`` rounds of ``--warmup`` untimed + ``--steps`` timed steps. Reported per count: samples/s summed over
the processes, the median and range over rounds (round k of every process), per process, and against one
process alone. Where more than one process shares the GPU, ``--mps`` (``auto``) uses the MPS daemon serving or
starts one for the count (``src.parallel.mps``) as a sweep does; the parent process never initialises CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's src, also when run as a script

import torch.multiprocessing as mp  # noqa: E402

from benchmarks.train_loops import BEST, BEST_CUDA, GRAPH_WARMUP, compose_config, machine, medsweep_variant  # noqa: E402
from src.config import Device, GpuShare  # noqa: E402
from src.data.shipped import SHIPPED  # noqa: E402
from src.errors import UsageError  # noqa: E402
from src.parallel import mps  # noqa: E402

TIMEOUT_S = 600  # a process that has not reported by then failed


def job_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    if args.device == "cuda":
        return (*BEST_CUDA, "cuda_graphs=true")
    return BEST.get(args.model, ())


def job(index: int, args: argparse.Namespace, barrier: Any, results: Any) -> None:
    """One process: the Trainer warmed up, the barrier, the timed rounds; its seconds per round to ``results``."""
    try:
        variant = medsweep_variant(compose_config(args, job_overrides(args)), args.warmup, f"job {index}")
        variant.round()
        barrier.wait(TIMEOUT_S)
        results.put((index, [variant.round() for _ in range(args.rounds)], machine(args, "")))
    except BaseException as error:  # the parent reports it in one line
        barrier.abort()
        results.put((index, f"{type(error).__name__}: {error}", ""))


def run_count(args: argparse.Namespace, count: int) -> tuple[list[list[float]], str]:
    """``count`` processes at once: each one's seconds per timed round, and the machine line."""
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(count), context.Queue()
    processes = [context.Process(target=job, args=(i, args, barrier, results)) for i in range(count)]
    for process in processes:
        process.start()
    reported: dict[int, list[float]] = {}
    line = ""
    try:
        for _ in processes:
            index, seconds, line = results.get(timeout=TIMEOUT_S)
            if isinstance(seconds, str):
                raise SystemExit(f"error: {count} jobs: job {index} failed: {seconds}")
            reported[index] = seconds
    except queue.Empty:
        raise SystemExit(f"error: {count} jobs: no result within {TIMEOUT_S} s") from None
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    return [reported[i] for i in range(count)], line


def measure(args: argparse.Namespace, count: int) -> dict:
    """One count's figures, with what a sweep of ``count`` jobs on one GPU does about MPS (none on the CPU)."""
    try:
        share = mps.sharing(GpuShare(args.mps), count, gpus=1 if args.device == "cuda" else 0)
    except UsageError as error:
        raise SystemExit(f"error: {error}") from None
    with tempfile.TemporaryDirectory(prefix="gpu-share-") as folder, mps.shared(share, Path(folder)):
        seconds, line = run_count(args, count)  # the spawned processes inherit the daemon's pipe folder
        used = os.environ.get(mps.SHARE_ENV) == "mps"
    samples = args.batch * args.steps
    rounds = [sum(samples / job_seconds[k] for job_seconds in seconds) for k in range(args.rounds)]
    return {"jobs": count, "mps": used, "summed_per_round": rounds, "machine": line}


def record(args: argparse.Namespace, rows: list[dict]) -> dict:
    """The figures as one JSON object (``--json``): the shape, and per count its summed samples/s per round."""
    return {"device": args.device, "model": args.model, "size": args.size, "batch": args.batch, "rows": rows}


def table(rows: list[dict]) -> str:
    single = next((row for row in rows if row["jobs"] == 1), None)
    head = "| jobs at once | MPS | samples/s summed (median of rounds) | range | per job | vs 1 job (per round) |"
    lines = [head, "|---|---|---|---|---|---|"]
    for row in rows:
        rounds = row["summed_per_round"]
        median = statistics.median(rounds)
        versus = "-"
        if single is not None:
            ratios = [own / alone for own, alone in zip(rounds, single["summed_per_round"], strict=True)]
            versus = f"**{median / statistics.median(single['summed_per_round']):.2f}x** "
            versus += f"({min(ratios):.2f}-{max(ratios):.2f})"
        lines.append(
            f"| {row['jobs']} | {'yes' if row['mps'] else 'no'} | {median:,.0f} | {min(rounds):,.0f}-{max(rounds):,.0f}"
            f" | {median / row['jobs']:,.0f} | {versus} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=[d.value for d in Device if d is not Device.auto])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=28, choices=(28, 64))
    parser.add_argument("--stem", default="standard")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=GRAPH_WARMUP, help="untimed steps before them, every round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--jobs", default="1,4", help="comma list of process counts")
    parser.add_argument("--mps", default="auto", choices=[s.value for s in GpuShare])
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=str(SHIPPED))
    parser.add_argument("--json", metavar="FILE", help="append the figures to FILE as one JSON line")
    args = parser.parse_args(argv)
    try:
        args.counts = [int(n) for n in args.jobs.split(",")]
    except ValueError:
        parser.error(f"--jobs {args.jobs}: a comma list of process counts")
    if min(args.counts) < 1 or args.steps < 1 or args.rounds < 1 or args.batch < 1 or args.warmup < 0:
        parser.error("--jobs, --steps, --rounds and --batch must be >= 1, --warmup >= 0")
    if args.device == "cuda" and args.warmup < GRAPH_WARMUP:
        parser.error(f"--warmup on cuda: at least {GRAPH_WARMUP} (the graph's eager steps and its capture)")
    if (args.warmup + args.steps) * args.batch > 1188:
        parser.error("(--warmup + --steps) x --batch exceeds AdrenalMNIST3D's 1188 training volumes")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    rows = [measure(args, count) for count in args.counts]
    print(f"command: python {shlex.join(sys.argv)}")
    print(rows[0]["machine"])
    print(
        f"{args.model} AdrenalMNIST3D {args.size}^3 batch {args.batch}, medsweep's Trainer "
        f"({' '.join(job_overrides(args)) or 'defaults'}); per round {args.warmup} untimed + {args.steps} timed "
        f"steps, {args.rounds} rounds after one untimed round and a barrier"
    )
    print(table(rows))
    print(f"wall time {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(record(args, rows)) + "\n")


if __name__ == "__main__":
    main()
