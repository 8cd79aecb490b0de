"""`aurakernel calibrate`: a calibration taken on a busy machine is measured again, or kept with a
warning that show / train print; the matmul probe is bounded in time and reports a dtype without a
fast path. The probes themselves are replaced by stand-ins that play a busy or an AVX2-only machine."""

import pytest
import torch

from aurakernel import calibrate
from aurakernel.hardware import host_cores, host_profile, load_calibration, save_calibration
from aurakernel.ops.base import Work


def test_implausible_names_more_threads_slower_and_spread_repeats():
    assert calibrate.implausible({1: [15.0] * 5, 2: [27.0, 27.5, 26.8, 27.1, 27.2]}) == []
    slower = calibrate.implausible({1: [15.1] * 5, 2: [8.3] * 5})
    assert len(slower) == 1 and "on 2 threads (8.3 GB/s) is slower than on 1 (15.1 GB/s)" in slower[0]
    spread = calibrate.implausible({1: [15.0, 15.0, 4.0, 15.0, 15.0]})
    assert len(spread) == 1 and "repeats spread 3.8x" in spread[0]


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    monkeypatch.setenv("AURAKERNEL_CACHE_DIR", str(tmp_path / "cache"))   # keep the session's calibration
    for probe, value in (("fork_overhead_us", 2.5), ("call_overhead_us", 0.5)):
        monkeypatch.setattr(calibrate, probe, lambda *a, value=value, **k: value)
    monkeypatch.setattr(calibrate, "matmul_tflops", lambda dtype, **k: 1.0 if dtype.itemsize == 4 else 0.01)
    monkeypatch.setattr(calibrate, "_inplace_runs", lambda threads, **k: [14.0 * threads] * 5)
    monkeypatch.setattr(calibrate, "own_gemm_tflops", lambda **k: 0.8)
    monkeypatch.setattr(calibrate, "fma_tflops", lambda threads, **k: 1.2)
    return monkeypatch


def _busy_then_idle(busy_attempts: int):
    """Stream repeats that spread apart (another process competing) for the first attempts."""
    calls = []

    def runs(threads, mbytes=256):
        calls.append(threads)
        attempt = (len(calls) - 1) // host_cores()
        return [10.0 * threads, 3.0, 10.0 * threads] if attempt < busy_attempts else [10.0 * threads] * 5
    return runs, calls


def test_a_busy_first_measurement_is_measured_again(stand_ins):
    runs, calls = _busy_then_idle(busy_attempts=1)
    stand_ins.setattr(calibrate, "_stream_runs", runs)
    cal = calibrate.calibrate()
    assert len(calls) == 2 * host_cores()   # every thread count measured twice
    assert cal["warnings"] == [] and cal["stream_gbps"]["1"] == 10.0 and cal["inplace_gbps"]["1"] == 14.0
    assert load_calibration()["stream_gbps"] == cal["stream_gbps"]
    hw = host_profile()   # the profile takes both rates from the calibration
    assert hw.stream_bandwidth(1) == 10.0e9 and hw.inplace_bandwidth(1) == 14.0e9
    assert hw.peak_tflops["fp32"] == 1.0 and hw.own_gemm_tflops == {"fp32": 0.8}   # torch's GEMM and ours
    assert cal["no_fast_path"] == ["bf16", "fp16"]
    assert cal["theoretical_tflops"]["fp32"] == 1.2   # the FMA probe's roof, not a count of pipes
    assert "no fast matmul path for bf16, fp16" in calibrate.describe(cal) and "IMPLAUSIBLE" not in calibrate.describe(cal)


def test_a_machine_that_stays_busy_is_kept_with_its_warning(stand_ins):
    runs, calls = _busy_then_idle(busy_attempts=99)
    stand_ins.setattr(calibrate, "_stream_runs", runs)
    cal = calibrate.calibrate()
    assert len(calls) == 3 * host_cores()
    assert cal["warnings"] and all("repeats spread" in w for w in cal["warnings"])
    line = calibrate.describe(load_calibration())
    assert "IMPLAUSIBLE" in line and "re-run `aurakernel calibrate` on an idle machine" in line
    assert "none yet" in calibrate.describe(None)


def test_the_in_place_probe_runs_and_is_checked_like_the_copy():
    gbps = calibrate._inplace_runs(1, mbytes=16)   # the compiled probe itself, on a small array
    assert len(gbps) == 5 and all(g > 0.1 for g in gbps)
    slower = calibrate.implausible({1: [20.0] * 5, 2: [9.0] * 5}, "stream in place")
    assert len(slower) == 1 and slower[0].startswith("stream in place on 2 threads (9.0 GB/s)")


def test_an_in_place_update_is_floored_at_the_in_place_rate(stand_ins):
    # the copy's rate a stand-in too: measured, it passed the in-place stand-in's on a fast hour
    stand_ins.setattr(calibrate, "_stream_runs", lambda threads, **k: [10.0 * threads] * 5)
    cal = calibrate.calibrate()
    hw = host_profile()
    work = Work(700, 0, in_place_bytes=600)   # AdamW's shape of traffic: most of it written back in place
    copy, inplace = hw.stream_bandwidth(hw.cores), hw.inplace_bandwidth(hw.cores)
    assert inplace == cal["inplace_gbps"][str(hw.cores)] * 1e9 > copy
    assert work.floor_seconds(hw) == pytest.approx(100 / copy + 600 / inplace)
    assert Work(700, 0).floor_seconds(hw) == pytest.approx(700 / copy)
    older = {k: v for k, v in cal.items() if k != "inplace_gbps"}   # a calibration from before the probe
    save_calibration(older)
    assert host_profile().inplace_bandwidth(hw.cores) == host_profile().stream_bandwidth(hw.cores)


def test_the_matmul_probe_stays_small_where_a_dtype_is_slow(monkeypatch):
    sizes = []

    def seconds(dtype, n, reps, per_flop):
        sizes.append(n)
        return 2 * n**3 * per_flop

    monkeypatch.setattr(calibrate, "_mm_seconds", lambda dtype, n, reps: seconds(dtype, n, reps, 1e-9))   # 1 GFLOP/s
    slow = calibrate.matmul_tflops(None)
    assert set(sizes) == {512} and slow == pytest.approx(1e-3)   # one 0.27 s product: no larger size tried
    sizes.clear()
    monkeypatch.setattr(calibrate, "_mm_seconds", lambda dtype, n, reps: seconds(dtype, n, reps, 1e-12))   # 1 TFLOP/s
    fast = calibrate.matmul_tflops(None)
    assert max(sizes) == 4096 and fast == pytest.approx(1.0)


def test_the_theoretical_peak_follows_the_isa():
    avx2 = calibrate.theoretical_tflops(2, 2.0, 32, {"avx2", "fma"})
    assert avx2 == {"fp32": pytest.approx(0.128), "bf16": pytest.approx(0.128)}   # 2 cores x 2 GHz x 32 FLOP/cycle
    avx512 = calibrate.theoretical_tflops(2, 2.0, 64, {"avx512f", "avx512_bf16"})
    assert avx512 == {"fp32": pytest.approx(0.256), "bf16": pytest.approx(0.512)}
    amx = calibrate.theoretical_tflops(2, 2.0, 64, {"avx512f", "amx_bf16"})
    assert amx["bf16"] == pytest.approx(4.096)
    # a measured fp32 roof replaces the pipe count (Zen 4: one 512-bit FMA a cycle, not two), and bf16's
    # dot products are twice it
    zen4 = calibrate.theoretical_tflops(2, 2.6, 64, {"avx512f", "avx512_bf16"}, fp32_roof=0.234)
    assert zen4 == {"fp32": pytest.approx(0.234), "bf16": pytest.approx(0.468)}


def test_the_fma_probe_counts_every_threads_multiply_adds(monkeypatch):
    """The roof is threads x iterations x the probe's FLOP per iteration (its chains x SIMD lanes x 2)
    over the slowest thread's time, the best of the repeats; the probe runs on the SIMD width of the
    build (16 chains of 64 B with AVX-512, 10 of 32 B on AVX2)."""
    from aurakernel.hardware import host_profile

    simd = host_profile(calibrated=False).simd_bytes
    k = calibrate._probe(2)
    assert k.call("fma_flops") == (16 if simd >= 64 else 10) * (simd // 4) * 2
    out = torch.zeros(1, dtype=torch.float64)
    k.call("fma", 1000, out)
    assert 0 < float(out) < 1   # the slowest thread's seconds: written, and a plausible time
    times = iter([0.5, 0.25, 1.0])
    monkeypatch.setattr(calibrate, "_probe", lambda threads: type("K", (), {
        "call": staticmethod(lambda name, *a: 512 if name == "fma_flops" else a[1].fill_(next(times, 0.25)))})())
    assert calibrate.fma_tflops(2, iters=1000, repeats=2) == pytest.approx(2 * 1000 * 512 / 0.25 / 1e12)


def test_the_own_gemm_probe_times_the_linear_kernel():
    """AuraKernel's blocked GEMM is timed on a real square product: a rate a machine could run at."""
    rate = calibrate.own_gemm_tflops(n=512)
    assert 1e-4 < rate < 100


def test_the_host_profile_reads_the_machines_memory():
    """The memory a plan may fill (indexer_score's kept products) is this machine's RAM, not the
    profile's default."""
    from aurakernel.hardware import physical_memory_bytes

    ram = physical_memory_bytes()
    assert ram > 2**30 and host_profile(calibrated=False).memory["DRAM"].capacity == ram
