"""The moe_unpermute kernel in a model: its torch ops (custom ops with autograd and fake registrations)
and the experts' combine (patch/experts.py's `moe_unpermute`) made to reach it."""

from __future__ import annotations

import functools

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.moe_unpermute import SPEC, MoeUnpermuteReference, moe_unpermute
from ..targets.host.library import built_kernel
from .base import Patch
from .experts import swap_into_experts
from .torch_op import torch_op


def _forward(proj: torch.Tensor, top_k_weights: torch.Tensor, rows: torch.Tensor, kernel: str) -> torch.Tensor:
    w = top_k_weights.contiguous()
    y = proj.new_empty(w.shape[0], proj.shape[-1])
    built_kernel(kernel).run_forward({"proj": proj.contiguous(), "top_k_weights": w, "rows": rows.contiguous()},
                                     {"y": y})
    return y


def _backward(dy: torch.Tensor, proj: torch.Tensor, top_k_weights: torch.Tensor, rows: torch.Tensor,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    proj, w = proj.contiguous(), top_k_weights.contiguous()
    grads = {"proj": torch.empty_like(proj), "top_k_weights": torch.empty_like(w)}
    built_kernel(kernel).run_backward({"proj": proj, "top_k_weights": w, "rows": rows.contiguous()}, {},
                                      {"y": dy.contiguous()}, grads)
    return grads["proj"], grads["top_k_weights"]


def _fake_forward(proj, top_k_weights, rows, kernel):
    return proj.new_empty(top_k_weights.shape[0], proj.shape[-1])


OP = torch_op("moe_unpermute", _forward, _backward, fake_forward=_fake_forward,
              saved=("proj", "top_k_weights", "rows"), consts=("kernel",), grads=("proj", "top_k_weights"))


def dispatch(lookup, proj: torch.Tensor, top_k_weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`moe_unpermute` in a patched module: the kernel planned for (K, H) where one fits the call
    (the rows and their weights in one dtype, on the CPU), else the torch code."""
    if (proj.device.type == "cpu" and proj.dim() == 2 and top_k_weights.dim() == 2 and rows.dim() == 1
            and proj.dtype == top_k_weights.dtype and rows.dtype == torch.int64
            and rows.shape[0] == proj.shape[0] == top_k_weights.numel()):
        kernel = lookup((top_k_weights.shape[-1], proj.shape[-1]), proj.dtype)
        if kernel is not None:
            return OP(proj, top_k_weights, rows, kernel)
    return moe_unpermute(proj, top_k_weights, rows)


class MoeUnpermutePatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        """A call of the experts (hidden, top_k_index, top_k_weights: the combine's rows are the
        hidden size wide) or of the reference (proj, top_k_weights, rows)."""
        if len(args) < 3 or not all(isinstance(a, torch.Tensor) for a in args[:3]):
            return None
        x, weights = (args[0], args[2]) if isinstance(module, DeepseekV4Experts) else (args[0], args[1])
        if x.dim() != 2 or weights.dim() != 2 or x.dtype not in (d.torch for d in self.spec.dtypes):
            return None
        return Problem(self.spec.name, "default", (weights.shape[0], weights.shape[1], x.shape[-1]),
                       DType.from_torch(x.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        """The experts (patch/experts.py's forward, which calls `moe_unpermute` by its module-level
        name) or MoeUnpermuteReference call the kernel."""
        swap_into_experts(module, self.spec.name, MoeUnpermuteReference,
                          moe_unpermute=functools.partial(dispatch, lookup))


PARTS = (MoeUnpermutePatch(SPEC),)
