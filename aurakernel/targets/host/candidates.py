"""Kernels checked and timed: `verify` runs a kernel against the reference at the tune loop's tail
shapes (every tune), and tilings of one problem are built, verified and timed side by side:
`tune --candidates N` times the cost model's N best and keeps the fastest (the model ranks, the
machine decides), and `bench search-quality` times a sample of the whole space the same way."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...errors import BuildError
from ...hardware import HardwareProfile
from ...measure import compare
from ...ops.base import OpSpec, Problem
from ...patch.base import Patch
from ...patch.deepseek_v4 import patch_of
from ...planner import model as planner_model
from ...planner.model import ChoiceModel
from ...verify import SEEDS, Verification, check_case
from .build import build_kernel
from .library import Kernel
from .ops import kernel_of


@dataclass
class Candidate:
    knobs: dict[str, int]
    predicted_us: float
    source_hash: str | None = None
    build_s: float = 0.0
    verify_s: float = 0.0
    verification: Verification | None = None
    failed: str | None = None          # why it does not count (build or verification failure)
    build_error: str | None = None     # the compiler's message, when the build failed
    us: float | None = None

    @property
    def summary(self) -> str:
        return self.verification.summary if self.verification else ""


def knobs_text(knobs: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items())


def runners_up(model: ChoiceModel, pick: dict[str, int], n: int) -> list[Candidate]:
    """The model's n best feasible tilings after the pick (planner/model.py's runners_up), as candidates."""
    return [Candidate(c, seconds * 1e6) for c, seconds in planner_model.runners_up(model, pick, n)]


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


def build_and_verify(spec: OpSpec, problem: Problem, cand: Candidate, hw: HardwareProfile) -> None:
    """Build the candidate's kernel and check it at the tune loop's tail shapes; a failure is noted
    on the candidate (it never counts as the fastest)."""
    t0 = time.perf_counter()
    try:
        cand.source_hash = build_kernel(spec, problem, cand.knobs).source_hash
        cases = [(p, build_kernel(spec, p, cand.knobs))
                 for p in kernel_of(spec).verification_problems(problem, cand.knobs, max(hw.simd_bytes // 4, 1))]
    except BuildError as exc:
        cand.build_s, cand.build_error = time.perf_counter() - t0, str(exc)
        cand.failed = f"build failed: {cand.build_error.splitlines()[0]}"
        return
    t1 = time.perf_counter()
    cand.verification = verify(spec, cases)
    cand.build_s, cand.verify_s = t1 - t0, time.perf_counter() - t1
    if not cand.verification.passed:
        cand.failed = cand.verification.summary


def timing_steps(spec: OpSpec, problem: Problem, hashes: dict[str, str]) -> dict[str, Callable[[], object]]:
    """Fwd + bwd through the operator's module patched with each kernel: the path Patch.timing_candidates
    times for `tune`, with one set of inputs shared by every candidate (the space can be large).
    An operator that is not a module (adamw: an optimizer step) times through its own
    timing_candidates, one kernel at a time."""
    patch = patch_of(spec)
    if type(patch).timing_candidates is not Patch.timing_candidates:
        return {name: patch.timing_candidates(problem, h, with_compiled=False)[0]["aurakernel"]
                for name, h in hashes.items()}
    module, step_of = spec.module_steps(problem)
    steps = {}
    for name, h in hashes.items():
        ours = copy.deepcopy(module)
        patch.patch(ours, lambda key, dtype, h=h: h)
        steps[name] = step_of(ours)
    return steps


def time_side_by_side(spec: OpSpec, problem: Problem, hashes: dict[str, str], threads: int) -> dict[str, float]:
    """Median microseconds of each named kernel, all in the same interleaved rounds."""
    timings = compare(timing_steps(spec, problem, hashes), threads=threads, budget_s=max(3.0, 0.3 * len(hashes)))
    return {name: t.us for name, t in timings.items()}


def time_fused_against_apart(spec: OpSpec, problem: Problem, fused_hash: str, part_hashes: dict[str, str],
                             threads: int) -> dict[str, float]:
    """Median microseconds of a fused kernel ("fused") and of the kernels of the ops it fuses run one
    after the other ("apart": with the glue autograd adds between them), fwd + bwd through the fused
    operator's reference module on the same inputs, in the same interleaved rounds."""
    patch = patch_of(spec)
    module, step_of = spec.module_steps(problem)
    fused, apart = copy.deepcopy(module), copy.deepcopy(module)
    patch.patch(fused, lambda key, dtype: fused_hash)
    patch.patch_parts(apart, {op: (lambda key, dtype, h=h: h) for op, h in part_hashes.items()})
    timings = compare({"fused": step_of(fused), "apart": step_of(apart)}, threads=threads)
    return {name: t.us for name, t in timings.items()}
