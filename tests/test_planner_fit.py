"""calibrate --fit (planner/fit.py) and `aurakernel bench search-quality` (aurakernel/bench/search_quality.py)."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from aurakernel.cli import main
from aurakernel.db import Record, TuningDB
from aurakernel.errors import UserError
from aurakernel.ops import OPS
from aurakernel.planner import fit
from conftest import FIXED_CALIBRATION
from aurakernel.targets.host.ops import kernel_of as host_kernel

TRUE_HOST = {"dram_time_scale": 1.4, "l2_time_scale": 1.0, "vector_cycles_per_elem": 0.6,
             "chunk_overhead_cycles": 30.0, "tile_overhead_ns": 90.0, "phase_overhead_us": 25.0}
# small shapes that put each pipe (DRAM, vector, per-tile and per-phase overheads) in charge somewhere
HOST_PROBLEMS = (("rms_norm", "weighted", "512x1024", "fp32"), ("rms_norm", "unweighted", "2048x256", "bf16"),
                 ("rms_norm", "weighted", "64x4096", "bf16"), ("rms_norm", "weighted", "32x128", "fp32"),
                 ("swiglu", "default", "1024x512", "fp32"))


def synthetic_db(path, hw, coefficients, noise=0.02, per_problem=8, seed=0) -> TuningDB:
    """Records whose measured times are the cost model's at `coefficients`, times (1 + noise)."""
    rng = random.Random(seed)
    truth = dataclasses.replace(hw, costmodel={**hw.costmodel, **coefficients})
    db = TuningDB(path)
    for n, (op, variant, shape, dtype) in enumerate(HOST_PROBLEMS):
        spec = OPS[op]
        problem = spec.problem(shape, dtype, variant)
        model = host_kernel(spec).tiling_problem(problem, truth)
        for i, choice in enumerate(rng.sample(fit.feasible_choices(model), per_problem)):
            t = model.evaluate(choice)[0] * (1 + rng.gauss(0, noise))
            db.add(Record(op, variant, problem.shape_text, dtype, "host", f"synthetic-{n}-{i}", "test",
                          {"knobs": choice}, None, t * 1e6, None, None, True, "measured", {}))
    return db


def test_nnls_is_the_non_negative_least_squares_optimum():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(30, 4)), rng.normal(size=30)
    x = fit.nnls(a, b)
    assert (x >= 0).all()
    # KKT: zero gradient on the support, a gradient that only pushes below zero off it
    grad = a.T @ (a @ x - b)
    assert np.allclose(grad[x > 0], 0, atol=1e-8) and (grad[x == 0] >= -1e-8).all()


def test_fit_recovers_known_host_coefficients(tmp_path, host):
    db = synthetic_db(tmp_path / "synthetic.sqlite", host, TRUE_HOST)
    report = fit.fit_host(db.path, hw=host, write=False)
    assert report.records == len(HOST_PROBLEMS) * 8 and report.skipped == {}
    for name, want in TRUE_HOST.items():
        assert report.after[name] == pytest.approx(want, rel=0.15), name
    assert report.median_rel_err_after < 0.03 < report.median_rel_err_before


def test_rank_correlation_improves_on_a_mis_set_model(tmp_path, host):
    # the caches decide the feasible choices, and with them how well a mis-set model ranks: a machine of
    # its own (2 cores, AVX2, 512 KB of L2 a core), whichever runs the test (a 1 MB L2 ranked 0.79 after)
    host = dataclasses.replace(host, cores=2, simd_bytes=32, memory={
        **host.memory, "L2": dataclasses.replace(host.memory["L2"], capacity=512 * 1024, per_core=True)})
    mis_set = dataclasses.replace(host, costmodel={**host.costmodel, "vector_cycles_per_elem": 4.0,
                                                   "dram_time_scale": 0.1, "chunk_overhead_cycles": 0.5,
                                                   "tile_overhead_ns": 2000.0})
    db = synthetic_db(tmp_path / "synthetic.sqlite", host, TRUE_HOST, seed=1)
    report = fit.fit_host(db.path, hw=mis_set, write=False)
    assert report.before["vector_cycles_per_elem"] == 4.0 and report.problems_ranked == len(HOST_PROBLEMS)
    # across problems size carries the ranking; within one (what the MILP's pick rests on) the mis-set model
    # ranks poorly (how poorly depends on the machine's caches, which decide the feasible choices) and the fit
    # mends it
    assert report.spearman_within_after > 0.8 and report.spearman_after > 0.98 and report.spearman_cv > 0.98
    assert report.spearman_within_after > report.spearman_within_before + 0.05
    assert report.spearman_after > report.spearman_before + 0.02
    # the DRAM pipe bounds no record at the mis-set start: the fit still finds its true scale
    assert report.after["dram_time_scale"] == pytest.approx(TRUE_HOST["dram_time_scale"], rel=0.1)


def test_fitted_host_coefficients_reach_the_planner(tmp_path, monkeypatch, host):
    from aurakernel.hardware import calibration_path, host_profile

    monkeypatch.setenv("AURAKERNEL_CACHE_DIR", str(tmp_path / "cache"))   # keep the session's calibration
    calibration_path().write_text(json.dumps(FIXED_CALIBRATION))
    db = synthetic_db(tmp_path / "synthetic.sqlite", host, TRUE_HOST)
    report = fit.fit_host(db.path, write=True)
    stored = json.loads(calibration_path().read_text())
    assert stored["costmodel"] == report.after and stored["costmodel_fit"]["records"] == report.records
    fitted = host_profile()
    assert {k: fitted.costmodel[k] for k in TRUE_HOST} == report.after
    spec = OPS["rms_norm"]
    problem = spec.problem("32x128", "fp32", "weighted")
    choice = fit.feasible_choices(host_kernel(spec).tiling_problem(problem, host))[0]

    def predicted(hw, **coefficients) -> float:
        hw = dataclasses.replace(hw, costmodel={**hw.costmodel, **coefficients})
        return host_kernel(spec).tiling_problem(problem, hw).evaluate(choice)[0]

    # the planner prices with the fitted coefficients (and only those changed), whatever machine this is
    assert predicted(fitted) == pytest.approx(predicted(host, **report.after), rel=1e-9)
    assert predicted(fitted) != pytest.approx(predicted(host), rel=1e-3)
    # the fitted per-phase cost is charged once per phase (forward and backward)
    later = report.after["phase_overhead_us"] + 10.0
    assert predicted(fitted, phase_overhead_us=later) - predicted(fitted) == pytest.approx(2 * 10e-6, rel=1e-6)


def test_recalibrating_keeps_the_fitted_coefficients(tmp_path, monkeypatch):
    from aurakernel import calibrate
    from aurakernel.hardware import load_calibration, save_calibration

    monkeypatch.setenv("AURAKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    fitted = {"phase_overhead_us": 42.0, "dram_time_scale": 0.9}
    save_calibration({**FIXED_CALIBRATION, "costmodel": fitted, "costmodel_fit": {"records": 20}})
    for probe, value in (("_stream_runs", [11.0] * 5), ("_inplace_runs", [15.0] * 5), ("fork_overhead_us", 2.5), ("call_overhead_us", 0.5),
                         ("matmul_tflops", 0.3)):   # the probes themselves take a minute: stand-ins
        monkeypatch.setattr(calibrate, probe, lambda *a, value=value, **k: value)
    calibrate.calibrate()
    cal = load_calibration()
    assert cal["fork_overhead_us"] == 2.5 and cal["costmodel"] == fitted and cal["costmodel_fit"] == {"records": 20}


def test_too_few_records_says_how_many_and_how_to_get_them(tmp_path, host, capsys):
    db = TuningDB(tmp_path / "few.sqlite")
    synthetic = synthetic_db(tmp_path / "synthetic.sqlite", host, TRUE_HOST, per_problem=1)
    for _, r in synthetic.frame().head(3).iterrows():
        db.add(Record(r["op"], r["variant"], r["shape"], r["dtype"], "host", r["source_hash"], "test",
                      json.loads(r["plan"]), None, r["measured_us"], None, None, True, "ok", {}))
    with pytest.raises(UserError, match=r"at least 12 .* it has 3: .*aurakernel tune"):
        fit.fit_host(db.path, hw=host, write=False)
    assert main(["calibrate", "--fit", "--db", str(tmp_path / "none.sqlite")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "it has 0" in err and "bench search-quality" in err


def synthetic_ascend_samples(hw, scales, per_op=3, seed=0) -> list[fit.AscendSample]:
    """Emulator-like samples from the planner's own model at `scales`: per-pipe busy cycles and a
    cycle estimate per phase (the planner's time less the launch the emulator does not model)."""
    from aurakernel.targets import ascend

    rng = random.Random(seed)
    truth = dataclasses.replace(hw, costmodel={**hw.costmodel, **scales})
    clock, launch = hw.clock_ghz * 1e9, hw.call_overhead_us * 1e-6
    samples = []
    for name in ("rms_norm", "swiglu", "cross_entropy", "adamw"):
        spec = OPS[name]
        problem = fit.calibration_problem(spec, hw)
        model = ascend.model(spec, problem, truth)
        for choice in rng.sample(fit.feasible_choices(model), per_op):
            phases = {}
            for phase, pipes in model.evaluate(choice)[1].items():
                # (the fit reads pipe counters of double-buffered runs only: single-buffered, the
                # planner has no separate pipe terms, and these are zero)
                busy = {p: pipes[p] * clock for p in ("MTE2", "MTE3", "Vector")}
                top = max(v for k, v in pipes.items() if k != "overhead")
                phases[phase] = {"cycles": (top + pipes["overhead"] - launch) * clock, "busy": {**busy, "Scalar": 0.0}}
            samples.append(fit.AscendSample(problem.op, problem.variant, problem.shape_text, problem.dtype.value,
                                            choice, phases))
    return samples


def test_ascend_fit_recovers_scales_and_the_overlay_reaches_the_planner_only(tmp_path, monkeypatch):
    from aurakernel import emulator
    from aurakernel.targets import ascend
    from aurakernel.hardware import load_profile

    monkeypatch.setenv("AURAKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    hw = load_profile("ascend910b2")
    scales = {"mte_copy_scale": 1.3, "mte_byte_scale": 0.8, "vec_repeat_scale": 1.5, "vec_slow_scale": 2.0,
              "vec_issue_scale": 0.7, "fill_scale": 2.0, "serial_mte_scale": 0.6}
    samples = synthetic_ascend_samples(hw, scales)
    report = fit.fit_ascend("ascend910b2", samples, write=True)
    for name, want in scales.items():
        assert report.after[name] == pytest.approx(want, rel=0.05), name
    assert report.spearman_after >= report.spearman_before and report.median_rel_err_after < 1e-3
    fitted = load_profile("ascend910b2")
    assert {k: fitted.costmodel[k] for k in scales} == report.after
    assert emulator.pipe_defines(fitted) == emulator.pipe_defines(hw)   # the emulator keeps its figures
    spec = OPS["rms_norm"]
    problem = fit.calibration_problem(spec, hw)
    choice = samples[0].knobs
    truth = dataclasses.replace(hw, costmodel={**hw.costmodel, **scales})
    assert ascend.model(spec, problem, fitted).evaluate(choice)[0] == pytest.approx(
        ascend.model(spec, problem, truth).evaluate(choice)[0], rel=0.01)
    with pytest.raises(UserError, match="at least 10 emulator samples"):
        fit.fit_ascend("ascend910b2", samples[:4], write=False)


# --- bench search-quality ------------------------------------------------------------------------

def test_search_quality_shapes_and_sampling():
    from aurakernel.bench import search_quality as sq

    for name, spec in OPS.items():
        shapes = sq.shapes(spec, spec.variants[0])
        assert len(shapes) == 3 and shapes[0] == tuple(spec.default_shape_for(spec.variants[0])), name
    space = [{"a": i} for i in range(40)]
    picked = sq._sample(space, {"a": 17}, 5, "seed")
    assert picked[0] == {"a": 17} and len(picked) == 5 and len({c["a"] for c in picked}) == 5
    assert picked == sq._sample(space, {"a": 17}, 5, "seed")
    assert sq._sample(space[:3], {"a": 1}, 5, "seed") == [{"a": 1}, {"a": 0}, {"a": 2}]


def test_search_quality_one_small_problem(tmp_path):
    from aurakernel.bench import search_quality as sq

    db = TuningDB(tmp_path / "tuning.sqlite")
    problem = OPS["rms_norm"].problem("64x256", "fp32", "weighted")
    result = sq.run(problem_list=[problem], max_candidates=3, db=db)
    assert set(sq.SUMMARY_KEYS) <= set(result) and len(result["rows"]) == 1
    row = result["rows"][0]
    assert set(sq.ROW_KEYS) <= set(row)
    assert row["failed"] == [] and row["candidates_measured"] == 3 and row["space_size"] > 3
    assert row["pick_rank"] is not None and 1 <= row["pick_rank"] <= 3   # the pick was among those measured
    assert row["pick_over_best"] >= 1.0 and result["pick_over_best_max"] == row["pick_over_best"]
    assert row["exhaustive_estimated"] and row["exhaustive_s"] > row["tune_s"] > row["solve_s"] > 0
    assert row["noise"] >= 1.0
    recorded = db.frame()
    assert len(recorded) == 3 and set(recorded["status"]) == {"measured"}
    assert row["pick_knobs"] in [json.loads(p)["knobs"] for p in recorded["plan"]]


def test_bench_suite_argument_keeps_the_kernels_options_apart(capsys):
    from aurakernel.bench import search_quality as sq

    for args, message in ((["bench", "search-quality", "--quick"], "--quick: option(s) of the kernels suite"),
                          (["bench", "--max-candidates", "3"], "--max-candidates: option(s) of `aurakernel bench "
                                                               "search-quality`"),
                          (["bench", "speed"], "unknown benchmark suite 'speed'")):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, args
    with pytest.raises(UserError, match="--shapes-per-op 4: accepted is 1 to 3"):
        sq.check_options(4, 16)
    with pytest.raises(UserError, match="--max-candidates 1: accepted is 2 or more"):
        sq.check_options(3, 1)


def test_search_quality_times_an_optimizer_step_too():
    """adamw is an optimizer, not a module: its candidates are timed as FusedAdamW steps."""
    from aurakernel.bench import search_quality as sq

    result = sq.run(problem_list=[OPS["adamw"].problem("65536", "fp32")], max_candidates=2)
    (row,) = result["rows"]
    assert row["failed"] == [] and row["candidates_measured"] == 2 and row["pick_over_best"] >= 1.0


def test_a_fit_that_ranks_the_records_worse_is_not_adopted(tmp_path, monkeypatch, host):
    """The fit is written only where it ranks the measured records no worse than the coefficients in use
    (in sample, cross-validated, within a problem): a worse one leaves the calibration as it was and
    says why; a record whose model is not linear in the coefficients is left out, not a crash."""
    from aurakernel.hardware import calibration_path

    monkeypatch.setenv("AURAKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    calibration_path().write_text(json.dumps(FIXED_CALIBRATION))
    before = calibration_path().read_text()
    db = synthetic_db(tmp_path / "synthetic.sqlite", host, TRUE_HOST)
    real = fit._fit_report

    def worse_cv(*args, **kwargs):
        report = real(*args, **kwargs)
        return dataclasses.replace(report, spearman_cv=report.spearman_before - 0.05)

    monkeypatch.setattr(fit, "_fit_report", worse_cv)
    report = fit.fit_host(db.path, write=True)
    assert report.path is None and calibration_path().read_text() == before
    assert report.kept_because.startswith("the fit ranks the records worse than the current coefficients (cross-validated")
    monkeypatch.setattr(fit, "_fit_report", real)

    real_decompose, calls = fit.decompose, []

    def nonlinear_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise fit.NonLinear("cost model not linear in its coefficients")
        return real_decompose(*args, **kwargs)

    monkeypatch.setattr(fit, "decompose", nonlinear_first)
    report = fit.fit_host(db.path, write=True)
    assert report.skipped == {"tiling model not linear in the coefficients at this plan": 1}
    assert report.records == len(HOST_PROBLEMS) * 8 - 1
    assert report.kept_because is None and json.loads(calibration_path().read_text())["costmodel"] == report.after
