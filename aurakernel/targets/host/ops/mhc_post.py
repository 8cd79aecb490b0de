"""The host C kernel of mhc_post (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 2048x4x4096 bf16, 2-core Xeon, AVX-512): 1.23x the
minimum traffic alone (forward 6.2 ms vs 5.2, backward 10.2 vs 8.1): one pass each way, near the
stream rate; the module path adds under 1 ms.
On the AVX2 EPYC the bf16 rows now go over pairs of columns (_common.h.j2's ak_pair_t: widening and
narrowing without lane shuffles; the backward's 20 row sums take both halves of a pair): kernels
alone, interleaved A/B at 1024x4x4096, backward 10.5 -> 8.7 ms median (1.21x), forward unchanged
(5.5 / 5.4 ms). The fused mhc_post_pre's backward shares these rows.
Where the streams outgrow the last-level cache, the rows can go out by streaming stores (the
`stream` knob: each row computed into a buffer in L1, then copied around the caches, so its lines
are not first read for ownership). On the AVX2 EPYC at 2048x4x4096 bf16 the kernel is half
arithmetic (the same rows from cache take 5.8 of its 9.5 ms forward, 9.9 of 17.6 backward), so it
gains less than the traffic it saves: kernels alone, interleaved, backward 15.9 -> 14.1 ms median,
forward 9.5 -> 8.4 ms in one run and unchanged in another; through the module 25.2 -> 24.2 ms
(tune, which times both: its model, bound by the arithmetic, cannot rank them).
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.mhc_post import SPEC
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


class MhcPostHost(HostKernel):
    knob_docs = {"tile_rows": "rows per tile handed to a thread", "threads": "OpenMP threads",
                 "stream": "1: outputs written by streaming stores (each row through a buffer in cache)"}
    entries = {"fwd": Entry("ak_mhc_post_fwd", ("ptr",) * 5 + ("i64",)),
               "bwd": Entry("ak_mhc_post_bwd", ("ptr",) * 9 + ("i64",))}
    streams_outputs = True   # half its time is arithmetic on an AVX2 EPYC: tune decides

    def phases(self, problem: Problem) -> list[RowwisePhase]:
        _, hc, d = problem.shape
        e = problem.dtype.itemsize
        return [
            RowwisePhase("forward", dram_bytes_per_row=(2 * hc + 1) * d * e + (hc + hc * hc) * 4,
                         vector_elems_per_row=d * hc * (hc + 1), chunked_passes=0,
                         resident_bytes_per_row=0, l1_bytes_per_col=0, l2_bytes_per_tile=0,
                         written_bytes_per_row=hc * d * e),
            RowwisePhase("backward", dram_bytes_per_row=(3 * hc + 2) * d * e + 2 * (hc + hc * hc) * 4,
                         vector_elems_per_row=d * hc * (2 * hc + 2), chunked_passes=0,
                         resident_bytes_per_row=0, l1_bytes_per_col=0, l2_bytes_per_tile=0,
                         written_bytes_per_row=(hc + 1) * d * e),
        ]

    def tiling_problem(self, problem: Problem, hw):
        rows, _, d = problem.shape
        phases = self.phases(problem)
        # one pass per row: no column chunking, so col_chunk is the whole row
        return rowwise_model(rows, d, phases, hw, fixed={"col_chunk": d}, streamed=self.streams_outputs)

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, hc, d = problem.shape
        return {"dtype": problem.dtype, "hc": int(hc), "d": int(d), "tile_rows": int(knobs["tile_rows"]),
                "threads": int(knobs["threads"]), "stream": int(knobs.get("stream", 0))}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": torch.empty_like(inputs["h"])}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        rows = inputs["post"].numel() // inputs["post"].shape[-1]
        kernel.call("fwd", inputs["post"], inputs["comb"], inputs["out"], inputs["h"], outputs["y"], rows)

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        rows = inputs["post"].numel() // inputs["post"].shape[-1]
        kernel.call("bwd", inputs["post"], inputs["comb"], inputs["out"], inputs["h"], grad_outputs["y"],
                    grads["post"], grads["comb"], grads["out"], grads["h"], rows)


PARTS = (MhcPostHost(SPEC),)
