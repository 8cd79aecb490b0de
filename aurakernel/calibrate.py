"""Measure this machine: streaming bandwidth per thread count, call and fork overheads, matmul peak.

Two streaming rates: a copy to fresh memory (STREAM's convention, read + write counted; the write's
read-for-ownership is paid but not counted), which the cost model and the roofline use, and an
update in place (the same two streams, no read-for-ownership), the floor of kernels that write back
where they read, such as AdamW's (`Work.in_place_bytes`).

The figures overlay the host profile (hardware.host_profile) and feed the cost model and the MFU.
They are cached per machine in the user's cache dir; `aurakernel calibrate` refreshes them, and
`aurakernel calibrate --fit` fits the cost model's coefficients to measurements (planner/fit.py).

A calibration taken on a busy machine would mislead every MFU and cost prediction after it, so the
figures are checked before they are kept (`implausible`: more threads streaming slower than fewer,
repeats that spread apart); an implausible run is measured again, and one that stays implausible is
kept with its warnings, which `aurakernel show` and `train` print. Each matmul probe is sized to
run in a fraction of a second, so a dtype with no fast path (bf16 on an AVX2-only CPU) costs
seconds, not minutes, and is reported as having none.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch

from .codegen import render
from .hardware import _cpu_flags, host_cores, host_profile, load_calibration, save_calibration
from .targets.host.library import Entry, compile_source

_ENTRIES = {
    "noop": Entry("ak_noop", ()),
    "stream": Entry("ak_stream", ("ptr", "ptr", "i64", "i64", "ptr")),
    "inplace": Entry("ak_stream_inplace", ("ptr", "i64", "i64", "ptr")),
    "fork": Entry("ak_fork", ("i64", "ptr")),
    "fma": Entry("ak_fma", ("i64", "ptr")),
    "fma_flops": Entry("ak_fma_flops_per_iter", (), "i64"),
}


def _probe(threads: int):
    simd = host_profile(calibrated=False).simd_bytes
    if simd not in (16, 32, 64):
        raise ValueError(f"SIMD width {simd} B: the probes take 16, 32 or 64")
    return compile_source(render("host/calibrate.c.j2", {"threads": int(threads), "simd_bytes": int(simd)}), _ENTRIES)


SPREAD_LIMIT = 1.5        # slowest / fastest repeat of one probe beyond this: the machine was busy
THREAD_SLOWDOWN = 0.85    # n threads streaming below this share of n-1 threads' bandwidth: the same
MATMUL_BUDGET_S = 0.25    # one timed matmul at most this long: the probe shrinks its size to fit
NO_FAST_PATH = 0.5        # a dtype below this share of fp32's peak has no fast path here


def _timed_gbps(threads: int, entry: str, args: tuple, nbytes: int) -> list[float]:
    """GB/s of each of 5 repeats of the probe `entry(*args, reps=2, seconds)` moving `nbytes` a rep."""
    k = _probe(threads)
    out = torch.zeros(1, dtype=torch.float64)
    runs = []
    for _ in range(5):
        k.call(entry, *args, 2, out)
        runs.append(nbytes / float(out) / 1e9)
    return runs


def _stream_runs(threads: int, mbytes: int = 256) -> list[float]:
    """GB/s of each of 5 repeats of a 2-array copy of `mbytes` on `threads` threads."""
    n = mbytes * 2**20 // 8  # two arrays of n floats: mbytes in all
    a, b = torch.zeros(n), torch.ones(n)
    return _timed_gbps(threads, "stream", (a, b, n), 2 * n * 4)


def _inplace_runs(threads: int, mbytes: int = 256) -> list[float]:
    """GB/s (read + write counted) of each of 5 repeats of an in-place update of `mbytes` on `threads`
    threads: the rate of kernels that write back where they read (AdamW), which pay no
    read-for-ownership. The copy above pays it uncounted, so this is the higher figure."""
    n = mbytes * 2**20 // 4
    return _timed_gbps(threads, "inplace", (torch.ones(n), n), 2 * n * 4)


def stream_gbps(threads: int, mbytes: int = 256) -> float:
    return statistics.median(_stream_runs(threads, mbytes))


def implausible(stream_runs: dict[int, list[float]], probe: str = "stream") -> list[str]:
    """What makes a set of stream measurements (threads -> repeats, GB/s) untrustworthy: more
    threads slower than fewer, or repeats that spread apart (another process competing)."""
    problems = []
    medians = {t: statistics.median(r) for t, r in sorted(stream_runs.items())}
    for t, runs in sorted(stream_runs.items()):
        if min(runs) > 0 and max(runs) / min(runs) > SPREAD_LIMIT:
            problems.append(f"{probe} on {t} thread(s): repeats spread {max(runs) / min(runs):.1f}x "
                            f"({min(runs):.1f} to {max(runs):.1f} GB/s)")
        if t - 1 in medians and medians[t] < THREAD_SLOWDOWN * medians[t - 1]:
            problems.append(f"{probe} on {t} threads ({medians[t]:.1f} GB/s) is slower than on {t - 1} "
                            f"({medians[t - 1]:.1f} GB/s)")
    return problems


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


def _median_seconds(fn, reps: int) -> float:
    """The median of `reps` timed calls of fn, after one untimed call (first touches, lazy setup)."""
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def _mm_seconds(dtype: torch.dtype, n: int, reps: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return _median_seconds(lambda: torch.mm(a, b), reps)


def _sized_rate(seconds, n: int, budget_s: float) -> float:
    """TFLOP/s of a square product timed by seconds(size, repeats): sized up from 512 to at most `n`
    while one product stays within `budget_s`; from 1024 up the best of 5 (then at the machine's rate)."""
    size, t = 512, seconds(512, 3)
    while size * 2 <= n and t * 8 <= budget_s:
        size *= 2
        t = seconds(size, 3)
    if size >= 1024:
        t = seconds(size, 5)
    return 2 * size**3 / t / 1e12


def matmul_tflops(dtype: torch.dtype, n: int = 4096, budget_s: float = MATMUL_BUDGET_S) -> float:
    """torch.mm's best square GEMM rate on all threads (a dtype without a fast path stays small and
    costs seconds)."""
    return _sized_rate(lambda size, reps: _mm_seconds(dtype, size, reps), n, budget_s)


def own_gemm_tflops(n: int = 4096, budget_s: float = MATMUL_BUDGET_S) -> float:
    """The fp32 rate of AuraKernel's own blocked GEMM (the linear kernel, as planned here), sized as
    torch.mm's probe is: what the planner weighs against torch's (peak_tflops) where a kernel may run
    either, since which is faster differs between machines (MKL on one AVX2 EPYC ran the LM head's
    chunk GEMMs at 60-75% of the FMA peak, on another at 86%)."""
    from .ops import get_op
    from .planner import solve_tiling
    from .targets.host.build import build_kernel
    from .targets.host.ops import kernel_of

    spec, hw = get_op("linear"), host_profile(calibrated=False)

    @functools.cache
    def product(size: int):   # the kernel and its operands, built once per size (each size is timed twice)
        problem = spec.problem(f"{size}x{size}x{size}", "fp32")
        knobs = solve_tiling(kernel_of(spec).tiling_problem(problem, hw), op="linear", variant=problem.variant,
                             shape=problem.shape, dtype="fp32", target="host", explain=False).knobs
        kernel = build_kernel(spec, problem, knobs)
        x, w, y = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
        return lambda: kernel.call("fwd", x, w, y, size, kernel.workspace("scratch"))

    return _sized_rate(lambda size, reps: _median_seconds(product(size), reps), n, budget_s)


def fma_tflops(threads: int, iters: int = 2_000_000, repeats: int = 5) -> float:
    """The fp32 multiply-add roof of `threads` cores, measured: independent FMA chains at the SIMD
    width (calibrate.c.j2's ak_fma), the best of `repeats` (a busy machine only slows it). What the
    ISA and the clock the cores really run at allow, where counting pipes gets it wrong (Zen 4 issues
    one 512-bit FMA a cycle, not two; turbo clocks differ from the reported one)."""
    k = _probe(threads)
    out = torch.zeros(1, dtype=torch.float64)
    k.call("fma", max(iters // 10, 1), out)   # warm-up (clock ramp)
    best = math.inf
    for _ in range(repeats):
        k.call("fma", iters, out)
        best = min(best, float(out))
    return threads * iters * int(k.call("fma_flops")) / best / 1e12


def theoretical_tflops(cores: int, clock_ghz: float, simd_bytes: int, flags: set[str],
                       fp32_roof: float | None = None) -> dict[str, float]:
    """The compute roof beside the measured matmul peak: fp32's from the FMA probe where measured
    (`fp32_roof`), else two FMA pipes of the SIMD width per core at the reported clock (2 x lanes x
    2 FLOP per cycle, an estimate); bf16 through AMX tiles where the CPU has them (1024 FLOP per
    cycle per core at the reported clock, an estimate), through AVX512-BF16 dot products (twice
    fp32's), else fp32's rate."""
    fp32 = fp32_roof if fp32_roof is not None else cores * clock_ghz * 2 * (simd_bytes // 4) * 2 / 1e3
    if "amx_bf16" in flags:
        bf16 = cores * clock_ghz * 1024 / 1e3
    elif "avx512_bf16" in flags:
        bf16 = 2 * fp32
    else:
        bf16 = fp32
    return {"fp32": round(fp32, 4), "bf16": round(bf16, 4)}


def slow_dtypes(peak_tflops: dict[str, float]) -> list[str]:
    """The 16-bit dtypes whose matmul peak is below NO_FAST_PATH of fp32's: no fast path on this CPU."""
    fp32 = peak_tflops.get("fp32", 0.0)
    return [d for d in ("bf16", "fp16") if d in peak_tflops and peak_tflops[d] < NO_FAST_PATH * fp32]


def calibrate(progress=None, attempts: int = 3) -> dict:
    """Run every probe; returns (and caches) the calibration overlay. Streams that look measured on
    a busy machine are measured again (up to `attempts` times); `warnings` lists what stayed wrong."""
    cores = host_cores()
    torch.set_num_threads(cores)
    cal = {"stream_gbps": {}, "call_overhead_us": 0.0, "fork_overhead_us": 0.0, "peak_tflops": {}}
    if progress:
        progress("FMA roof fp32")
    roof = fma_tflops(cores)   # again at the end: the better of two, seconds apart, so a busy spell at one is outlived
    for attempt in range(attempts):
        runs, in_place = {}, {}
        for t in range(1, cores + 1):
            if progress:
                progress(f"stream {t}" + (f" (again: attempt {attempt + 1})" if attempt else ""))
            runs[t] = _stream_runs(t)
            if progress:
                progress(f"stream in place {t}")
            in_place[t] = _inplace_runs(t)
        warnings = implausible(runs) + implausible(in_place, "stream in place")
        if not warnings:
            break
    cal["stream_gbps"] = {str(t): round(statistics.median(r), 3) for t, r in runs.items()}
    cal["inplace_gbps"] = {str(t): round(statistics.median(r), 3) for t, r in in_place.items()}
    if progress:
        progress(f"fork {cores}")
    cal["fork_overhead_us"] = round(fork_overhead_us(cores), 3)
    if progress:
        progress("call")
    cal["call_overhead_us"] = round(call_overhead_us(), 3)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if progress:
            progress(f"mm {name}")
        cal["peak_tflops"][name] = round(matmul_tflops(dtype), 4)
    cal["peak_tflops"]["fp16"] = cal["peak_tflops"]["bf16"]
    if progress:
        progress("own GEMM fp32")
    cal["own_gemm_tflops"] = {"fp32": round(own_gemm_tflops(), 4)}
    if progress:
        progress("FMA roof fp32 (again)")
    cal["fma_tflops"] = {"fp32": round(max(roof, fma_tflops(cores)), 4)}   # measured (calibrations before it: absent)
    hw = host_profile(calibrated=False)
    cal["theoretical_tflops"] = theoretical_tflops(cores, hw.clock_ghz, hw.simd_bytes, _cpu_flags(),
                                                   fp32_roof=cal["fma_tflops"]["fp32"])
    cal["theoretical_clock_ghz"] = round(hw.clock_ghz, 3)   # the OS's reported clock: turbo can exceed it
    cal["no_fast_path"] = slow_dtypes(cal["peak_tflops"])
    cal["warnings"] = warnings
    cal["measured_at"] = time.time()
    # coefficients fitted to the tuning DB (`calibrate --fit`) survive a re-measure: they are scales
    # on top of these figures, still the best estimate until the next fit
    previous = load_calibration() or {}
    for key in ("costmodel", "costmodel_fit"):
        if key in previous:
            cal[key] = previous[key]
    cal["path"] = str(save_calibration(cal))
    return cal


def describe(cal: dict | None) -> str:
    """One line on the calibration in use: when it was taken and what to distrust in it."""
    if not cal:
        return "calibration: none yet (the first tune or train measures this machine)"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(cal["measured_at"])) if "measured_at" in cal else "unknown time"
    line = f"calibration: taken {when} ({cal.get('path', 'cache')})"
    if cal.get("no_fast_path"):
        line += f"; no fast matmul path for {', '.join(cal['no_fast_path'])}"
    if cal.get("warnings"):
        line += f"; IMPLAUSIBLE ({'; '.join(cal['warnings'])}): re-run `aurakernel calibrate` on an idle machine"
    return line
