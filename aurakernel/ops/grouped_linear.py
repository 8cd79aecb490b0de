"""The routed experts' projections: transformers' `_grouped_linear` (integrations/moe.py), which its
grouped_mm experts forward calls twice per MoE layer (gate_up, then down), each

    y[r] = x[r] W[g]^T   for the rows r of group g: offsets[g - 1] <= r < offsets[g]

over the (token, expert) rows sorted by expert, W: [experts, OUT, IN]. On the CPU torch's
`_grouped_mm` runs it as one GEMM per expert (and autograd's two more per expert): matmul work
whose time is the FMA rate the code reaches at an expert's narrow shapes (the tiny config: ~256 rows
x 256 x 256). The host kernel runs the same GEMMs on the planned, packed driver of `linear`, all
groups in one call each way.

It is a function the experts' code calls, not a module: the patch makes a patched experts module's
forward call the kernel (patch.install.swap_globals), the profiler records its calls (SWAP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations import moe

from . import scoped
from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

SWAP = scoped.FunctionSwap(moe, "_grouped_linear")

# fp32 sums of IN (forward, dx) or of a group's rows (dW) in another order than torch's GEMM
_TOL = Tolerance(1e-4, 1e-4)


def group_sizes(rows: int, experts: int, seed: int) -> torch.Tensor:
    """Uneven rows per expert summing to `rows`, the first expert routed nothing (an empty group, as
    an expert no token picked): what the router's top-k gives a batch."""
    g = torch.Generator().manual_seed(seed)
    share = torch.rand(experts, generator=g) + 0.5
    share[0] = 0.0 if experts > 1 else 1.0
    sizes = (share / share.sum() * rows).floor().long()
    sizes[-1] += rows - int(sizes.sum())
    return sizes


def call_problem(input, weight, offs, bias=None, is_transposed=False) -> Problem | None:
    """The grouped_linear problem of one `_grouped_linear` call (for the profiler's recorder): the
    kernel's case, fp32 without bias and with W as [experts, OUT, IN]."""
    if (bias is not None or is_transposed or input.dim() != 2 or weight.dim() != 3
            or input.dtype != torch.float32 or weight.dtype != torch.float32):
        return None
    experts, d_out, d_in = weight.shape
    return Problem("grouped_linear", "default", (input.shape[0], experts, d_in, d_out), DType.fp32)


class GroupedLinearReference(torch.nn.Module):
    """The experts' weights and a call of the (possibly patched) module-level `_grouped_linear`, as
    the experts' forward makes it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _grouped_linear(x, self.weight, offsets, is_transposed=False)


_grouped_linear = moe._grouped_linear   # the global GroupedLinearReference's code calls (patched per module)


class GroupedLinearSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[2:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, experts, d_in, d_out = problem.shape
        g = torch.Generator().manual_seed(seed)
        offsets = torch.cumsum(group_sizes(rows, experts, seed), 0).to(torch.int32)
        return {"x": torch.randn(rows, d_in, generator=g),
                "weight": torch.randn(experts, d_out, d_in, generator=g) / d_in**0.5,
                "offsets": offsets}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("x", "weight")

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        """What `_grouped_linear` computes, one F.linear per group: torch's grouped GEMM itself takes
        only rows of whole 16 B (not the odd widths the kernel is verified at) and no float64."""
        x, w = inputs["x"], inputs["weight"]
        parts, lo = [], 0
        for g, hi in enumerate(inputs["offsets"].tolist()):
            parts.append(F.linear(x[lo:hi], w[g]))
            lo = hi
        return {"y": torch.cat([*parts, x.new_zeros(x.shape[0] - lo, w.shape[1])])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL

    def work(self, problem: Problem, backward: bool) -> Work:
        """x, every W and y once each; the backward reads dy, x and W and writes dx and dW."""
        rows, experts, d_in, d_out = problem.shape
        e, w = problem.dtype.itemsize, experts * d_out * d_in
        if backward:
            return Work((2 * rows * d_in + rows * d_out + 2 * w) * e, 4 * rows * d_in * d_out)
        return Work((rows * d_in + w + rows * d_out) * e, 2 * rows * d_in * d_out)

    def module_call(self, problem: Problem, inputs: Tensors):
        return GroupedLinearReference(inputs["weight"]), (inputs["x"], inputs["offsets"])


SPEC = GroupedLinearSpec(
    name="grouped_linear",
    summary="the routed experts' grouped projections (transformers' _grouped_linear) as planned GEMMs per expert",
    shape_meaning="ROWSxEXPERTSxINxOUT: routed (token, expert) rows x experts x input x output features",
    shape_rank=4,
    default_shape=(2048, 8, 256, 256),
    dtypes=(DType.fp32,),
    variants=("default",),
)
