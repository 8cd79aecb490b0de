"""`tune --candidates N` on the host: the planner's N best tilings built, verified and timed side by
side; the fastest verified one is kept, recorded and swapped, never one that failed verification."""

from __future__ import annotations

import json

import pytest
import torch

from aurakernel import agent
from aurakernel.db import TuningDB
from aurakernel.hardware import host_profile
from aurakernel.ops import OPS
from aurakernel.targets.host import target as host_target
from aurakernel.targets.host.build import build_kernel
from aurakernel.targets.host.candidates import Candidate, runners_up
from aurakernel.targets.host.ops import kernel_of

SPEC = OPS["rms_norm"]
PROBLEM = SPEC.problem("256x1024", "bf16", "weighted")


def _ranked(n):
    hw = host_profile()
    model = kernel_of(SPEC).tiling_problem(PROBLEM, hw)
    pick = {k: host_target.TARGET.plan(SPEC, PROBLEM, hw, target="host").knobs[k] for k in model.domains}
    return [Candidate(pick, model.evaluate(pick)[0] * 1e6), *runners_up(model, pick, n - 1)]


def _tune(tmp_path, monkeypatch, fake_us, fail=None):
    """tune_problem with 3 candidates; the side-by-side times are `fake_us` (in the model's order) and
    candidate `fail` (an index) fails its verification."""
    real = host_target.build_and_verify

    def build_and_verify(spec, problem, cand, hw):
        real(spec, problem, cand, hw)
        if fail is not None and cand.knobs == _ranked(3)[fail].knobs:
            cand.failed = "FAILED 1/6 checks; first: y outside tolerance"
            cand.verification.passed = False

    monkeypatch.setattr(host_target, "build_and_verify", build_and_verify)
    us_of = {build_kernel(SPEC, PROBLEM, c.knobs).source_hash: us for c, us in zip(_ranked(3), fake_us)}
    monkeypatch.setattr(host_target, "time_side_by_side",
                        lambda spec, problem, hashes, threads: {k: us_of[h] for k, h in hashes.items()})
    return agent.tune_problem(SPEC, PROBLEM, host_profile(), target="host", solver="highs",
                              db=TuningDB(tmp_path / "t.sqlite"), with_compiled=False, candidates=3)


def test_the_fastest_of_the_planners_best_is_kept_and_recorded(tmp_path, monkeypatch):
    ranked = _ranked(3)
    assert len({tuple(c.knobs.items()) for c in ranked}) == 3
    assert [c.predicted_us for c in ranked] == sorted(c.predicted_us for c in ranked)   # the pick first
    result = _tune(tmp_path, monkeypatch, fake_us=[30.0, 20.0, 10.0])
    assert result.status == "ok" and result.verified
    third = ranked[2].knobs
    assert {k: result.plan.knobs[k] for k in third} == third
    assert result.source_hash == build_kernel(SPEC, PROBLEM, third).source_hash
    assert result.plan.binding_constraint.startswith("measured: the fastest of the planner's 3 best")
    assert result.plan.predicted_us == pytest.approx(ranked[2].predicted_us)
    assert any(r.startswith("timed the planner's 3 best tilings") and "10 us" in r for r in result.reasons)
    best = TuningDB(tmp_path / "t.sqlite").best("rms_norm", "weighted", PROBLEM.shape_text, "bf16", "host")
    assert best is not None and json.loads(best["plan"])["knobs"] == result.plan.knobs


def test_the_pick_stays_when_it_is_fastest_and_a_failed_candidate_is_never_kept(tmp_path, monkeypatch):
    ranked = _ranked(3)
    result = _tune(tmp_path, monkeypatch, fake_us=[15.0, 1.0, 20.0], fail=1)   # the "fastest" failed
    assert result.status == "ok" and result.verified
    assert {k: result.plan.knobs[k] for k in ranked[0].knobs} == ranked[0].knobs
    assert result.source_hash == build_kernel(SPEC, PROBLEM, ranked[0].knobs).source_hash
    assert not result.plan.binding_constraint.startswith("measured")
    line = next(r for r in result.reasons if r.startswith("timed the planner's 3 best tilings"))
    assert "FAILED 1/6 checks" in line and "15 us" in line and "20 us" in line


def test_a_fused_kernel_is_timed_against_its_parts_kernels_on_the_same_inputs(monkeypatch):
    """autotune's fused-or-apart decision: mhc_post_pre's kernel and mhc_post's then mhc_pre's kernels
    (not the reference), fwd + bwd through the same module on the same inputs, in one comparison;
    both give the same gradients."""
    from types import SimpleNamespace

    from aurakernel.targets.host import candidates, library

    hw = host_profile()
    hashes = {}
    for op in ("mhc_post_pre", "mhc_post", "mhc_pre"):
        spec, problem = OPS[op], OPS[op].problem("45x4x256", "fp32")
        hashes[op] = build_kernel(spec, problem, host_target.TARGET.plan(spec, problem, hw, target="host").knobs).source_hash
    called, real_call = [], library.Kernel.call

    def call(self, name, *args):
        called.append(self.source_hash)
        return real_call(self, name, *args)

    def compare(steps, threads):
        runs = {}
        for name, step in steps.items():
            called.clear()
            runs[name] = (step(), set(called))
        ran["grads"] = {name: grads for name, (grads, _) in runs.items()}
        ran["kernels"] = {name: kernels for name, (_, kernels) in runs.items()}
        return {"fused": SimpleNamespace(us=1.0), "apart": SimpleNamespace(us=2.0)}

    ran = {}
    monkeypatch.setattr(library.Kernel, "call", call)
    monkeypatch.setattr(candidates, "compare", compare)
    spec = OPS["mhc_post_pre"]
    times = host_target.TARGET.time_fused_against_apart(
        spec, spec.problem("45x4x256", "fp32"), hashes["mhc_post_pre"],
        {op: hashes[op] for op in spec.fuses}, hw)
    assert times == {"fused": 1.0, "apart": 2.0}
    assert ran["kernels"] == {"fused": {hashes["mhc_post_pre"]}, "apart": {hashes["mhc_post"], hashes["mhc_pre"]}}
    for fused, apart in zip(ran["grads"]["fused"], ran["grads"]["apart"], strict=True):
        assert fused is not None and apart is not None
        assert torch.allclose(fused, apart, rtol=1e-4, atol=1e-4)
    with pytest.raises(NotImplementedError, match="fuses no operators"):
        from aurakernel.patch.deepseek_v4 import patch_of
        patch_of(OPS["mhc_post"]).patch_parts(torch.nn.Module(), {})


def test_tune_times_every_value_of_a_knob_the_model_cannot_rank_and_keeps_the_fastest(tmp_path, monkeypatch):
    """swiglu bf16's `lookup` (which directions look silu up in a table): all four builds verified,
    timed side by side with the plan's, the fastest kept in the plan, the DB and the swap's checks;
    the built kernel has the table entries its value says and only those."""
    from aurakernel.swap import _knobs_refused

    spec = OPS["swiglu"]
    problem = spec.problem("200x512", "bf16")
    hw = host_profile()
    assert kernel_of(spec).measured_knobs(problem) == ("lookup",)
    assert kernel_of(spec).measured_knobs(spec.problem("200x512", "fp32")) == ()
    planned = host_target.TARGET.plan(spec, problem, hw, target="host").knobs
    hash_of = {v: build_kernel(spec, problem, {**planned, "lookup": v}).source_hash for v in range(4)}
    for v in range(4):
        kernel = build_kernel(spec, problem, {**planned, "lookup": v})
        assert (kernel.has("fwd_table"), kernel.has("bwd_table")) == (bool(v & 1), bool(v & 2))
    fake_us = {0: 30.0, 1: 10.0, 2: 40.0, 3: 20.0}
    timed = []

    def time_side_by_side(spec_, problem_, hashes, threads):
        timed.append(sorted(hashes.values()))
        return {name: fake_us[next(v for v, h in hash_of.items() if h == hsh)] for name, hsh in hashes.items()}

    monkeypatch.setattr(host_target, "time_side_by_side", time_side_by_side)
    result = agent.tune_problem(spec, problem, hw, target="host", solver="highs", db=TuningDB(tmp_path / "t.sqlite"),
                                with_compiled=False)
    assert timed == [sorted(hash_of.values())]   # the four in one comparison
    assert result.status == "ok" and result.verified
    assert result.plan.knobs["lookup"] == 1 and result.source_hash == hash_of[1]
    assert result.plan.binding_constraint.startswith("measured: the fastest value of lookup")
    line = next(r for r in result.reasons if r.startswith("timed every value of lookup"))
    assert all(f"lookup={v}" in line for v in range(4)) and "10 us" in line
    best = TuningDB(tmp_path / "t.sqlite").best("swiglu", "default", problem.shape_text, "bf16", "host")
    assert json.loads(best["plan"])["knobs"]["lookup"] == 1
    assert _knobs_refused(spec, problem, result.plan.knobs, hw) is None


@pytest.mark.parametrize("timings,status", [([(3.0, 2.0), (1.0, 2.0)], "ok"), ([(3.0, 2.0), (2.5, 2.0)], "slower")])
def test_a_kernel_is_dropped_as_slower_only_when_a_second_timing_agrees(timings, status, tmp_path, monkeypatch):
    """One side-by-side timing that finds the kernel slower than eager is taken again; the kernel is
    kept when the second finds it faster, dropped (slower, with both sides' times) when it agrees."""
    calls = iter(timings)
    monkeypatch.setattr(host_target, "measure_problem",
                        lambda *a, **k: (dict(zip(("aurakernel", "eager"), next(calls))), {}, {}))
    result = agent.tune_problem(SPEC, PROBLEM, host_profile(), target="host", solver="highs",
                                db=TuningDB(tmp_path / "t.sqlite"), with_compiled=False)
    assert next(calls, None) is None   # both timings were taken
    assert result.status == status
    better = min(timings, key=lambda t: t[0] / t[1])
    assert (result.measured_us, result.eager_us) == better
    assert ("not faster than eager (2.5 us vs 2.0 us)" in result.reasons) == (status == "slower")
