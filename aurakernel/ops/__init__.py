"""The operator library: one OpSpec per operator, registered by name.

Operators from outside AuraKernel join it without an edit here: a package declares its parts (its
OpSpec; a kernel per target it supports, targets/host/kernel.py HostKernel and targets/ascend/kernel.py
AscendKernel; and where it goes in a model, patch/base.py Patch) in the `aurakernel.ops` entry-point
group (`toy = my_package:PARTS` under `[project.entry-points."aurakernel.ops"]`), loaded when this
module is imported, or calls `aurakernel.register(spec, kernel, patch)`. Its spec names its template
folders (OpSpec.template_dirs) and its patch the modules it replaces (Patch.sites); `aurakernel ops`
lists it and `tune` tunes it like a built-in one.
"""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points

from ..errors import UserError
from ..parts import Part
from .adamw import SPEC as ADAMW
from .attn_softmax import SPEC as ATTN_SOFTMAX
from .base import OpSpec, Problem
from .block_linear import SPEC as BLOCK_LINEAR
from .compressor import SPEC as COMPRESSOR
from .cross_entropy import SPEC as CROSS_ENTROPY
from .grouped_linear import SPEC as GROUPED_LINEAR
from .indexer_score import SPEC as INDEXER_SCORE
from .linear import SPEC as LINEAR
from .linear_cross_entropy import SPEC as LINEAR_CROSS_ENTROPY
from .mhc import HEAD as MHC_HEAD
from .mhc import PRE as MHC_PRE
from .mhc_post import SPEC as MHC_POST
from .mhc_post_pre import SPEC as MHC_POST_PRE
from .moe_permute import SPEC as MOE_PERMUTE
from .moe_unpermute import SPEC as MOE_UNPERMUTE
from .rms_norm import SPEC as RMS_NORM
from .rope import SPEC as ROPE
from .sparse_attention import SPEC as SPARSE_ATTENTION
from .router import SPEC as ROUTER
from .swiglu import SPEC as SWIGLU

OPS: dict[str, OpSpec] = {spec.name: spec for spec in (RMS_NORM, MHC_PRE, MHC_POST, MHC_POST_PRE, MHC_HEAD, ROUTER, SWIGLU, ROPE, ATTN_SOFTMAX,
                                                        COMPRESSOR, INDEXER_SCORE, SPARSE_ATTENTION, CROSS_ENTROPY,
                                                        LINEAR_CROSS_ENTROPY, LINEAR, GROUPED_LINEAR, BLOCK_LINEAR, MOE_PERMUTE,
                                                        MOE_UNPERMUTE,
                                                        ADAMW)}


ENTRY_POINT_GROUP = "aurakernel.ops"


def register(*parts):
    """Add an operator to the library: its OpSpec, its kernels and its patch (any object with a
    `register()` method and a `spec`: HostKernel, AscendKernel, Patch), each idempotent for the same
    object. Returns the first."""
    if not parts:
        raise UserError("register takes an operator's OpSpec and its kernels, got nothing")
    for part in parts:
        if isinstance(part, OpSpec):
            have = OPS.get(part.name)
            if have is not None and have is not part:
                raise UserError(f"operator {part.name!r} is already registered (by {type(have).__module__}): "
                                "choose another name")
            OPS[part.name] = part
        elif isinstance(part, Part) and isinstance(part.spec, OpSpec):
            part.register()
        else:
            raise UserError(f"register takes an OpSpec, an operator's kernel (HostKernel, AscendKernel) or its Patch, "
                            f"got {type(part).__name__}")
    return parts[0]


def load_entry_points() -> list[str]:
    """Register the OpSpecs that installed packages declare in the entry-point group; one that does
    not load is a warning naming it, not a failure of the library. Returns the names registered."""
    names = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            parts = ep.load()
            register(*(parts if isinstance(parts, tuple | list) else (parts,)))
            names.append(ep.name)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the built-in operators
            warnings.warn(f"aurakernel.ops entry point {ep.name!r} ({ep.value}) was not loaded: "
                          f"{type(exc).__name__}: {exc}", stacklevel=2)
    return names


def get_op(name: str) -> OpSpec:
    spec = OPS.get(name)
    if spec is None:
        raise UserError(f"unknown operator {name!r}: accepted are {', '.join(sorted(OPS))}")
    return spec


load_entry_points()

__all__ = ["ENTRY_POINT_GROUP", "OPS", "OpSpec", "Problem", "get_op", "load_entry_points", "register"]
