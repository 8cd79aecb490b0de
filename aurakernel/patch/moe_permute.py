"""The moe_permute kernel in a model: its torch ops (custom ops with autograd and fake registrations)
and the experts' dispatch (patch/experts.py's `moe_permute`) made to reach it."""

from __future__ import annotations

import functools

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.moe_permute import SPEC, MoePermuteReference, moe_permute
from ..targets.host.library import built_kernel
from .base import Patch
from .experts import swap_into_experts
from .torch_op import torch_op


def _forward(hidden: torch.Tensor, top_k_index: torch.Tensor, experts: int,
             kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = built_kernel(kernel)
    inputs = {"hidden": hidden.contiguous(), "top_k_index": top_k_index.to(torch.int64).contiguous()}
    outputs = k.empty_outputs(Problem(SPEC.name, "default", (hidden.shape[0], experts, top_k_index.shape[-1],
                                                             hidden.shape[-1]), DType.from_torch(hidden.dtype)), inputs)
    k.run_forward(inputs, outputs)
    return outputs["selected"], outputs["offsets"], outputs["rows"]


def _backward(d_selected: torch.Tensor, top_k_index: torch.Tensor, selected: torch.Tensor, offsets: torch.Tensor,
              rows: torch.Tensor, kernel: str) -> torch.Tensor:
    d_hidden = d_selected.new_empty(top_k_index.shape[0], d_selected.shape[-1])
    built_kernel(kernel).run_backward({"top_k_index": top_k_index}, {"rows": rows},
                                      {"selected": d_selected.contiguous()}, {"hidden": d_hidden})
    return d_hidden


def _fake_forward(hidden, top_k_index, experts, kernel):
    pairs = top_k_index.numel()
    return (hidden.new_empty(pairs, hidden.shape[-1]), torch.empty(experts, dtype=torch.int32, device=hidden.device),
            torch.empty(pairs, dtype=torch.int64, device=hidden.device))


def _fake_backward(d_selected, top_k_index, selected, offsets, rows, kernel):
    return d_selected.new_empty(top_k_index.shape[0], d_selected.shape[-1])


OP = torch_op("moe_permute", _forward, _backward, fake_forward=_fake_forward, fake_backward=_fake_backward,
              outputs=3, differentiable=1, save_outputs=True, saved=("top_k_index",), consts=("kernel",),
              grads=("hidden",))


def dispatch(lookup, hidden: torch.Tensor, top_k_index: torch.Tensor, experts: int, stable: bool = False):
    """`moe_permute` in a patched module: the kernel planned for (E, K, H) where one fits the call,
    else the torch code."""
    if (hidden.device.type == "cpu" and hidden.dim() == 2 and top_k_index.dim() == 2
            and not top_k_index.is_floating_point() and top_k_index.shape[0] == hidden.shape[0]):
        kernel = lookup((experts, top_k_index.shape[-1], hidden.shape[-1]), hidden.dtype)
        if kernel is not None:
            return OP(hidden, top_k_index, experts, kernel)
    return moe_permute(hidden, top_k_index, experts, stable)


class MoePermutePatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        """A call of the experts (hidden, top_k_index, top_k_weights) or of the reference (hidden, top_k_index)."""
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
            return None
        hidden, ids = args[0], args[1]
        if hidden.dim() != 2 or ids.dim() != 2 or hidden.dtype not in (d.torch for d in self.spec.dtypes):
            return None
        experts = module.num_experts if isinstance(module, DeepseekV4Experts) else getattr(module, "experts", None)
        if not isinstance(experts, int):
            return None
        return Problem(self.spec.name, "default", (hidden.shape[0], experts, ids.shape[-1], hidden.shape[-1]),
                       DType.from_torch(hidden.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        """The experts (patch/experts.py's forward, which calls `moe_permute` by its module-level name)
        or MoePermuteReference call the kernel."""
        swap_into_experts(module, self.spec.name, MoePermuteReference,
                          moe_permute=functools.partial(dispatch, lookup))


PARTS = (MoePermutePatch(SPEC),)
