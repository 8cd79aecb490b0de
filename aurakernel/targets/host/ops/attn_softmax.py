"""The host C kernel of attn_softmax (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 1x64x256x320 bf16, 2-core Xeon, AVX-512): 2.9x the
minimum traffic alone (forward 2.5 ms vs 0.7, backward 2.8 vs 1.1): an exp per score and the
row's max and sum sweeps over rows of 320; the tensors are small enough to stay in cache, so the
exp polynomial, not memory, is the limit.
16-bit probabilities keep 8 or 11 mantissa bits, so their exp is the degree-4 polynomial
(ak_exp_neg16, relative error < 6e-5; the backward rebuilds p with the same one). AVX2 EPYC, kernel
alone, two A/B rounds against the degree-6 exp: forward 2.57 / 3.00 -> 2.20 / 2.68 ms, backward
3.01 / 3.46 -> 2.57 / 3.26 ms (the machine's noise is about that size; fwd+bwd over eager 4.3x -> 4.7x).
"""

from __future__ import annotations

import torch

from ....ops.attn_softmax import SCALING, SPEC, _mask_rows
from ....ops.base import Problem, Tensors
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


class AttnSoftmaxHost(HostKernel):
    knob_docs = {"tile_rows": "(batch, head, query) rows per tile", "threads": "OpenMP threads"}
    entries = {"fwd": Entry("ak_attn_softmax_fwd", ("ptr", "ptr", "i64", "i64", "ptr", "ptr", "ptr", "ptr",
               "i64", "i64", "i64", "i64", "f32")),
               "bwd": Entry("ak_attn_softmax_bwd", ("ptr", "ptr", "i64", "i64", "ptr", "ptr", "ptr", "ptr", "ptr",
               "ptr", "ptr", "i64", "i64", "i64", "i64", "f32"))}

    def tiling_problem(self, problem: Problem, hw):
        batch, heads, seq, keys = problem.shape
        e = problem.dtype.itemsize
        phases = [RowwisePhase("forward", keys * (2 * e + 4), 3 * keys * 12, 0, keys * (e + 4), 0, 0),
                  RowwisePhase("backward", keys * (3 * e + 4), 2 * keys * 12, 0, keys * (2 * e + 4), 0, 0)]
        return rowwise_model(batch * heads * seq, keys, phases, hw, fixed={"col_chunk": keys})

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "tile_rows": int(knobs["tile_rows"]), "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        s = inputs["scores"]
        rows = s.numel() // s.shape[-1]
        return {"probs": torch.empty_like(s), "row_max": torch.empty(rows), "row_sum": torch.empty(rows)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        s = inputs["scores"]
        mask, msb, mss = _mask_rows(inputs["mask"], s)
        kernel.call("fwd", s, mask, msb, mss, inputs["sinks"].float().contiguous(), outputs["probs"],
                    outputs["row_max"], outputs["row_sum"], *s.shape, float(inputs.get("scaling", SCALING)))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        s = inputs["scores"]
        mask, msb, mss = _mask_rows(inputs["mask"], s)
        heads = s.shape[1]
        scratch = kernel.workspace_of(kernel.meta["threads"] * heads)
        d_sinks = torch.empty(heads)
        kernel.call("bwd", s, mask, msb, mss, inputs["sinks"].float().contiguous(), outputs["row_max"],
                    outputs["row_sum"], grad_outputs["probs"].to(s.dtype).contiguous(), grads["scores"], d_sinks,
                    scratch, *s.shape, float(inputs.get("scaling", SCALING)))
        grads["sinks"].copy_(d_sinks)

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        batch, heads, seq, keys = problem.shape
        tail = min(seq, knobs["tile_rows"] * knobs["threads"] + 1)
        return [problem, Problem(problem.op, problem.variant, (2, heads + 1, tail, keys + 5), problem.dtype)]


PARTS = (AttnSoftmaxHost(SPEC),)
