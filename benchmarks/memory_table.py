"""Predicted vs measured peak training memory (CPU, or ``--device cuda``): one fresh process per cell, a Markdown table.

    python -m benchmarks.memory_table --threads 2 --steps 3              # from the project root
    python -m benchmarks.memory_table --held-out                         # cells the constants were not fitted on
    python -m benchmarks.memory_table --stems --threads 1 --repeats 3    # 28^3, both stems, lowest of 3 readings

Each cell builds the model, loaders and ``Trainer`` with ``src.training.build.build_trainer`` as a run's rank
does (real AdrenalMNIST3D, ``data.loader=tensor``), predicts with :func:`src.perf.memory.predict` as a run does,
and runs
``Trainer.fit`` for one epoch of ``--steps`` optimizer steps: ``memory.start()``, ``train_epoch``, and the
``mem/peak_mb`` that epoch logs (evaluation comes after it). A cell runs in its own interpreter so no RSS
peak leaks from one cell into the next. ``--cell KEY=VALUE ...`` runs one cell here and prints its result
as one JSON line (the tests use it); with ``--trace PATH`` and ``benchmarks/malloc/trace.so`` preloaded, it also
writes the cell's allocations of 64 KiB and more, from ``memory.start()`` on, for ``benchmarks.malloc.replay``:

    gcc -O2 -shared -fPIC -o benchmarks/malloc/trace.so benchmarks/malloc/trace.c -ldl
    LD_PRELOAD=benchmarks/malloc/trace.so python -m benchmarks.memory_table --threads 1 --trace /tmp/cell.trace \
        --cell model=resnet18 model.stem=small batch_size=4
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_ROOT = ROOT / "data" / "medmnist"  # the MedMNIST files that ship (src/data/shipped.py)
# (model, data.size, model.stem): the standard stem throughout, since densenet121's small stem costs
# ~50 forward GFLOPs per sample at 28^3; densenet121 at 64^3 so that its activations dominate.
MODELS = (("resnet18", 28, "standard"), ("resnet18", 64, "standard"), ("densenet121", 64, "standard"))
BATCHES = (4, 16)
COLUMNS = {
    "model": "model",
    "data.size": "size",
    "model.stem": "stem",
    "batch_size": "batch",
    "amp": "amp",
    "model.checkpointing": "ckpt",
}
HELD_OUT = (  # other models, batches, optimizers, two epochs (fit's copy of the best weights), the small stem
    "model=resnet18 data.size=64 model.stem=standard batch_size=8 optim=sgd",
    "model=resnet34 data.size=64 model.stem=standard batch_size=8 amp=true optim=adamw",
    "model=resnet50 data.size=64 model.stem=standard batch_size=4",
    "model=resnet10 data.size=64 model.stem=standard batch_size=16",
    "model=resnet10 data.size=64 model.stem=standard batch_size=32",
    "model=resnet18 data.size=64 model.stem=standard batch_size=32",
    "model=resnet18 data.size=28 model.stem=standard batch_size=32 epochs=2",
    "model=densenet121 data.size=28 model.stem=standard batch_size=32",
    "model=densenet121 data.size=64 model.stem=standard batch_size=8 model.checkpointing=true",
    "model=densenet121 data.size=64 model.stem=standard batch_size=32 amp=true model.checkpointing=true",
    "model=densenet121 data.size=28 model.stem=small batch_size=2 limit_batches=2",
    "model=densenet121 data.size=28 model.stem=small batch_size=2 limit_batches=2 model.checkpointing=true",
)


STEMS = tuple(  # 28^3 fp32, the small (MedMNIST) and the standard stem: resnet18's large weights against densenet121's
    f"model={model} data.size=28 model.stem={stem} batch_size={batch}"
    for model in ("resnet18", "densenet121")
    for stem in ("small", "standard")
    for batch in BATCHES
)


def grid() -> list[list[str]]:
    """Every model x batch x amp, checkpointing on and off for DenseNet only (ResNet ignores it)."""
    return [
        [
            f"model={model}",
            f"data.size={size}",
            f"model.stem={stem}",
            f"batch_size={batch}",
            f"amp={str(amp).lower()}",
            f"model.checkpointing={str(ckpt).lower()}",
        ]
        for model, size, stem in MODELS
        for batch in BATCHES
        for amp in (False, True)
        for ckpt in ((False, True) if model.startswith("densenet") else (False,))
    ]


def run_cell(overrides: list[str], trace: str | None = None) -> dict:
    """Train in this process as ``run_rank`` does; the prediction and the ``mem/peak_mb`` the run logs. ``trace``: the
    file ``benchmarks/malloc/trace.so`` (preloaded) writes the allocations to from ``memory.start()`` on."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from src.cli import register
    from src.execution import resolve
    from src.parallel.ranks import seed_everything
    from src.perf.memory import predict
    from src.training.build import build_trainer
    from src.training.mfu import Mfu
    from src.training.trainer import Hooks

    register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=overrides))
    execution = resolve(cfg)
    seed_everything(cfg, execution.threads)
    prediction = predict(cfg, execution)
    trainer = build_trainer(cfg, execution, hooks=Hooks(epoch_metrics=(Mfu.of(cfg, execution, 1),)))
    if trace:
        traced(trainer.memory, trace)
    logged = []
    trainer.fit(lambda metrics, step: logged.append(metrics))
    if trace:
        ctypes.CDLL(None).malloc_trace_off()
    last = [metrics for metrics in logged if "mem/peak_mb" in metrics][-1]
    return {
        "prediction": dataclasses.asdict(prediction),
        "measured_mb": last["mem/peak_mb"],
        "perf": {key: value for key, value in last.items() if key.startswith("perf/")},
    }


def traced(memory, path: str) -> None:
    """Start ``trace.so``'s trace when ``memory`` starts measuring."""
    process, start = ctypes.CDLL(None), memory.start

    def start_and_trace() -> None:
        start()
        process.malloc_trace_on(path.encode())

    memory.start = start_and_trace


def row(overrides: list[str], result: dict) -> str:
    """A table row: the cell's keys, what else it overrides, prediction, activations, measured, ratio."""
    values = dict(item.split("=", 1) for item in overrides)
    cells = [values.pop(key, "false" if key in ("amp", "model.checkpointing") else "") for key in COLUMNS]
    cells[1] += "^3"
    predicted, measured = result["prediction"]["total_mb"], result["measured_mb"]
    cells += [
        " ".join(f"{k}={v}" for k, v in values.items()),
        f"{predicted:.0f}",
        f"{result['prediction']['activations_mb']:.0f}",
        f"{measured:.0f}",
        f"{measured / predicted:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=str(DATA_ROOT))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per cell (limit_batches)")
    parser.add_argument("--held-out", action="store_true", help="the held-out cells instead of the grid")
    parser.add_argument("--stems", action="store_true", help="the 28^3 small/standard stem cells instead of the grid")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per cell; the lowest reading is kept")
    parser.add_argument("--trace", help="with --cell: write its allocations here (benchmarks/malloc/trace.so)")
    parser.add_argument("--cell", nargs=argparse.REMAINDER, help="run one cell with these overrides, print JSON")
    args = parser.parse_args()
    fixed = [
        "data=adrenalmnist3d",
        f"data.root={args.data_root}",
        "data.download=false",
        f"device={args.device}",
        f"num_threads={args.threads}",
        f"limit_batches={args.steps}",
        "epochs=1",
    ]
    if args.trace and not hasattr(ctypes.CDLL(None), "malloc_trace_on"):
        sys.exit("error: --trace needs LD_PRELOAD=benchmarks/malloc/trace.so (build it as the module docstring says)")
    if args.cell is not None:
        print(json.dumps(run_cell(fixed + args.cell, args.trace)))
        return
    print(f"| {' | '.join(COLUMNS.values())} | other | predicted MiB | activations MiB | measured MiB | ratio |")
    print("|---" * (len(COLUMNS) + 5) + "|")
    cells = HELD_OUT if args.held_out else STEMS if args.stems else None
    for overrides in [cell.split() for cell in cells] if cells else grid():
        readings = [measure(args, overrides) for _ in range(args.repeats)]
        print(row(overrides, min(readings, key=lambda result: result["measured_mb"])), flush=True)


def measure(args: argparse.Namespace, overrides: list[str]) -> dict:
    """One cell in a fresh interpreter (``--cell``), its JSON result."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.memory_table",
            "--data-root",
            args.data_root,
            "--threads",
            str(args.threads),
            "--device",
            args.device,
            "--steps",
            str(args.steps),
            "--cell",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


if __name__ == "__main__":
    main()
