"""The operators' host C kernels (kernel.KERNELS holds them by operator name). A
third-party operator adds its own through aurakernel.register (HostKernel / AscendKernel.register)."""

from __future__ import annotations

from . import (adamw, attn_softmax, compressor, cross_entropy, indexer_score, mhc, mhc_post, rms_norm, rope, router,
               swiglu)
from ....errors import UserError
from ....ops.base import OpSpec
from ..kernel import KERNELS, HostKernel

for _module in (rms_norm, mhc, mhc_post, router, swiglu, rope, attn_softmax, compressor, indexer_score,
                cross_entropy, adamw):
    for _kernel in _module.KERNELS:
        _kernel.register()


def kernel_of(spec: OpSpec) -> HostKernel:
    """The operator's host kernel; a one-line error naming those that have one."""
    kernel = KERNELS.get(spec.name)
    if kernel is None:
        raise UserError(f"operator {spec.name!r} has no host kernel: available for {', '.join(sorted(KERNELS))}")
    return kernel
