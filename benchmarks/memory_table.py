"""Predicted vs measured peak training memory (CPU, or ``--device cuda``): one fresh process per cell, a Markdown table.

    python -m benchmarks.memory_table --threads 2 --steps 3              # from the project root
    python -m benchmarks.memory_table --held-out                         # cells the constants were not fitted on
    python -m benchmarks.memory_table --stems --threads 1 --repeats 3    # 28^3, both stems, lowest of 3 readings

On a GPU, ``--gpu-grid`` runs the zoo at 28, 64 and 128^3, bf16 and float32, several batches, graphed and eager, every
cell in this one process (peak statistics reset, everything freed and the allocator's cache emptied between cells: a
graph's private pool goes with its graph), one JSON line per cell (``--json``) and a Markdown table (``--markdown``)
with each cell's ratio, marked within +-15% or not, and the graph pools' reserved bytes read from the allocator's
snapshot (what the graphed terms of ``src/perf/memory.py`` are to be fitted on):

    python -m benchmarks.memory_table --device cuda --gpu-grid --steps 6 --json memory.jsonl --markdown memory.md

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
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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


# --gpu-grid: (data.size, batches) for each model, each cell at bf16 and float32, graphed and eager; sides MedMNIST
# does not ship (128^3) from a NIfTI folder of its 64^3 volumes (benchmarks/nifti_adrenal.py --per-split), resampled
GPU_MODELS = ("resnet18", "densenet121")
GPU_SHAPES = ((28, (4, 16)), (64, (4, 16)), (128, (4,)))
MEDMNIST_SIZES = (28, 64)
NIFTI_PER_SPLIT = 32  # volumes of each split a --gpu-grid writes where no --nifti-root is given
TOLERANCE = 0.15  # the predictor's goal: measured within 1 +- 15% of the prediction
MIB = 2**20


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


def gpu_grid(models: tuple[str, ...], shapes=GPU_SHAPES, device: str = "cuda") -> list[list[str]]:
    """Every model x size x batch x precision (``amp``) x step (graphed, eager; eager only on a CPU, which never
    graphs)."""
    graphs = (True, False) if device == "cuda" else (False,)
    return [
        [
            f"model={model}",
            f"data.size={size}",
            "model.stem=standard",
            f"batch_size={batch}",
            f"amp={str(amp).lower()}",
            f"cuda_graphs={str(graphed).lower()}",
        ]
        for model in models
        for size, batches in shapes
        for batch in batches
        for amp in (True, False)
        for graphed in graphs
    ]


def graph_pools() -> dict[str, float]:
    """The CUDA allocator's segments outside its default pool (graphs' private pools): reserved and allocated MiB."""
    import torch

    pools = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)]
    return {
        "pool_reserved_mb": sum(seg["total_size"] for seg in pools) / MIB,
        "pool_allocated_mb": sum(seg["allocated_size"] for seg in pools) / MIB,
    }


def run_in_process(overrides: list[str], device: str) -> dict:
    """One cell in this process (``--gpu-grid``): on CUDA what earlier cells left allocated is read first
    (``leftover_mb``: the measured peak includes it), the graph pools after training; then everything is freed and the
    allocator's cache emptied. A cell that fails is a record with its ``error``, and the grid goes on."""
    import torch

    cuda = device == "cuda"
    leftover = torch.cuda.memory_allocated() / MIB if cuda else 0.0
    start, pools = time.perf_counter(), {}
    try:
        result = run_cell(overrides, inspect=lambda trainer: pools.update(graph_pools() if cuda else {}))
    except Exception as err:  # an out of memory, a capture that fails: the cell's record says so
        result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return result | pools | {"leftover_mb": leftover, "seconds": round(time.perf_counter() - start, 1)}


def run_cell(overrides: list[str], trace: str | None = None, inspect: Callable[[object], None] | None = None) -> dict:
    """Train in this process as ``run_rank`` does; the prediction and the ``mem/peak_mb`` the run logs. ``trace``: the
    file ``benchmarks/malloc/trace.so`` (preloaded) writes the allocations to from ``memory.start()`` on; ``inspect``
    is called with the trainer after training."""
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
    if inspect:
        inspect(trainer)
    last = [metrics for metrics in logged if "mem/peak_mb" in metrics][-1]
    return {
        "prediction": dataclasses.asdict(prediction),
        "measured_mb": last["mem/peak_mb"],
        **({"peak_reserved_mb": last["mem/peak_reserved_mb"]} if "mem/peak_reserved_mb" in last else {}),
        "graphed": execution.graphed,
        "dtype": execution.dtype_name,
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


GPU_COLUMNS = (
    "model",
    "size",
    "batch",
    "dtype",
    "step",
    "predicted MiB",
    "of it graphed terms MiB",
    "measured MiB",
    "reserved MiB",
    "graph pools reserved MiB",
    "ratio",
    "within +-15%",
)


def gpu_row(record: dict) -> str:
    """A ``--gpu-grid`` table row from a cell's record; a failed cell says why."""
    from src.perf.memory import GRAPHED

    values = dict(item.split("=", 1) for item in record["cell"])
    amp = "bf16/fp16 (amp)" if values["amp"] == "true" else "float32"
    head = [values["model"], f"{values['data.size']}^3", values["batch_size"]]
    if "error" in record:
        step = "graphed" if values.get("cuda_graphs") == "true" else "eager"
        return "| " + " | ".join([*head, amp, step, f"error: {record['error']}", *[""] * 6]) + " |"
    prediction = record["prediction"]
    graphed = sum(prediction.get(term, 0) for term in ("static_inputs_mb", *GRAPHED))
    ratio = record["measured_mb"] / prediction["total_mb"]
    cells = [
        *head,
        record["dtype"],
        prediction["step"],
        f"{prediction['total_mb']:.0f}",
        f"{graphed:.0f}",
        f"{record['measured_mb']:.0f}",
        f"{record['peak_reserved_mb']:.0f}" if "peak_reserved_mb" in record else "-",
        f"{record.get('pool_reserved_mb', 0):.0f}",
        f"{ratio:.2f}",
        "yes" if within(ratio) else "**no**",
    ]
    return "| " + " | ".join(cells) + " |"


def within(ratio: float) -> bool:
    return 1 - TOLERANCE <= ratio <= 1 + TOLERANCE


def gpu_summary(records: list[dict]) -> str:
    """How many cells are within +-15%, graphed and eager apart, and how many failed."""
    parts = []
    for step in ("graphed", "eager"):
        done = [r for r in records if "error" not in r and r["prediction"]["step"] == step]
        if done:
            ratios = [r["measured_mb"] / r["prediction"]["total_mb"] for r in done]
            inside = sum(within(ratio) for ratio in ratios)
            parts.append(f"{step}: {inside} of {len(done)} within +-15% (ratios {min(ratios):.2f}-{max(ratios):.2f})")
    failed = sum("error" in r for r in records)
    return "; ".join(parts) + (f"; {failed} cells failed" if failed else "")


def parse_shapes(text: list[str]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``28:4,16 128:4`` as ``((28, (4, 16)), (128, (4,)))``."""
    pairs = (item.split(":") for item in text)
    return tuple((int(size), tuple(int(batch) for batch in batches.split(","))) for size, batches in pairs)


def nifti_data(root: str, size: int) -> list[str]:
    """The overrides that train on the NIfTI folder of AdrenalMNIST3D's 64^3 volumes (1 mm) at ``size``: resampled to
    keep the field of view."""
    spacing = 64 / size
    return ["data=nifti", f"data.root={root}", f"data.spacing=[{spacing:g},{spacing:g},{spacing:g}]",
            "data.classes=[normal,hyperplasia]"]  # fmt: skip


def write_nifti(out: Path, per_split: int) -> None:
    """AdrenalMNIST3D's first ``per_split`` 64^3 volumes of each split as a NIfTI folder (nifti_adrenal.py)."""
    script = ROOT / "benchmarks" / "nifti_adrenal.py"
    subprocess.run([sys.executable, str(script), "--out", str(out), "--per-split", str(per_split)], check=True)


def run_gpu_grid(args: argparse.Namespace, common: list[str], adrenal: list[str]) -> None:
    """``--gpu-grid``: every cell in this process, a JSON line each as it ends, the table and its summary."""
    records = []
    lines = ["| " + " | ".join(GPU_COLUMNS) + " |", "|---" * len(GPU_COLUMNS) + "|"]
    print("\n".join(lines), flush=True)
    shapes = parse_shapes(args.sizes)
    with tempfile.TemporaryDirectory(prefix="memory_table_") as scratch:
        nifti = args.nifti_root
        if nifti is None and any(size not in MEDMNIST_SIZES for size, _ in shapes):
            nifti = str(Path(scratch) / "adrenal_nifti")
            write_nifti(Path(nifti), NIFTI_PER_SPLIT)
        for cell in gpu_grid(tuple(args.models), shapes, args.device):
            size = int(dict(item.split("=", 1) for item in cell)["data.size"])
            data = adrenal if size in MEDMNIST_SIZES else nifti_data(nifti, size)
            record = {"cell": cell, **run_in_process([*data, *common, *cell], args.device)}
            records.append(record)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(json.dumps(record) + "\n")
            lines.append(gpu_row(record))
            print(lines[-1], flush=True)
    lines += ["", gpu_summary(records)]
    print(lines[-1], flush=True)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


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
    parser.add_argument("--gpu-grid", action="store_true", help="the GPU grid, every cell in this process")
    parser.add_argument("--models", nargs="+", default=list(GPU_MODELS), help="--gpu-grid: the models")
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=[f"{size}:{','.join(map(str, batches))}" for size, batches in GPU_SHAPES],
        help="--gpu-grid: SIZE:BATCH,BATCH... each",
    )
    parser.add_argument(
        "--nifti-root", help="--gpu-grid: the NIfTI folder of nifti_adrenal.py for sizes past 64 (default: one written)"
    )
    parser.add_argument("--json", help="--gpu-grid: append each cell's record here, a JSON line")
    parser.add_argument("--markdown", help="--gpu-grid: write the table here")
    parser.add_argument("--cell", nargs=argparse.REMAINDER, help="run one cell with these overrides, print JSON")
    args = parser.parse_args()
    adrenal = ["data=adrenalmnist3d", f"data.root={args.data_root}", "data.download=false"]
    common = [f"device={args.device}", f"num_threads={args.threads}", f"limit_batches={args.steps}", "epochs=1"]
    fixed = adrenal + common
    if args.gpu_grid:
        run_gpu_grid(args, common, adrenal)
        return
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
