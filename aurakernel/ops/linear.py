"""A bias-free linear layer, y = x W^T (torch.nn.Linear without bias): every projection of V4 (the
query's low-rank pair, the KV and output projections, the shared expert, the compressors' and the
indexer's projections).

It is matmul work, not a chain of small ops: on the host its time is the GEMMs' FLOPs at the rate
the code reaches. torch's CPU GEMM (MKL / oneDNN) runs V4's narrow projections (1024 tokens x 256
x 128 in the tiny config) at 55-80% of an AVX2 core pair's FMA peak; a GEMM planned for the
shape (panel sizes from the machine's caches) and reading W and dy through strides, not
transposed copies, gets closer. A plan keeps the kernel only where it measured faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

# fp32 sums of IN (forward, dx) or TOKENS (dW) products in another order than torch's GEMM: the
# error grows with the reduction's length, ~1e-6 relative per term at unit-scale inputs
_TOL = Tolerance(1e-4, 1e-4)


class LinearSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        tokens, d_in, d_out = problem.shape
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(tokens, d_in, generator=g).to(problem.dtype.torch),
                "weight": (torch.randn(d_out, d_in, generator=g) / d_in**0.5).to(problem.dtype.torch)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("x", "weight")

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": F.linear(inputs["x"], inputs["weight"])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL

    def work(self, problem: Problem, backward: bool) -> Work:
        """x, W and y once each; the backward reads dy, x and W and writes dx and dW."""
        tokens, d_in, d_out = problem.shape
        e = problem.dtype.itemsize
        if backward:
            return Work((2 * tokens * d_in + tokens * d_out + 2 * d_out * d_in) * e, 4 * tokens * d_in * d_out)
        return Work((tokens * d_in + d_out * d_in + tokens * d_out) * e, 2 * tokens * d_in * d_out)

    def module_call(self, problem: Problem, inputs: Tensors):
        _, d_in, d_out = problem.shape
        mod = torch.nn.Linear(d_in, d_out, bias=False, dtype=problem.dtype.torch)
        with torch.no_grad():
            mod.weight.copy_(inputs["weight"])
        return mod, (inputs["x"],)


SPEC = LinearSpec(
    name="linear",
    summary="bias-free nn.Linear (y = x W^T) as three planned, strided GEMMs (forward, dx, dW)",
    shape_meaning="TOKENSxINxOUT: tokens x input features x output features",
    shape_rank=3,
    default_shape=(1024, 256, 128),
    dtypes=(DType.fp32,),
    variants=("default",),
)
