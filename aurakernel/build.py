"""Render + build one kernel for a problem and a set of knob values.

Built kernels are kept in a cache keyed by source hash, so the custom ops that the trainer calls
can find their kernel by that hash (a string argument torch.compile and FSDP pass through).
"""

from __future__ import annotations

from .backends import backend_for
from .backends.base import Kernel
from .codegen import render
from .ops.base import OpSpec, Problem

_BUILT: dict[str, Kernel] = {}


def build_kernel(spec: OpSpec, problem: Problem, knobs: dict[str, int], target_kind: str = "host") -> Kernel:
    params = spec.render_params(problem, knobs)
    source = render(spec.template(target_kind), params, spec.template_dirs)
    kernel = _BUILT.get(source.hash)
    if kernel is None:
        kernel = backend_for(target_kind).build(source, spec.entries)
        kernel.meta = dict(params)
        _BUILT[source.hash] = kernel
    return kernel


def built_kernel(source_hash: str) -> Kernel:
    """A kernel built earlier in this process, by source hash."""
    return _BUILT[source_hash]
