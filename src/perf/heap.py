"""glibc's heap in a training process: large blocks handed back to the system when freed.

glibc serves a block from its heap, and keeps it resident once freed, when it is below the mmap threshold; that
threshold rises by itself to the largest block freed so far (up to 32 MiB). A 3D network's gradients, optimizer
states, oneDNN weight copies and activations churn every step in blocks of a few to 30 MiB, so the resident set
then holds hundreds of MiB of freed heap on top of the live tensors (docs/benchmarks.md). A fixed threshold stops
the rise: blocks from ``MMAP_THRESHOLD`` up are mapped on their own and returned on free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 4 << 20  # bytes
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own setting: a user's value is left as it is


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` for this process, unless ``MALLOC_MMAP_THRESHOLD_`` is set;
    False where the C library is not glibc (nothing to do) or the user chose a threshold."""
    if ENV in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): another allocator, nothing to fix
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
