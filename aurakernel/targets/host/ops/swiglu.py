"""The host C kernel of swiglu (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 8192x2048 bf16, 2-core Xeon, AVX-512): 1.74x the
minimum traffic alone (forward 7.0 ms vs 3.5, backward 9.2 vs 5.8). The arithmetic binds: a
sigmoid per element is an exp (a degree-6 polynomial) and a division, ~2.5 cycles per element per
core, which one pass over 16.8 M elements cannot hide behind its 96 MB of traffic. 512-bit vectors
took the backward from 12.9 to 9.2 ms. The sigmoid's division is now a linear guess and three
Newton steps (ak_recip_1_2: a 512-bit division holds its unit 16 cycles): forward 8.1 -> 7.0 ms,
backward 10.7 -> 9.9 ms on buffers already written (same run). What is left is the exp polynomial
and the bf16 widening and rounding around it, ~45 vector instructions per 16 elements.
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
