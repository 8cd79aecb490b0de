"""The host C kernel of indexer_score (templates/host/): its tiling model, template values and C calls.

Where the time goes (1x512x64x128x256 bf16, AVX2 EPYC at 2.45 GHz, 2 cores: 157 GFLOP/s of fp32
FMA at most): FMAs. The forward is one GEMM (q k^T, 2.1 GFLOP) in 15 ms; the backward computes the
products again (the op never stores the [B, S, H, T] products: 1 GB at V4-Flash's 4096 tokens) and
then dq and dk, 6.4 GFLOP in 46 ms: both ~140 GFLOP/s, ~90% of that peak, against 3% of the stream
bandwidth. torch.compile keeps the products and does a third less arithmetic (fwd+bwd ~61 ms), so
1.3x over it is out of reach without storing them; the kernel's gain is the memory (8.8 MiB peak
against compile's 112.8).
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.indexer_score import SPEC
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


def _fwd(kernel, q, k, w, out):
    b, s, h, dim = q.shape
    t = k.shape[1]
    scratch = kernel.workspace_of(kernel.call("fwd_scratch", b, t))   # the kernel sizes it: AMX or AVX path
    kernel.call("fwd", q, k, w, out, scratch, b, s, t, dim**-0.5)


def _bwd(kernel, q, k, w, g, dq, dk, dw):
    b, s, h, dim = q.shape
    t = k.shape[1]
    scratch = kernel.workspace_of(kernel.call("bwd_scratch", b, t))
    kernel.call("bwd", q, k, w, g, dq, dk, dw, scratch, b, s, t, dim**-0.5)


class IndexerScoreHost(HostKernel):
    knob_docs = {"tile_rows": "queries per tile", "threads": "OpenMP threads"}
    entries = {"fwd": Entry("ak_indexer_fwd", ("ptr",) * 5 + ("i64", "i64", "i64", "f32")),
               "bwd": Entry("ak_indexer_bwd", ("ptr",) * 8 + ("i64", "i64", "i64", "f32")),
               "fwd_scratch": Entry("ak_indexer_fwd_scratch", ("i64", "i64"), "i64"),
               "bwd_scratch": Entry("ak_indexer_bwd_scratch", ("i64", "i64"), "i64")}

    def tiling_problem(self, problem: Problem, hw):
        batch, seq, heads, dim, entries = problem.shape
        e = problem.dtype.itemsize
        per_row_flops = 2 * heads * dim * entries
        phases = [RowwisePhase("forward", heads * dim * e + entries * 4, per_row_flops / 16, 0, 0, 0, 0),
                  RowwisePhase("backward", 2 * heads * dim * e + entries * 4, 3 * per_row_flops / 16, 0, 0, 0, 0)]
        return rowwise_model(batch * seq, heads * dim, phases, hw,
                             fixed={"col_chunk": heads * dim, "vec": max(hw.simd_bytes // 4, 4)})

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "heads": int(problem.shape[2]), "dim": int(problem.shape[3]),
                "vec": int(knobs["vec"]), "tile_rows": int(knobs["tile_rows"]), "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        q, k = inputs["q"], inputs["k"]
        return {"y": torch.empty(q.shape[0], q.shape[1], k.shape[1])}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        q, k = inputs["q"].contiguous(), inputs["k"].contiguous()
        w = self.spec.weights(inputs["hidden"], inputs["proj"], q.shape[2]).contiguous()
        _fwd(kernel, q, k, w, outputs["y"])

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        q, k, hidden, proj = (inputs[n] for n in ("q", "k", "hidden", "proj"))
        heads = q.shape[2]
        w = self.spec.weights(hidden, proj, heads).contiguous()
        dw = torch.empty_like(w)
        _bwd(kernel, q.contiguous(), k.contiguous(), w, grad_outputs["y"].float().contiguous(), grads["q"], grads["k"], dw)
        dw = dw * heads**-0.5   # back through the scaling and the projection (torch ops)
        grads["hidden"].copy_(dw.to(hidden.dtype) @ proj)
        grads["proj"].copy_(dw.reshape(-1, heads).t() @ hidden.reshape(-1, hidden.shape[-1]))

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        batch, seq, heads, dim, entries = problem.shape
        tail = min(seq, knobs["tile_rows"] * knobs["threads"] + 1)
        return [problem, Problem(problem.op, problem.variant, (2, tail, heads, dim + 3, entries + 5), problem.dtype)]


PARTS = (IndexerScoreHost(SPEC),)
