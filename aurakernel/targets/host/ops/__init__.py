"""The operators' host C kernels (kernel.KERNELS holds them by operator name).
A third-party operator adds its own through aurakernel.register."""

from __future__ import annotations

from . import (adamw, attn_softmax, block_linear, compressor, cross_entropy, grouped_linear, indexer_score, linear,
               linear_cross_entropy, mhc, mhc_post, mhc_post_pre, moe_permute, moe_unpermute, rms_norm, rope, router,
               sparse_attention, swiglu)
from ..kernel import KERNELS

KERNELS.load(rms_norm, mhc, mhc_post, mhc_post_pre, router, swiglu, rope, attn_softmax, compressor, indexer_score,
             sparse_attention, cross_entropy, linear_cross_entropy, linear, grouped_linear, block_linear,
             moe_permute, moe_unpermute, adamw)
kernel_of = KERNELS.of
