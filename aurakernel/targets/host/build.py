"""Render and build an operator's host kernel for a problem and a set of knob values.

Built kernels are kept per process by source hash, so the custom ops the trainer calls find their
kernel by that hash (a string argument torch.compile and FSDP pass through).
"""

from __future__ import annotations

from ...codegen import render
from ...ops.base import OpSpec, Problem
from .library import Kernel, built_kernel, compile_source, find_built, keep
from .ops import kernel_of

__all__ = ["build_kernel", "built_kernel"]


def build_kernel(spec: OpSpec, problem: Problem, knobs: dict[str, int]) -> Kernel:
    """The operator's host kernel for `problem` at `knobs`: rendered, built (or found) and bound."""
    impl = kernel_of(spec)
    params = impl.render_params(problem, knobs)
    source = render(impl.template(), params, spec.template_dirs)
    kernel = find_built(source.hash)
    if kernel is None:
        kernel = compile_source(source, impl.entries)
        kernel.meta, kernel.impl = dict(params), impl
        keep(kernel)
    return kernel
