"""The routed experts' combine: after the grouped projections, transformers' grouped_mm experts forward
(integrations/moe.py) weights each (token, k) pair's row by its routing weight, puts the rows back in
token order and sums a token's K of them,

    weighted = proj * sample_weights_g[:, None];   out[t] = sum_k weighted[rows[t K + k]]

(rows: each pair's row, moe_permute's output, transformers' inv_perm). Eager that is a multiply, a
gather of every row and a reduction, each a pass over [tokens x K, H]; the backward two more
multiplies, a reduction, a scatter and an expand. The kernel reads each pair's row once: forward
out[t] = sum_k w[t, k] proj[rows[t K + k]], backward d proj[rows[t K + k]] = w[t, k] d out[t] and
d w[t, k] = d out[t] . proj[rows[t K + k]], one call each.
"""

from __future__ import annotations

import torch

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

# fp32: the weights' gradient is a dot product over H in another order than torch's multiply and sum
_TOL = {DType.fp32: Tolerance(1e-5, 1e-5), DType.bf16: Tolerance(1.6e-2, 1e-2)}


def moe_unpermute(proj: torch.Tensor, top_k_weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """transformers' combine (grouped_mm_experts_forward): each pair's row, weighted, summed per token
    (the multiply commutes with the gather, so it is done after it: the same values)."""
    tokens, top_k = top_k_weights.shape
    weighted = proj.index_select(0, rows) * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(tokens, top_k, proj.shape[-1]).sum(dim=1)


class MoeUnpermuteReference(torch.nn.Module):
    """The combine as the experts' forward (patch/experts.py) calls it: the module-level
    `moe_unpermute`, which a patch swaps for the kernel in this module's namespace."""

    def forward(self, proj: torch.Tensor, top_k_weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return moe_unpermute(proj, top_k_weights, rows)


class MoeUnpermuteSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        tokens, top_k, hidden = problem.shape
        g = torch.Generator().manual_seed(seed)
        weights = torch.rand(tokens, top_k, generator=g) + 0.1
        return {"proj": torch.randn(tokens * top_k, hidden, generator=g).to(problem.dtype.torch),
                "top_k_weights": (weights / weights.sum(-1, keepdim=True)).to(problem.dtype.torch),
                "rows": torch.randperm(tokens * top_k, generator=g)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("proj", "top_k_weights")

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": moe_unpermute(inputs["proj"], inputs["top_k_weights"], inputs["rows"])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype]

    def work(self, problem: Problem, backward: bool) -> Work:
        """The K rows a token and its output row (backward: d out, the rows and their gradients)."""
        tokens, top_k, hidden = problem.shape
        e = problem.dtype.itemsize
        pairs = tokens * top_k
        if backward:
            return Work((2 * pairs * hidden + tokens * hidden) * e + pairs * (8 + 2 * e), 4 * pairs * hidden)
        return Work((pairs * hidden + tokens * hidden) * e + pairs * (8 + e), 2 * pairs * hidden)

    def module_call(self, problem: Problem, inputs: Tensors):
        return MoeUnpermuteReference(), (inputs["proj"], inputs["top_k_weights"], inputs["rows"])


SPEC = MoeUnpermuteSpec(
    name="moe_unpermute",
    summary="the routed experts' combine: each (token, expert) row weighted by its routing weight, summed per token",
    shape_meaning="TOKENSxTOPKxHIDDEN: tokens x experts per token x hidden size",
    shape_rank=3,
    default_shape=(1024, 6, 4096),
    dtypes=(DType.fp32, DType.bf16),
    variants=("default",),
)
