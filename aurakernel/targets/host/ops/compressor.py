"""The host C kernel of compressor (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, HCA 1x32x128x512 and CSA 1x1024x4x512 bf16, 2-core
Xeon, AVX-512): 1.8x and 2.2x the minimum traffic alone, the forward the larger share (1.4 and 3.1
ms vs 0.3 and 0.6): a softmax over each window (an exp per entry) and the kv_norm after the
pooling; the windows are short (4 or 128 entries), so per-window setup weighs on the forward.
The softmax weights are rounded to the dtype before use, so a 16-bit build takes the degree-4 exp
(ak_exp_neg16, relative error < 6e-5). AVX2 EPYC, kernel alone, two A/B rounds against the degree-6
exp: forward HCA 1.45 / 1.46 -> 1.23 / 1.21 ms, CSA 2.95 / 2.93 -> 2.62 / 2.64 ms; fwd+bwd through the
module HCA 2.52 -> 2.23-2.28 ms, CSA 5.25 -> 4.87-5.06 ms.
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.compressor import CHANNEL_BLOCK, EPS, SPEC, _p_size
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


class CompressorHost(HostKernel):
    knob_docs = {"tile_rows": "windows per tile", "threads": "OpenMP threads"}
    entries = {"fwd": Entry("ak_compressor_fwd", ("ptr",) * 10 + ("i64", "i64", "i64", "f32")),
               "bwd": Entry("ak_compressor_bwd", ("ptr",) * 12 + ("i64", "i64", "i64"))}

    def tiling_problem(self, problem: Problem, hw):
        batch, windows, ratio, d = problem.shape
        dk = 2 * d if problem.variant == "csa" else d
        slots = 2 * ratio if problem.variant == "csa" else ratio
        e = problem.dtype.itemsize
        phases = [RowwisePhase("forward", ratio * dk * 2 * e + d * e, slots * d * 20, 0, 0, 0, 0),
                  RowwisePhase("backward", ratio * dk * 4 * e + d * e, slots * d * 30, 0, 0, 0, 0)]
        return rowwise_model(batch * windows, d, phases, hw, fixed={"col_chunk": d})

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "ratio": int(problem.shape[2]), "d": int(problem.shape[3]),
                "overlap": problem.variant == "csa", "tile_rows": int(knobs["tile_rows"]), "channel_block": CHANNEL_BLOCK,
                "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        """y, and what the forward saves for the backward: rstd, the softmax weights p (in the dtype,
        which is what the reference rounds them to), pooled and the unrounded sum_s p kv."""
        kv = inputs["kv"]
        ratio, d = inputs["position_bias"].shape[0], inputs["weight"].shape[0]
        batch, windows = kv.shape[0], kv.shape[1] // ratio
        return {"y": kv.new_empty(batch, windows, d), "rstd": torch.empty(batch, windows),
                "p": kv.new_empty(batch, windows, _p_size(ratio, d, kv.shape[-1] == 2 * d)),
                "pooled": torch.empty(batch, windows, d), "exact": torch.empty(batch, windows, d)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        kv = inputs["kv"]
        ratio, d = kernel.meta["ratio"], kernel.meta["d"]
        scratch = kernel.workspace_of(kernel.meta["threads"] * _p_size(ratio, d, kernel.meta["overlap"]))
        kernel.call("fwd", kv, inputs["gate"], inputs["position_bias"], inputs["weight"], outputs["y"],
                    outputs["rstd"], outputs["p"], outputs["pooled"], outputs["exact"], scratch,
                    kv.shape[0], kv.shape[1], kv.shape[1] // ratio, float(inputs.get("eps", EPS)))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        kv = inputs["kv"]
        ratio, d = kernel.meta["ratio"], kernel.meta["d"]
        scratch = kernel.workspace_of(kernel.meta["threads"] * (ratio * kv.shape[-1] + d))
        kernel.call("bwd", kv, inputs["weight"], outputs["rstd"], outputs["p"], outputs["pooled"], outputs["exact"],
                    grad_outputs["y"].contiguous(), grads["kv"], grads["gate"], grads["position_bias"],
                    grads["weight"], scratch, kv.shape[0], kv.shape[1], kv.shape[1] // ratio)

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        batch, windows, ratio, d = problem.shape
        tail = min(windows, knobs["tile_rows"] * knobs["threads"] + 1)
        return [problem, Problem(problem.op, problem.variant, (2, tail, ratio, d + 3), problem.dtype)]


PARTS = (CompressorHost(SPEC),)
