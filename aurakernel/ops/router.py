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
import torch.nn.functional as F
from transformers import DeepseekV4Config
from transformers.activations import ACT2FN
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

from ..dtypes import DType
from ..errors import UserError
from ..patch.install import require
from ..patch.torch_op import torch_op
from ..targets.host.library import built_kernel
from .base import OpSpec, Problem, Tensors, Tolerance, Work, bind

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

    def call_problem(self, module, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None:
            return None
        variant = "hash" if isinstance(module, DeepseekV4HashRouter) else "topk"
        logits_dtype = torch.promote_types(x.dtype, module.weight.dtype)
        if torch.is_autocast_enabled("cpu"):
            logits_dtype = torch.get_autocast_dtype("cpu")
        if logits_dtype not in (d.torch for d in self.dtypes):
            return None
        return Problem(self.name, variant, (x.numel() // x.shape[-1], module.num_experts, module.top_k),
                       DType.from_torch(logits_dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        score_fn = getattr(module, "score_fn", None)
        require(type(score_fn) is type(ACT2FN["sqrtsoftplus"]),
                f"scoring_func is {type(score_fn).__name__}: the router kernel scores with sqrtsoftplus")
        bind(module, lookup, self.name, [(DeepseekV4HashRouter, "forward", _hash_forward),
                                         (DeepseekV4TopKRouter, "forward", _topk_forward),
                                         (RouterAfterLogits, "forward", _after_logits_forward)])


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


def _select(scores: torch.Tensor, bias: torch.Tensor, top_k: int, kernel: str) -> torch.Tensor:
    return _select_with(built_kernel(kernel), scores, bias, top_k)


SELECT_OP = torch_op("router_select", _select,
                     fake_forward=lambda scores, bias, top_k, kernel: scores.new_empty(scores.shape[0], top_k,
                                                                                       dtype=torch.long))


def select(logits, bias, top_k: int, indices=None, kernel=None):
    """Scores (bitwise torch's) and the experts in ascending order: the kernel's selection (a built
    Kernel, or a source hash: through the custom op), with tied rows re-selected by torch.topk, or
    torch.topk alone when no kernel is given."""
    scores = ACT2FN["sqrtsoftplus"](logits)
    if indices is None and kernel is not None:
        if isinstance(kernel, str):
            return scores, SELECT_OP(scores, bias, top_k, kernel)
        return scores, _select_with(kernel, scores, bias, top_k)
    if indices is None:
        indices = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    return scores, indices.sort(dim=-1).values


def _route_forward(logits: torch.Tensor, scores: torch.Tensor | None, indices: torch.Tensor, scale: float,
                   kernel: str) -> torch.Tensor:
    """scores=None: hash routing, the kernel scores only the given experts."""
    rows, top_k = indices.shape
    idx = indices.contiguous()
    weights = logits.new_empty(rows, top_k)
    if scores is None:
        built_kernel(kernel).call("fwd_given", logits.contiguous(), idx, weights, rows, scale)
    else:
        built_kernel(kernel).call("fwd", scores.contiguous(), idx, weights, rows, scale)
    return weights


def _route_backward(d_weights: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor, scale: float,
                    kernel: str) -> torch.Tensor:
    logits = logits.contiguous()
    d_logits = torch.empty_like(logits)
    built_kernel(kernel).call("bwd", logits, indices.contiguous(), d_weights.to(logits.dtype).contiguous(),
                              d_logits, logits.shape[0], scale)
    return d_logits


ROUTE_OP = torch_op("router", _route_forward, _route_backward,
                    fake_forward=lambda logits, scores, indices, scale, kernel: logits.new_empty(indices.shape),
                    saved=("logits", "indices"), consts=("scale", "kernel"), grads=("logits",))


def route(logits, bias, top_k: int, scale: float, kernel: str, indices=None):
    """(weights, indices) of the router for `logits` through the kernel."""
    if indices is not None:   # hash routing: nothing to select, no full score matrix needed; the table's order
        return ROUTE_OP(logits, None, indices, scale, kernel), indices
    with torch.no_grad():
        scores, indices = select(logits, bias, top_k, None, kernel)
    return ROUTE_OP(logits, scores, indices, scale, kernel), indices


def _kernel_for(module, logits):
    if logits.device.type != "cpu":
        return None
    return module._ak_lookup((module.num_experts, module.top_k), logits.dtype)


def _topk_forward(self: DeepseekV4TopKRouter, hidden_states):
    flat = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(flat, self.weight)
    kernel = _kernel_for(self, logits)
    if kernel is None:
        return DeepseekV4TopKRouter.forward(self, hidden_states)
    weights, indices = route(logits, self.e_score_correction_bias, self.top_k, float(self.routed_scaling_factor), kernel)
    return logits, weights, indices


def _hash_forward(self: DeepseekV4HashRouter, hidden_states, input_ids):
    flat = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(flat, self.weight)
    kernel = _kernel_for(self, logits)
    if kernel is None:
        return DeepseekV4HashRouter.forward(self, hidden_states, input_ids)
    indices = self.tid2eid[input_ids.reshape(-1)].long()
    weights, indices = route(logits, None, self.top_k, float(self.routed_scaling_factor), kernel, indices)
    return logits, weights, indices


def _after_logits_forward(self: RouterAfterLogits, logits, bias_or_indices):
    kernel = self._ak_lookup(None, logits.dtype)
    if self.hash:
        return route(logits, None, self.top_k, float(self.routed_scaling_factor), kernel, bias_or_indices)
    return route(logits, bias_or_indices, self.top_k, float(self.routed_scaling_factor), kernel)


SPEC = RouterSpec(
    name="router",
    summary="MoE router after the gate matmul: sqrtsoftplus, biased top-k (or hash table), gather, renorm, scale",
    shape_meaning="ROWSxEXPERTSxTOP_K: tokens x routed experts x experts per token",
    shape_rank=3,
    default_shape=(4096, 256, 6),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("topk", "hash"),
)
