"""The host kernel of grouped_linear: the routed experts' projections as linear's planned GEMMs, one
group after the other or the groups dealt to the threads (templates/host/grouped_linear.c.j2), their
tiling model and calls.

Where the time goes (tiny V4 config, 1024 tokens x top-2 over 8 experts: ~256 rows an expert, fp32,
2-core EPYC with AVX-512): torch's CPU `_grouped_mm` is one MKL GEMM per expert, and its autograd two
more, at the narrow shapes linear's docstring describes; in the training step ~42 ms of ~160. The
same GEMMs on linear's packed driver, every group in one C call each way: 2048x8x256x256 fwd+bwd
4.05 ms alone (preallocated outputs) against torch's 5.3 through the module, 4.8 ms through ours
(the custom op, autograd and fresh outputs: ~0.7 ms); 1.12-1.28x eager in autotune's side-by-side
timing, the step's grouped projections ~27 ms, the step 182.8 -> 168.9 and 160.9 -> 153.1 ms (two
A/B runs of 12 steps, plans with and without the kernel). How the threads share the work is the
`by_group` knob, timed by tune: at 8 groups either way is within 5% (the model prices the groups as
equal, the router fills them unevenly), at 64 groups of ~128 rows (8192x64x512x256) whole groups per
thread ran 35.0 ms against 38.5 (one fork a call, B packed once per GEMM, not per thread).
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.grouped_linear import SPEC
from ..library import Entry
from .linear import Gemm, LinearHost, gemm_model, gemms


def group_gemms(problem: Problem) -> dict[str, list[Gemm]]:
    """One group's GEMMs: linear's (linear.gemms) for the mean rows of a group."""
    rows, experts, d_in, d_out = problem.shape
    return gemms(Problem(problem.op, problem.variant, (max(1, -(-rows // max(experts, 1))), d_in, d_out), problem.dtype))


def _bounds(offsets) -> torch.Tensor:
    """The kernel's scratch for the groups' row ranges and order: 3 int64 a group."""
    return torch.empty(3 * max(offsets.shape[0], 1), dtype=torch.int64)


class GroupedLinearHost(LinearHost):
    knob_docs = {**LinearHost.knob_docs,
                 "by_group": "1: the threads take whole groups (each GEMM on one thread); 0: they share every GEMM"}
    entries = {"fwd": Entry("ak_grouped_linear_fwd", ("ptr", "ptr", "ptr", "i64", "i64", "ptr", "ptr", "ptr")),
               "bwd": Entry("ak_grouped_linear_bwd", ("ptr", "ptr", "ptr", "ptr", "i64", "i64", "ptr", "ptr", "ptr", "ptr")),
               "scratch": Entry("ak_grouped_linear_scratch", (), "i64")}

    def tiling_problem(self, problem: Problem, hw):
        return gemm_model(group_gemms(problem), hw, groups=problem.shape[1])

    def measured_knobs(self, problem: Problem) -> tuple[str, ...]:
        """The model knows the mean rows of a group, not how unevenly the router fills them, so the
        groups' split over the threads is timed on the tuned problem's inputs."""
        return ("by_group",) if problem.shape[1] > 1 else ()

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        rows, _, d_in, d_out = problem.shape
        flat = Problem(problem.op, problem.variant, (rows, d_in, d_out), problem.dtype)
        return {**super().render_params(flat, knobs), "by_group": int(knobs.get("by_group", 0))}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        x = inputs["x"]
        return {"y": x.new_empty(x.shape[0], inputs["weight"].shape[1])}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        x, w, offsets = inputs["x"], inputs["weight"], inputs["offsets"]
        kernel.call("fwd", x, w, offsets, offsets.shape[0], x.shape[0], outputs["y"], kernel.workspace("scratch"),
                    _bounds(offsets))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        x, w, offsets = inputs["x"], inputs["weight"], inputs["offsets"]
        kernel.call("bwd", grad_outputs["y"], x, w, offsets, offsets.shape[0], x.shape[0], grads["x"], grads["weight"],
                    kernel.workspace("scratch"), _bounds(offsets))

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        """linear's cases (rows split unevenly over threads and k-panels, widths off the SIMD grid) with
        the tuned experts, whose inputs (make_inputs) route nothing to the first: an empty group."""
        rows, experts, d_in, d_out = problem.shape
        flat = Problem(problem.op, problem.variant, (-(-rows // max(experts, 1)), d_in, d_out), problem.dtype)
        return [problem] + [Problem(p.op, p.variant, (p.shape[0] * experts, experts, *p.shape[1:]), p.dtype)
                            for p in super().verification_problems(flat, knobs, simd_elems)[1:]]


PARTS = (GroupedLinearHost(SPEC),)
