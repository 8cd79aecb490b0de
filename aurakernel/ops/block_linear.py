"""The attention's grouped output projection: transformers' DeepseekV4GroupedLinear (o_a_proj), a
block-diagonal linear. The heads' outputs are cut into G groups and each group goes through its own
[OUT, IN] block of the weight,

    y[t, g] = x[t, g] W_g^T,   W_g = weight[g OUT : (g + 1) OUT]     x: [tokens, G, IN], y: [tokens, G, OUT]

(V4-Flash: 8 groups of 4096 -> 1024; V4-Pro: 16). Eager it is a torch.bmm over transposed views and
a copy of the transposed result; the backward two more bmm. The host kernel runs each group's three
GEMMs on `linear`'s planned, packed driver, reading x and writing y and dx in their [tokens, G, .]
layout through strides (no transposed copies).
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

# fp32 sums of IN (forward, dx) or of the tokens (dW) in another order than torch's bmm
_TOL = Tolerance(1e-4, 1e-4)


def block_linear_module(groups: int, d_in: int, d_out: int) -> DeepseekV4GroupedLinear:
    """transformers' module: G blocks of [OUT, IN], no bias."""
    return DeepseekV4GroupedLinear(d_in, groups * d_out, groups)


class BlockLinearSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        tokens, groups, d_in, d_out = problem.shape
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(tokens, groups, d_in, generator=g),
                "weight": torch.randn(groups * d_out, d_in, generator=g) / d_in**0.5}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("x", "weight")

    def module_call(self, problem: Problem, inputs: Tensors):
        _, groups, d_in, d_out = problem.shape
        module = block_linear_module(groups, d_in, d_out)
        with torch.no_grad():
            module.weight.copy_(inputs["weight"])
        return module, (inputs["x"],)

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        """transformers' forward (a bmm over transposed views) with the inputs' weight."""
        _, groups, d_in, d_out = problem.shape
        module = block_linear_module(groups, d_in, d_out)
        # the module run with the input weight in its place, so the reference's gradient reaches it
        return {"y": torch.func.functional_call(module, {"weight": inputs["weight"]}, (inputs["x"],))}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL

    def work(self, problem: Problem, backward: bool) -> Work:
        """x, W and y once each; the backward reads dy, x and W and writes dx and dW."""
        tokens, groups, d_in, d_out = problem.shape
        e, w = problem.dtype.itemsize, groups * d_out * d_in
        flops = 2 * tokens * groups * d_in * d_out
        if backward:
            return Work((2 * tokens * groups * d_in + tokens * groups * d_out + 2 * w) * e, 2 * flops)
        return Work((tokens * groups * (d_in + d_out) + w) * e, flops)


SPEC = BlockLinearSpec(
    name="block_linear",
    summary="the attention's grouped output projection (DeepseekV4GroupedLinear, o_a_proj): a GEMM per group",
    shape_meaning="TOKENSxGROUPSxINxOUT: tokens x groups x input x output features of a group",
    shape_rank=4,
    default_shape=(1024, 8, 512, 128),
    dtypes=(DType.fp32,),
    variants=("default",),
)
