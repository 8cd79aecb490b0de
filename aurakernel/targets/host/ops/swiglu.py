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
A bf16 gate takes one of 65536 values, so the bf16 build looks silu(min(g, L)) and its derivative up
(silu_table: torch's fp32 silu of every bit pattern, 256 KB each, built once per limit; the values
real gates take cover a few tens of KB of it). Same run, kernel alone, AVX2 EPYC: forward 10.1 ->
4.6 ms (the traffic bound: 6.3 at the calibrated stream bandwidth), backward 18.0 -> 13.6 ms (bound
10.4). gcc loads the table with scalar loads, not vgatherdps: the interleaved [65536][2] layout it did
gather from ran the backward at 16.3 ms.
Which is faster differs between CPUs. On an EPYC with AVX-512 (Zen 4; 16-lane sigmoids; 2 cores,
kernels alone, 8192x2048 bf16, interleaved): the backward evaluated 12.6 ms against 13.9 looked up,
the forward looked up 5.7 ms against 6.7 evaluated; with the tables' loads taken out (constants in
their place, wrong numbers) the backward ran 7.6-10.0 against 12.6-15.9 ms: the lookups are the
backward's cost there, not its traffic. On the same machine built for AVX2 (AURAKERNEL_HOST_ISA=avx2)
looking up wins both ways (fwd+bwd through the module 21.7 ms, evaluated 28.9). So each direction's
choice is the `lookup` knob, which tune times on the machine (all four values side by side,
HostKernel.measured_knobs): with AVX-512 it keeps 1 (the forward looks up; 15.3 ms fwd+bwd against
17.6 for both looking up), with AVX2 3.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ....dtypes import bf16_patterns
from ....ops.base import Problem, Tensors
from ....ops.swiglu import LIMIT, SPEC
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


def _halves(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inter = packed.shape[-1] // 2
    return packed[..., :inter], packed[..., inter:]


@functools.lru_cache(maxsize=8)
def silu_table(limit: float) -> torch.Tensor:
    """[2, 65536] fp32: torch's silu of min(g, limit), then its derivative (s (1 + g (1 - s)), as
    torch's silu backward), for g every bf16 bit pattern: what the bf16 kernels look the gate up in."""
    g = bf16_patterns().float().clamp(max=limit)
    s = torch.sigmoid(g)
    return torch.stack([F.silu(g), s * (1 + g * (1 - s))]).contiguous()


def forward(kernel, gate: torch.Tensor, up: torch.Tensor, in_stride: int, y: torch.Tensor, rows: int,
            limit: float) -> None:
    """y = silu(min(gate, limit)) * clamp(up): by lookup where the build has it (bf16), else computed."""
    if kernel.has("fwd_table"):
        kernel.call("fwd_table", gate, up, in_stride, silu_table(limit), y, rows, limit)
    else:
        kernel.call("fwd", gate, up, in_stride, y, rows, limit)


def backward(kernel, gate: torch.Tensor, up: torch.Tensor, in_stride: int, dy: torch.Tensor, dgate: torch.Tensor,
             dup: torch.Tensor, out_stride: int, rows: int, limit: float) -> None:
    if kernel.has("bwd_table"):
        kernel.call("bwd_table", gate, up, in_stride, silu_table(limit), dy, dgate, dup, out_stride, rows, limit)
    else:
        kernel.call("bwd", gate, up, in_stride, dy, dgate, dup, out_stride, rows, limit)


FWD_LOOKUP, BWD_LOOKUP = 1, 2   # the `lookup` knob's bits: which directions look the gate up (bf16)


class SwigluHost(HostKernel):
    knob_docs = {"tile_rows": "rows per tile handed to a thread", "threads": "OpenMP threads",
                 "lookup": "bf16: 1 the forward, 2 the backward, 3 both look silu up in a table (0: evaluated)"}
    entries = {"fwd": Entry("ak_swiglu_fwd", ("ptr", "ptr", "i64", "ptr", "i64", "f32")),
               "bwd": Entry("ak_swiglu_bwd", ("ptr", "ptr", "i64", "ptr", "ptr", "ptr", "i64", "i64", "f32")),
               "fwd_table": Entry("ak_swiglu_fwd_table", ("ptr", "ptr", "i64", "ptr", "ptr", "i64", "f32"),
                                  optional=True),   # bf16 only
               "bwd_table": Entry("ak_swiglu_bwd_table", ("ptr", "ptr", "i64", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "f32"),
                                  optional=True)}

    def tiling_problem(self, problem: Problem, hw):
        rows, inter = problem.shape
        e = problem.dtype.itemsize

        def phases(lookup: int) -> list[RowwisePhase]:   # a lookup: about a third of the sigmoid's operations
            return [RowwisePhase("forward", 3 * inter * e, (4 if lookup & FWD_LOOKUP else 12) * inter, 0, 0, 0, 0),
                    RowwisePhase("backward", 5 * inter * e, (8 if lookup & BWD_LOOKUP else 20) * inter, 0, 0, 0, 0)]

        if problem.dtype.value != "bf16":   # 65536 gate values to tabulate: bf16 only
            return rowwise_model(rows, inter, phases(0), hw, fixed={"col_chunk": inter})
        return rowwise_model(rows, inter, {v: phases(v) for v in range(4)}, hw, fixed={"col_chunk": inter},
                             formulation="lookup")

    def measured_knobs(self, problem: Problem) -> tuple[str, ...]:
        """A lookup is a scalar load per table and element (no gather), the sigmoid ~30 vector
        operations per 8 or 16 elements: which is faster differs between CPUs (a Zen 4 EPYC: the backward
        evaluated 12.6 ms against 13.9 looked up, the forward looked up 5.7 against 6.7, at 8192x2048)."""
        return ("lookup",) if problem.dtype.value == "bf16" else ()

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        lookup = int(knobs.get("lookup", 0))
        return {"dtype": problem.dtype, "inter": int(problem.shape[1]), "tile_rows": int(knobs["tile_rows"]),
                "threads": int(knobs["threads"]), "fwd_table": int(bool(lookup & FWD_LOOKUP)),
                "bwd_table": int(bool(lookup & BWD_LOOKUP))}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        gu = inputs["gate_up"]
        return {"y": gu.new_empty(gu.shape[0], gu.shape[1] // 2)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        gate, up = _halves(inputs["gate_up"])
        forward(kernel, gate, up, inputs["gate_up"].stride(0), outputs["y"], gate.shape[0],
                float(inputs.get("limit", LIMIT)))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        gate, up = _halves(inputs["gate_up"])
        dgate, dup = _halves(grads["gate_up"])
        backward(kernel, gate, up, inputs["gate_up"].stride(0), grad_outputs["y"], dgate, dup,
                 grads["gate_up"].stride(0), gate.shape[0], float(inputs.get("limit", LIMIT)))


PARTS = (SwigluHost(SPEC),)
