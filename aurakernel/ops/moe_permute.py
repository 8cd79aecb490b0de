"""The routed experts' dispatch: transformers' grouped_mm experts forward (integrations/moe.py) sorts
the (token, k) pairs by expert and gathers their rows before the grouped projections,

    expert_ids_g, perm = sort(top_k_index.reshape(-1))
    selected[r] = hidden[perm[r] // K]                          [tokens x K, H]
    offsets = cumsum(histc(expert_ids_g, E, 0, E - 1))          int32, each expert's end row

and its combine (moe_unpermute) needs each pair's row back, rows[perm[r]] = r (its inv_perm). Eager
that is a sort, a division, a gather, a histogram, a cumulative sum and a scatter of row numbers,
each a pass and a dispatch; the backward an index_add_ of the gathered rows' gradients. The kernel
sorts by counting (E buckets) and gathers in one call, and its backward sums each token's K row
gradients (no scatter). A group's rows keep their tokens' order (a stable sort: torch's default sort,
transformers', does not promise one, so the kernel's reference sorts stably; the grouped projections
are row by row, so the order inside a group changes only the order of the weight gradients' sums).
An expert id outside [0, E) (expert-parallel sentinels) sorts after every group and is left out of
the offsets, as with transformers' histc.
"""

from __future__ import annotations

import torch

from ..dtypes import DType
from ..errors import UserError
from .base import OpSpec, Problem, Tensors, Tolerance, Work

# the gather copies; the backward sums K rows in another order than index_add_ (bf16: rounding each add)
_TOL = {DType.fp32: Tolerance(1e-6, 1e-6), DType.bf16: Tolerance(1.6e-2, 1e-2)}


def moe_permute(hidden: torch.Tensor, top_k_index: torch.Tensor, experts: int, stable: bool = False):
    """transformers' dispatch (grouped_mm_experts_forward): the pairs' rows grouped by expert, the
    groups' end rows (int32) and each pair's row (int64, [tokens x K]). Sorted as transformers sorts
    (torch's default sort: bitwise its results) unless `stable` (the kernel's order, its reference)."""
    num_top_k = top_k_index.size(-1)
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1), stable=stable)
    selected = hidden.index_select(0, perm // num_top_k)
    # histc as transformers calls it: float ids on the CPU (and MPS), int ids elsewhere
    histc_input = expert_ids_g.float() if hidden.device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=experts, min=0, max=experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    rows = torch.empty_like(perm)
    rows[perm] = torch.arange(perm.size(0), device=perm.device)
    return selected, offsets, rows


class MoePermuteReference(torch.nn.Module):
    """The dispatch as the experts' forward (patch/experts.py) calls it, stably sorted: the
    module-level `moe_permute`, which a patch swaps for the kernel in this module's namespace."""

    def __init__(self, experts: int):
        super().__init__()
        self.experts = experts

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor):
        return moe_permute(hidden, top_k_index, self.experts, stable=True)


def routed_experts(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """[tokens, K] int64: K distinct experts a token (a router's top-k) where there are that many,
    expert 0 never picked where the others suffice (an empty group)."""
    g = torch.Generator().manual_seed(seed)
    first = 1 if experts - 1 >= top_k else 0
    if experts - first < top_k:   # more picks than experts: repeats, as a hash table may give
        return torch.randint(0, experts, (tokens, top_k), generator=g)
    keys = torch.rand(tokens, experts - first, generator=g)
    return keys.topk(top_k, dim=1).indices + first


class MoePermuteSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def check_shape(self, shape: tuple[int, ...]) -> None:
        if shape[1] > 4096:
            raise UserError(f"moe_permute: {shape[1]} experts; accepted are at most 4096 (the kernel's buckets)")

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        tokens, experts, top_k, hidden = problem.shape
        g = torch.Generator().manual_seed(seed + 1)
        return {"hidden": torch.randn(tokens, hidden, generator=g).to(problem.dtype.torch),
                "top_k_index": routed_experts(tokens, experts, top_k, seed)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("hidden",)

    def visible_outputs(self) -> tuple[str, ...]:
        return ("selected", "offsets", "rows")

    def grad_outputs(self) -> tuple[str, ...]:
        return ("selected",)

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return dict(zip(self.visible_outputs(), moe_permute(inputs["hidden"], inputs["top_k_index"], problem.shape[1],
                                                            stable=True)))

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype]

    def work(self, problem: Problem, backward: bool) -> Work:
        """hidden once and the K rows a token (forward; backward the other way round), the ids and
        the row numbers; the backward adds K rows a token."""
        tokens, experts, top_k, hidden = problem.shape
        e = problem.dtype.itemsize
        moved = (tokens * hidden + tokens * top_k * hidden) * e + tokens * top_k * 16
        return Work(moved, tokens * top_k * hidden if backward else 0)

    def module_call(self, problem: Problem, inputs: Tensors):
        return MoePermuteReference(problem.shape[1]), (inputs["hidden"], inputs["top_k_index"])


SPEC = MoePermuteSpec(
    name="moe_permute",
    summary="the routed experts' dispatch: the (token, expert) pairs' rows sorted by expert, their offsets and rows",
    shape_meaning="TOKENSxEXPERTSxTOPKxHIDDEN: tokens x routed experts x experts per token x hidden size",
    shape_rank=4,
    default_shape=(1024, 256, 6, 4096),
    dtypes=(DType.fp32, DType.bf16),
    variants=("default",),
)
