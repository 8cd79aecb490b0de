"""Time candidates side by side in one run: warm-ups, interleaved rounds, medians, ratios.

The machines are noisy, so absolute times mean little; ratios of candidates measured in the same
rounds (each round runs every candidate once, in rotating order) are what AuraKernel reports.
The thread count is fixed for the whole measurement.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    median_s: float
    samples: list[float]

    @property
    def us(self) -> float:
        return self.median_s * 1e6


def compare(candidates: dict[str, Callable[[], object]], *, warmup: int = 2, min_rounds: int = 5,
            max_rounds: int = 30, budget_s: float = 3.0, max_s: float = 60.0,
            threads: int | None = None) -> dict[str, Timing]:
    """Median seconds per call of each candidate, measured in interleaved rounds: at least
    `min_rounds`, more while within `budget_s`. Calls that take minutes (eager dense attention in
    bf16 on a CPU without bf16 arithmetic) would make that hours: once a warm-up call takes longer
    than a quarter of `max_s` (longer than a torch.compile of one operator), the other warm-ups and
    the calibration are skipped, and no round starts after `max_s` (one always runs)."""
    if threads is not None:
        torch.set_num_threads(threads)
    names = list(candidates)
    slow = False
    for _ in range(warmup):
        for name in names:
            t0 = time.perf_counter()
            candidates[name]()
            slow = slow or time.perf_counter() - t0 > max_s / 4
        if slow:
            break
    # calls shorter than ~2 ms are repeated inside one sample, so timer overhead stays negligible
    inner = dict.fromkeys(names, 1)
    for name in names if not slow else ():
        t0 = time.perf_counter()
        candidates[name]()
        one = time.perf_counter() - t0
        inner[name] = max(1, min(1000, int(2e-3 / max(one, 1e-7))))
    samples: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    rounds = 0
    while rounds < 1 or (rounds < min_rounds and time.perf_counter() - start < max_s) or (
            rounds < max_rounds and time.perf_counter() - start < budget_s):
        order = names[rounds % len(names):] + names[:rounds % len(names)]
        for name in order:
            fn, n = candidates[name], inner[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
        rounds += 1
    return {n: Timing(statistics.median(s), s) for n, s in samples.items()}


@contextlib.contextmanager
def cpu_profile(**kwargs):
    """torch.profiler over the CPU, without the two lines its tracer prints on stderr at every start
    and stop (no setting turns them off): stderr is closed only while the profiler starts and stops,
    never while the profiled code runs."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], **kwargs)
    with _stderr_closed():
        prof.start()
    try:
        yield prof
    finally:
        with _stderr_closed():
            prof.stop()


@contextlib.contextmanager
def _stderr_closed():
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """The allocator's high-water mark during one call of `fn`, above what was allocated before it:
    the most bytes of tensors it held at once (outputs, temporaries, saved activations, gradients),
    from torch.profiler's allocation events (CPU tensors included, unlike the CUDA allocator stats)."""
    with cpu_profile(profile_memory=True) as prof:
        fn()
    events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"))
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def reset_peak_rss() -> bool:
    """Start a new resident-set high-water mark for this process (Linux: /proc/self/clear_refs 5);
    False where the system has none to reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark since the last reset_peak_rss (VmHWM), or since it
    started where there is no /proc (getrusage)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux, bytes on macOS
    return rss if sys.platform == "darwin" else rss * 1024
