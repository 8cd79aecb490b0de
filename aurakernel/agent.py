"""The tuning loop: plan -> render -> build -> verify -> measure -> record, for one problem.

A kernel that fails to build or verify, or is not faster than the eager reference, is recorded
with its status and never offered for swapping.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .db import Record, TuningDB
from .dtypes import DType
from .errors import BuildError, PlanInfeasible, UserError
from .hardware import HardwareProfile, free_memory_bytes, load_profile
from .measure import compare
from .ops import OPS, get_op
from .ops.base import OpSpec, Problem
from .paths import default_db_path, write_text_atomic
from .patch.deepseek_v4 import patch_of
from .planfile import KernelPlan, PlanEntry
from .planner import Plan, solve_tiling
from .profiler import ProfileReport, Workload, profile_training
from .targets.host.build import build_kernel
from .targets.host.ops import kernel_of as host_kernel
from .targets.host.target import verify
from .verify import Verification

if TYPE_CHECKING:
    from .targets.ascend import AscendTuneResult


@dataclass
class TuneResult:
    problem: Problem
    target: str
    plan: Plan
    source_hash: str | None
    verification: Verification | None
    measured_us: float | None = None
    eager_us: float | None = None
    compiled_us: float | None = None
    aurakernel_compiled_us: float | None = None   # the kernel inside torch.compile (bench only)
    status: str = "ok"
    reasons: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return bool(self.verification and self.verification.passed)

    @property
    def speedup_vs_eager(self) -> float | None:
        return self.eager_us / self.measured_us if self.eager_us and self.measured_us else None

    @property
    def speedup_vs_compiled(self) -> float | None:
        return self.compiled_us / self.measured_us if self.compiled_us and self.measured_us else None

    @property
    def usable(self) -> bool:
        """Safe and worth swapping in: verified and faster than eager."""
        return self.status == "ok"

    def to_json(self) -> dict:
        p = self.problem
        return {
            "op": p.op, "variant": p.variant, "shape": p.shape_text, "dtype": p.dtype.value, "target": self.target,
            "plan": self.plan.knobs, "binding_constraint": self.plan.binding_constraint,
            "predicted_us": self.plan.predicted_us, "predicted_pipes_us": self.plan.pipes_us,
            "measured_us": self.measured_us, "eager_us": self.eager_us, "compiled_us": self.compiled_us,
            "speedup_vs_eager": self.speedup_vs_eager, "speedup_vs_compiled": self.speedup_vs_compiled,
            "verified": self.verified,
            "verification": self.verification.summary if self.verification else None,
            "solver": self.plan.solver, "solve_s": self.plan.solve_s,
            "source_hash": self.source_hash, "status": self.status, "reasons": self.reasons,
        }


def measure_problem(spec: OpSpec, problem: Problem, kernel_hash: str, *, with_compiled: bool,
                    threads: int, with_compiled_kernel: bool = False) -> tuple[dict[str, float], dict[str, str]]:
    """Median microseconds of eager, torch.compile, the kernel and (with_compiled_kernel) the kernel
    under torch.compile (fwd+bwd), in the same rounds."""
    candidates, notes = patch_of(spec).timing_candidates(problem, kernel_hash, with_compiled, with_compiled_kernel)
    timings = compare(candidates, threads=threads)
    return {name: t.us for name, t in timings.items()}, notes


def check_fits_in_memory(spec: OpSpec, problem: Problem) -> None:
    """Refuse a problem whose tensors cannot all be in this machine's memory before anything runs:
    its forward + backward traffic (the work model's bytes, which touch every tensor once) must fit,
    or tuning would grow until the OOM killer ends it."""
    need = sum(spec.work(problem, backward=b).bytes_moved for b in (False, True))
    free = free_memory_bytes()
    if need > free:
        raise UserError(f"{problem.describe()}: its tensors need about {need / 2**30:,.1f} GiB (forward + backward), "
                        f"this machine has {free / 2**30:,.1f} GiB free: choose a smaller --shape")


def tune(op: str, shape: str | None, dtype: str | None = None, *, variant: str | None = None, target: str = "host",
         solver: str = "highs", db_path=None, with_compiled: bool = True,
         hw: HardwareProfile | None = None, out_dir=None) -> TuneResult | AscendTuneResult:
    """Tune one operator from CLI-style arguments (validated here)."""
    spec = get_op(op)
    problem = spec.problem(shape, dtype, variant)
    check_fits_in_memory(spec, problem)
    hw = hw or load_profile(target)
    if hw.kind == "ascend":   # AscendC: verified and estimated in the emulator, nothing to time here
        from .targets import ascend
        return ascend.tune(spec, problem, hw, target=target, solver=solver, out_dir=out_dir)
    if hw.kind != "host":
        raise UserError(f"target {target!r} is an {hw.kind} profile; kernels can be built for: host, ascend targets")
    return tune_problem(spec, problem, hw, target=target, solver=solver,
                        db=TuningDB(db_path or default_db_path()), with_compiled=with_compiled)


def tune_problem(spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str,
                 db: TuningDB, with_compiled: bool, with_compiled_kernel: bool = False) -> TuneResult:
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, hw), op=problem.op, variant=problem.variant,
                        shape=problem.shape, dtype=problem.dtype.value, target=target, solver=solver)
    result = TuneResult(problem, target, plan, None, None)
    try:
        kernel = build_kernel(spec, problem, plan.knobs)
        result.source_hash = kernel.source_hash
        cases = [(p, build_kernel(spec, p, plan.knobs))
                 for p in host_kernel(spec).verification_problems(problem, plan.knobs, max(hw.simd_bytes // 4, 1))]
    except BuildError as exc:
        result.status, result.reasons = "build_failed", [str(exc).splitlines()[0]]
        _record(db, result, hw, detail={"error": str(exc)[-2000:]})
        return result

    result.verification = verify(spec, cases)
    if not result.verification.passed:
        result.status, result.reasons = "verify_failed", [result.verification.summary]
        _record(db, result, hw)
        return result

    times, notes = measure_problem(spec, problem, kernel.source_hash, with_compiled=with_compiled, threads=hw.cores,
                                   with_compiled_kernel=with_compiled_kernel)
    result.measured_us = times["aurakernel"]
    result.eager_us = times["eager"]
    result.compiled_us = times.get("compiled")
    result.aurakernel_compiled_us = times.get("aurakernel_compiled")
    result.reasons.extend(notes.values())
    if result.measured_us >= result.eager_us:
        result.status = "slower"
        result.reasons.append(f"not faster than eager ({result.measured_us:.1f} us vs {result.eager_us:.1f} us)")
    _record(db, result, hw)
    return result


@dataclass
class AutotuneResult:
    plan: KernelPlan
    profile: ProfileReport
    tuned: list[TuneResult]


def problems_from_profile(report: ProfileReport) -> list[Problem]:
    """One problem per (op, variant, compile-time extents, dtype) seen: the call with the most work
    (largest leading extents) stands for all of them (the kernel takes any leading extents)."""
    found: dict[tuple, Problem] = {}
    for group in report.groups:
        for s in group.shapes:
            spec = OPS[s["op"]]
            problem = Problem(s["op"], s["variant"], tuple(s["shape"]), DType.parse(s["dtype"]))
            key = (problem.op, problem.variant, spec.kernel_key(problem), problem.dtype)
            lead = len(problem.shape) - len(spec.kernel_key(problem))
            size = math.prod(problem.shape[:lead])
            if key not in found or size > math.prod(found[key].shape[:lead]):
                found[key] = problem
    return list(found.values())


def autotune(workload: Workload, *, target: str = "host", solver: str = "highs", db_path=None,
             with_compiled: bool = False, profile_steps: int = 3, progress=None) -> AutotuneResult:
    """Profile the workload's training step, tune every group that has an OpSpec, build the plan."""
    hw = load_profile(target)
    if hw.kind != "host":
        raise UserError(f"target {target!r} is an {hw.kind} profile: autotune builds host kernels here "
                        f"(autotune_ascend writes AscendC projects)")
    db = TuningDB(db_path or default_db_path())
    if progress:
        progress(f"profiling {profile_steps} training steps")
    report = profile_training(workload, steps=profile_steps, hw=hw)
    plan = KernelPlan(target=target, config=workload.config_path, hardware=hw.fingerprint(),
                      profile=[{"name": g.name, "kind": g.kind, "time_us": g.time_us, "share": g.share,
                                "calls": g.calls, "ops": g.ops, "saving_us": g.saving_us, "tunable": g.tunable}
                               for g in report.groups])
    for g in report.groups:
        if g.kind == "fusable" and not g.tunable:
            plan.skipped.append({"op": g.name, "reason": "no OpSpec for this group yet: runs the reference"})
    tuned = []
    for problem in problems_from_profile(report):
        if progress:
            progress(f"tuning {problem.describe()}")
        spec = OPS[problem.op]
        try:
            r = tune_problem(spec, problem, hw, target=target, solver=solver, db=db, with_compiled=with_compiled)
        except PlanInfeasible as exc:
            plan.skipped.append({"op": problem.op, "variant": problem.variant, "shape": problem.shape_text,
                                 "dtype": problem.dtype.value, "reason": str(exc)})
            continue
        tuned.append(r)
        if r.usable:
            plan.kernels.append(PlanEntry(
                op=problem.op, variant=problem.variant, kernel_key=list(spec.kernel_key(problem)),
                dtype=problem.dtype.value, shape=problem.shape_text, knobs=r.plan.knobs,
                source_hash=r.source_hash, predicted_us=r.plan.predicted_us, measured_us=r.measured_us,
                eager_us=r.eager_us, compiled_us=r.compiled_us, binding_constraint=r.plan.binding_constraint))
        else:
            plan.skipped.append({"op": problem.op, "variant": problem.variant, "shape": problem.shape_text,
                                 "dtype": problem.dtype.value, "reason": "; ".join(r.reasons) or r.status})
    return AutotuneResult(plan, report, tuned)


@dataclass
class AscendAutotuneResult:
    projects: list            # AscendTuneResult per problem with an AscendC kernel
    skipped: list[dict]
    profile: ProfileReport

    def to_json(self) -> dict:
        return {"projects": [r.to_json() for r in self.projects], "skipped": self.skipped}


def autotune_ascend(workload: Workload, *, target: str, out_dir, solver: str = "highs", profile_steps: int = 2,
                    progress=None) -> AscendAutotuneResult:
    """The workload's op groups (profiled on the host) planned for an Ascend target: one AscendC op
    project per problem that has an AscendC kernel, under out_dir/<op>_<variant>_<shape>_<dtype>/,
    each verified in the emulator; summary.json lists them and what was skipped, and why."""
    from pathlib import Path

    from .targets import ascend
    hw = load_profile(target)
    if hw.kind != "ascend":
        raise UserError(f"target {target!r} is a {hw.kind} profile: autotune --target takes an Ascend profile here")
    out = Path(out_dir)
    if progress:
        progress(f"profiling {profile_steps} training steps on the host")
    report = profile_training(workload, steps=profile_steps, hw=load_profile("host"))
    projects, skipped = [], []
    for problem in problems_from_profile(report):
        spec = OPS[problem.op]
        where = {"op": problem.op, "variant": problem.variant, "shape": problem.shape_text, "dtype": problem.dtype.value}
        if not ascend.supported(spec):
            skipped.append(where | {"reason": "no AscendC kernel for this operator yet"})
            continue
        if progress:
            progress(f"planning and emulating {problem.describe()}")
        try:
            projects.append(ascend.tune(spec, problem, hw, target=target, solver=solver,
                                         out_dir=out / f"{problem.op}_{problem.variant}_{problem.shape_text}_{problem.dtype.value}"))
        except PlanInfeasible as exc:
            skipped.append(where | {"reason": str(exc)})
        except BuildError as exc:   # one kernel that does not build must not cost the other groups
            skipped.append(where | {"reason": str(exc).splitlines()[0]})
    result = AscendAutotuneResult(projects, skipped, report)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "summary.json", json.dumps(result.to_json(), indent=2, default=str))
    return result


def _record(db: TuningDB, r: TuneResult, hw: HardwareProfile, detail: dict | None = None) -> None:
    detail = dict(detail or {})
    if r.verification is not None:
        detail["verification"] = r.verification.summary
    detail["reasons"] = r.reasons
    db.add(Record(
        op=r.problem.op, variant=r.problem.variant, shape=r.problem.shape_text, dtype=r.problem.dtype.value,
        target=r.target, source_hash=r.source_hash or "-", hardware=hw.fingerprint(), plan=r.plan.to_dict(),
        predicted_us=r.plan.predicted_us, measured_us=r.measured_us, eager_us=r.eager_us,
        compiled_us=r.compiled_us, verified=r.verified, status=r.status, detail=detail,
    ))


