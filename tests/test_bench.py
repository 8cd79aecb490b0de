"""`aurakernel bench`: the regression gate's comparison logic, the JSON schema, the reports."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from aurakernel import bench

MACHINE = {"cpu": "Test CPU", "cores": 2, "path_flags": ["avx2", "avx512f"], "platform": "linux",
           "stream_gbps": 20.0, "peak_tflops": {"fp32": 0.4, "bf16": 2.0}}


def kernel(op, vs_eager, vs_compiled, verified=True):
    return {"op": op, "variant": "default", "shape": "64x64", "dtype": "bf16", "aurakernel_us": 100.0,
            "peak_mib": {"aurakernel": 12.5, "eager": 50.0, "compiled": 25.0},
            "eager_us": 100.0 * vs_eager, "compiled_us": 100.0 * vs_compiled, "speedup_vs_eager": vs_eager,
            "speedup_vs_compiled": vs_compiled, "roofline_pct": 40.0, "intensity": 0.5, "verified": verified,
            "verification": "passed 6 checks" if verified else "FAILED 1/6 checks; first: y outside tolerance",
            "status": "ok" if verified else "verify_failed"}


def result(kernels, train=(2.0, 1.3), machine=MACHINE, quick=False):
    return {"schema": bench.SCHEMA, "machine": dict(machine), "versions": {"aurakernel": "test"}, "quick": quick,
            "subset": quick,
            "kernels": kernels, "summary": bench.summarize(kernels),
            "train_step": {"steps": 10, "median_step_ms": {"eager": 200.0, "compiled": 130.0, "aurakernel": 100.0},
                           "tokens_per_s": {"eager": 5.0, "compiled": 7.7, "aurakernel": 10.0},
                           "mfu": {"eager": 0.1, "compiled": 0.15, "aurakernel": 0.2}, "final_loss": {},
                           "swapped": {}, "speedup_vs_eager": train[0], "speedup_vs_compiled": train[1],
                           "peak_mib": {"eager": 400.0, "compiled": 350.0, "aurakernel": 300.0}}}


BASE = result([kernel("rms_norm", 5.0, 1.5), kernel("swiglu", 4.0, 1.1)])


def test_a_twenty_percent_slowdown_is_caught_and_named():
    slower = result([kernel("rms_norm", 4.0, 1.2), kernel("swiglu", 4.0, 1.1)])   # 20% down on rms_norm
    failures = bench.regressions(slower, BASE, 0.15)
    assert len(failures) == 2 and all(f.startswith("rms_norm[default] 64x64 bf16") for f in failures)
    assert "speedup_vs_eager 4.00x, baseline 5.00x" in failures[0]


def test_noise_within_the_threshold_passes():
    noisy = result([kernel("rms_norm", 5.0 * 0.9, 1.5 * 1.1), kernel("swiglu", 4.0 * 0.87, 1.1 * 0.95)],
                   train=(2.0 * 0.9, 1.3 * 0.88))
    assert bench.regressions(noisy, BASE, 0.15) == []


def test_training_step_regression_is_caught():
    slow_train = result([kernel("rms_norm", 5.0, 1.5), kernel("swiglu", 4.0, 1.1)], train=(1.5, 1.3))
    failures = bench.regressions(slow_train, BASE, 0.15)
    assert failures == [f for f in failures if f.startswith("training step: speedup_vs_eager")] and len(failures) == 1


def test_a_verification_failure_always_fails():
    broken = result([kernel("rms_norm", 50.0, 15.0, verified=False), kernel("swiglu", 4.0, 1.1)])
    assert any("not verified" in f for f in bench.regressions(broken, BASE, 0.15))
    assert any("not verified" in f for f in bench.regressions(broken, BASE, 0.99))
    other_cpu = dict(MACHINE, cpu="Another CPU")   # even when speedups cannot be compared
    assert any("not verified" in f for f in bench.regressions(result(broken["kernels"], machine=other_cpu), BASE, 0.15))


def test_a_missing_kernel_fails_but_quick_runs_cover_a_subset():
    partial = result([kernel("rms_norm", 5.0, 1.5)])
    assert any("swiglu" in f and "not measured" in f for f in bench.regressions(partial, BASE, 0.15))
    assert bench.regressions(result([kernel("rms_norm", 5.0, 1.5)], quick=True), BASE, 0.15) == []


def test_another_cpu_is_not_compared():
    other = result([kernel("rms_norm", 1.0, 0.5), kernel("swiglu", 1.0, 0.5)],
                   machine=dict(MACHINE, path_flags=["avx2", "avx512f", "amx_bf16"]))
    assert "amx_bf16" in bench.comparable(other, BASE)
    assert bench.regressions(other, BASE, 0.15) == []


def test_reports_markdown_and_non_empty_plots(tmp_path):
    paths = bench.write_outputs(BASE, tmp_path)
    assert {p.name for p in paths} == {"bench.json", "bench.md", "speedup.png", "roofline.png"}
    for p in paths:
        assert p.stat().st_size > 0
    for png in ("speedup.png", "roofline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / png).stat().st_size > 5000
    md = (tmp_path / "bench.md").read_text()
    assert "| rms_norm[default] | 64x64 | bf16 |" in md and "5.00x" in md and "Training step: 2.00x" in md
    assert "| 12.5 / 50.0 / 25.0 |" in md and "| aurakernel | 100 | 10 | 20.00% | 300 |" in md
    assert "calibrated rates (20.0 GB/s streamed, STREAM's copy)" in md   # the roofline column's denominator
    assert json.loads((tmp_path / "bench.json").read_text()) == BASE


def test_roofline_points_are_attained_gflops_under_the_slope_or_the_matmul_peak():
    streaming = kernel("rms_norm", 5.0, 1.5)                    # 40% of 20 GB/s at 0.5 FLOP/B
    gemm = dict(kernel("linear_cross_entropy", 1.3, 1.0), intensity=1000.0, roofline_pct=5.0)
    (a, b) = bench.roofline_points(result([streaming, gemm]), [streaming, gemm])
    assert a["gflops"] == pytest.approx(4.0) and a["roof_pct"] == pytest.approx(40.0)
    # 5% of 20 GB/s at 1000 FLOP/B: 1000 GFLOP/s, half of the 2 TFLOP/s bf16 peak (below the slope's 20000)
    assert b["gflops"] == pytest.approx(1000.0) and b["roof_pct"] == pytest.approx(50.0)
    assert bench.roofline_points(result([streaming], machine={"cpu": "old", "cores": 2}), [streaming]) == []
    # an update in place beats the copy's slope: placed at the GB/s it attained, above the slope
    adamw = dict(kernel("adamw", 3.0, 1.3), dtype="fp32", roofline_pct=95.0, attained_gbps=28.0, intensity=0.25)
    (c,) = bench.roofline_points(result([adamw]), [adamw])
    assert c["gflops"] == pytest.approx(7.0) and c["roof_pct"] == pytest.approx(140.0)


def test_matmul_work_is_placed_against_the_compute_roof_in_the_table_and_the_plot():
    """A GEMM-class kernel moves little memory for its FLOPs: its roofline is the share of the
    arithmetic it waits on (the faster of its dtype's matmul peak and the FMA probe), not the 2% of
    the memory floor; a streaming kernel keeps its traffic share."""
    streaming = dict(kernel("rms_norm", 5.0, 1.5), dtype="fp32")          # 4 GFLOP/s: the traffic's 40% is larger
    gemm = dict(kernel("linear", 1.1, 0.9), dtype="fp32", intensity=500.0, roofline_pct=2.0)   # 200 GFLOP/s
    def rows(md):
        return {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| linear") or
                line.startswith("| rms_norm")}
    md = bench.markdown(result([streaming, gemm]))
    assert "| 50% |" in rows(md)["linear[default]"]      # of the 0.4 TFLOP/s fp32 matmul peak
    assert "| 40% |" in rows(md)["rms_norm[default]"]
    assert "fp32 400 GFLOP/s" in md
    fma = dict(MACHINE, fma_tflops={"fp32": 0.8})   # the FMA probe above the matmul peak: the roof
    assert "| 25% |" in rows(bench.markdown(result([streaming, gemm], machine=fma)))["linear[default]"]
    _, g = bench.roofline_points(result([streaming, gemm], machine=fma), [streaming, gemm])
    assert g["gflops"] == pytest.approx(200.0) and g["roof_pct"] == pytest.approx(25.0)


def test_the_roofline_draws_the_measured_fma_roof_above_the_matmul_peaks(tmp_path, monkeypatch):
    """The plot's roofs: a line per matmul peak and, where the calibration measured it, the fp32 FMA
    roof; a calibration from before the probe draws the peaks alone."""
    import matplotlib.axes

    lines = []
    real_axhline = matplotlib.axes.Axes.axhline
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", lambda ax, y, **kw: lines.append(y) or real_axhline(ax, y, **kw))
    rows = [kernel("rms_norm", 5.0, 1.5)]
    from aurakernel.bench.report import roofline_plot

    roofline_plot(result(rows, machine=dict(MACHINE, fma_tflops={"fp32": 3.0})), rows, tmp_path / "r.png")
    assert sorted(lines) == [400.0, 2000.0, 3000.0]   # GFLOP/s: fp32 and bf16 matmul peaks, the FMA roof
    lines.clear()
    roofline_plot(result(rows), rows, tmp_path / "r2.png")   # a calibration from before the probe
    assert sorted(lines) == [400.0, 2000.0]


def test_matmul_class_operators_run_in_fp32_where_bf16_has_no_fast_path(tmp_path):
    import dataclasses

    from aurakernel.hardware import load_profile

    host = load_profile("host")
    avx2 = dataclasses.replace(host, peak_tflops={"fp32": 0.1, "bf16": 0.0013, "fp16": 0.0013})
    amx = dataclasses.replace(host, peak_tflops={"fp32": 0.2, "bf16": 1.5, "fp16": 1.5})
    dtypes = {p.describe(): p.dtype.value for p in bench.bench_problems(False, None, avx2)}
    fp32 = sorted(d.split()[0] for d, t in dtypes.items() if t == "fp32")
    assert fp32 == ["adamw", "block_linear", "grouped_linear", "indexer_score", "indexer_score[causal]", "linear",
                    "linear_cross_entropy", "sparse_attention[csa]",
                    "sparse_attention[hca]", "sparse_attention[sliding]"]   # adamw and the linears take fp32 only
    assert all(p.dtype.value == "bf16" for p in bench.bench_problems(False, None, amx)
               if p.op not in ("adamw", "linear", "grouped_linear", "block_linear"))
    md = bench.markdown(result([kernel("rms_norm", 5.0, 1.5)], machine=dict(MACHINE, peak_tflops=avx2.peak_tflops)))
    assert "no fast bf16 matmul path (bf16 1.3 GFLOP/s against fp32's 100)" in md
    assert "no fast bf16" not in bench.markdown(BASE)


def test_a_directory_of_baselines_gives_each_machine_its_own(tmp_path):
    other = dict(MACHINE, cpu="Other CPU", path_flags=["avx2"])
    assert bench.machine_slug(MACHINE) == "test-cpu-2c-avx2-avx512f"
    assert bench.machine_slug(other) != bench.machine_slug(MACHINE)
    (tmp_path / f"{bench.machine_slug(other)}.json").write_text(json.dumps(result([kernel("swiglu", 9.0, 9.0)], machine=other)))
    base, why = bench.load_baseline(tmp_path, MACHINE)           # none recorded for this machine: no error
    assert base is None and "no baseline for this machine (test-cpu-2c-avx2-avx512f.json" in why
    assert bench.machine_slug(other) in why and "--update-baseline" in why
    assert bench.baseline_path(tmp_path, MACHINE) == tmp_path / "test-cpu-2c-avx2-avx512f.json"   # where an update writes
    bench.baseline_path(tmp_path, MACHINE).write_text(json.dumps(BASE))
    base, why = bench.load_baseline(tmp_path, MACHINE)
    assert why is None and base["kernels"] == BASE["kernels"] and bench.comparable(result([]), base) is None
    base, why = bench.load_baseline(tmp_path, other)
    assert why is None and base["kernels"][0]["speedup_vs_eager"] == 9.0
    single = tmp_path / f"{bench.machine_slug(other)}.json"       # a file is used as given, whatever its machine
    assert bench.baseline_path(single, MACHINE) == single and bench.load_baseline(single, MACHINE)[0]["machine"] == other


def test_bad_baseline_is_one_line_exit_2(tmp_path, capsys):
    """Each refused before any kernel runs, in one line (the CLI's main, in process: the console
    script's exit codes are test_cli's)."""
    from aurakernel.cli import main

    (tmp_path / "bad.json").write_text("{\"kernels\": 3}")
    for args, fragment in (([f"--baseline={tmp_path / 'none.json'}"], "does not exist"),
                           ([f"--baseline={tmp_path / 'bad.json'}"], "not a schema-1 bench result"),
                           (["--max-regression", "1.5"], "--max-regression")):
        assert main(["bench", "--quick", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fragment in err and "Traceback" not in err, err


QUICK_RUN_OPS = ("rms_norm", "adamw")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One real `aurakernel bench --quick` run against a baseline that it must beat, on two of its
    operators (a row-wise one and the elementwise optimizer), without the training step: .ci/run gates
    the whole quick suite, training step included, right after the tests."""
    out = tmp_path_factory.mktemp("bench")
    baseline = copy.deepcopy(BASE)
    baseline["machine"] = bench.machine_info()
    baseline["kernels"], baseline["train_step"] = [], None   # nothing to regress against but verification
    baselines = out / "baselines"                             # this machine's baseline beside another's
    baselines.mkdir()
    (baselines / f"{bench.machine_slug(baseline['machine'])}.json").write_text(json.dumps(baseline))
    (baselines / "other-cpu-2c-avx2.json").write_text(json.dumps(BASE))
    proc = subprocess.run([sys.executable, "-m", "aurakernel.cli", "bench", "--quick", "--no-compiled", "--json",
                           "--ops", ",".join(QUICK_RUN_OPS), "--no-train", "--out", str(out / "report"),
                           "--baseline", str(baselines)],
                          capture_output=True, text=True, timeout=900)
    return proc, out


def test_quick_suite_json_schema(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["schema"] == bench.SCHEMA and d["quick"] is True
    assert set(d["machine"]) >= {"cpu", "cores", "path_flags"} and set(d["versions"]) >= {"torch", "transformers"}
    assert {k["op"] for k in d["kernels"]} == set(QUICK_RUN_OPS) and set(QUICK_RUN_OPS) <= set(bench.QUICK_OPS)
    for k in d["kernels"]:
        assert set(k) >= set(bench.KERNEL_KEYS)
        assert k["verified"] is True and k["speedup_vs_eager"] > 0 and k["roofline_pct"] > 0   # >100: cache-resident
        assert set(k["peak_mib"]) == {"eager", "aurakernel"} and min(k["peak_mib"].values()) > 0
    assert d["train_step"] is None                    # --no-train
    assert "not compared" not in proc.stderr          # this machine's baseline was the one compared with
    assert (out / "report" / "speedup.png").stat().st_size > 0


def test_combined_runs_report_medians_and_a_baseline_keeps_the_lowest():
    runs = [result([kernel("rms_norm", v, 1.0 + v / 10)], train=(t, 1.2)) for v, t in ((5.0, 2.0), (4.0, 2.2), (6.0, 1.9))]
    runs[1]["kernels"][0]["verified"] = False
    med, low = bench.combine(runs), bench.combine(runs, envelope=True)
    assert med["kernels"][0]["speedup_vs_eager"] == 5.0 and low["kernels"][0]["speedup_vs_eager"] == 4.0
    assert low["train_step"]["speedup_vs_eager"] == 1.9 and med["train_step"]["speedup_vs_eager"] == 2.0
    assert med["kernels"][0]["verified"] is False and med["runs"] == 3


def test_compare_caps_calls_that_take_minutes(monkeypatch):
    """A candidate whose call takes minutes (eager dense bf16 attention on an AVX2 CPU) is called
    twice, a warm-up and one round, not the eight calls of a normal measurement; candidates of
    milliseconds still get every warm-up and their rounds. A fake clock stands in for the calls' time."""
    from aurakernel import measure

    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    calls = {"slow": 0, "fast": 0}

    def call(name, seconds):
        def fn():
            calls[name] += 1
            clock[0] += seconds
        return fn

    timings = measure.compare({"slow": call("slow", 120.0), "fast": call("fast", 0.01)}, max_s=60.0)
    assert calls == {"slow": 2, "fast": 2}
    assert timings["slow"].median_s == pytest.approx(120.0) and len(timings["fast"].samples) == 1
    calls.update(slow=0, fast=0)
    timings = measure.compare({"fast": call("fast", 0.01)}, max_s=60.0)
    assert calls["fast"] == 2 + 1 + len(timings["fast"].samples) and len(timings["fast"].samples) >= 5
