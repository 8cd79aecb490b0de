"""The host C kernel of router (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 4096x256x6 bf16, 2-core Xeon, AVX-512): the top-k
forward is selection work, not traffic: 1.76 ms against 0.08 ms of minimum traffic (sqrtsoftplus of
256 scores per token, then the 6 largest by repeated max over the row); the hash router (no
selection) runs at 0.9x its traffic bound. On the portable AVX2 path the top-k forward was 11.8 ms:
its 16-lane vectors (two registers each) spilled the 14 sorted levels on every expert; the lanes
now follow the vector width (8 on AVX2): 2.35 ms, and the module's forward + backward 3.0 ms
against eager's 7.9 (it was 12.9, slower than eager).
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from ....ops.base import Problem, Tensors
from ....ops.router import SCALE, SPEC
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


def _select_with(kernel, scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """The kernel's top-k of scores + bias in ascending expert order; tied rows re-selected by torch.topk."""
    rows = scores.shape[0]
    indices = torch.empty(rows, top_k, dtype=torch.long)
    tie = torch.empty(rows, dtype=torch.uint8)
    kernel.call("select", scores.contiguous(), bias.float().contiguous(), indices, tie, rows)
    tied = tie.nonzero().flatten()
    if tied.numel():
        picked = torch.topk(scores[tied] + bias, top_k, dim=-1, sorted=False).indices
        indices[tied] = picked.sort(dim=-1).values
    return indices


class RouterHost(HostKernel):
    knob_docs = {"tile_rows": "token rows per tile", "threads": "OpenMP threads"}
    entries = {"select": Entry("ak_router_select", ("ptr", "ptr", "ptr", "ptr", "i64")),
               "fwd": Entry("ak_router_fwd", ("ptr", "ptr", "ptr", "i64", "f32")),
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
        rows = inputs["logits"].shape[0]
        if "input_ids" in inputs:   # hash routing: the kernel scores the table's experts itself
            outputs["indices"].copy_(inputs["tid2eid"][inputs["input_ids"]])
            kernel.call("fwd_given", inputs["logits"], outputs["indices"], outputs["weights"], rows, SCALE)
            return
        scores = ACT2FN["sqrtsoftplus"](inputs["logits"])   # bitwise torch's, as the reference
        outputs["indices"].copy_(_select_with(kernel, scores, inputs.get("bias"), outputs["indices"].shape[1]))
        kernel.call("fwd", scores.contiguous(), outputs["indices"], outputs["weights"], rows, SCALE)

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        kernel.call("bwd", inputs["logits"], outputs["indices"], grad_outputs["weights"].contiguous(), grads["logits"],
                    inputs["logits"].shape[0], SCALE)

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        rows, experts, top_k = problem.shape
        tail = min(rows, knobs["tile_rows"] * knobs["threads"] * 2 + 3)
        return [problem, Problem(problem.op, problem.variant, (tail, experts, top_k), problem.dtype)]


PARTS = (RouterHost(SPEC),)
