"""mHC post: the stream update at the end of each DeepseekV4DecoderLayer sub-block,

    new_streams = post (x) block_output + comb^T @ streams

written inline in DeepseekV4DecoderLayer.forward (twice per layer). The kernel is one pass over
the streams forward and one backward (all four gradients together). Swapping patches the layer's
forward to route both updates through an `MhcPost` module (Liger-style: the layer's code is
repeated with that one expression replaced).
"""

from __future__ import annotations

import torch

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

_TOL = {
    DType.fp32: {n: Tolerance(1e-5, 1e-5) for n in ("y", "out", "h")} | {n: Tolerance(1e-4, 1e-4) for n in ("post", "comb")},
    DType.bf16: {n: Tolerance(2e-2, 1.6e-2) for n in ("y", "out", "h")} | {n: Tolerance(2e-2, 2e-2) for n in ("post", "comb")},
    DType.fp16: {n: Tolerance(2e-3, 2e-3) for n in ("y", "out", "h")} | {n: Tolerance(2e-3, 2e-3) for n in ("post", "comb")},
}


class MhcPost(torch.nn.Module):
    """The reference: DeepseekV4DecoderLayer's stream update, verbatim."""

    def forward(self, post, comb, block_output, hidden_states):
        dtype = hidden_states.dtype
        return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden_states)


class MhcPostSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, hc, d = problem.shape
        g = torch.Generator().manual_seed(seed)
        comb = torch.rand(rows, hc, hc, generator=g)
        return {"post": 2 * torch.rand(rows, hc, generator=g), "comb": comb / comb.sum(-1, keepdim=True),
                "out": torch.randn(rows, d, generator=g).to(problem.dtype.torch),
                "h": torch.randn(rows, hc, d, generator=g).to(problem.dtype.torch)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("post", "comb", "out", "h")

    def module_call(self, problem: Problem, inputs: Tensors):
        return MhcPost(), (inputs["post"], inputs["comb"], inputs["out"], inputs["h"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": MhcPost()(inputs["post"], inputs["comb"], inputs["out"], inputs["h"])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    def work(self, problem: Problem, backward: bool) -> Work:
        rows, hc, d = problem.shape
        e = problem.dtype.itemsize
        if not backward:
            return Work(rows * ((2 * hc + 1) * d * e + (hc + hc * hc) * 4), rows * d * hc * (2 * hc + 2))
        return Work(rows * ((3 * hc + 2) * d * e + 2 * (hc + hc * hc) * 4), rows * d * hc * (4 * hc + 4))

SPEC = MhcPostSpec(
    name="mhc_post",
    summary="mHC post (DeepseekV4DecoderLayer): post-weighted block output + comb^T @ streams",
    shape_meaning="ROWSxHCxD: tokens x streams (hc_mult) x hidden",
    shape_rank=3,
    default_shape=(2048, 4, 4096),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)
