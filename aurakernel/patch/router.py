"""The router kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.router import RouterAfterLogits, SPEC
from ..targets.host.library import built_kernel
from ..targets.host.ops.router import _select_with, route_weights
from .base import Patch, bind
from .install import require
from .torch_op import torch_op


def _select(logits: torch.Tensor, bias: torch.Tensor, top_k: int, kernel: str) -> torch.Tensor:
    return _select_with(built_kernel(kernel), logits, bias, top_k)


SELECT_OP = torch_op("router_select", _select,
                     fake_forward=lambda logits, bias, top_k, kernel: logits.new_empty(logits.shape[0], top_k,
                                                                                        dtype=torch.long))


def select(logits, bias, top_k: int, kernel=None):
    """The experts in ascending order: the kernel's selection (a built Kernel, or a source hash:
    through the custom op; rows it cannot decide re-selected by torch, see _select_with), or
    torch.topk of the scores (bitwise torch's) when no kernel is given."""
    if kernel is not None:
        if isinstance(kernel, str):
            return SELECT_OP(logits, bias, top_k, kernel)
        return _select_with(kernel, logits, bias, top_k)
    scores = ACT2FN["sqrtsoftplus"](logits)
    return torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices.sort(dim=-1).values


def _route_forward(logits: torch.Tensor, indices: torch.Tensor, scale: float, kernel: str) -> torch.Tensor:
    """The weights of the selected (or, hash routing, given) experts: the kernel scores only those."""
    weights = logits.new_empty(indices.shape)
    route_weights(built_kernel(kernel), logits.contiguous(), indices.contiguous(), weights, scale)
    return weights


def _route_backward(d_weights: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor, scale: float,
                    kernel: str) -> torch.Tensor:
    logits = logits.contiguous()
    d_logits = torch.empty_like(logits)
    built_kernel(kernel).call("bwd", logits, indices.contiguous(), d_weights.to(logits.dtype).contiguous(),
                              d_logits, logits.shape[0], scale)
    return d_logits


ROUTE_OP = torch_op("router", _route_forward, _route_backward,
                    fake_forward=lambda logits, indices, scale, kernel: logits.new_empty(indices.shape),
                    saved=("logits", "indices"), consts=("scale", "kernel"), grads=("logits",))


def route(logits, bias, top_k: int, scale: float, kernel: str, indices=None):
    """(weights, indices) of the router for `logits` through the kernel (hash routing: the table's
    `indices`, in its order; nothing to select)."""
    if indices is None:
        with torch.no_grad():
            indices = select(logits, bias, top_k, kernel)
    return ROUTE_OP(logits, indices, scale, kernel), indices


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


class RouterPatch(Patch):
    def call_problem(self, module, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None:
            return None
        variant = "hash" if isinstance(module, DeepseekV4HashRouter) else "topk"
        logits_dtype = torch.promote_types(x.dtype, module.weight.dtype)
        if torch.is_autocast_enabled("cpu"):
            logits_dtype = torch.get_autocast_dtype("cpu")
        if logits_dtype not in (d.torch for d in self.spec.dtypes):
            return None
        return Problem(self.spec.name, variant, (x.numel() // x.shape[-1], module.num_experts, module.top_k),
                       DType.from_torch(logits_dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        score_fn = getattr(module, "score_fn", None)
        require(type(score_fn) is type(ACT2FN["sqrtsoftplus"]),
                f"scoring_func is {type(score_fn).__name__}: the router kernel scores with sqrtsoftplus")
        bind(module, lookup, self.spec.name, [(DeepseekV4HashRouter, "forward", _hash_forward),
                                         (DeepseekV4TopKRouter, "forward", _topk_forward),
                                         (RouterAfterLogits, "forward", _after_logits_forward)])


PARTS = (RouterPatch(SPEC),)
