"""The host C kernel of swiglu (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 8192x2048 bf16, 2-core Xeon, AVX-512): 1.74x the
minimum traffic alone (forward 7.0 ms vs 3.5, backward 9.2 vs 5.8). The arithmetic binds: a
sigmoid per element is an exp (a degree-6 polynomial) and a division, ~2.5 cycles per element per
core, which one pass over 16.8 M elements cannot hide behind its 96 MB of traffic. 512-bit vectors
took the backward from 12.9 to 9.2 ms. The sigmoid's division is now a linear guess and three
Newton steps (ak_recip_1_2: a 512-bit division holds its unit 16 cycles): forward 8.1 -> 7.0 ms,
backward 10.7 -> 9.9 ms on buffers already written (same run). What is left is the exp polynomial
and the bf16 widening and rounding around it, ~45 vector instructions per 16 elements.
On the AVX2 EPYC (16 lanes of bf16 per iteration in two 8-lane halves, 16 vector registers) the
forward's loop was 174 instructions per 16 elements, a fifth of them constants reloaded and values
spilled, and ran at 2.7x the traffic bound: the nested select clamping `up` compiled to compares and
blends, the sigmoid's sign select to another, exp's upper clamp and underflow select are dead for
its argument -|x| (ak_exp_nonpos), and a 16-bit result needs neither exp's degree-6 polynomial nor
the third Newton step (ak_sigmoid16: degree 4, two steps, relative error < 5e-5); the backward's
interval masks are one compare each (the clamped value equals the input). Same run, kernel alone:
forward 16.3 -> 11.8 ms, backward 25.6 -> 19.2 ms (bound 6.3 and 10.4).
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.swiglu import LIMIT, SPEC
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


def _halves(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inter = packed.shape[-1] // 2
    return packed[..., :inter], packed[..., inter:]


class SwigluHost(HostKernel):
    knob_docs = {"tile_rows": "rows per tile handed to a thread", "threads": "OpenMP threads"}
    entries = {"fwd": Entry("ak_swiglu_fwd", ("ptr", "ptr", "i64", "ptr", "i64", "f32")),
               "bwd": Entry("ak_swiglu_bwd", ("ptr", "ptr", "i64", "ptr", "ptr", "ptr", "i64", "i64", "f32"))}

    def tiling_problem(self, problem: Problem, hw):
        rows, inter = problem.shape
        e = problem.dtype.itemsize
        phases = [RowwisePhase("forward", 3 * inter * e, 12 * inter, 0, 0, 0, 0),
                  RowwisePhase("backward", 5 * inter * e, 20 * inter, 0, 0, 0, 0)]
        return rowwise_model(rows, inter, phases, hw, fixed={"col_chunk": inter})

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "inter": int(problem.shape[1]), "tile_rows": int(knobs["tile_rows"]),
                "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        gu = inputs["gate_up"]
        return {"y": gu.new_empty(gu.shape[0], gu.shape[1] // 2)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        gate, up = _halves(inputs["gate_up"])
        kernel.call("fwd", gate, up, inputs["gate_up"].stride(0), outputs["y"], gate.shape[0],
                    float(inputs.get("limit", LIMIT)))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        gate, up = _halves(inputs["gate_up"])
        dgate, dup = _halves(grads["gate_up"])
        kernel.call("bwd", gate, up, inputs["gate_up"].stride(0), grad_outputs["y"], dgate, dup,
                    grads["gate_up"].stride(0), gate.shape[0], float(inputs.get("limit", LIMIT)))


PARTS = (SwigluHost(SPEC),)
