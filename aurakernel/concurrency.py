"""Work that may overlap: what an emulated target does (builds, emulator runs) is subprocesses, so
several run at once on a thread per core; what is timed on this CPU never shares it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from .hardware import host_cores


def map_in_order(fn: Callable, jobs: list, *, side_by_side: bool) -> Iterable:
    """fn over jobs, results in order. Side by side on a thread per core; else one after the other
    on this thread (so a measurement shares the CPU with nothing, nor runs on a thread whose
    OpenMP team is not the one torch's ops use)."""
    workers = min(len(jobs), host_cores())
    if not side_by_side or workers <= 1:
        return map(fn, jobs)
    pool = ThreadPoolExecutor(workers)
    try:
        return list(pool.map(fn, jobs))
    finally:   # an error or Ctrl-C: the jobs not yet started are dropped, not run to the end first
        pool.shutdown(wait=True, cancel_futures=True)
