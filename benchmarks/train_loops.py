"""Training-loop benchmark on CPU or a GPU: the plain tutorial loop, MONAI's idiom and medsweep's Trainer, one process.

    python benchmarks/train_loops.py --model resnet18 --size 28 --batch 16 --steps 10 --warmup 2 --threads 2
    python benchmarks/train_loops.py --model densenet121 --size 64 --batch 4 --steps 3 --warmup 1 --threads 2
    python benchmarks/train_loops.py --model resnet18 --size 28 --sweep-best   # which medsweep switches are fastest
    # issue 21's GPU targets ((warm-up + timed steps) x batch within the 1188 training volumes)
    python benchmarks/train_loops.py --device cuda --model densenet121 --size 28 --batch 32 --steps 30 --warmup 5
    python benchmarks/train_loops.py --device cuda --model resnet18 --size 28 --batch 32 --steps 30 --warmup 5
    python benchmarks/train_loops.py --device cuda --model resnet18 --size 64 --batch 16 --steps 60 --warmup 5
    python benchmarks/train_loops.py --device cuda --model densenet121 --size 64 --batch 16 --steps 60 --warmup 5

Every variant trains on AdrenalMNIST3D's training split with the same batch, seed (set before each model is
built), optimizer (Adam, lr 1e-3), cross-entropy loss and number of warm-up and timed steps, on ``--device``
(model, batches and loss; ``--threads`` is the host's: on CUDA it converts and loads the data):

* ``plain``: the loop of PyTorch's tutorials: a ``Dataset`` holding the ``.npz`` arrays that turns one volume
  into a normalised float tensor in ``__getitem__``, a shuffling ``DataLoader``, fp32, ``optimizer.zero_grad()``,
  ``loss.item()`` every step, on the medsweep zoo model built with the default model switches. On CUDA as the
  tutorials write it for a GPU: ``pin_memory=True``, ``.to(device, non_blocking=True)``, torch's default Adam.
* ``monai`` (when ``monai`` is installed): MONAI's 3D classification idiom: ``monai.data.ArrayDataset`` with
  ``ScaleIntensity`` + ``EnsureType``, ``monai.data.DataLoader`` (pinned on CUDA), MONAI's ``DenseNet121`` /
  ``resnet18``, the same loop. MONAI's ResNet gets the stem of ``--stem``; its DenseNet has only the standard
  stem and needs 64^3.
* ``medsweep`` (CPU): the real ``Trainer``, built by ``src.training.build.build_trainer`` as a run's rank builds
  it, one ``train_epoch`` per round (``limit_batches`` = warm-up + timed steps), with the ``--medsweep`` overrides
  (default: :data:`BEST`).
* ``medsweep-eager`` and ``medsweep-graphed`` (CUDA, in its place): that ``Trainer`` with the ``--medsweep``
  overrides (default: :data:`BEST_CUDA`, bf16 autocast), then ``cuda_graphs=false`` (every step eager) or
  ``cuda_graphs=true`` (each optimizer step replayed as one CUDA graph after its eager warm-up steps and the
  capture); where the config cannot be captured (float16 autocast on a GPU without bf16, ...) the graphed
  variant is skipped with the reason.

Timing: in rounds; in each, every variant runs its warm-up steps untimed, then its timed steps, the variant
order reversing from round to round so that load from other processes falls on all alike. Reported, as timeit
does, from each variant's fastest round (on shared cores a slower round measures the other processes, not the
loop): samples/s, ms per step, and the speed-up as the ratio of the fastest rounds; beside it the median and
range of the per-round ratios, and every round's samples/s below the table. On CUDA the device is synchronised
at each timed window's edges only (the tutorials' loops still wait every step, at their ``loss.item()``); with
``medsweep-graphed`` the warm-up is at least :data:`GRAPH_WARMUP` steps for every variant (``--warmup`` is
raised to it, as the header says), so that the graph's eager steps and its capture are never timed.
Peak memory: ``src.training.meters.MemoryMonitor`` over each variant's first round, variants one after another
in this process. CPU: growth of the peak RSS, reset through /proc/self/clear_refs, freed heap handed back
(malloc_trim) first. CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less what was
allocated at the start (the other variants' models, its own weights): the growth, as on CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's src, also when run as a script

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from src.cli import register  # noqa: E402
from src.config import Config, Device, Stem  # noqa: E402
from src.data.files import npz_path  # noqa: E402
from src.data.loaders import load_splits  # noqa: E402
from src.data.shipped import SHIPPED  # noqa: E402
from src.errors import UsageError  # noqa: E402
from src.execution import resolve  # noqa: E402
from src.models import build_model  # noqa: E402
from src.models.layers import resolve_stem  # noqa: E402
from src.parallel.ranks import seed_everything  # noqa: E402
from src.training.build import build_trainer  # noqa: E402
from src.training.meters import MemoryMonitor, ThroughputMeter, device_name, synchronize  # noqa: E402
from src.training.step_graph import WARMUP_STEPS  # noqa: E402

CPU = torch.device("cpu")
LR = 1e-3  # medsweep's default Adam learning rate, used by every variant
VARIANTS = {"cpu": ("plain", "monai", "medsweep"), "cuda": ("plain", "monai", "medsweep-eager", "medsweep-graphed")}
MEDSWEEP = {"medsweep": (), "medsweep-eager": ("cuda_graphs=false",), "medsweep-graphed": ("cuda_graphs=true",)}
GRAPH_WARMUP = WARMUP_STEPS + 1  # the graphed step's eager steps, then the step that captures (and replays) it
# The medsweep switches --sweep-best flips, one at a time, away from their defaults.
SWITCHES = (
    "channels_last=true",
    "data.loader=dataloader",
    "model.inplace_act=false",
    "compile=true",
    "non_blocking=false",
    "amp=true",
    "optim.fused=false",
)
MIN_GAIN = 1.05  # a flip counts as faster than the defaults from this speed-up on (noise guard)
# The fastest medsweep overrides per model, found with --sweep-best on an AMD EPYC with avx512_bf16 (2 threads,
# torch 2.13.0; docs/benchmarks.md): bf16 autocast and the fused optimizer, which is now the default; the other
# switches moved the step time by noise only. Where the CPU has no fast bf16, amp=true trains in float32.
BEST = {"resnet18": ("amp=true",), "densenet121": ("amp=true",)}
# On CUDA, every model: bf16 autocast (amp_dtype=auto: bfloat16 from compute capability 8.0, no GradScaler), the
# precision issue 21 measured the graphed step in; channels_last slowed its eager bf16 step at 28^3, so it stays off.
BEST_CUDA = ("amp=true",)


@dataclass
class Variant:
    """One training set-up; ``round`` runs its warm-up and timed steps and returns the timed seconds."""

    name: str
    model: str
    stem: str
    round: Callable[[], float]
    seconds: list[float] = field(default_factory=list)
    peak_mb: float | None = None


class NpzVolumes(Dataset):
    """The tutorials' ``Dataset``: numpy arrays kept as they are, one item converted to tensors per call."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = torch.tensor(self.images[index], dtype=torch.float32).unsqueeze(0)
        image = (image / 255 - 0.5) / 0.5  # ToTensor + Normalize(0.5, 0.5), MedMNIST's transform
        return image, torch.tensor(self.labels[index], dtype=torch.long)


def read_train(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The training images ``(N, D, H, W)`` uint8 and labels ``(N,)`` int64 of a MedMNIST ``.npz``."""
    with np.load(path) as npz:
        return npz["train_images"], npz["train_labels"].reshape(-1).astype(np.int64)


def tutorial_round(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    warmup: int,
    steps: int,
    device: torch.device,
) -> float:
    """``warmup + steps`` steps of the tutorials' loop on a fresh pass over ``loader``; seconds of the last
    ``steps``, ``device`` synchronised at the window's edges."""
    criterion = nn.CrossEntropyLoss()
    model.train()
    running_loss = 0.0
    synchronize(device)
    start = time.perf_counter()
    for i, (inputs, labels) in enumerate(itertools.islice(loader, warmup + steps)):
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()  # the tutorials print it: a host sync every step
        if i + 1 == warmup:
            synchronize(device)
            start = time.perf_counter()
    synchronize(device)
    return time.perf_counter() - start


def compose_config(args: argparse.Namespace, overrides: tuple[str, ...] = ()) -> Config:
    """The typed medsweep config of this benchmark's setting plus ``overrides``."""
    fixed = [
        f"model={args.model}",
        f"model.stem={args.stem}",
        "data=adrenalmnist3d",
        f"data.root={args.data_root}",
        f"data.size={args.size}",
        "data.download=false",
        f"device={args.device}",
        f"num_threads={args.threads}",
        f"batch_size={args.batch}",
        f"seed={args.seed}",
        "optim=adam",
        f"optim.lr={LR}",
        "sched=none",
        f"limit_batches={args.warmup + args.steps}",
    ]
    register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=fixed + list(overrides)))


def plain_variant(cfg: Config, data: tuple[np.ndarray, np.ndarray], workers: int, warmup: int) -> Variant:
    """The tutorials' loop on medsweep's zoo model with its default switches."""
    execution = resolve(cfg)
    seed_everything(cfg, execution.threads)
    device = execution.device
    model = build_model(cfg.model, cfg.data).to(device)
    loader = DataLoader(
        NpzVolumes(*data),
        batch_size=cfg.batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=device.type == "cuda",
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    timed = cfg.limit_batches - warmup
    return Variant(
        "plain",
        f"{cfg.model.name} (medsweep zoo)",
        stem_name(cfg),
        lambda: tutorial_round(model, loader, optimizer, warmup, timed, device),
    )


def monai_model(cfg: Config) -> nn.Module:
    """MONAI's own network for ``cfg.model.name``; its ResNet with the stem of ``cfg``."""
    from monai.networks.nets import DenseNet121, resnet18

    if cfg.model.name == "densenet121":
        return DenseNet121(spatial_dims=3, in_channels=cfg.data.in_channels, out_channels=cfg.data.num_classes)
    stem = (
        {"conv1_t_size": 7, "conv1_t_stride": 2}
        if stem_name(cfg) == "standard"
        else {"conv1_t_size": 3, "conv1_t_stride": 1, "no_max_pool": True}
    )
    return resnet18(spatial_dims=3, n_input_channels=cfg.data.in_channels, num_classes=cfg.data.num_classes, **stem)


def monai_skip_reason(cfg: Config) -> str | None:
    """Why the MONAI variant cannot run this setting, or None."""
    if cfg.model.name not in ("resnet18", "densenet121"):
        return f"no MONAI counterpart of {cfg.model.name} here (resnet18, densenet121)"
    if cfg.model.name == "densenet121" and (cfg.data.size < 64 or stem_name(cfg) != "standard"):
        return "MONAI's DenseNet121 has only the standard stem and needs 64^3 (its pools fail on 1^3 maps at 28^3)"
    if find_spec("monai") is None:
        return "monai is not installed (pip install -c constraints.txt monai)"
    return None


def monai_variant(cfg: Config, data: tuple[np.ndarray, np.ndarray], workers: int, warmup: int) -> Variant:
    """MONAI's idiom: ArrayDataset with ScaleIntensity + EnsureType, monai.data.DataLoader, MONAI's network."""
    from monai.data import ArrayDataset
    from monai.data import DataLoader as MonaiDataLoader
    from monai.transforms import Compose, EnsureType, ScaleIntensity

    execution = resolve(cfg)
    seed_everything(cfg, execution.threads)
    device = execution.device
    model = monai_model(cfg).to(device)
    images, labels = data
    dataset = ArrayDataset(images[:, None], img_transform=Compose([ScaleIntensity(), EnsureType()]), labels=labels)
    loader = MonaiDataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=device.type == "cuda",
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    timed = cfg.limit_batches - warmup
    return Variant(
        "monai",
        f"MONAI {type(model).__name__}",
        stem_name(cfg),
        lambda: tutorial_round(model, loader, optimizer, warmup, timed, device),
    )


def medsweep_variant(cfg: Config, warmup: int, name: str = "medsweep") -> Variant:
    """medsweep's ``Trainer`` as ``run_rank`` builds it; a round is one ``train_epoch`` whose meter skips ``warmup``
    (and synchronises the device at its timed window's edges)."""
    execution = resolve(cfg)
    seed_everything(cfg, execution.threads)
    device = execution.device
    trainer = build_trainer(cfg, execution, splits={"train": load_splits(cfg.data)["train"]})
    trainer.meter = ThroughputMeter(device, warmup=warmup, first_warmup=warmup)
    epochs = itertools.count()
    timed = cfg.limit_batches - warmup
    return Variant(
        name,
        f"{cfg.model.name} (medsweep zoo)",
        stem_name(cfg),
        lambda: trainer.train_epoch(next(epochs))["perf/step_ms"] * timed / 1000,
    )


def stem_name(cfg: Config) -> str:
    return resolve_stem(cfg.model.stem, cfg.data.size).value


def allocated_mb(device: torch.device) -> float:
    """MiB allocated by tensors on a CUDA device now; 0 on CPU, where the monitor measures growth itself."""
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def measure(variants: list[Variant], repeats: int, device: torch.device) -> None:
    """``repeats`` rounds over ``variants`` (order reversed every other round); the first round of a variant
    not yet measured also reads its peak memory's growth."""
    monitor = MemoryMonitor(device)
    for index in range(repeats):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            first = variant.peak_mb is None
            if first:
                monitor.start()  # CPU: hands freed heap back first; CUDA: resets the peak to what is allocated
                held = allocated_mb(device)
            variant.seconds.append(variant.round())
            if first:
                variant.peak_mb = monitor.peak()["mem/peak_mb"] - held


def speedup(variant: Variant, reference: Variant) -> float:
    """How much faster ``variant`` trains than ``reference``: the ratio of their fastest rounds."""
    return min(reference.seconds) / min(variant.seconds)


def speedup_cell(variant: Variant, reference: Variant) -> str:
    """The speed-up, then the median and range of the per-round ratios (rounds paired in time)."""
    ratios = [ref / own for ref, own in zip(reference.seconds, variant.seconds, strict=True)]
    return (
        f"**{speedup(variant, reference):.2f}x** (per round {statistics.median(ratios):.2f}, "
        f"{min(ratios):.2f}-{max(ratios):.2f})"
    )


def table(variants: list[Variant], references: dict[str, Variant], args: argparse.Namespace) -> str:
    """The Markdown table: one row per variant, one speed-up column per reference."""
    head = [
        "variant",
        "model",
        "size",
        "stem",
        "batch",
        "samples/s",
        "step ms",
        "peak MiB",
        *[f"speed-up vs {label}" for label in references],
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        fastest = min(v.seconds)
        cells = [
            v.name,
            v.model,
            f"{args.size}^3",
            v.stem,
            str(args.batch),
            f"{args.batch * args.steps / fastest:.2f}",
            f"{1000 * fastest / args.steps:.0f}",
            f"{v.peak_mb:.0f}",
            *(speedup_cell(v, reference) for reference in references.values()),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def record(variants: list[Variant], args: argparse.Namespace) -> dict:
    """The table as one JSON object (``--json``): the shape, and each variant's samples/s per round."""
    return {
        "device": args.device,
        "model": args.model,
        "size": args.size,
        "batch": args.batch,
        "steps": args.steps,
        "machine": machine(args, ""),
        "samples_per_s": {v.name: [args.batch * args.steps / s for s in v.seconds] for v in variants},
        "peak_mb": {v.name: v.peak_mb for v in variants},
    }


def rounds_line(variants: list[Variant], args: argparse.Namespace) -> str:
    return "samples/s per round: " + "; ".join(
        f"{v.name} " + " ".join(f"{args.batch * args.steps / s:.2f}" for s in v.seconds) for v in variants
    )


PEAK_SOURCE = {
    "cpu": "CPU: peak RSS growth, reset via /proc/self/clear_refs",
    "cuda": "CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats, less what was allocated at the start",
}


def machine(args: argparse.Namespace, monai: str) -> str:
    """The software and the machine: torch (with CUDA and cuDNN, and the GPU, on CUDA), threads, CPU."""
    if args.device == "cpu":
        return f"torch {torch.__version__}{monai}; {torch.get_num_threads()} threads; CPU: {device_name(CPU)}"
    cuda = torch.device("cuda")
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}){monai}; "
        f"GPU: {device_name(cuda)}; {torch.get_num_threads()} threads (host side); CPU: {device_name(CPU)}"
    )


def header(args: argparse.Namespace, n_train: int) -> str:
    monai = f", monai {version('monai')}" if find_spec("monai") else ""
    raised = (
        f" (--warmup {args.asked_warmup} raised to {args.warmup}: the graphed step's eager steps and its capture)"
        if args.warmup != args.asked_warmup
        else ""
    )
    return "\n".join(
        [
            f"command: python {shlex.join(sys.argv)}",
            f"{machine(args, monai)}; load average at start {os.getloadavg()[0]:.2f}",
            f"AdrenalMNIST3D {args.size}^3, {n_train} training volumes; batch {args.batch}; seed {args.seed}; "
            f"Adam lr {LR}; per round {args.warmup} warm-up + {args.steps} timed steps, {args.repeats} rounds; "
            f"loader workers {args.workers}{raised}",
            "timing in one process, variant order reversed every other round; samples/s and step ms: fastest round; "
            "speed-up: ratio of the fastest rounds (per-round ratios: median, min-max)"
            + ("; the GPU synchronised at each timed window's edges only" if args.device == "cuda" else ""),
            f"peak MiB: MemoryMonitor ({PEAK_SOURCE[args.device]}) over each variant's first "
            "round, measured one after another in this process"
            + (", malloc_trim before each" if args.device == "cpu" else ""),
        ]
    )


def run_variants(args: argparse.Namespace, data: tuple[np.ndarray, np.ndarray]) -> None:
    """Build the asked variants, time them in rounds, print the table."""
    base = compose_config(args)
    best = BEST_CUDA if args.device == "cuda" else BEST.get(args.model, ())
    overrides = tuple(args.medsweep.split()) if args.medsweep is not None else best
    print(f"medsweep overrides: {' '.join(overrides) or '(defaults)'}")
    variants = []
    for name in args.variants:
        if name == "plain":
            variants.append(plain_variant(base, data, args.workers, args.warmup))
        elif name == "monai" and (reason := monai_skip_reason(base)):
            print(f"monai: skipped: {reason}")
        elif name == "monai":
            variants.append(monai_variant(base, data, args.workers, args.warmup))
        else:
            try:
                variants.append(medsweep_variant(compose_config(args, overrides + MEDSWEEP[name]), args.warmup, name))
            except UsageError as error:  # e.g. cuda_graphs=true where the step cannot be captured
                print(f"{name}: skipped: {error}")
    timed_table(variants, {v.name: v for v in variants if v.name == "plain"}, args)
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(record(variants, args)) + "\n")
    if args.profile:
        print(profile_table(variants, args.profile))


def sweep_best(args: argparse.Namespace, data: tuple[np.ndarray, np.ndarray]) -> None:
    """Time medsweep with its defaults and with each switch flipped alone; then, in new rounds, the best flip
    and all flips that beat the defaults by :data:`MIN_GAIN` together. Prints the tables and the fastest
    overrides by speed-up over the plain loop (the later rounds' figure where a variant ran in both)."""
    plain = plain_variant(compose_config(args), data, args.workers, args.warmup)
    defaults = medsweep_variant(compose_config(args), args.warmup, "medsweep defaults")
    flips = [medsweep_variant(compose_config(args, (s,)), args.warmup, s) for s in SWITCHES]
    references = {"plain": plain, "medsweep defaults": defaults}
    scores = timed_table([plain, defaults, *flips], references, args)
    gains = sorted((v for v in flips if speedup(v, defaults) >= MIN_GAIN), key=lambda v: scores[v.name], reverse=True)
    if len(gains) > 1:
        together = medsweep_variant(
            compose_config(args, tuple(v.name for v in gains)), args.warmup, " ".join(v.name for v in gains)
        )
        for v in (plain, defaults, gains[0]):
            v.seconds.clear()
        scores.update(timed_table([plain, defaults, gains[0], together], references, args))
    scores.pop("plain")
    best = max(scores, key=scores.get)
    print(f"best: {best.removeprefix('medsweep ')}, {scores[best]:.2f}x the plain loop")


def profile_table(variants: list[Variant], rows: int) -> str:
    """One more round of each variant under ``torch.profiler``: the ``rows`` ops with the most self CPU time over
    all variants, per variant their calls and self milliseconds (warm-up steps included), and each round's total.
    On CUDA that is the host's side: the launches, not the kernels."""
    profiles = {}
    for v in variants:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            v.round()
        profiles[v.name] = {e.key: (e.count, e.self_cpu_time_total / 1000) for e in prof.key_averages()}
    ops = sorted(
        {op for ops in profiles.values() for op in ops},
        key=lambda op: max(ops.get(op, (0, 0.0))[1] for ops in profiles.values()),
        reverse=True,
    )[:rows]
    head = ["op", *(f"{name}: calls, self ms" for name in profiles)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in ["total", *ops]:
        cells = [
            f"{sum(c for c, _ in p.values())}, {sum(t for _, t in p.values()):.0f}"
            if op == "total"
            else "{}, {:.1f}".format(*p.get(op, (0, 0.0)))
            for p in profiles.values()
        ]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timed_table(variants: list[Variant], references: dict[str, Variant], args: argparse.Namespace) -> dict[str, float]:
    """Time ``variants`` in rounds, print their table; each one's speed-up over the plain loop, if timed."""
    measure(variants, args.repeats, torch.device(args.device))
    print(table(variants, references, args))
    print(rounds_line(variants, args))
    plain = references.get("plain")
    return {v.name: speedup(v, plain) for v in variants} if plain else {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="a medsweep zoo model (monai: resnet18, densenet121)")
    parser.add_argument("--size", type=int, default=28, choices=(28, 64))
    parser.add_argument("--stem", default="standard", choices=[s.value for s in Stem])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help=f"untimed steps before them, every round (with medsweep-graphed at least {GRAPH_WARMUP}: raised)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds")
    parser.add_argument("--device", default="cpu", choices=[d.value for d in Device if d is not Device.auto])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads: the loops on CPU, the host side on CUDA")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers of plain and monai")
    parser.add_argument(
        "--variants",
        help="comma list of plain, monai, medsweep (CPU) or plain, monai, medsweep-eager, medsweep-graphed (CUDA); "
        "default: all of the device's",
    )
    parser.add_argument(
        "--medsweep",
        help="Hydra overrides of the medsweep variants, space separated "
        "(default: the model's best found by --sweep-best on CPU, amp=true on CUDA)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="then profile one round each: the N costliest ops"
    )
    parser.add_argument("--sweep-best", action="store_true", help="find the fastest medsweep switches instead")
    parser.add_argument("--data-root", default=str(SHIPPED))
    parser.add_argument("--json", metavar="FILE", help="append the table to FILE as one JSON line")
    args = parser.parse_args(argv)
    known = VARIANTS[args.device]
    args.variants = args.variants.split(",") if args.variants else list(known)
    if unknown := set(args.variants) - set(known):
        parser.error(f"--variants: unknown on {args.device}: {', '.join(sorted(unknown))}; use {', '.join(known)}")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.batch < 1 or args.threads < 1:
        parser.error("--steps, --repeats, --batch and --threads must be >= 1, --warmup >= 0")
    if args.sweep_best and args.device == "cuda":
        parser.error("--sweep-best flips CPU switches: on CUDA compare overrides with --medsweep instead")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"error: --device cuda: torch {torch.__version__} sees no CUDA device\n")
    args.asked_warmup = args.warmup
    if "medsweep-graphed" in args.variants:
        args.warmup = max(args.warmup, GRAPH_WARMUP)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data = read_train(npz_path(compose_config(args).data))
    if (args.warmup + args.steps) * args.batch > len(data[1]):
        sys.exit(f"error: (warmup + steps) x batch exceeds the {len(data[1])} training volumes: lower them")
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    print(header(args, len(data[1])))
    (sweep_best if args.sweep_best else run_variants)(args, data)
    print(f"wall time {time.perf_counter() - started:.0f} s; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
