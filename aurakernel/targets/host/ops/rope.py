"""The host C kernel of rope (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 4096x64x512x64 bf16, 2-core Xeon, AVX-512): 1.40x the
minimum traffic alone (forward 29.6 ms vs 18.6, backward 22.5 vs 18.6): the rotated pairs are
interleaved (even/odd lanes), so each vector of output takes a permute of its inputs; the
untouched part of every head is a plain copy at the stream rate.
On the AVX2 EPYC (interleaved A/B of the kernels alone, 1024x64x512x64 bf16) the forward took 1.5x
the backward: its x is the transposed view the attention hands over, and rows taken in (b, h, s)
order read 1 KB at a time 64 KB apart. Rows are now taken in x's memory order (y written a row
apart instead): forward 12.7 -> 10.0 ms median. In bf16 a rotated pair is one 32-bit word
(ak_pair_t): no deinterleaving shuffles (forward 1.05x alone, within the noise here).
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.rope import SPEC
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


def _call(kernel, entry: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor) -> None:
    b, h, s, _ = x.shape
    c32 = cos.float().expand(b, s, cos.shape[-1])
    s32 = sin.float().expand(b, s, sin.shape[-1])
    if c32.stride(-1) != 1 or s32.stride() != c32.stride():
        c32, s32 = c32.contiguous(), s32.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if y.stride(-1) != 1:
        raise ValueError(f"rope writes rows of unit stride: y's strides are {y.stride()}")
    kernel.call(entry, x, x.stride(0), x.stride(1), x.stride(2), c32, s32, c32.stride(0), c32.stride(1),
                y, y.stride(0), y.stride(1), y.stride(2), b, h, s)


class RopeHost(HostKernel):
    knob_docs = {"tile_rows": "(token, head) rows per tile", "threads": "OpenMP threads"}
    entries = {name: Entry(f"ak_rope_{name}", ("ptr", "i64", "i64", "i64", "ptr", "ptr", "i64", "i64", "ptr", "i64", "i64",
                                               "i64", "i64", "i64", "i64")) for name in ("fwd", "bwd")}

    def tiling_problem(self, problem: Problem, hw):
        tokens, heads, head_dim, rope_dim = problem.shape
        e = problem.dtype.itemsize
        phase = RowwisePhase("forward", 2 * head_dim * e, 3 * rope_dim + head_dim, 0, 0, 0, 0)
        back = RowwisePhase("backward", 2 * head_dim * e, 3 * rope_dim + head_dim, 0, 0, 0, 0)
        return rowwise_model(tokens * heads, head_dim, [phase, back], hw, fixed={"col_chunk": head_dim})

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "head_dim": int(problem.shape[2]), "rope_dim": int(problem.shape[3]),
                "tile_rows": int(knobs["tile_rows"]), "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        x = inputs["x"]
        return {"y": torch.empty(x.shape, dtype=x.dtype)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        _call(kernel, "fwd", inputs["x"], inputs["cos"], inputs["sin"], outputs["y"])

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        _call(kernel, "bwd", grad_outputs["y"], inputs["cos"], inputs["sin"], grads["x"])

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        tokens, heads, head_dim, rope_dim = problem.shape
        tail = min(tokens, knobs["tile_rows"] * knobs["threads"] + 3)
        return [problem, Problem(problem.op, problem.variant, (tail, heads + 1, head_dim + 3, rope_dim), problem.dtype)]


PARTS = (RopeHost(SPEC),)
