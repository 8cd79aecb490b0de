"""The host C kernel of router (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 4096x256x6 bf16, 2-core Xeon, AVX-512): the top-k
forward is selection work, not traffic: 1.76 ms against 0.08 ms of minimum traffic (sqrtsoftplus of
256 scores per token, then the 6 largest by repeated max over the row); the hash router (no
selection) runs at 0.9x its traffic bound. On the portable AVX2 path the top-k forward was 11.8 ms:
its 16-lane vectors (two registers each) spilled the 14 sorted levels on every expert; the lanes
now follow the vector width (8 on AVX2): 2.35 ms, and the module's forward + backward 3.0 ms
against eager's 7.9 (it was 12.9, slower than eager).
Then the scores were the largest part (AVX2 EPYC, `aurakernel tune router --variant topk`: forward +
backward 3.75 ms, of which torch's sqrtsoftplus 2.0 ms: its bf16 softplus runs ~1.8 ns an element).
Our own vectorised softplus was no faster (2.46 ms for scores and selection) and could only match
torch's bits with a rounding certificate. A bf16 logit has 65536 possible values, though: the kernel
now looks its score up in a 128 KB table of torch's own scores (score_table; bitwise, tested), 0.70
ms for scores and selection together; 3.75 -> 1.53 ms (2.8x -> 6.6x eager, 6.6x torch.compile).
"""

from __future__ import annotations

import functools

import torch
from transformers.activations import ACT2FN

from ....dtypes import bf16_patterns
from ....ops.base import Problem, Tensors
from ....ops.router import SCALE, SPEC
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


@functools.cache
def score_table() -> torch.Tensor:
    """torch's sqrtsoftplus of every bf16 bit pattern, indexed by the bits: what the reference scores a
    bf16 logit with (the same bits on torch's vector and scalar paths, checked by the tests)."""
    return ACT2FN["sqrtsoftplus"](bf16_patterns()).contiguous()


def _select_with(kernel, logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """The kernel's top-k of sqrtsoftplus(logits) + bias in ascending expert order, the scores bitwise
    torch's (bf16 builds look them up in score_table; the others take torch's); rows whose k-th and
    runner-up tie (or with a NaN) re-selected by torch.topk, so routing is always the reference's."""
    rows = logits.shape[0]
    indices = torch.empty(rows, top_k, dtype=torch.long)
    tie = torch.empty(rows, dtype=torch.uint8)
    bias = bias.float().contiguous()
    if kernel.has("select_table"):
        kernel.call("select_table", logits.contiguous(), score_table(), bias, indices, tie, rows)
        flagged = tie.nonzero().flatten()
        scores = score_table()[logits[flagged].view(torch.int16).long() & 0xFFFF] if flagged.numel() else None
    else:
        scores = ACT2FN["sqrtsoftplus"](logits).contiguous()
        kernel.call("select", scores, bias, indices, tie, rows)
        flagged = tie.nonzero().flatten()
        scores = scores[flagged]
    if flagged.numel():
        picked = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
        indices[flagged] = picked.sort(dim=-1).values
    return indices


def route_weights(kernel, logits: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, scale: float) -> None:
    """The weights of the given experts (selected, or a hash table's) into `weights`."""
    rows = logits.shape[0]
    if kernel.has("fwd_table"):
        kernel.call("fwd_table", logits, score_table(), indices, weights, rows, scale)
    else:
        kernel.call("fwd_given", logits, indices, weights, rows, scale)


class RouterHost(HostKernel):
    knob_docs = {"tile_rows": "token rows per tile", "threads": "OpenMP threads"}
    entries = {"select": Entry("ak_router_select", ("ptr", "ptr", "ptr", "ptr", "i64")),
               "select_table": Entry("ak_router_select_table", ("ptr",) * 5 + ("i64",), optional=True),   # bf16 only
               "fwd_table": Entry("ak_router_fwd_table", ("ptr",) * 4 + ("i64", "f32"), optional=True),
               "fwd_given": Entry("ak_router_fwd_given", ("ptr", "ptr", "ptr", "i64", "f32")),
               "bwd": Entry("ak_router_bwd", ("ptr", "ptr", "ptr", "ptr", "i64", "f32"))}

    def tiling_problem(self, problem: Problem, hw):
        rows, experts, top_k = problem.shape
        e = problem.dtype.itemsize
        phases = [RowwisePhase("forward", experts * e + top_k * 12, experts * 40, 0, 0, 0, 0),
                  RowwisePhase("backward", experts * e * 2 + top_k * 12, experts + top_k * 40, 0, 0, 0, 0)]
        return rowwise_model(rows, experts, phases, hw, fixed={"col_chunk": experts, "vec": max(hw.simd_bytes // 4, 4)})

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "experts": int(problem.shape[1]), "top_k": int(problem.shape[2]),
                "hash": problem.variant == "hash", "tile_rows": int(knobs["tile_rows"]),
                "threads": int(knobs["threads"]), "lanes": int(knobs["vec"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        rows, top_k = inputs["logits"].shape[0], problem.shape[2] if problem else None
        return {"weights": inputs["logits"].new_empty(rows, top_k),
                "indices": torch.empty(rows, top_k, dtype=torch.long)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        if "input_ids" in inputs:   # hash routing: the table's experts
            outputs["indices"].copy_(inputs["tid2eid"][inputs["input_ids"]])
        else:
            outputs["indices"].copy_(_select_with(kernel, inputs["logits"], inputs.get("bias"), outputs["indices"].shape[1]))
        route_weights(kernel, inputs["logits"], outputs["indices"], outputs["weights"], SCALE)

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        kernel.call("bwd", inputs["logits"], outputs["indices"], grad_outputs["weights"].contiguous(), grads["logits"],
                    inputs["logits"].shape[0], SCALE)

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        rows, experts, top_k = problem.shape
        tail = min(rows, knobs["tile_rows"] * knobs["threads"] * 2 + 3)
        return [problem, Problem(problem.op, problem.variant, (tail, experts, top_k), problem.dtype)]


PARTS = (RouterHost(SPEC),)
