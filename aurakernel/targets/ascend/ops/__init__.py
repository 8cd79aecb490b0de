"""The operators' AscendC kernels (kernel.KERNELS holds them by operator name).
A third-party operator adds its own through aurakernel.register."""

from __future__ import annotations

from . import (adamw, attn_softmax, compressor, cross_entropy, indexer_score, mhc, mhc_post, rms_norm, rope, router,
               sparse_attention, swiglu)
from ....ops.base import OpSpec
from ..kernel import KERNELS

KERNELS.load(rms_norm, mhc, mhc_post, router, swiglu, rope, attn_softmax, compressor, indexer_score,
             cross_entropy, adamw, sparse_attention)
kernel_of = KERNELS.of


def supported(spec: OpSpec) -> bool:
    return spec.name in KERNELS
