"""The host kernel of block_linear: the attention's grouped output projection as linear's planned GEMMs,
a group after the other or the groups dealt to the threads (templates/host/block_linear.c.j2), their
tiling model and calls.

Where the time goes (tiny V4 config: 1024 tokens x 2 groups of 128 -> 64, fp32, 2-core EPYC with
AVX-512): torch.bmm over the transposed views (forward, and two in the backward) ran at ~130 GFLOP/s
and the transposed result was copied back to [tokens, G, OUT]; ~3.3 ms of the training step. The
kernel alone runs 1024x2x128x64 at ~205-215 GFLOP/s (forward 157 us, backward 330 us, either way of
sharing the GEMMs within 3%), through the module (the custom op, autograd, fresh outputs) 666 us
against eager's 713 and torch.compile's 841 (`tune`, one run); the training step with / without it
153.0 / 159.7 and 142.8 / 146.4 ms (A/B runs of 12 and 24 alternating steps).
"""

from __future__ import annotations

from ....ops.base import Problem, Tensors
from ....ops.block_linear import SPEC
from ..library import Entry
from .linear import Gemm, LinearHost, gemm_model


def block_gemms(problem: Problem) -> dict[str, list[Gemm]]:
    """One group's GEMMs: linear's (linear.gemms), A's rows G times as far apart."""
    tokens, groups, d_in, d_out = problem.shape
    dw = d_in * d_out
    return {"forward": [Gemm(tokens, d_out, d_in, True, groups * d_in, dw)],
            "backward": [Gemm(tokens, d_in, d_out, False, groups * d_out, dw),
                         Gemm(d_out, d_in, tokens, False, groups * d_out, dw)]}


class BlockLinearHost(LinearHost):
    knob_docs = {**LinearHost.knob_docs,
                 "by_group": "1: the threads take whole groups (each GEMM on one thread); 0: they share every GEMM"}
    entries = {"fwd": Entry("ak_block_linear_fwd", ("ptr", "ptr", "ptr", "i64", "ptr")),
               "bwd": Entry("ak_block_linear_bwd", ("ptr", "ptr", "ptr", "ptr", "ptr", "i64", "ptr")),
               "scratch": Entry("ak_block_linear_scratch", (), "i64")}

    def tiling_problem(self, problem: Problem, hw):
        return gemm_model(block_gemms(problem), hw, groups=problem.shape[1])

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        tokens, groups, d_in, d_out = problem.shape
        flat = Problem(problem.op, problem.variant, (tokens, d_in, d_out), problem.dtype)
        return {**super().render_params(flat, knobs), "groups": int(groups), "by_group": int(knobs.get("by_group", 0))}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        x = inputs["x"]
        return {"y": x.new_empty(x.shape[0], x.shape[1], inputs["weight"].shape[0] // x.shape[1])}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        x = inputs["x"]
        kernel.call("fwd", x, inputs["weight"], outputs["y"], x.shape[0], kernel.workspace("scratch"))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        x = inputs["x"]
        kernel.call("bwd", grad_outputs["y"], x, inputs["weight"], grads["x"], grads["weight"], x.shape[0],
                    kernel.workspace("scratch"))

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        """linear's cases (tokens split unevenly over threads and k-panels, widths off the SIMD grid)
        with the tuned groups."""
        tokens, groups, d_in, d_out = problem.shape
        flat = Problem(problem.op, problem.variant, (tokens, d_in, d_out), problem.dtype)
        return [problem] + [Problem(p.op, p.variant, (p.shape[0], groups, *p.shape[1:]), p.dtype)
                            for p in super().verification_problems(flat, knobs, simd_elems)[1:]]


PARTS = (BlockLinearHost(SPEC),)
