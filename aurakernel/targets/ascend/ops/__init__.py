"""The operators' AscendC kernels, by operator name. A third-party operator adds its own with
`register(kernel)` (an AscendKernel for its OpSpec, templates under its spec's template folders)."""

from __future__ import annotations

from ....errors import UserError
from ..kernel import AscendKernel
from . import (adamw, attn_softmax, compressor, cross_entropy, indexer_score, mhc, mhc_post, rms_norm, rope, router,
               swiglu)

KERNELS: dict[str, AscendKernel] = {k.spec.name: k for m in (rms_norm, mhc, mhc_post, router, swiglu, rope, attn_softmax,
                                                              compressor, indexer_score, cross_entropy, adamw)
                                    for k in m.KERNELS}


def register(kernel: AscendKernel) -> AscendKernel:
    """Add an operator's AscendC kernel (idempotent for the same kernel)."""
    have = KERNELS.get(kernel.spec.name)
    if have is not None and have is not kernel:
        raise UserError(f"operator {kernel.spec.name!r} already has an AscendC kernel ({type(have).__name__})")
    KERNELS[kernel.spec.name] = kernel
    return kernel
