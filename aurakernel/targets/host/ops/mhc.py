"""The host C kernel of mhc (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 1024x4x4096 bf16, 2-core Xeon, AVX-512): compute,
not memory. mhc_pre alone is 6.5x its minimum traffic (forward 8.0 ms vs 1.5, backward 19.7 vs
2.7), mhc_head 4.2x: the mix projection (4 streams x 4096 -> 24 coefficients per token) is a GEMM
with N = 24, the register-blocked tiles reach a small share of the FMA peak at that width, and the
backward adds the projection's weight gradient (a reduction over every token) and the Sinkhorn
backward per row.
With AMX (bf16) the forward's projection runs on the tile unit (x straight from memory, fn in bf16
hi + lo parts): forward 8.0 -> 3.5-3.9 ms. The same for the backward (dn = d_mix fn and the weight
gradient as tile GEMMs, dn recomputed per chunk instead of stored) measured no gain (17-20 ms either
way): there the time is the passes over x (d_pre, the weight gradient's row pairs, dn . x, dx) and
the per-thread weight-gradient accumulator (32 x W fp32, past L2) loaded and stored per tile, not the
multiply-adds; it stays on the vector path until those passes are fused. (A second try, with
padded strides, fn blocked for contiguous B tiles and B reused across four C tiles, measured the
same: alone, dn's tile GEMM runs at ~46 cycles per tile multiply against 16 at peak, since K is only
96 and every C tile is zeroed and stored after three; its rows x W fp32 output is what bounds it.)
mhc_head's backward (4 outputs: no GEMM) updated the weight gradient row by row, streaming all of it
(4 x W fp32) and fn once per token; it now sweeps the tile's rows over one column chunk at a time
(that chunk of fn and of the gradient stays in cache) and recomputes dn for dx in a second sweep:
10.5 -> 7.6 ms.
On the AVX2 EPYC (portable path) the projection is the forward's cost: ak_gemm ran its 8 x 2-vector
register blocks with 16 spilled registers and N = 24 as a 2-vector block plus a lone vector (one FMA
per broadcast of x), 53 GFLOP/s per core; 6-row blocks and one 3-vector block run 100, forward 13.1 ->
10.7 ms. The backward (28.6 ms against 4.9 of traffic) is bound by its two fp32 GEMMs (1.6 GFLOP:
~8 ms at that rate on 2 cores), the weight gradient's per-thread accumulator (24 x 16384 fp32, past
the 512 KB L2) and the passes over x; K = 24 of dn = dmix fn leaves each register block 24 FMAs
per load and store of its accumulators.
Timed per section (thread 0, 1024x4x4096 bf16, AVX2 EPYC), that backward was 26.5 ms: the weight
gradient's GEMM 11.4 (35 GFLOP/s a core, against 85 for the same GEMM alone), dn's 7.3, the rest
d_pre, widening and dx. The GEMMs ran slow on their operands' strides: fn's rows and the gradient's
rows lie W floats (64 KB) apart, so a chunk of 24 of them maps to the same L1 and L2 sets and is
evicted as it is used; the widened x rows were 2 KB apart. Now the backward runs in two phases. First
d_mix per tile, with what dx needs of each row (pre, and k = rstd^3 sum(dn x) / W, which is
sum_j d_mix_j mix_j times rstd^2 / W from the saved mixes, so dx needs no dn before it). Then, per
chunk of D columns, for every tile and stream: dn as a GEMM tile, dx at once, and the weight
gradient's chunk with the tile's rows as K. fn's and the gradient's chunks are copied into
buffers with padded rows (each task owns its columns: no per-thread gradient to reduce): 26.5 ->
23 ms. The weight gradient's GEMM still ran at half the rate it runs alone: gcc's code for ak_gemm
inlined at that call (A transposed: lda = 1, acs = 24 constant) was the cause; ak_gemm is no longer
inlined (_gemm.h.j2): 23 -> 18 ms. mhc_head's backward (one sweep instead of two, by the same
identity) 9.4 -> 7.6 ms. Forward + backward through the module, pre 42.8 -> 27.7 ms (torch.compile
35), head 15.2. What is left is the math and the memory: the two backward GEMMs (1.6 GFLOP) and the
forward's (0.8) at about 85 GFLOP/s a core are 14 ms; x read twice in the backward (d_pre needs
whole rows before anything else) and dx written are 7 ms at the stream bandwidth. A transposed
forward GEMM (fn x^T: 16-wide blocks, 97 GFLOP/s alone against 72) measured slower in place
(9.9 against 9.2 ms): the transposes cost more than the blocks saved.
At the tiny config's widths (1024 x 4 x 256 fp32, AVX2 EPYC) inside a training step: forward 0.7 ms,
backward 1.6 ms a call (alone in cache 0.57 / 1.25). perf of the backward alone: the three GEMMs 36%,
OpenMP barrier waits ~7%, the per-tile body (Sinkhorn's backward, d_pre, the dx row loop) the rest.
Sinkhorn's backward divided once per element; it divides once per row and normalisation.
The forward's GEMM (N = 24, or mhc_head's 4 padded to 8) ran at the load ports' rate, not the FMAs':
gcc folded B's loads into every FMA of the 4 x 3-vector block (16 loads per 12 FMAs) and kept the
one-vector block's accumulators on the stack (its row loop was not unrolled). B is now pinned in
registers and the one-vector block unrolled (_gemm.h.j2): one EPYC core at 64 x 24 x 128, 68 -> 88
GFLOP/s; at 64 x 8 x 128, 31 -> 63. In place (1024 x 4 x 4096 bf16, interleaved in one process):
mhc_pre forward 9.1 -> 7.5 ms, mhc_head forward 7.2 -> 5.3 ms; the tiny model's 1024 x 4 x 256 fp32
mhc_pre forward 586 -> 504 us. The backwards are unchanged; the register blocks are now always
inlined into ak_gemm, since the larger ak_gemm had gcc call ak_block_6 out of line (10-14% slower).
The plan had held mhc_pre's column chunk to a quarter of the 512 KB L2 (1 KB a column: fn's and
d_fn's rows for every stream), so 128 columns at every width; a chunk is GEMM calls with K = the
chunk, which block for the caches themselves, and the widest chunks ran fastest: now planned against
the L3 share (1024x4x256 fp32 3.39 -> 2.35 ms, 1024x4x4096 bf16 50.6 -> 40.9 ms fwd+bwd).
perf of the forward at the tiny widths (1024x4x256 fp32, Zen 4): the GEMM ~62% of its cycles; of the
rest, a sixth went to transposing fn into the GEMM's B (a column at a time: fn's 24 rows lie W floats
apart, 4 KB or a multiple of it, so they fell into one L1 set and evicted each other) and an eighth to
the sums of squares (one chain of dependent FMAs per row). fn is now transposed 16 columns at a time
along its rows, and the sums keep 64 partial sums: forward 492 -> 443 us (three alternating runs of
each); 1024x4x4096 bf16 8.45 / 9.37 -> 8.09 / 8.91 ms.
With 16-lane vectors (AVX-512) the forward's mix had its 24 outputs padded to two vectors (mhc_head's 4
to one): a quarter (three quarters) of the GEMM's FMAs were on zero columns. ak_gemm now ends such
column counts in an 8-lane block and NP pads to 8 lanes there (_gemm.h.j2); a 512-bit FMA runs as two
256-bit halves on Zen 4, so the 8-lane part costs half of a 16-lane one. Kernels alone, interleaved
(Zen 4 EPYC, 2 cores, medians of 15-25 rounds; outputs bitwise the same): mhc_pre forward 1024x4x4096
bf16 7.76 -> 6.59 ms, 1024x4x256 fp32 509 -> 451 us, mhc_post_pre's 883 -> 814 us; mhc_head forward
1024x4x4096 bf16 4.87 -> 4.18 ms. The backwards' GEMMs have wide N (a chunk's columns) and are unchanged.
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.mhc import EPS, HEAD, ITERS, PRE
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


class MhcHost(HostKernel):
    knob_docs = {"tile_rows": "rows per tile (x tile kept in L2 for the second pass)",
                 "col_chunk": "flattened columns per chunk (fn's chunk kept in L1 across the tile)",
                 "threads": "OpenMP threads"}
    entries = {"fwd": Entry("ak_mhc_fwd", ("ptr",) * 10 + ("i64", "f32", "f32")),
               "bwd": Entry("ak_mhc_bwd", ("ptr",) * 14 + ("i64", "f32")),
               "fwd_scratch": Entry("ak_mhc_fwd_scratch", (), "i64"),
               "bwd_scratch": Entry("ak_mhc_bwd_scratch", ("i64",), "i64")}

    def phases(self, problem: Problem) -> list[RowwisePhase]:
        rows, hc, d = problem.shape
        e, w, n = problem.dtype.itemsize, hc * d, self.spec.nout(hc)
        return [
            RowwisePhase("forward", dram_bytes_per_row=(w + d) * e + (n + 1 + hc * (hc + 1)) * 4,
                         vector_elems_per_row=w * (n + 2) + d * hc, chunked_passes=1,
                         resident_bytes_per_row=w * e, l1_bytes_per_col=n * 4 + 4 + e,
                         l2_bytes_per_tile=n * w * 4),
            # pre: x and dy read twice (d_pre; then dx and the weight gradient), dx written; a
            # chunk's fn and d_fn rows for every stream, and x and dn of a tile (up to 32 rows), stay
            # in L2 (a chunk is col_chunk columns of each stream)
            RowwisePhase("backward", dram_bytes_per_row=(3 * w + 2 * d) * e + (n + hc * (hc + 1)) * 4,
                         vector_elems_per_row=w * (2 * n + 6) + d * hc, chunked_passes=1,
                         resident_bytes_per_row=0, l1_bytes_per_col=(2 * hc * n + 2 * 32) * 4,
                         l2_bytes_per_tile=2 * n * w * 4)
            if not self.spec.head else
            # head: one sweep of the tile (still cached from d_pre) over fn and the per-thread d_fn
            RowwisePhase("backward", dram_bytes_per_row=(2 * w + d) * e + (n + hc * (hc + 1)) * 4,
                         vector_elems_per_row=w * (2 * n + 4) + d * hc, chunked_passes=1,
                         resident_bytes_per_row=w * e, l1_bytes_per_col=2 * n * 4 + 4 + e,
                         l2_bytes_per_tile=2 * n * w * 4),
        ]

    def tiling_problem(self, problem: Problem, hw):
        rows, hc, d = problem.shape
        # the mix projection runs as GEMM tiles of 8 rows; the x tile spills from L2 to the (large,
        # shared) L3 without harm, so residency is planned against the L3 share. So does a chunk: its
        # GEMMs block fn's and d_fn's columns for L1 and L2 themselves, and what a chunk costs is its
        # calls (K = the chunk), so the chunk is planned against the L3 share too. Held to the L2 share,
        # col_chunk was 128 at every width, where the widest chunks ran fastest (AVX2 EPYC, fwd+bwd,
        # one run each: 1024x4x256 fp32 3.39 ms at 128, 2.35 at 1024; 1024x4x4096 bf16 50.6 ms at
        # 128, 40.9 at 2048). The tile and the chunk share that L3 share (one constraint on both):
        # held to it apart, 1024x4x4096 bf16 took 4096-column chunks beside a 2 MB tile, and its
        # backward ran at 20.0-21.9 ms (best of 15) against 18.0-18.8 at 2048 (AVX2 EPYC, interleaved);
        # through the bench's module, fwd+bwd 30.7 -> 27.1 ms (1.23x -> 1.40x torch.compile)
        return rowwise_model(rows, hc * d, self.phases(problem), hw, fixed={"vec": max(hw.simd_bytes // 4, 4)}, row_block=8,
                             resident_level="L3", chunk_level="L3")

    def template(self) -> str:   # mhc_head's kernel is mhc_pre's with the head's epilogue
        return "host/mhc_pre.c.j2"

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, hc, d = problem.shape
        return {"dtype": problem.dtype, "hc": int(hc), "d": int(d), "nout": self.spec.nout(hc), "iters": ITERS,
                "head": self.spec.head, "fused_post": False, "vec": int(knobs["vec"]), "tile_rows": int(knobs["tile_rows"]), "col_chunk": int(knobs["col_chunk"]),
                "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        x = inputs["x"]
        rows, hc, d = x.shape[0], x.shape[-2], x.shape[-1]
        f32 = {"dtype": torch.float32, "device": x.device}
        out = {"y": x.new_empty(rows, d), "mix": torch.empty(rows, self.spec.nout(hc), **f32),
               "rstd": torch.empty(rows, **f32)}
        if not self.spec.head:
            out["post"] = torch.empty(rows, hc, **f32)
            out["comb"] = torch.empty(rows, hc, hc, **f32)
        return out

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        x = inputs["x"]
        scratch = kernel.workspace("fwd_scratch")
        kernel.call("fwd", x, inputs["fn"], inputs["base"], inputs["scale"], outputs["y"], outputs.get("post"),
                    outputs.get("comb"), outputs["mix"], outputs["rstd"], scratch, outputs["rstd"].numel(), EPS, EPS)

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        x = inputs["x"]
        rows, hc = outputs["rstd"].numel(), kernel.meta["hc"]
        scratch = kernel.workspace_of(kernel.call("bwd_scratch", rows))
        d_scale = torch.empty(3, dtype=torch.float32)
        d_post = grad_outputs.get("post")
        d_comb = grad_outputs.get("comb")
        if not self.spec.head:
            d_post = d_post if d_post is not None else torch.zeros(rows, hc)
            d_comb = d_comb if d_comb is not None else torch.zeros(rows, hc, hc)
        kernel.call("bwd", x, inputs["fn"], inputs["base"], inputs["scale"], outputs["mix"], outputs["rstd"],
                    grad_outputs["y"], d_post, d_comb, grads["x"], grads["fn"], grads["base"], d_scale, scratch,
                    rows, EPS)
        grads["scale"].copy_(d_scale[: grads["scale"].numel()])


PARTS = (MhcHost(PRE), MhcHost(HEAD),)
