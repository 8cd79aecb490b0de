"""How a process that runs host kernels gets its memory for large CPU tensors.

A kernel that writes a fresh 32 MB output pays for the pages before it writes a byte: glibc maps
allocations above its mmap threshold fresh from the kernel and unmaps them when freed, so every
call faults in and zeroes new pages (8 ms for a 32 MB tensor on a 2-core Xeon, where the kernel
itself takes 3.5 ms and a copy into memory already touched 1.4 ms). `retain_freed_memory` raises
glibc's mmap and trim thresholds so large blocks come from the heap and stay mapped when freed: the
next tensor of that size reuses pages already faulted in (the same clone then takes 1.2-1.9 ms)
-- often, not always: an aligned allocation does not always fit the block freed before it (of ten
64 MB tensors allocated one after another, 3-5 reuse a freed block instead of faulting in 16384
fresh pages each).
The process's resident set then stays at its peak instead of shrinking between steps; its peak is
unchanged. The CLI and the benchmarks call it (every candidate they time alike); set
AURAKERNEL_RETAIN_FREED_MEMORY=0 to keep glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30   # blocks above 1 GiB are still mapped on their own (and returned when freed)
TRIM_THRESHOLD = (1 << 31) - 1


def retain_freed_memory() -> bool:
    """Make freed large blocks stay mapped for reuse (glibc); False where it does not apply (another
    C library, or AURAKERNEL_RETAIN_FREED_MEMORY=0)."""
    if os.environ.get("AURAKERNEL_RETAIN_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):   # not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
