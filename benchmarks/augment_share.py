"""Augmentation cost on CPU: ``src.training.augment.Augment`` on one batch against one full training step.

    python benchmarks/augment_share.py
    python benchmarks/augment_share.py --model resnet18 --sizes 28 64 --batches 16 4 --reps 20 --threads 2
    python benchmarks/augment_share.py --bf16-reps 3   # a CPU without avx512_bf16: a bf16 step takes minutes

For each size (with its batch), on random volumes normalised as training normalises them:

* ``aug ms``: the ``--aug`` config (default ``conf/aug/standard.yaml``) on the batch, a fresh
  ``step_generator`` per call as in training; then each part alone (flip + rot90, affine, intensity; the
  affine with ``affine_p=1``, so the grid sampling is always paid, as it is whenever ``affine_p > 0``).
* ``step ms``: forward, cross-entropy, backward and Adam step of ``--model`` (``--stem`` stem, built by
  ``src.models.build_model``, optimizer by ``src.training.optim.build_optimizer``), fp32 and under bf16 autocast
  (``src.training.optim.Precision``).
* ``share``: aug / (aug + step), the fraction of a training step that augmentation adds.

Timing: the median of ``--reps`` timed calls (``--bf16-reps`` for bf16 steps; 0 skips them) after ``--warmup``
untimed ones (``--step-warmup`` for steps), on ``--threads`` threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's src, also when run as a script

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from src.cli import register  # noqa: E402
from src.config import AugConfig, Config, Stem  # noqa: E402
from src.data.loaders import to_input  # noqa: E402
from src.execution import resolve  # noqa: E402
from src.models import build_model  # noqa: E402
from src.parallel.ranks import seed_everything  # noqa: E402
from src.training.augment import Augment, step_generator  # noqa: E402
from src.training.meters import device_name  # noqa: E402
from src.training.optim import Precision, build_optimizer  # noqa: E402

CPU = torch.device("cpu")
PARTS = {
    "flip+rot90": {"flip": True, "rot90": True},
    "affine": {"affine": True, "affine_p": 1.0},
    "intensity": {"intensity": True},
}


def compose_config(args: argparse.Namespace, size: int, batch: int) -> Config:
    """The typed medsweep config of one row."""
    overrides = [
        f"model={args.model}",
        f"model.stem={args.stem}",
        "data=adrenalmnist3d",
        f"data.size={size}",
        f"aug={args.aug}",
        "device=cpu",
        f"num_threads={args.threads}",
        f"batch_size={batch}",
        f"seed={args.seed}",
        "optim=adam",
    ]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))


def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (avx512_bf16 or AMX); without them oneDNN emulates bf16, slowly."""
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and bool({"avx512_bf16", "amx_bf16"} & set(cpuinfo.read_text().split()))


def median_ms(call: Callable[[int], object], warmup: int, reps: int) -> float:
    """Median wall time of ``call(i)`` over ``reps`` calls after ``warmup`` untimed ones, in ms."""
    for i in range(warmup):
        call(i)
    times = []
    for i in range(warmup, warmup + reps):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def aug_ms(cfg: AugConfig, images: torch.Tensor, seed: int, args: argparse.Namespace) -> float:
    augment = Augment(cfg)
    return median_ms(lambda i: augment(images, step_generator(CPU, seed, 0, i, 0)), args.warmup, args.reps)


def step_ms(
    cfg: Config, images: torch.Tensor, labels: torch.Tensor, amp: bool, reps: int, args: argparse.Namespace
) -> float:
    """One training step: forward, loss, backward, optimizer step (bf16 autocast when ``amp``)."""
    seed_everything(cfg, resolve(cfg).threads)
    model = build_model(cfg.model, cfg.data).train()
    optimizer = build_optimizer(cfg.optim, model.parameters())
    precision = Precision.build(torch.bfloat16 if amp else torch.float32, CPU)

    def step(_: int) -> None:
        with precision.autocast():
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return median_ms(step, args.step_warmup, reps)


def row(args: argparse.Namespace, size: int, batch: int) -> list[str]:
    cfg = compose_config(args, size, batch)
    data = torch.Generator().manual_seed(args.seed)
    images = to_input(
        torch.randint(0, 256, (batch, cfg.data.in_channels, size, size, size), generator=data, dtype=torch.uint8)
    )
    labels = torch.randint(0, cfg.data.num_classes, (batch,), generator=data)
    aug = aug_ms(cfg.aug, images, args.seed, args)
    off = dataclasses.replace(cfg.aug, flip=False, rot90=False, affine=False, intensity=False)
    parts = [
        aug_ms(dataclasses.replace(off, name=part, **switches), images, args.seed, args)
        for part, switches in PARTS.items()
    ]
    steps = [
        step_ms(cfg, images, labels, amp, reps, args) if reps else None
        for amp, reps in ((False, args.reps), (True, args.bf16_reps))
    ]
    return [
        f"{size}^3",
        str(batch),
        f"{aug:.2f}",
        *(f"{p:.2f}" for p in parts),
        *(cell for s in steps for cell in ((f"{s:.0f}", f"{100 * aug / (aug + s):.1f}%") if s else ("-", "-"))),
    ]


def header(args: argparse.Namespace) -> str:
    return "\n".join(
        [
            f"command: python {shlex.join(sys.argv)}",
            f"torch {torch.__version__}; {torch.get_num_threads()} threads; CPU: {device_name(CPU)}; "
            f"load average at start {os.getloadavg()[0]:.2f}; bf16 instructions (avx512_bf16/AMX): "
            f"{'yes' if native_bf16() else 'no (oneDNN emulates bf16)'}",
            f"model {args.model} ({args.stem} stem), Adam; aug={args.aug}; random volumes; "
            f"medians of {args.reps} timed calls after {args.warmup} warm-up "
            f"(steps: {args.step_warmup} warm-up; bf16: {args.bf16_reps} timed); "
            "share = aug / (aug + step)",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="a medsweep zoo model")
    parser.add_argument("--stem", default="standard", choices=[s.value for s in Stem])
    parser.add_argument("--aug", default="standard", help="a conf/aug config")
    parser.add_argument("--sizes", type=int, nargs="+", default=[28, 64], choices=(28, 64))
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 4], help="one batch size per size")
    parser.add_argument("--reps", type=int, default=20, help="timed calls (augmentation, fp32 steps)")
    parser.add_argument("--bf16-reps", type=int, help="timed bf16 steps (default: --reps; 0: none)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed augmentation calls before the timed ones")
    parser.add_argument("--step-warmup", type=int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if len(args.batches) != len(args.sizes):
        parser.error(f"--batches needs one value per size ({len(args.sizes)}), got {len(args.batches)}")
    args.bf16_reps = args.reps if args.bf16_reps is None else args.bf16_reps
    if min(*args.batches, args.reps, args.threads) < 1 or min(args.warmup, args.step_warmup, args.bf16_reps) < 0:
        parser.error("--batches, --reps and --threads must be >= 1, --warmup, --step-warmup and --bf16-reps >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    register()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(header(args))
    head = [
        "size",
        "batch",
        "aug ms",
        *(f"{part} ms" for part in PARTS),
        "step fp32 ms",
        "share fp32",
        "step bf16 ms",
        "share bf16",
    ]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for size, batch in zip(args.sizes, args.batches, strict=True):
        print("| " + " | ".join(row(args, size, batch)) + " |", flush=True)
    print(f"wall time {time.perf_counter() - started:.0f} s; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
