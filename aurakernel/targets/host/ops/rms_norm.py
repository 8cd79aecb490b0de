"""The host C kernel of rms_norm (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 4096x4096 bf16, 2-core Xeon, AVX-512): the kernel
alone is 1.41x the minimum traffic at the calibrated stream rate (forward 3.3 ms vs 2.3, backward
4.9 vs 3.5): one read of x and one write of y forward, x, dy in and dx out backward, each row's
second sweep from L1/L2, the loops vectorised at 512 bits. The module path adds ~1 ms (custom op,
autograd, the dw reduction over the per-tile partials). Fresh outputs cost nothing extra once freed
pages are reused (hostmem.py); before that, first-touch faults doubled the forward.
On the AVX2 EPYC (same tool, this machine's calibration: 16.1 GB/s) both variants run at the traffic
bound: weighted forward 3.9 ms / backward 5.8 against 4.2 / 6.3, unweighted 3.4 / 4.6 against the
same (the 32 MB operands partly stay in the 32 MB L3, hence under it). Nothing is left to take: one
read of each input and one write of each output is the minimum, and torch.compile's generated loop
makes the same passes, so the unweighted norm stays ~1.0-1.1x torch.compile (module 9.25 ms against
9.36 in one bench run); the weighted one is 2.1x (compile does not fuse dw's reduction).
Later runs on the same EPYC, busier, found the bf16 kernel issue-bound, not traffic-bound: in cache
(256x4096, one thread) it made ~1 element a cycle, forward and backward alike, as fp32 did; the
loops spent their shuffle port on widening (two per 16 loads) and narrowing (a pack and a permute
per 16 stores). bf16 unweighted now loops over pairs of elements (_common.h.j2, ak_pair_t), which
widen and narrow with shifts and masks: 1.55x faster in cache (fwd 236 -> 154 us, bwd 327 -> 213 at
256x4096, interleaved A/B), at 4096x4096 fwd 1.04-1.18x and bwd 1.23-1.26x (6.6 -> 6.4 / 11.0 ->
8.7 ms median alone). Not the weighted norm: its weight read at stride 2 costs the shuffles back
(backward 0.88x). Non-temporal stores of y and dx (no read for ownership: a plain copy 16 -> 21 GB/s
here) were tried and gave nothing measurable beside this run-to-run noise.
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.rms_norm import EPS, SPEC
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


class RmsNormHost(HostKernel):
    knob_docs = {"tile_rows": "rows per tile (kept in L2 between the two passes)",
                 "col_chunk": "columns per inner chunk (multiple of the SIMD width; kept in L1)",
                 "threads": "OpenMP threads (tiles split statically)"}
    entries = {"fwd": Entry("ak_rms_norm_fwd", ("ptr", "ptr", "ptr", "ptr", "i64", "f32")),
               "bwd": Entry("ak_rms_norm_bwd", ("ptr",) * 7 + ("i64",))}

    def tiling_problem(self, problem: Problem, hw):
        rows, cols = problem.shape
        e = problem.dtype.itemsize
        w = 4 if problem.variant == "weighted" else 0
        phases = [
            RowwisePhase("forward", dram_bytes_per_row=cols * 2 * e + 4, vector_elems_per_row=2 * cols,
                         chunked_passes=1, resident_bytes_per_row=cols * e, l1_bytes_per_col=w + 2 * e,
                         l2_bytes_per_tile=cols * w, fixed_resident_bytes=cols * w),
            RowwisePhase("backward", dram_bytes_per_row=cols * 3 * e + 4, vector_elems_per_row=3 * cols,
                         chunked_passes=1, resident_bytes_per_row=2 * cols * e, l1_bytes_per_col=2 * w + 3 * e,
                         l2_bytes_per_tile=cols * 2 * w, fixed_resident_bytes=cols * 2 * w),
        ]
        return rowwise_model(rows, cols, phases, hw)

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "cols": int(problem.shape[1]),
                "weighted": problem.variant == "weighted",
                "tile_rows": int(knobs["tile_rows"]), "col_chunk": int(knobs["col_chunk"]),
                "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        x = inputs["x"]
        return {"y": torch.empty_like(x), "rstd": torch.empty(x.numel() // x.shape[-1], dtype=torch.float32)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        x = inputs["x"]
        w = inputs.get("weight")
        rows = x.numel() // x.shape[-1]
        kernel.call("fwd", x, w, outputs["y"], outputs["rstd"], rows, float(inputs.get("eps", EPS)))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        x = inputs["x"]
        w = inputs.get("weight")
        rows = x.numel() // x.shape[-1]
        dw = grads.get("weight")
        partial = torch.empty(kernel.meta["threads"] * x.shape[-1], dtype=torch.float32) if w is not None else None
        kernel.call("bwd", grad_outputs["y"], x, w, outputs["rstd"], grads["x"], dw, partial, rows)


PARTS = (RmsNormHost(SPEC),)
