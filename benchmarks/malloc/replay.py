"""Replay a malloc trace (``trace.c``) on this process's glibc: the allocations' own live peak against the peak of
glibc's heap plus mmapped chunks, which is what the resident set grows by when every allocated page is written.

    python -m benchmarks.malloc.replay /tmp/cell.trace

The difference between the two peaks is the freed heap glibc keeps resident (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
from pathlib import Path

MIB = 2**20


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def glibc() -> ctypes.CDLL:
    libc = ctypes.CDLL("libc.so.6")
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = MallInfo2
    return libc


def replay(lines: list[str]) -> dict[str, float]:
    """Allocate and free as the trace did (64-byte aligned, as PyTorch's CPU allocator); peaks in MiB."""
    libc = glibc()

    def held() -> int:
        info = libc.mallinfo2()
        return info.arena + info.hblkhd

    base, live, live_bytes, live_peak, held_peak = held(), {}, 0, 0, 0
    for line in lines:
        op, ptr, size = line.split()
        if op == "a":
            block = ctypes.c_void_p()
            libc.posix_memalign(ctypes.byref(block), 64, int(size))
            live[ptr] = block.value, int(size)
            live_bytes += int(size)
            live_peak = max(live_peak, live_bytes)
        elif ptr in live:
            block, size = live.pop(ptr)
            libc.free(block)
            live_bytes -= size
        held_peak = max(held_peak, held() - base)
    return {"live_peak_mb": live_peak / MIB, "heap_and_mmapped_peak_mb": held_peak / MIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--sizes", type=int, default=10, help="list the sizes that allocate the most bytes")
    args = parser.parse_args()
    lines = Path(args.trace).read_text().splitlines()
    sizes = collections.Counter(int(line.split()[2]) for line in lines if line.startswith("a "))
    for size, count in sorted(sizes.items(), key=lambda item: -item[0] * item[1])[: args.sizes]:
        print(f"{size / MIB:9.2f} MiB x {count}")
    print(" ".join(f"{key}={value:.0f}" for key, value in replay(lines).items()))


if __name__ == "__main__":
    main()
