"""The rope kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import functools

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.rope import SWAP, RopeReference, SPEC
from ..targets.host.library import built_kernel
from ..targets.host.ops.rope import _call
from .base import Patch
from .install import swap_globals
from .torch_op import torch_op


def _like(t: torch.Tensor) -> torch.Tensor:
    """The output of a rotation of t: t's layout where t is dense (the attention output's transposed
    view stays one, so the reshape after it is a view, not a copy), else contiguous; rows of unit
    stride either way (the kernel writes through the strides). The fake implementations make the same,
    so a compiled graph sees the strides the kernel writes."""
    y = torch.empty_like(t)
    return y if y.stride(-1) == 1 else t.new_empty(t.shape)


def _forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: str) -> torch.Tensor:
    y = _like(x)
    _call(built_kernel(kernel), "fwd", x, cos, sin, y)
    return y


def _backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: str) -> torch.Tensor:
    """The inverse rotation (dx keeps dy's shape and layout; rope is orthogonal)."""
    dx = _like(dy)
    _call(built_kernel(kernel), "bwd", dy, cos, sin, dx)
    return dx


OP = torch_op("rope", _forward, _backward, fake_forward=lambda x, cos, sin, kernel: _like(x),
              fake_backward=lambda dy, cos, sin, kernel: _like(dy),
              saved=("cos", "sin"), consts=("kernel",), grads=("x",))


def rope_dispatch(lookup, x, cos, sin, unsqueeze_dim: int = 1):
    """Drop-in for v4.apply_rotary_pos_emb with `lookup` bound (functools.partial): the kernel when
    one fits the call, else the reference."""
    if (unsqueeze_dim != 1 or x.dim() != 4 or cos.dim() != 3 or x.device.type != "cpu"
            or cos.requires_grad or sin.requires_grad):
        return SWAP.reference(x, cos, sin, unsqueeze_dim)
    kernel = lookup((x.shape[-1], 2 * cos.shape[-1]), x.dtype)
    if kernel is None:
        return SWAP.reference(x, cos, sin, unsqueeze_dim)
    return OP(x, cos, sin, kernel)


# the modules whose code calls apply_rotary_pos_emb (the attention, the compressors, the indexer)
ROPE_CALLERS = (v4.DeepseekV4Attention, v4.DeepseekV4HCACompressor, v4.DeepseekV4CSACompressor, v4.DeepseekV4Indexer)




def call_problem(x, cos, sin, unsqueeze_dim=1):
    """The rope problem of one call (for the profiler's recorder)."""
    if x.dim() != 4 or x.dtype not in (d.torch for d in SPEC.dtypes):
        return None
    b, h, s, d = x.shape
    return Problem("rope", "default", (b * s, h, d, 2 * cos.shape[-1]), DType.from_torch(x.dtype))


class RopePatch(Patch):
    def call_problem(self, module, args):
        return None   # a function, not a module: the profiler records it through SWAP.recording

    def patch(self, module: torch.nn.Module, lookup) -> None:
        """Make rope run kernels in every module of `module` (a DeepseekV4Model, or RopeReference)
        whose code calls apply_rotary_pos_emb."""
        dispatch = functools.partial(rope_dispatch, lookup)
        for sub in module.modules():
            if isinstance(sub, (*ROPE_CALLERS, RopeReference)):
                swap_globals(sub, apply_rotary_pos_emb=dispatch)


PARTS = (RopePatch(SPEC),)
