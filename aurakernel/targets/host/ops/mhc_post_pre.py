"""The host C kernel of mhc_post_pre: mhc_pre's template rendered with fused_post (each tile's
streams made by mhc_post's row update, then mhc_pre's passes over them from cache; the backward's
mhc_post rows load the streams' two gradients and add them), planned with mhc_pre's knobs.

Where the time goes (AVX2 EPYC, 2 cores, bf16, the C kernels alone, fused against mhc_post + mhc_pre
with the add autograd makes between them): at 1024x4x4096, forward 13.0 against 13.7 ms, backward
28.8 against 20.5 + 4.4 (the add) + 7.6 = 32.5; at 4096x4x4096, forward 60.2 against 58.2, backward
142.6 against 96.2 + 18.3 + 33.6 = 148.1. Through the modules (benchmarks/mhc_post_pre.py) that is
1.06x apart at 1024 rows and 0.98-1.02x at 4096 (runs differ by a few percent). The saved passes
over the streams hardly show on this machine: mhc_pre's forward is bound by the mix projection's
multiply-adds, not by its read of the streams, and the rounding the layer's code does (post and
comb cast, each term rounded: what makes the streams bit-exact, see _mhc_post_rows.h.j2) costs the
fused forward what the saved read gives back. Autotune keeps the kernel only where it runs
faster than the two apart, timed side by side through the same module (agent._drop_fusions_not_faster_than_apart):
it had compared their times from separate tunes, where a run's noise is larger than what the fusion
saves, and dropped the kernel at the tiny config's 1024x4x256 fp32 (4129 us against 752 + 2179 apart)
where side by side it ran 3.09 ms against 3.68 apart.
Tried and dropped: mhc_post's backward inside mhc_pre's column-chunk loop, on each chunk's dx while
it is in cache (dx never written). At 4096 rows it ran 125-290 ms against 142.6 depending on the
chunk (best with 512-2048 columns; mhc_pre's plan then took 128, an L2 rule since dropped): a chunk of a row is four
short segments of h, g_x, d_h and x per row, and the per-chunk partial row sums add a reduction.
Where a chunk is a whole stream (col_chunk >= D: the tiny config's 1024x4x256 fp32) none of that
applies: each tile's dx rows are whole once its HC streams are done, so mhc_post's rows run on them
from a per-thread tile buffer (`post_in_tiles`, the template's POST_IN_TILES) and dx_pre (4 MB there)
is neither written nor read back. Kernel alone 1499 -> 1426 us (medians of 300, three alternating
runs); in the training step 1729 / 1853 -> 1637 / 1772 us a call (two alternating runs, 10 steps).
The RMSNorm after the HyperConnection (input_layernorm / post_attention_layernorm on y) is not fused.
With link_layers, 7 of the tiny model's 8 HyperConnections a step run inside this kernel, so the norm
would join it here (post + pre + norm), not mhc_pre. What it could save, kernels alone on the AVX2
EPYC: the norm at 1024 x 256 fp32 is 133 / 163 us forward / backward in cache (255 / 343 after a
cache flush) against this kernel's 1.3 / 3.5 ms: at most 2-5 ms of a ~260 ms step. At V4's widths
(1024 x 4096 bf16) it is 1.5 / 2.1 ms against 17.7 / 44.0 ms (up to 6%). The backward would take dz
and never write dy: d_pre_i = r (x_i . (w dz)) - c (x_i . y) with r the norm's rstd and
c = r^3 sum(w dz y) / D, both from the row pass mhc_pre's backward already makes, and dy recomputed
per column chunk from x for dx.
"""

from __future__ import annotations

import dataclasses

import torch

from ....ops.base import Problem, Tensors
from ....ops.mhc import EPS, PRE
from ....ops.mhc_post import SPEC as POST
from ....ops.mhc_post_pre import SPEC
from ....planner.costmodel import RowwisePhase
from ..library import Entry
from .mhc import MhcHost
from .mhc_post import MhcPostHost


def post_in_tiles(kernel) -> bool:
    """Whether the built kernel's backward chunks are whole streams (its plan's col_chunk >= D), so
    that mhc_post's rows run on each tile's dx while it is in cache (the template's POST_IN_TILES) and
    mhc_pre's dx is never written out whole; else the kernel's scratch holds that dx."""
    return bool(kernel.call("post_in_tiles"))


class MhcPostPreHost(MhcHost):
    entries = {"fwd": Entry("ak_mhc_post_pre_fwd", ("ptr",) * 14 + ("i64", "f32", "f32")),
               "bwd": Entry("ak_mhc_post_pre_bwd", ("ptr",) * 22 + ("i64", "f32")),
               "fwd_scratch": Entry("ak_mhc_fwd_scratch", (), "i64"),
               "bwd_scratch": Entry("ak_mhc_bwd_scratch", ("i64",), "i64"),
               "post_in_tiles": Entry("ak_mhc_post_in_tiles", (), "i64")}

    def __init__(self, spec):
        super().__init__(spec)
        self.pre = MhcHost(PRE)   # the planning and rendering of the mhc_pre part
        self.post = MhcPostHost(POST)   # the cost of the mhc_post part

    def phases(self, problem: Problem) -> list[RowwisePhase]:
        """mhc_pre's phases with mhc_post's rows added, less the pass the fusion saves: forward, the
        streams mhc_post writes are read back by mhc_pre from cache; backward, mhc_post's rows read
        the streams' second gradient too and add it."""
        stream_elems = problem.shape[1] * problem.shape[2]
        stream_bytes = stream_elems * problem.dtype.itemsize
        (pre_fwd, pre_bwd), (post_fwd, post_bwd) = self.pre.phases(problem), self.post.phases(problem)
        def plus(phase, part, dram_bytes, vector_elems):
            return dataclasses.replace(
                phase, dram_bytes_per_row=phase.dram_bytes_per_row + part.dram_bytes_per_row + dram_bytes,
                vector_elems_per_row=phase.vector_elems_per_row + part.vector_elems_per_row + vector_elems)

        return [plus(pre_fwd, post_fwd, -stream_bytes, 0), plus(pre_bwd, post_bwd, stream_bytes, stream_elems)]

    def template(self) -> str:
        return self.pre.template()

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {**self.pre.render_params(problem, knobs), "fused_post": True}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        h = inputs["h"]
        out = self.pre.empty_outputs(problem, {"x": h})
        return {"streams": torch.empty_like(h), "next_post": out["post"], "next_comb": out["comb"], "y": out["y"],
                "mix": out["mix"], "rstd": out["rstd"]}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        kernel.call("fwd", inputs["post"], inputs["comb"], inputs["out"], inputs["h"], outputs["streams"],
                    inputs["fn"], inputs["base"], inputs["scale"], outputs["y"], outputs["next_post"],
                    outputs["next_comb"], outputs["mix"], outputs["rstd"], kernel.workspace("fwd_scratch"),
                    outputs["rstd"].numel(), EPS, EPS)

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        rows = outputs["rstd"].numel()
        # the kernel's scratch (mhc_pre's whole dx in it where post_in_tiles is not): reused, so no page
        # faults per call
        scratch = kernel.workspace_of(kernel.call("bwd_scratch", rows))
        d_scale = torch.empty(3, dtype=torch.float32)
        kernel.call("bwd", inputs["post"], inputs["comb"], inputs["out"], inputs["h"], outputs["streams"],
                    inputs["fn"], inputs["base"], inputs["scale"], outputs["mix"], outputs["rstd"],
                    grad_outputs["streams"], grad_outputs["y"], grad_outputs["next_post"], grad_outputs["next_comb"],
                    grads["post"], grads["comb"], grads["out"], grads["h"], grads["fn"], grads["base"],
                    d_scale, scratch, rows, EPS)
        grads["scale"].copy_(d_scale[: grads["scale"].numel()])


PARTS = (MhcPostPreHost(SPEC),)
