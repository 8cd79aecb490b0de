"""The Ascend target: plan -> render an op project -> build it against the emulator -> verify and
estimate, for Ascend profiles (kind: ascend).

Without CANN there is no NPU to run on: the rendered kernel is compiled with g++ against
aurakernel/emulator (the documented AscendC API with the hardware's rules enforced) and run on the
CPU, which proves the numerics and yields per-pipe cycle estimates. With CANN (ASCEND_HOME_PATH)
the same project builds for real with its CMakeLists (see the project's README).

An operator takes part with an AscendKernel (kernel.py) in targets/ascend/ops/<op>.py and its
templates under templates/ascendc/<op>/.
"""

from __future__ import annotations

import copy
import re
import tempfile
from pathlib import Path

import torch

from ... import emulator
from ...codegen import Identifier, Source, render
from ...concurrency import map_in_order
from ...errors import BuildError, PlanInfeasible, UserError
from ...hardware import HardwareProfile, load_profile
from ...ops.base import OpSpec, Problem
from ...paths import write_text_atomic
from ...planner import Plan, solve_tiling
from ...planner.ascend import CubeWork, VectorWork, ascend_rowwise_model, bound_us, hbm_us, largest_floor, roofline_us
from ...planner.model import ChoiceModel, runners_up
from ...planner.schedule import Pipeline, Schedule, ascend_row_pipeline, schedule_knobs, simulate, solve_schedule
from ...verify import Check, Verification, check_case
from ..result import TuneResult
from .ops import kernel_of, supported

PROJECT_FILES = {   # template -> file written into the op project
    "kernel.cpp.j2": "{op}_kernel.cpp",
    "tiling.h.j2": "{op}_tiling.h",
    "host.cpp.j2": "{op}_host.cpp",
    "binding.cpp.j2": "{op}_binding.cpp",
    "CMakeLists.txt.j2": "CMakeLists.txt",
    "README.md.j2": "README.md",
}
SEEDS = (0, 1, 2)

__all__ = ["TARGET", "cube_plan", "emulate_at", "estimate_summary", "kernel_of", "minimum_traffic", "model", "plan", "render_project", "supported", "tune", "verify"]


def model(spec: OpSpec, problem: Problem, hw: HardwareProfile) -> ChoiceModel:
    """The op's UB-partition / pipe model: its kernel as rows x cols, its phases."""
    kernel = kernel_of(spec)
    rows, cols = kernel.rows_cols(problem)
    return ascend_rowwise_model(rows, cols, problem.dtype.itemsize, kernel.phases(problem), hw,
                                split_cols=kernel.split_cols, col_tiles=kernel.col_tiles(problem),
                                tile_rows_step=kernel.tile_rows_step)


def pipelines(spec: OpSpec, problem: Problem, hw: HardwareProfile, knobs: dict[str, int]) -> dict[str, Pipeline]:
    """The op's phases at the tiling's knobs as copy-in -> compute -> copy-out pipelines: those whose
    template renders a schedule (compute_waits_scalar), {} when none does."""
    kernel = kernel_of(spec)
    waits = kernel.compute_waits_scalar
    if not waits:
        return {}
    rows, cols = kernel.rows_cols(problem)
    return {ph.name: ascend_row_pipeline(ph, rows, cols, problem.dtype.itemsize, knobs, hw,
                                         split_cols=kernel.split_cols, compute_waits_scalar=waits[ph.name])
            for ph in kernel.phases(problem) if ph.name in waits}


def schedule(spec: OpSpec, problem: Problem, hw: HardwareProfile, knobs: dict[str, int],
             time_limit_s: float = 10.0) -> dict[str, tuple[Pipeline, Schedule]]:
    """Each phase's solved pipeline schedule (CP-SAT) at the tiling's knobs."""
    return {name: (pipe, solve_schedule(pipe, time_limit_s)) for name, pipe in pipelines(spec, problem, hw, knobs).items()}


_CUBE_PLANS: dict[tuple, Plan | None] = {}


def cube_plan(spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str,
              explain: bool = True) -> Plan | None:
    """The tiling of the kernel's Cube phases (its cube_model), or None for a vector-only kernel.
    Solved once per process for each problem, profile and solver, and handed out as a copy: every
    runner-up that fastest_emulated estimates keeps the same Cube part (sparse attention's model took
    ~10 s to solve and explain, once per candidate)."""
    key = (spec.name, problem, repr(hw), target, solver, explain)
    if key[:-1] + (True,) in _CUBE_PLANS:   # an explained plan serves a caller that needs no explanation
        key = key[:-1] + (True,)
    if key not in _CUBE_PLANS:
        cube = kernel_of(spec).cube_model(problem, hw)
        _CUBE_PLANS[key] = None if cube is None else solve_tiling(
            cube, op=problem.op, variant=problem.variant, shape=problem.shape, dtype=problem.dtype.value,
            target=target, solver=solver, explain=explain)
    return copy.deepcopy(_CUBE_PLANS[key])


def plan(spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str,
         scheduled: bool = True, explain: bool = True) -> Plan:
    """Tiling (the UB-partition MILP), then, where the template renders one, the pipeline schedule
    of each phase at that tiling; a schedule that cannot be solved leaves the plain order. Without
    `scheduled` and `explain` (what predicted_us needs): no schedules and no binding constraint."""
    computes = kernel_of(spec).variants
    if computes is not None and problem.variant not in computes:
        raise PlanInfeasible("variant", f"{spec.name}[{problem.variant}] has no AscendC kernel: its kernels compute "
                                        f"{', '.join(computes)}")
    rows = model(spec, problem, hw)
    if rows.phases:
        the_plan = solve_tiling(rows, solver=solver, explain=explain, **_plan_fields(problem, target))
    else:   # every phase runs on the Cube: the row-wise knobs only fill the template's unused vector part
        the_plan = Plan(knobs={k: v[0] for k, v in rows.domains.items()}, predicted_us=0.0, pipes_us={},
                        binding_constraint="", solver=solver, solve_s=0.0, status="optimal", **_plan_fields(problem, target))
    return _finish(spec, problem, hw, the_plan, target=target, solver=solver, scheduled=scheduled, explain=explain)


def _plan_fields(problem: Problem, target: str) -> dict:
    return dict(op=problem.op, variant=problem.variant, shape=problem.shape, dtype=problem.dtype.value, target=target)


def plan_at(spec: OpSpec, problem: Problem, hw: HardwareProfile, row_knobs: dict[str, int], *, target: str,
            solver: str, why: str, explain: bool = True) -> Plan:
    """The plan at the row-wise model's `row_knobs` (a runner-up of the tiling MILP's pick), its Cube part
    and pipeline schedules solved as plan() solves them; `why` is its binding constraint."""
    seconds, detail = model(spec, problem, hw).evaluate(row_knobs)
    the_plan = Plan(knobs=dict(row_knobs), predicted_us=seconds * 1e6,
                    pipes_us={ph: {p: v * 1e6 for p, v in pipes.items()} for ph, pipes in detail.items()},
                    binding_constraint=why, solver=solver, solve_s=0.0, status="optimal", **_plan_fields(problem, target))
    return _finish(spec, problem, hw, the_plan, target=target, solver=solver, scheduled=True, explain=explain)


def _finish(spec: OpSpec, problem: Problem, hw: HardwareProfile, the_plan: Plan, *, target: str, solver: str,
            scheduled: bool, explain: bool = True) -> Plan:
    """A row-wise tiling with the Cube phases' own plan merged in, then its pipeline schedules."""
    on_cube = cube_plan(spec, problem, hw, target=target, solver=solver, explain=explain)
    if on_cube is not None:   # the Cube phases' own tiling, solved apart and merged; a knob both models
        # name is the Cube model's (mHC's forward `chunk`: no row phase's time reads it)
        the_plan.knobs = dict(sorted({**the_plan.knobs, **on_cube.knobs}.items()))
        the_plan.predicted_us += on_cube.predicted_us
        the_plan.pipes_us = {**the_plan.pipes_us, **on_cube.pipes_us}
        the_plan.solve_s += on_cube.solve_s
        the_plan.binding_constraint = "; ".join(b for b in (the_plan.binding_constraint, on_cube.binding_constraint) if b)
    if not scheduled:
        return the_plan
    try:
        solved = schedule(spec, problem, hw, the_plan.knobs)
    except PlanInfeasible as exc:   # the plain CopyIn / Compute / CopyOut order still runs
        the_plan.schedule = {"fallback": str(exc)}
        return the_plan
    for name, (pipe, sched) in solved.items():
        plain_leads = {s.name: 0 for s in pipe.stages}
        plain_buffers = {q.name: the_plan.knobs["buffers"] for q in pipe.queues}
        the_plan.schedule[name] = {**sched.to_dict(pipe), "plain_cycles": simulate(pipe, plain_leads, plain_buffers)}
    the_plan.knobs = dict(sorted({**the_plan.knobs, **schedule_knobs({n: s for n, (_, s) in solved.items()})}.items()))
    return the_plan


def project_name(spec: OpSpec, problem: Problem) -> Identifier:
    """The op project's name: its libraries' (libak_<name>_kernels / _ops) and its torch ops' prefix
    (torch.ops.aurakernel.<name>_fwd), one per kernel (operator, variant, dtype and the kernel key's widths),
    so a process loads the projects of several widths side by side (the same names would make the
    loader reuse the first kernel library and torch refuse the second op registration)."""
    parts = [spec.name, *([problem.variant] if problem.variant != "default" else []), problem.dtype.value,
             *(["x".join(str(int(k)) for k in spec.kernel_key(problem))] if spec.kernel_key(problem) else [])]
    return Identifier("_".join(parts))   # rendered into C++ and CMake


def op_type(spec: OpSpec, problem: Problem) -> Identifier:
    """The project's CANN operator type (its OpDef classes in op_host, the backward's with "Grad"):
    the project name in CamelCase, so two installed projects of one operator (another dtype, other
    widths) register different types, as their libraries and torch ops differ."""
    return Identifier("Ak" + "".join(part[:1].upper() + part[1:] for part in project_name(spec, problem).split("_")))


def snake_case(op_type: str) -> Identifier:
    """An operator type's lower snake case name, by the rule CANN's custom-op build applies to find a type's
    kernel entry (asc-devkit docs, "命名转换规则对照表"): an upper-case letter becomes lower case, with an
    underscore before it where the letter before it is lower case or a digit, or is upper case and the
    letter after it lower case (AddCustom -> add_custom, Conv2DCustom -> conv2_d_custom, GRUCell -> gru_cell)."""
    out = []
    for i, c in enumerate(op_type):
        if c.isupper():
            before, after = op_type[i - 1:i], op_type[i + 1:i + 2]
            if before and (before.islower() or before.isdigit() or (before.isupper() and after.islower())):
                out.append("_")
            c = c.lower()
        out.append(c)
    return Identifier("".join(out))


# a kernel's name after the project's entry (`kernel_entry`), by the role its emulator runs ask for
ENTRY_SUFFIXES = {"fwd": "", "bwd": "_grad", "given": "_given", "bwd_head": "_grad_head"}


def kernel_entry(spec: OpSpec, problem: Problem) -> Identifier:
    """The forward kernel's name, the project's operator type in snake case, so that msopgen's build finds
    it for that type (and the backward's, `<entry>_grad`, for `<type>Grad`); one per project, so two
    projects' kernel libraries loaded in one process export no name twice."""
    return snake_case(op_type(spec, problem))


def render_project(spec: OpSpec, problem: Problem, knobs: dict[str, int], out_dir: Path,
                   hw: HardwareProfile) -> dict[str, Path]:
    """Write the op project (kernel, tiling, host, binding, CMake, README) for `hw` into out_dir. A
    kernel that picks an instruction form at run time weighs the forms with `hw`'s vector costs
    (vec_issue_cycles, vec_slow_factor: the planner's and the emulator's figures)."""
    kernel = kernel_of(spec)
    figures = hw.ascend_pipes(hw.cores)
    params = {**kernel.params(problem, knobs), **kernel.profile_params(problem, knobs, hw), "batch_mode": kernel.syncs_cores,
              "lib": project_name(spec, problem), "op_type": op_type(spec, problem), "entry": kernel_entry(spec, problem),
              "vec_issue_cycles": max(1, round(figures.vec_issue)), "vec_slow_factor": max(1, round(figures.vec_slow_factor))}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for template, name in PROJECT_FILES.items():
        text = render(f"ascendc/{kernel.folder}/{template}", params, spec.template_dirs).text
        written[template] = write_text_atomic(out_dir / name.format(op=spec.name), text)
    return written


class Emulated:
    """The project's kernels built against the emulator, launched as the project's tiling launches them
    (in batch mode where the kernel syncs its blocks; the block count is each run's); `exe(entry, nargs)`
    builds on first use."""

    def __init__(self, spec: OpSpec, project: dict[str, Path], hw: HardwareProfile):
        self.source = project["kernel.cpp.j2"].read_text()
        entries = set(re.findall(r'extern "C" __global__ __aicore__ void (\w+)\(', self.source))
        self.entry = min(entries, key=len)   # the forward's; the others are it with a suffix (ENTRY_SUFFIXES)
        self.include = project["tiling.h.j2"].parent
        self.hw, self.batch_mode = hw, kernel_of(spec).syncs_cores
        self._exes: dict[tuple, Path] = {}

    def exe(self, role: str, nargs: int, *, cores: str = "aiv", l2_args: tuple[int, ...] = (),
            l2_vector_reads: tuple[int, ...] = ()) -> Path:
        """The kernel of `role` (ENTRY_SUFFIXES: "fwd", "bwd", ...) built for blocks of `cores`
        (emulator.CORES; any number of them: the run gives it), with the workspace arguments `l2_args`
        kept in L2 and the vector cores' reads of `l2_vector_reads` found there (emulator.build)."""
        key = (role, nargs, cores, l2_args, l2_vector_reads)
        if key not in self._exes:
            self._exes[key] = emulator.build(self.source, entry=self.entry + ENTRY_SUFFIXES[role], nargs=nargs, hw=self.hw, include_dirs=(self.include,),
                                             batch_mode=self.batch_mode, cores=cores, l2_args=l2_args,
                                             l2_vector_reads=l2_vector_reads)
        return self._exes[key]


def verify(spec: OpSpec, problems: list[Problem], knobs: dict[str, int], emu: Emulated, seeds=SEEDS) -> Verification:
    """Forward and backward in the emulator against the PyTorch reference (verify.check_case);
    a broken hardware rule fails the case with the emulator's message."""
    result = Verification(passed=True)
    kernel = kernel_of(spec)
    for problem in problems:
        for seed in seeds:
            def run(inputs, grad_out, problem=problem):
                outputs, grads, reports = kernel.run(problem, knobs, inputs, grad_out, emu)
                errors = [e for r in reports.values() for e in r.errors]
                return outputs, grads, errors[0] if errors else None
            result.checks.extend(check_case(spec, problem, seed, run))
    result.passed = bool(result.checks) and all(c.passed for c in result.checks)
    return result


def estimate_summary(estimate: dict[str, emulator.RunReport], hw: HardwareProfile, the_plan: Plan | None,
                     floors: dict[str, VectorWork] | None = None, cube: dict[str, CubeWork] | None = None,
                     minimum: dict[str, int] | None = None) -> dict:
    """The emulator's run at the full shape as tune reports it: per phase its cycles, time, busiest
    pipes, UB use and its bound against the traffic it makes (its busiest block's share of HBM), the
    vector work of `floors` and the Cube MACs of `cube`; and the totals against the op's true bound.

    The true bound is per pass (backward: the phases named "backward..."; forward: the others) the
    larger of the op's minimum traffic at the whole chip's HBM bandwidth (`minimum`: the pass's bytes
    from the op's `work`, or what the kernels moved where that is less) and its phases' vector / Cube
    floors. Traffic a kernel makes beyond the minimum (partial sums written per core, a second pass
    over an input) therefore shows as distance from the bound; `traffic_us` is the sum of the phases'
    own bounds, so the two tell excess traffic from pipes that do not overlap."""
    floors, cube, minimum = floors or {}, cube or {}, minimum or {}
    phases = {}
    for phase, rep in estimate.items():
        gm, on_cube = rep.busiest_gm_bytes(), rep.cube_blocks
        bound, kind = bound_us(gm, floors.get(phase), hw, cube=cube.get(phase), cube_blocks=on_cube)
        est_us = rep.cycles / (hw.clock_ghz * 1e3)
        phases[phase] = {"est_cycles": rep.cycles, "est_us": est_us, "pipes_cycles": rep.pipe_cycles(),
                         "hbm_us": roofline_us(gm, hw, on_cube), "roofline_us": bound, "bound": kind,
                         "roofline_ratio": est_us / bound if bound else None,
                         "ub_bytes": rep.ub_used(), "buffers": rep.buffers()}
    est_us = sum(ph["est_us"] for ph in phases.values())
    bound, kinds = 0.0, set()
    for pass_ in ("forward", "backward"):
        mine = [ph for ph in estimate if ph.startswith("backward") == (pass_ == "backward")]
        if not mine:
            continue
        moved = sum(estimate[ph].total_gm_bytes() for ph in mine)
        least, kind = largest_floor({"HBM": hbm_us(min(moved, minimum.get(pass_, moved)), hw),
                                     "vector": sum(floors[ph].floor_us(hw) for ph in mine if ph in floors),
                                     "Cube": sum(cube[ph].floor_us(hw) for ph in mine if ph in cube)})
        bound, kinds = bound + least, kinds | {kind}
    traffic = sum(ph["roofline_us"] for ph in phases.values())
    return {"schedule": the_plan.schedule if the_plan else None, "ub_bytes": max((ph["ub_bytes"] for ph in phases.values()), default=0),
            "est_cycles": sum(ph["est_cycles"] for ph in phases.values()), "est_us": est_us, "roofline_us": bound,
            "bound": "+".join(sorted(kinds)), "roofline_ratio": est_us / bound if bound else None,
            "traffic_us": traffic, "traffic_ratio": est_us / traffic if traffic else None, "phases": phases}


def minimum_traffic(spec: OpSpec, problem: Problem) -> dict[str, int]:
    """The bytes the op's forward and backward must move at least (its `work`), for the true bound."""
    return {p: spec.work(problem, backward=p == "backward").bytes_moved for p in ("forward", "backward")}


def emulate(spec: OpSpec, problem: Problem, knobs: dict[str, int], emu: Emulated) -> dict[str, emulator.RunReport]:
    """Forward and backward once at `problem`'s full shape: the emulator's reports (the estimate)."""
    inputs = spec.make_inputs(problem, 0)
    with torch.no_grad():
        likes = spec.reference(problem, inputs)
    grad_out = {k: torch.randn(likes[k].shape).to(likes[k].dtype) for k in spec.grad_outputs()}
    return kernel_of(spec).run(problem, knobs, inputs, grad_out, emu)[2]


def emulate_at(spec: OpSpec, problem: Problem, knobs: dict[str, int], hw: HardwareProfile) -> dict[str, emulator.RunReport]:
    """The op project at `knobs`, rendered into a scratch folder, built against the emulator and run
    once at `problem`'s full shape: its reports (emulate)."""
    with tempfile.TemporaryDirectory(prefix=f"ak-{spec.name}-") as tmp:
        return emulate(spec, problem, knobs, Emulated(spec, render_project(spec, problem, knobs, Path(tmp), hw), hw))


def emulated_us(spec: OpSpec, problem: Problem, knobs: dict[str, int], hw: HardwareProfile) -> tuple[float | None, str | None]:
    """The emulator's estimate (us, forward + backward) of the kernel at `knobs` on `problem`, or None
    and why not (a tiling the template refuses, a build or run error)."""
    try:
        reports = emulate_at(spec, problem, knobs, hw)
    except (UserError, BuildError) as exc:
        return None, str(exc).splitlines()[0][:200]
    errors = [e for r in reports.values() for e in r.errors]
    return (None, errors[0][:200]) if errors else (sum(r.cycles for r in reports.values()) / (hw.clock_ghz * 1e3), None)


def fastest_emulated(spec: OpSpec, problem: Problem, hw: HardwareProfile, pick: Plan, n: int, *, target: str,
                     solver: str, explain: bool = True) -> tuple[Plan, str]:
    """The planner's pick and the row-wise model's n - 1 runners-up, each estimated in the emulator at the
    problem's shape (side by side): the fastest that runs, and a note of every tiling's estimate. The
    model ranks, the emulator decides (the NPU would, where CANN runs). An op whose phases all run on the
    Cube has no row-wise runners-up: its pick stays."""
    rows = model(spec, problem, hw)
    if not rows.phases:
        return pick, f"--candidates {n}: {spec.name}'s tilings are its Cube model's; the planner's pick alone"
    kernel, seen, others = kernel_of(spec), set(), []

    def rendered(knobs: dict[str, int]) -> str:   # tilings that render the same kernel are one candidate
        return repr(sorted(kernel.params(problem, {**pick.knobs, **knobs}).items()))
    seen.add(rendered(pick.knobs))
    for knobs, _ in runners_up(rows, pick.knobs):
        if len(others) == n - 1:
            break
        try:
            key = rendered(knobs)
        except UserError:   # a tiling the template refuses
            continue
        if key not in seen:
            seen.add(key)
            others.append(plan_at(spec, problem, hw, knobs, target=target, solver=solver, explain=explain,
                                  why=f"emulated: the fastest of the planner's {n} best"))
    cands = [pick, *others]
    estimates = list(map_in_order(lambda p: emulated_us(spec, problem, p.knobs, hw), cands, side_by_side=True))
    varied = [k for k in rows.domains if len({p.knobs[k] for p in cands}) > 1] or list(rows.domains)
    shown = [{k: p.knobs[k] for k in varied} for p in cands]   # the knobs the candidates differ in
    note = f"emulated the planner's {len(cands)} best tilings: " + "; ".join(
        ", ".join(f"{k}={v}" for k, v in knobs.items()) + ": " + (f"{us:.2f} us" if us is not None else f"failed ({why})")
        for knobs, (us, why) in zip(shown, estimates))
    ran = [(us, i) for i, (us, _) in enumerate(estimates) if us is not None]
    if not ran or min(ran)[1] == 0:
        return pick, note
    best_us, best = min(ran)
    won = cands[best]
    if estimates[0][0] is not None:
        won.binding_constraint += f" (the pick, {', '.join(f'{k}={v}' for k, v in shown[0].items())}, ran {estimates[0][0] / best_us:.2f}x slower)"
    return won, note


def tune(spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str,
         out_dir: Path | None = None, candidates: int = 1, explain: bool = True) -> TuneResult:
    """Plan, render the op project, verify it in the emulator at tail shapes (3 seeds) and estimate
    its cycles at the full shape (nothing runs here to time: measured_us stays None). With candidates
    > 1 the planner's that many best tilings are estimated side by side and the fastest kept. Without
    `explain` the plan names no binding constraint (a solve per capacity: ~7 s of sparse attention's
    ~10 s Cube plan)."""
    kernel = kernel_of(spec)
    the_plan = plan(spec, problem, hw, target=target, solver=solver, explain=explain)
    notes = []
    if candidates > 1:
        the_plan, note = fastest_emulated(spec, problem, hw, the_plan, candidates, target=target, solver=solver,
                                          explain=explain)
        notes.append(note)
    knobs = the_plan.knobs
    with tempfile.TemporaryDirectory(prefix=f"ak-{spec.name}-") as scratch:
        project = render_project(spec, problem, knobs, Path(out_dir) if out_dir is not None else Path(scratch), hw)
        source_hash = Source("ascendc/kernel.cpp", project["kernel.cpp.j2"].read_text()).hash
        emu = Emulated(spec, project, hw)
        verification = verify(spec, kernel.verification_problems(problem, knobs), knobs, emu)
        estimate = emulate(spec, problem, knobs, emu)
    errors = [e for r in estimate.values() for e in r.errors]
    if errors:
        verification.checks.append(Check(problem.shape, 0, "kernel", float("nan"), float("nan"), False, errors[0]))
        verification.passed = False
    result = TuneResult(problem, target, the_plan, source_hash, verification,
                        estimate=estimate_summary(estimate, hw, the_plan, kernel.vector_floor(problem),
                                                 kernel.cube_floor(problem), minimum_traffic(spec, problem)),
                        project_dir=str(Path(out_dir)) if out_dir is not None else None,
                        project_name=str(project_name(spec, problem)) if out_dir is not None else None)
    if not verification.passed:
        result.status, result.reasons = "verify_failed", [verification.summary]
    result.reasons.extend(notes)
    return result


class AscendTarget:
    """An Ascend NPU profile: the UB-partition MILP and pipeline schedule, the op project rendered
    and verified in the emulator, its cycles estimated (built for real where CANN is)."""

    kind = "ascend"
    swappable = False
    writes_projects = True
    times_nothing_here = True   # tunes build and run the emulator in subprocesses: several overlap

    def supported(self, spec: OpSpec) -> bool:
        return supported(spec)

    def profiling_hardware(self, hw: HardwareProfile) -> HardwareProfile:
        return load_profile("host")   # the training step runs here; its problems are planned for the NPU

    def predicted_us(self, spec: OpSpec, problem: Problem, hw: HardwareProfile) -> float:
        return plan(spec, problem, hw, target=hw.name, solver="highs", scheduled=False, explain=False).predicted_us

    def time_fused_against_apart(self, spec: OpSpec, problem: Problem, fused_hash: str, part_hashes: dict[str, str],
                                 hw: HardwareProfile) -> None:
        return None   # nothing runs here: no fused kernel is swapped in from an Ascend plan

    def tune(self, spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str,
             with_compiled: bool = False, with_compiled_kernel: bool = False, out_dir: Path | None = None,
             with_memory: bool = False, candidates: int = 1) -> TuneResult:
        # (emulated: no host memory to measure; candidates are estimated side by side in the emulator)
        return tune(spec, problem, hw, target=target, solver=solver, out_dir=out_dir, candidates=candidates)


TARGET = AscendTarget()
