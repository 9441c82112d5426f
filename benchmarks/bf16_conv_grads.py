"""CPU bf16 autocast: the weight gradient of a 3D conv against float64, plain ``nn.Conv3d`` vs medsweep's ``Conv3d``.

    python -m benchmarks.bf16_conv_grads                 # the shapes medsweep's zoo meets, a Markdown table
    python -m benchmarks.bf16_conv_grads --scan          # every map of 1-6 voxels a side: counts of wrong ones

torch 2.13's CPU build (oneDNN 3.12, ``jit_bf16:avx512_core_bf16`` backward-weights) returns garbage for some
small maps; the bad kernel can also corrupt the heap, so each case runs in a forked child and a child that
dies reads as ``crash``. The reference is ``torch.nn.grad.conv3d_weight`` in float64 (oneDNN has no float64).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import warnings

import torch
from torch import nn

from src.models.layers import Conv3d
from src.models.profile import autocast_weight_grad

WRONG = 0.05  # relative error; bf16 rounding gives 0.2-1% on these convs
# (C_in, C_out, kernel, stride, map): maps the zoo's convs see at 28^3 and 64^3 with the standard stem
ZOO_SHAPES = [
    (1, 64, 7, 2, (28, 28, 28)),
    (64, 64, 3, 1, (7, 7, 7)),
    (128, 128, 3, 1, (4, 4, 4)),
    (128, 256, 3, 2, (4, 4, 4)),
    (256, 256, 3, 1, (2, 2, 2)),
    (512, 512, 3, 1, (1, 1, 1)),
    (128, 32, 3, 1, (4, 4, 4)),
    (128, 32, 3, 1, (2, 2, 2)),
    (128, 32, 3, 1, (1, 1, 1)),
    (512, 128, 1, 1, (2, 2, 2)),
    (64, 64, 3, 1, (2, 4, 4)),
    (64, 128, 3, 2, (4, 1, 6)),
]
SCAN_CONVS = [(32, 32, 3, 1), (128, 32, 3, 1), (64, 128, 3, 2), (32, 32, 1, 1), (1, 32, 3, 1)]


def relative_error(
    conv_type: type[nn.Conv3d],
    in_channels: int,
    out_channels: int,
    kernel: int,
    stride: int,
    shape: tuple[int, int, int],
    batch: int = 2,
) -> float:
    """:func:`src.models.profile.autocast_weight_grad`'s error for a seeded conv of ``conv_type`` on a random batch."""
    torch.manual_seed(0)
    conv = conv_type(in_channels, out_channels, kernel, stride, kernel // 2, bias=False)
    return autocast_weight_grad(conv, torch.randn(batch, in_channels, *shape))[1]


def in_child(*args) -> float:
    """:func:`relative_error` in a forked child; ``nan`` when the child dies (a corrupted heap)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, repr(relative_error(*args)).encode())
        os._exit(0)
    os.close(write)
    answer = os.read(read, 64)
    os.close(read)
    os.waitpid(pid, 0)
    return float(answer) if answer else float("nan")


def shown(error: float) -> str:
    return "crash" if error != error else f"{error:.3g}" + (" (wrong)" if error > WRONG else "")


def zoo_table() -> None:
    print("| C_in | C_out | kernel | stride | map | nn.Conv3d bf16 | medsweep Conv3d |")
    print("|---|---|---|---|---|---|---|")
    for cin, cout, kernel, stride, shape in ZOO_SHAPES:
        plain, ours = (in_child(kind, cin, cout, kernel, stride, shape) for kind in (nn.Conv3d, Conv3d))
        print(
            f"| {cin} | {cout} | {kernel} | {stride} | {'x'.join(map(str, shape))} | {shown(plain)} | {shown(ours)} |",
            flush=True,
        )


def scan() -> None:
    print("| C_in | C_out | kernel | stride | maps | nn.Conv3d wrong or crash | medsweep Conv3d wrong or crash |")
    print("|---|---|---|---|---|---|---|")
    maps = list(itertools.product(range(1, 7), repeat=3))
    for cin, cout, kernel, stride in SCAN_CONVS:
        bad = [
            sum(not in_child(kind, cin, cout, kernel, stride, shape) <= WRONG for shape in maps)
            for kind in (nn.Conv3d, Conv3d)
        ]
        print(f"| {cin} | {cout} | {kernel} | {stride} | {len(maps)} | {bad[0]} | {bad[1]} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scan", action="store_true", help="all maps of 1-6 voxels a side, counts only")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TF32")
    torch.set_num_threads(1)
    onednn = re.search(r"MKL-DNN (v[\d.]+)", torch.__config__.show())
    print(f"torch {torch.__version__}, oneDNN {onednn.group(1) if onednn else 'absent'}, 1 thread\n")
    scan() if args.scan else zoo_table()


if __name__ == "__main__":
    main()
