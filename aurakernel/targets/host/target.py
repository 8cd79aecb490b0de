"""The host target: C kernels built with the system compiler and run on this CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from ...errors import BuildError
from ...hardware import HardwareProfile
from ...measure import compare, peak_allocated_bytes
from ...ops.base import OpSpec, Problem
from ...patch.deepseek_v4 import patch_of
from ...planner import Plan, solve_tiling
from ...verify import SEEDS, Verification, check_case
from ..result import TuneResult
from .build import build_kernel
from .kernel import KERNELS
from .library import Kernel
from .ops import kernel_of


def _run_host(spec: OpSpec, problem: Problem, kernel: Kernel):
    """The host kernel on poisoned outputs and gradients (NaN, or an impossible integer)."""
    impl = kernel_of(spec)
    def run(inputs, grad_out):
        outputs = impl.empty_outputs(problem, inputs)
        for t in outputs.values():
            t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)
        impl.run_forward(kernel, inputs, outputs)
        diff = spec.differentiable(problem)
        grads = {k: torch.full(inputs[k].shape, float("nan"), dtype=inputs[k].dtype) for k in diff}
        if diff:  # an operator without gradients (the optimizer update) has no backward
            impl.run_backward(kernel, inputs, outputs, grad_out, grads)
        return outputs, grads, None
    return run


def verify(spec: OpSpec, cases: list[tuple[Problem, Kernel]], seeds=SEEDS) -> Verification:
    """Check each (problem, kernel) case on every seed; all must pass."""
    result = Verification(passed=True)
    for problem, kernel in cases:
        for seed in seeds:
            result.checks.extend(check_case(spec, problem, seed, _run_host(spec, problem, kernel)))
    result.passed = all(c.passed for c in result.checks)
    return result


def measure_problem(spec: OpSpec, problem: Problem, kernel_hash: str, *, with_compiled: bool,
                    threads: int, with_compiled_kernel: bool = False,
                    with_memory: bool = False) -> tuple[dict[str, float], dict[str, str], dict[str, int]]:
    """Median microseconds of eager, torch.compile, the kernel and (with_compiled_kernel) the kernel
    under torch.compile (fwd+bwd), in the same rounds; with_memory, each one's peak of allocated
    bytes over one fwd+bwd too (the allocator's high-water mark, measure.peak_allocated_bytes)."""
    candidates, notes = patch_of(spec).timing_candidates(problem, kernel_hash, with_compiled, with_compiled_kernel)
    timings = compare(candidates, threads=threads)
    peaks = {name: peak_allocated_bytes(fn) for name, fn in candidates.items()} if with_memory else {}
    return {name: t.us for name, t in timings.items()}, notes, peaks


class HostTarget:
    """This CPU: the tiling MILP over its caches and cores, gcc, verification against the reference
    at tail shapes, and timing side by side with eager and torch.compile."""

    kind = "host"
    swappable = True
    writes_projects = False

    def supported(self, spec: OpSpec) -> bool:
        return spec.name in KERNELS

    def profiling_hardware(self, hw: HardwareProfile) -> HardwareProfile:
        return hw

    def plan(self, spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str = "highs") -> Plan:
        return solve_tiling(kernel_of(spec).tiling_problem(problem, hw), op=problem.op, variant=problem.variant,
                            shape=problem.shape, dtype=problem.dtype.value, target=target, solver=solver)

    def predicted_us(self, spec: OpSpec, problem: Problem, hw: HardwareProfile) -> float:
        return self.plan(spec, problem, hw, target=hw.name).predicted_us

    def tune(self, spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str,
             with_compiled: bool, with_compiled_kernel: bool = False, out_dir: Path | None = None,
             with_memory: bool = False) -> TuneResult:
        plan = self.plan(spec, problem, hw, target=target, solver=solver)
        result = TuneResult(problem, target, plan, None, None)
        try:
            kernel = build_kernel(spec, problem, plan.knobs)
            result.source_hash = kernel.source_hash
            cases = [(p, build_kernel(spec, p, plan.knobs))
                     for p in kernel_of(spec).verification_problems(problem, plan.knobs, max(hw.simd_bytes // 4, 1))]
        except BuildError as exc:
            result.status, result.reasons = "build_failed", [str(exc).splitlines()[0]]
            result.build_error = str(exc)[-2000:]
            return result
        result.verification = verify(spec, cases)
        if not result.verification.passed:
            result.status, result.reasons = "verify_failed", [result.verification.summary]
            return result
        times, notes, result.peak_bytes = measure_problem(
            spec, problem, kernel.source_hash, with_compiled=with_compiled, threads=hw.cores,
            with_compiled_kernel=with_compiled_kernel, with_memory=with_memory)
        result.measured_us = times["aurakernel"]
        result.eager_us = times["eager"]
        result.compiled_us = times.get("compiled")
        result.aurakernel_compiled_us = times.get("aurakernel_compiled")
        result.reasons.extend(notes.values())
        if result.measured_us >= result.eager_us:
            result.status = "slower"
            result.reasons.append(f"not faster than eager ({result.measured_us:.1f} us vs {result.eager_us:.1f} us)")
        return result


TARGET = HostTarget()
