"""The operator library: one OpSpec per operator, registered by name."""

from __future__ import annotations

from ..errors import UserError
from .base import OpSpec, Problem
from .adamw import SPEC as ADAMW
from .attn_softmax import SPEC as ATTN_SOFTMAX
from .compressor import SPEC as COMPRESSOR
from .cross_entropy import SPEC as CROSS_ENTROPY
from .indexer_score import SPEC as INDEXER_SCORE
from .mhc import HEAD as MHC_HEAD
from .mhc import PRE as MHC_PRE
from .mhc_post import SPEC as MHC_POST
from .rms_norm import SPEC as RMS_NORM
from .rope import SPEC as ROPE
from .router import SPEC as ROUTER
from .swiglu import SPEC as SWIGLU

OPS: dict[str, OpSpec] = {spec.name: spec for spec in (RMS_NORM, MHC_PRE, MHC_POST, MHC_HEAD, ROUTER, SWIGLU, ROPE, ATTN_SOFTMAX,
                                                        COMPRESSOR, INDEXER_SCORE, CROSS_ENTROPY, ADAMW)}


def get_op(name: str) -> OpSpec:
    spec = OPS.get(name)
    if spec is None:
        raise UserError(f"unknown operator {name!r}: accepted are {', '.join(sorted(OPS))}")
    return spec


__all__ = ["OPS", "OpSpec", "Problem", "get_op"]
