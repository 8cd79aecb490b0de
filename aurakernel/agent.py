"""The tuning loop: plan -> render -> build -> verify -> measure (or estimate) -> record, for one
problem on any target (targets/: looked up by the profile's kind, never branched on), and autotune:
the same loop over every problem a profiled training step poses.

A kernel that fails to build or verify, or is not faster than the eager reference, is recorded
with its status and never offered for swapping.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .concurrency import map_in_order
from .db import Record, TuningDB
from .dtypes import DType
from .errors import BuildError, PlanInfeasible, UserError
from .hardware import HardwareProfile, free_memory_bytes, load_profile
from .ops import OPS, get_op
from .ops.base import OpSpec, Problem
from .paths import default_db_path, write_text_atomic
from .planfile import KernelPlan, PlanEntry
from .profiler import ProfileReport, Workload, profile_training
from .targets import target_for
from .targets.result import TuneResult

__all__ = ["AutotuneResult", "TuneResult", "autotune", "check_fits_in_memory", "distinct_problems", "kernel_identity",
           "plan_entry", "problems_from_profile", "tune", "tune_problem"]


def check_fits_in_memory(spec: OpSpec, problem: Problem) -> None:
    """Refuse a problem whose tensors cannot all be in this machine's memory before anything runs:
    its forward + backward traffic (the work model's bytes, which touch every tensor once) must fit,
    or tuning would grow until the OOM killer ends it."""
    need = sum(spec.work(problem, backward=b).bytes_moved for b in (False, True))
    free = free_memory_bytes()
    if need > free:
        raise UserError(f"{problem.describe()}: its tensors need about {need / 2**30:,.1f} GiB (forward + backward), "
                        f"this machine has {free / 2**30:,.1f} GiB free: choose a smaller --shape")


MAX_CANDIDATES = 16


def check_candidates(candidates: int) -> None:
    """--candidates: 1 to MAX_CANDIDATES (timed side by side on the host, estimated side by side in the
    emulator on an Ascend target)."""
    if not 1 <= candidates <= MAX_CANDIDATES:
        raise UserError(f"--candidates {candidates}: accepted is 1 (the planner's pick) to {MAX_CANDIDATES} "
                        f"(its that many best tilings, timed against each other)")


def tune(op: str, shape: str | None, dtype: str | None = None, *, variant: str | None = None, target: str = "host",
         solver: str = "highs", db_path=None, with_compiled: bool = True,
         hw: HardwareProfile | None = None, out_dir=None, candidates: int = 1) -> TuneResult:
    """Tune one operator from CLI-style arguments (validated here)."""
    spec = get_op(op)
    problem = spec.problem(shape, dtype, variant)
    check_fits_in_memory(spec, problem)
    hw = hw or load_profile(target)
    return tune_problem(spec, problem, hw, target=target, solver=solver,
                        db=TuningDB(db_path or default_db_path()), with_compiled=with_compiled,
                        out_dir=Path(out_dir) if out_dir is not None else None, candidates=candidates)


def tune_problem(spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str,
                 db: TuningDB, with_compiled: bool, with_compiled_kernel: bool = False,
                 out_dir: Path | None = None, with_memory: bool = False, candidates: int = 1) -> TuneResult:
    """One problem through its target's pipeline, recorded in the DB; candidates > 1: the planner's
    that many best tilings timed against each other, the fastest verified one kept (host)."""
    result = _tune_unrecorded(spec, problem, hw, target=target, solver=solver, with_compiled=with_compiled,
                              with_compiled_kernel=with_compiled_kernel, out_dir=out_dir, with_memory=with_memory,
                              candidates=candidates)
    _record(db, result, hw)
    return result


def _tune_unrecorded(spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, **options) -> TuneResult:
    check_candidates(options.get("candidates", 1))
    return target_for(hw).tune(spec, problem, hw, target=target, **options)


@dataclass
class AutotuneResult:
    plan: KernelPlan                 # the kernels `apply` can swap in (none for a target that cannot run here)
    profile: ProfileReport
    tuned: list[TuneResult]
    skipped: list[dict] = field(default_factory=list)   # problems not tuned, or not usable, and why

    def to_json(self) -> dict:
        """summary.json of a target that writes op projects: each project's result and what was skipped."""
        return {"projects": [r.to_json() for r in self.tuned], "skipped": self.skipped}


def kernel_identity(problem: Problem) -> tuple:
    """What one kernel of a plan covers: (op, variant, compile-time extents, dtype)."""
    return (problem.op, problem.variant, tuple(OPS[problem.op].kernel_key(problem)), problem.dtype)


def distinct_problems(problems) -> list[Problem]:
    """One problem per kernel identity: the call with the most work (largest leading extents) stands
    for all of them (the kernel takes any leading extents)."""
    found: dict[tuple, Problem] = {}
    for problem in problems:
        key = kernel_identity(problem)
        lead = len(problem.shape) - len(key[2])
        if key not in found or math.prod(problem.shape[:lead]) > math.prod(found[key].shape[:lead]):
            found[key] = problem
    return list(found.values())


def problems_from_profile(report: ProfileReport) -> list[Problem]:
    """The distinct problems of a profiled step."""
    return distinct_problems(Problem(s["op"], s["variant"], tuple(s["shape"]), DType.parse(s["dtype"]))
                             for group in report.groups for s in group.shapes)


def plan_entry(result: TuneResult) -> PlanEntry:
    """The plan's entry for a usable tuning result."""
    p = result.problem
    return PlanEntry(op=p.op, variant=p.variant, kernel_key=list(OPS[p.op].kernel_key(p)), dtype=p.dtype.value,
                     shape=p.shape_text, knobs=result.plan.knobs, source_hash=result.source_hash,
                     predicted_us=result.plan.predicted_us, measured_us=result.measured_us,
                     eager_us=result.eager_us, compiled_us=result.compiled_us,
                     binding_constraint=result.plan.binding_constraint)


def autotune(workload: Workload, *, target: str = "host", solver: str = "highs", db: TuningDB | None = None,
             with_compiled: bool = False, profile_steps: int = 3, out_dir=None, progress=None,
             candidates: int = 1) -> AutotuneResult:
    """Profile the workload's training step, tune every problem it poses that the target has a kernel
    for, and collect the usable kernels in a plan. A target that writes op projects (AscendC) puts
    one per problem under out_dir/<op>_<variant>_<shape>_<dtype>/ and a summary.json beside them."""
    hw = load_profile(target)
    tgt = target_for(hw)
    check_candidates(candidates)
    if tgt.writes_projects and out_dir is None:
        raise UserError(f"target {target!r} writes an op project per problem: give the folder for them (--out)")
    db = db if db is not None else TuningDB(default_db_path())
    if progress:
        progress(f"profiling {profile_steps} training steps")
    report = profile_training(workload, steps=profile_steps, hw=tgt.profiling_hardware(hw))
    plan = KernelPlan(target=target, config=workload.config_path, hardware=hw.fingerprint(),
                      profile=[{"name": g.name, "kind": g.kind, "time_us": g.time_us, "share": g.share,
                                "calls": g.calls, "ops": g.ops, "saving_us": g.saving_us, "tunable": g.tunable}
                               for g in report.groups])
    for g in report.groups:
        if g.kind == "fusable" and not g.tunable:
            plan.skipped.append({"op": g.name, "reason": "no OpSpec for this group yet: runs the reference"})
    tuned, skipped = [], []   # skipped: the problems not tuned or not usable (the plan lists them too)
    jobs = []
    for problem in problems_from_profile(report):
        where = {"op": problem.op, "variant": problem.variant, "shape": problem.shape_text, "dtype": problem.dtype.value}
        if not tgt.supported(OPS[problem.op]):
            skipped.append(where | {"reason": f"no {tgt.kind} kernel for this operator yet"})
            continue
        project = (Path(out_dir) / f"{problem.op}_{problem.variant}_{problem.shape_text}_{problem.dtype.value}"
                   if tgt.writes_projects else None)
        jobs.append((problem, where, project))

    def tune_one(job):
        problem, _, project = job
        if progress:
            progress(f"tuning {problem.describe()}")
        try:
            return _tune_unrecorded(OPS[problem.op], problem, hw, target=target, solver=solver,
                                    with_compiled=with_compiled, out_dir=project, candidates=candidates)
        except (PlanInfeasible, BuildError) as exc:   # one problem that cannot be planned or built must not cost the others
            return exc

    for (_, where, _), r in zip(jobs, map_in_order(tune_one, jobs, side_by_side=tgt.times_nothing_here)):
        if isinstance(r, Exception):
            skipped.append(where | {"reason": str(r).splitlines()[0]})
            continue
        _record(db, r, hw)
        tuned.append(r)
        if not r.usable:
            skipped.append(where | {"reason": "; ".join(r.reasons) or r.status})
        elif tgt.swappable:
            plan.kernels.append(plan_entry(r))
    if progress and any(OPS[r.problem.op].fuses for r in tuned):
        progress("timing fused kernels against their parts apart")
    _drop_fusions_not_faster_than_apart(plan, tuned, skipped, lambda r, parts: tgt.time_fused_against_apart(
        OPS[r.problem.op], r.problem, r.source_hash, {op: p.source_hash for op, p in parts.items()}, hw))
    plan.skipped.extend(skipped)
    result = AutotuneResult(plan, report, tuned, skipped)
    if tgt.writes_projects:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(out_dir) / "summary.json", json.dumps(result.to_json(), indent=2, default=str))
    return result


def _drop_fusions_not_faster_than_apart(plan: KernelPlan, tuned: list[TuneResult], skipped: list[dict],
                                        time_apart) -> None:
    """A fused kernel (OpSpec.fuses) stays in the plan only where it beats the kernels of the ops it
    fuses, tuned for the same shape and dtype, run one after the other: time_apart(result, {op: part
    result}) -> {"fused": us, "apart": us}, the two timed side by side (times from separate runs
    differ by more than a fusion saves on a noisy machine), or None where the target times nothing."""
    usable = {(r.problem.op, r.problem.shape, r.problem.dtype): r for r in tuned if r.usable}
    for r in tuned:
        names = OPS[r.problem.op].fuses
        parts = {op: usable.get((op, r.problem.shape, r.problem.dtype)) for op in names}
        if not names or not r.usable or None in parts.values():
            continue
        times = time_apart(r, parts)
        if times is None:
            continue
        r.against_apart = times
        r.reasons.append(f"{times['fused']:.1f} us against {' + '.join(names)} apart {times['apart']:.1f} us "
                         "(timed side by side)")
        if times["fused"] < times["apart"]:
            continue
        plan.kernels = [e for e in plan.kernels if e.source_hash != r.source_hash]
        skipped.append({"op": r.problem.op, "variant": r.problem.variant, "shape": r.problem.shape_text,
                        "dtype": r.problem.dtype.value,
                        "reason": f"not faster than {' + '.join(names)} apart ({times['fused']:.1f} us vs "
                                  f"{times['apart']:.1f} us, timed side by side)"})


def _record(db: TuningDB, r: TuneResult, hw: HardwareProfile) -> None:
    detail = {"reasons": r.reasons}
    if r.build_error is not None:
        detail["error"] = r.build_error
    if r.verification is not None:
        detail["verification"] = r.verification.summary
    if r.estimate is not None:
        detail["estimate"] = {k: v for k, v in r.estimate.items() if k not in ("phases", "schedule")}
    db.add(Record(
        op=r.problem.op, variant=r.problem.variant, shape=r.problem.shape_text, dtype=r.problem.dtype.value,
        target=r.target, source_hash=r.source_hash or "-", hardware=hw.fingerprint(), plan=r.plan.to_dict(),
        predicted_us=r.plan.predicted_us, measured_us=r.measured_us, eager_us=r.eager_us,
        compiled_us=r.compiled_us, verified=r.verified, status=r.status, detail=detail,
    ))
