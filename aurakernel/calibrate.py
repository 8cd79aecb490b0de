"""Measure this machine: streaming bandwidth per thread count, call and fork overheads, matmul peak.

The figures overlay the host profile (hardware.host_profile) and feed the cost model and the MFU.
They are cached per machine in the user's cache dir; `aurakernel calibrate` refreshes them, and
`aurakernel calibrate --fit` fits the cost model's coefficients to measurements (planner/fit.py).
"""

from __future__ import annotations

import statistics
import time

import torch

from .codegen import render
from .hardware import host_cores, load_calibration, save_calibration
from .targets.host.library import Entry, compile_source

_ENTRIES = {
    "noop": Entry("ak_noop", ()),
    "stream": Entry("ak_stream", ("ptr", "ptr", "i64", "i64", "ptr")),
    "fork": Entry("ak_fork", ("i64", "ptr")),
}


def _probe(threads: int):
    return compile_source(render("host/calibrate.c.j2", {"threads": threads}), _ENTRIES)


def stream_gbps(threads: int, mbytes: int = 256) -> float:
    n = mbytes * 2**20 // 8  # two arrays of n floats: mbytes in all
    a, b = torch.empty(n), torch.ones(n)
    a.fill_(0.0)
    k = _probe(threads)
    out = torch.zeros(1, dtype=torch.float64)
    runs = []
    for _ in range(5):
        k.call("stream", a, b, n, 2, out)
        runs.append(float(out))
    return 2 * n * 4 / statistics.median(runs) / 1e9


def fork_overhead_us(threads: int) -> float:
    k = _probe(threads)
    out = torch.zeros(1, dtype=torch.float64)
    runs = []
    for _ in range(5):
        k.call("fork", 2000, out)
        runs.append(float(out))
    return statistics.median(runs) * 1e6


def call_overhead_us() -> float:
    k = _probe(1)
    fn, _ = k._functions["noop"]
    reps = 20000
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t0) / reps)
    return statistics.median(runs) * 1e6


def matmul_tflops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        runs.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(runs) / 1e12


def calibrate(progress=None) -> dict:
    """Run every probe; returns (and caches) the calibration overlay."""
    cores = host_cores()
    torch.set_num_threads(cores)
    steps = [("stream", t) for t in range(1, cores + 1)] + [("fork", cores), ("call", 0),
                                                              ("mm", torch.float32), ("mm", torch.bfloat16)]
    cal = {"stream_gbps": {}, "call_overhead_us": 0.0, "fork_overhead_us": 0.0, "peak_tflops": {}}
    for kind, arg in steps:
        if progress:
            progress(f"{kind} {arg if kind != 'call' else ''}".strip())
        if kind == "stream":
            cal["stream_gbps"][str(arg)] = round(stream_gbps(arg), 3)
        elif kind == "fork":
            cal["fork_overhead_us"] = round(fork_overhead_us(arg), 3)
        elif kind == "call":
            cal["call_overhead_us"] = round(call_overhead_us(), 3)
        else:
            name = "fp32" if arg == torch.float32 else "bf16"
            cal["peak_tflops"][name] = round(matmul_tflops(arg), 4)
    cal["peak_tflops"]["fp16"] = cal["peak_tflops"]["bf16"]
    cal["measured_at"] = time.time()
    # coefficients fitted to the tuning DB (`calibrate --fit`) survive a re-measure: they are scales
    # on top of these figures, still the best estimate until the next fit
    previous = load_calibration() or {}
    for key in ("costmodel", "costmodel_fit"):
        if key in previous:
            cal[key] = previous[key]
    cal["path"] = str(save_calibration(cal))
    return cal


