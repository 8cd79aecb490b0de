"""Time candidates side by side in one run: warm-ups, interleaved rounds, medians, ratios.

The machines are noisy, so absolute times mean little; ratios of candidates measured in the same
rounds (each round runs every candidate once, in rotating order) are what AuraKernel reports.
The thread count is fixed for the whole measurement.
"""

from __future__ import annotations

import statistics
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
            max_rounds: int = 30, budget_s: float = 3.0, threads: int | None = None) -> dict[str, Timing]:
    """Median seconds per call of each candidate, measured in interleaved rounds."""
    if threads is not None:
        torch.set_num_threads(threads)
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    # calls shorter than ~2 ms are repeated inside one sample, so timer overhead stays negligible
    inner = {}
    for name in names:
        t0 = time.perf_counter()
        candidates[name]()
        one = time.perf_counter() - t0
        inner[name] = max(1, min(1000, int(2e-3 / max(one, 1e-7))))
    samples: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (rounds < max_rounds and time.perf_counter() - start < budget_s):
        order = names[rounds % len(names):] + names[:rounds % len(names)]
        for name in order:
            fn, n = candidates[name], inner[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
        rounds += 1
    return {n: Timing(statistics.median(s), s) for n, s in samples.items()}
