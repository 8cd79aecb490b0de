"""The host C kernel of indexer_score (templates/host/): its tiling model, template values and C calls.

Where the time goes (1x512x64x128x256 fp32, AVX2 EPYC at 2.45 GHz, 2 cores: 157 GFLOP/s of fp32
FMA at most): FMAs. The forward is one GEMM (q k^T, 2.1 GFLOP) in 15 ms; a backward that computes the
products again (dq and dk need their signs, dw their values) runs three, 6.4 GFLOP in 46 ms: both
~140 GFLOP/s, ~90% of that peak, against 3% of the stream bandwidth. torch.compile keeps the products
(fwd+bwd ~61 ms, a third less arithmetic). So the products are a planned formulation
(`keep_products`): kept, the forward's GEMM writes them straight into a [B, S, H, T] fp32 tensor the
backward reads (one stream each way, 1.5 ms at this shape, against the 15 ms GEMM saved); recomputed,
the op holds no memory past its outputs. The planner keeps them while they take at most KEEP_SHARE
of memory (32 MiB here; V4-Flash at 4096 tokens, 1 GiB a layer, recomputes). Kept, one `aurakernel
bench` run: 46.6 ms against eager's 70.3 and torch.compile's 62.2 (1.51x / 1.33x; recomputing it was
60.8 against 61.3, 1.01x), peak memory 48.9 MiB against compile's 112.6.

The causal variant (what DeepseekV4Indexer takes to its top-k: each query's entries past (position + 1)
// ratio at -inf) passes the kernel each row's limit: its products GEMM covers the entries the row sees,
rounded up to whole vectors (the GEMM's columns short of a vector run in a loop per row and k: with
limits that are not multiples of 16 the causal kernel was slower than scoring every entry, 27.1
against 21.9 ms), the backward's GEMMs those entries only, and query tiles are dealt to the threads in
turn (in halves, the second thread had the later rows: three times the first's products). Kernel
alone, Zen 4 EPYC with AVX-512, 1x512x64x128x128 fp32 (ratio 4: half the products), medians of 9
alternating calls with the products kept: every entry 6.40 + 13.21 ms, causal 4.63 + 9.44 ms (1.40x;
the rows that see few entries run narrow GEMMs). At 2048 tokens (1x2048x64x128x512 bf16, products
recomputed, medians of 5 alternating): 90.4 + 250.8 against 47.5 + 135.7 ms, 1.86x.
"""

from __future__ import annotations

import torch

from ....ops.base import Problem, Tensors
from ....ops.indexer_score import SPEC, causal_limit
from ....planner.costmodel import RowwisePhase, rowwise_model
from ....planner.model import Constraint, Term
from ..kernel import HostKernel
from ..library import Entry


def kept_products(kernel, q, k) -> torch.Tensor:
    """The forward's products q.k [B, S, H, T] fp32 for the backward where the plan keeps them, else empty."""
    if not kernel.meta.get("keep_products"):
        return q.new_empty(0, dtype=torch.float32)
    return q.new_empty(*q.shape[:3], k.shape[1], dtype=torch.float32)


def _fwd(kernel, q, k, w, out, products, limit=None):
    """The scores into `out`; with `limit` ([B, S] int64: the entries each query sees, the causal rule)
    only those are computed and the rest written -inf."""
    b, s, h, dim = q.shape
    t = k.shape[1]
    scratch = kernel.workspace_of(kernel.call("fwd_scratch", b, t))   # the kernel sizes it: AMX or AVX path
    kernel.call("fwd", q, k, w, _limit(limit, b, s), out, products, scratch, b, s, t, dim**-0.5)


def _bwd(kernel, q, k, w, g, products, dq, dk, dw, limit=None):
    b, s, h, dim = q.shape
    t = k.shape[1]
    scratch = kernel.workspace_of(kernel.call("bwd_scratch", b, t))
    kernel.call("bwd", q, k, w, _limit(limit, b, s), g, products, dq, dk, dw, scratch, b, s, t, dim**-0.5)


def _limit(limit: torch.Tensor | None, b: int, s: int) -> torch.Tensor | None:
    if limit is None:
        return None   # NULL: every entry
    if limit.dtype != torch.int64 or tuple(limit.shape) != (b, s) or not limit.is_contiguous():
        raise ValueError(f"indexer_score limit: a contiguous int64 [{b}, {s}] tensor, got {limit.dtype} {tuple(limit.shape)}")
    return limit


# the kept products may take this share of memory at most: they live from the forward to the backward,
# one [B, S, H, T] fp32 tensor per CSA layer (V4-Flash at 4096 tokens: 1 GiB each, 21 layers), so a
# training step holds many; where they are larger the backward computes them again
KEEP_SHARE = 1 / 64


class IndexerScoreHost(HostKernel):
    knob_docs = {"tile_rows": "queries per tile", "threads": "OpenMP threads",
                 "keep_products": "1: the forward keeps q.k (fp32) for the backward; 0: the backward computes it again"}
    entries = {"fwd": Entry("ak_indexer_fwd", ("ptr",) * 7 + ("i64", "i64", "i64", "f32")),
               "bwd": Entry("ak_indexer_bwd", ("ptr",) * 10 + ("i64", "i64", "i64", "f32")),
               "fwd_scratch": Entry("ak_indexer_fwd_scratch", ("i64", "i64"), "i64"),
               "bwd_scratch": Entry("ak_indexer_bwd_scratch", ("i64", "i64"), "i64")}

    def tiling_problem(self, problem: Problem, hw):
        batch, seq, heads, dim, entries = problem.shape
        e = problem.dtype.itemsize
        # one GEMM's FLOPs a row, priced as vector elements: over the entries a row scores (causal: its limit, on average)
        scored = float(causal_limit(1, seq, entries).float().mean()) if problem.variant == "causal" else entries
        gemm = 2 * heads * dim * scored / 16
        kept = heads * entries * 4              # a row's products, fp32
        row_bytes = {"forward": heads * dim * e + entries * 4, "backward": 2 * heads * dim * e + entries * 4}
        phases = {keep: [RowwisePhase("forward", row_bytes["forward"] + keep * kept, gemm, 0, 0, 0, 0),
                         RowwisePhase("backward", row_bytes["backward"] + keep * kept, (3 - keep) * gemm, 0, 0, 0, 0)]
                  for keep in (0, 1)}
        model = rowwise_model(batch * seq, heads * dim, phases, hw, formulation="keep_products",
                              fixed={"col_chunk": heads * dim, "vec": max(hw.simd_bytes // 4, 4)})
        limit = hw.memory["DRAM"].capacity * KEEP_SHARE
        model.constraints.append(Constraint(
            "kept products (memory)", Term.of(("keep_products",), model.domains, lambda k: k * batch * seq * kept),
            limit, f"keep_products x {batch * seq * kept:,} B"))
        return model

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "heads": int(problem.shape[2]), "dim": int(problem.shape[3]),
                "vec": int(knobs["vec"]), "tile_rows": int(knobs["tile_rows"]), "threads": int(knobs["threads"]),
                "keep_products": bool(knobs.get("keep_products", 0))}   # plans made before the knob: recompute

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        q, k = inputs["q"], inputs["k"]
        return {"y": torch.empty(q.shape[0], q.shape[1], k.shape[1])}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        q, k = inputs["q"].contiguous(), inputs["k"].contiguous()
        w = self.spec.weights(inputs["hidden"], inputs["proj"], q.shape[2]).contiguous()
        outputs["products"] = kept_products(kernel, q, k)
        _fwd(kernel, q, k, w, outputs["y"], outputs["products"], inputs.get("limit"))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        q, k, hidden, proj = (inputs[n] for n in ("q", "k", "hidden", "proj"))
        heads = q.shape[2]
        w = self.spec.weights(hidden, proj, heads).contiguous()
        dw = torch.empty_like(w)
        _bwd(kernel, q.contiguous(), k.contiguous(), w, grad_outputs["y"].float().contiguous(), outputs["products"],
             grads["q"], grads["k"], dw, inputs.get("limit"))
        dw = dw * heads**-0.5   # back through the scaling and the projection (torch ops)
        grads["hidden"].copy_(dw.to(hidden.dtype) @ proj)
        grads["proj"].copy_(dw.reshape(-1, heads).t() @ hidden.reshape(-1, hidden.shape[-1]))

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        batch, seq, heads, dim, entries = problem.shape
        tail = min(seq, knobs["tile_rows"] * knobs["threads"] + 1)
        return [problem, Problem(problem.op, problem.variant, (2, tail, heads, dim + 3, entries + 5), problem.dtype)]


PARTS = (IndexerScoreHost(SPEC),)
