"""The MoE router after its fp32 gate matmul (which stays a matmul): DeepseekV4TopKRouter
(sqrtsoftplus scores, top-k on score + e_score_correction_bias, gather of the unbiased scores,
renormalisation, routed scaling) and DeepseekV4HashRouter (the same with tid2eid's experts).

Routing must be the reference's exactly (one flipped expert changes a token's output), so the
scores s = sqrt(softplus(logits)) stay torch's own ops, bitwise the reference's. The kernel takes
the top-k of s + bias, renormalises and scales, and runs the whole backward.

Top-k ties: torch.topk leaves the choice among exactly tied values to its implementation (CPU:
std::nth_element or partial_sort depending on k and E), and such ties are common with bf16 scores
and a zero correction bias. The kernel flags every row whose k-th and (k+1)-th values tie (or that
holds a NaN); those rows are re-selected by torch.topk itself, so ties go exactly as in the
reference. The k experts come back in ascending expert order (torch's sorted=False order is
unspecified; the experts loop does not depend on it); the reference is put in the same order.
Hash routing keeps the table's order, exactly as the reference."""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config
from transformers.activations import ACT2FN
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

from ..dtypes import DType
from ..errors import UserError
from .base import OpSpec, Problem, Tensors, Tolerance, Work

SCALE = 1.5
VOCAB = 64   # hash-routing table rows in the test inputs

_TOL = {DType.fp32: Tolerance(1e-5, 1e-5), DType.bf16: Tolerance(2e-2, 1.6e-2), DType.fp16: Tolerance(2e-3, 2e-3)}


def _config(experts: int, top_k: int) -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=top_k,
                            routed_scaling_factor=SCALE, vocab_size=VOCAB, num_hidden_layers=1,
                            layer_types=["sliding_attention"], mlp_layer_types=["moe"])


class RouterAfterLogits(torch.nn.Module):
    """The router's code after `logits = F.linear(flat, self.weight)`, verbatim (timing reference)."""

    def __init__(self, experts: int, top_k: int, hash_routing: bool):
        super().__init__()
        self.top_k, self.hash = top_k, hash_routing
        self.score_fn = ACT2FN["sqrtsoftplus"]
        self.routed_scaling_factor = SCALE

    def forward(self, logits, bias_or_indices):
        scores = self.score_fn(logits)
        if self.hash:
            indices = bias_or_indices
        else:
            indices = torch.topk(scores + bias_or_indices, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices


class RouterSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def check_shape(self, shape):
        if shape[2] > shape[1]:
            raise UserError(f"router shape {shape}: TOP_K must not exceed EXPERTS")

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, experts, top_k = problem.shape
        g = torch.Generator().manual_seed(seed)
        out = {"logits": (torch.randn(rows, experts, generator=g) * 3).to(problem.dtype.torch)}
        if problem.variant == "hash":
            out["tid2eid"] = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(VOCAB)])
            out["input_ids"] = torch.randint(0, VOCAB, (rows,), generator=g)
        else:
            out["bias"] = torch.randn(experts, generator=g) * 0.3
        return out

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("logits",)

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        """transformers' router module itself, with an identity gate so its matmul passes the logits through."""
        rows, experts, top_k = problem.shape
        cfg = _config(experts, top_k)
        logits = inputs["logits"]
        mod = (DeepseekV4HashRouter if problem.variant == "hash" else DeepseekV4TopKRouter)(cfg)
        # the gate in the logits' dtype; the correction bias stays fp32, as checkpoints keep it
        mod.weight = torch.nn.Parameter(torch.eye(experts, dtype=logits.dtype))
        with torch.no_grad():
            if problem.variant == "hash":
                mod.tid2eid.copy_(inputs["tid2eid"])
            else:
                mod.e_score_correction_bias.copy_(inputs["bias"])
        args = (logits, inputs["input_ids"]) if problem.variant == "hash" else (logits,)
        _, weights, indices = mod(*args)
        if problem.variant == "hash":     # the table's order, kept by the kernel
            return {"weights": weights, "indices": indices}
        order = indices.argsort(dim=-1)   # the kernel's (equally valid) ascending expert order
        return {"weights": weights.gather(-1, order), "indices": indices.gather(-1, order)}

    def visible_outputs(self) -> tuple[str, ...]:
        return ("weights", "indices")

    def grad_outputs(self) -> tuple[str, ...]:
        return ("weights",)

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype]

    def module_call(self, problem: Problem, inputs: Tensors):
        rows, experts, top_k = problem.shape
        hash_routing = problem.variant == "hash"
        second = inputs["tid2eid"][inputs["input_ids"]] if hash_routing else inputs["bias"]
        return RouterAfterLogits(experts, top_k, hash_routing), (inputs["logits"], second)

    def work(self, problem: Problem, backward: bool) -> Work:
        rows, experts, top_k = problem.shape
        e = problem.dtype.itemsize
        return Work(rows * experts * e * (2 if backward else 1) + rows * top_k * 12, rows * experts * 30)

SPEC = RouterSpec(
    name="router",
    summary="MoE router after the gate matmul: sqrtsoftplus, biased top-k (or hash table), gather, renorm, scale",
    shape_meaning="ROWSxEXPERTSxTOP_K: tokens x routed experts x experts per token",
    shape_rank=3,
    default_shape=(4096, 256, 6),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("topk", "hash"),
)
