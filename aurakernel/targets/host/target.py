"""The host target: C kernels built with the system compiler and run on this CPU."""

from __future__ import annotations

import torch

from ...ops.base import OpSpec, Problem
from ...verify import SEEDS, Verification, check_case
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
