"""Interleaved partial RoPE: transformers' DeepSeek-V4 `apply_rotary_pos_emb`, as the attention
uses it on q, on the shared kv, and (with -sin) to de-rotate the attention output, and as the
compressor and the indexer use it on their pooled keys and queries.

It is a module-level function, not a module: the patch makes the modules of a patched model that
call it (ROPE_CALLERS) call `rope_dispatch` instead (patch.install.swap_globals); every other
module in the process keeps the reference.
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from . import scoped
from ..dtypes import DType
from ..errors import UserError
from .base import OpSpec, Problem, Tensors, Tolerance, Work

# bf16/fp16: the reference rounds each of the two gradient paths (x and rotate_half(x)) to the
# input dtype before adding them; the kernel rounds once, so they differ by about one ulp
_TOL = {DType.fp32: Tolerance(1e-6, 1e-5), DType.bf16: Tolerance(3e-2, 1.6e-2), DType.fp16: Tolerance(4e-3, 2e-3)}


class RopeReference(torch.nn.Module):
    """Calls the (possibly patched) module-level function, as the attention does."""

    def forward(self, x, cos, sin):
        return apply_rotary_pos_emb(x, cos, sin)


def _angles(tokens: int, rope_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
    freqs = torch.arange(tokens, dtype=torch.float)[None, :, None] * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


# the transformers function the kernel replaces, captured before anything patched it
SWAP = scoped.FunctionSwap(v4, "apply_rotary_pos_emb")


class RopeSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[2:]

    def check_shape(self, shape):
        _, _, head_dim, rope_dim = shape
        if rope_dim % 2 or rope_dim > head_dim:
            raise UserError(f"rope shape {shape}: ROPE_DIM must be even and at most HEAD_DIM")

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        tokens, heads, head_dim, rope_dim = problem.shape
        g = torch.Generator().manual_seed(seed)
        # [B=1, H, S, D] as the transposed view the attention hands over
        x = torch.randn(1, tokens, heads, head_dim, generator=g).to(problem.dtype.torch).transpose(1, 2)
        cos, sin = _angles(tokens, rope_dim, problem.dtype.torch)
        return {"x": x, "cos": cos, "sin": sin}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("x",)

    def module_call(self, problem: Problem, inputs: Tensors):
        return RopeReference(), (inputs["x"], inputs["cos"], inputs["sin"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": SWAP.reference(inputs["x"], inputs["cos"], inputs["sin"])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype]

    def work(self, problem: Problem, backward: bool) -> Work:
        tokens, heads, head_dim, rope_dim = problem.shape
        e = problem.dtype.itemsize
        return Work(2 * tokens * heads * head_dim * e + tokens * rope_dim * 4, 3 * tokens * heads * rope_dim)

SPEC = RopeSpec(
    name="rope",
    summary="interleaved partial RoPE on the trailing rope slice of each head (and its inverse)",
    shape_meaning="TOKENSxHEADSxHEAD_DIMxROPE_DIM",
    shape_rank=4,
    default_shape=(4096, 64, 512, 64),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)
