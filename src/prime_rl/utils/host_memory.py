"""glibc's malloc told to keep what a process frees, for processes that allocate the same large tensors every step.

By default glibc serves a large allocation with a fresh mapping (above a threshold that moves between 128 KiB and
32 MiB) and hands freed memory at the heap's top back to the kernel: a trainer step that allocates tens of MB of
activations per layer then takes a page fault for every 4 KiB it touches, each page zeroed by the kernel, on every
step. With the threshold at glibc's largest (32 MiB) and trimming only above 2 GiB free, what one step freed serves
the next, up to 2 GiB of it. Measured with benchmarks/step_profile.py (docs/benchmarks.md "One step, profiled").
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit (mallopt refuses more); above it a tensor is mapped anyway
# Up to 2 GiB of freed heap kept (mallopt takes an int; -1, never trimming, let a process that freed one model
# and built another grow past both: 24 GiB in benchmarks/step_profile.py --apart at 0.44 B).
TRIM_THRESHOLD = 2**31 - 1


def keep_freed_memory() -> bool:
    """Set both thresholds for this process; False where the C library is not glibc (macOS, musl) or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
