"""The block_linear kernel in a model: its torch ops (custom ops with autograd and fake registrations)
and the patched forward of DeepseekV4GroupedLinear (the attention's grouped output projection)."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.block_linear import SPEC
from ..targets.host.library import built_kernel
from .base import Patch, bind
from .torch_op import torch_op


def _forward(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> torch.Tensor:
    x = x.contiguous()
    y = x.new_empty(x.shape[0], x.shape[1], weight.shape[0] // x.shape[1])
    built_kernel(kernel).run_forward({"x": x, "weight": weight.detach().contiguous()}, {"y": y})
    return y


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    grads = {"x": torch.empty_like(x), "weight": torch.empty_like(weight, memory_format=torch.contiguous_format)}
    built_kernel(kernel).run_backward({"x": x, "weight": weight.detach().contiguous()}, {}, {"y": dy.contiguous()}, grads)
    return grads["x"], grads["weight"]


def _fake_forward(x, weight, kernel):
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[0] // x.shape[1])


def _fake_backward(dy, x, weight, kernel):
    return torch.empty_like(x), torch.empty_like(weight)


OP = torch_op("block_linear", _forward, _backward, fake_forward=_fake_forward, fake_backward=_fake_backward,
              saved=("x", "weight"), consts=("kernel",), grads=("x", "weight"))


def runs_kernel(module: DeepseekV4GroupedLinear, x) -> bool:
    """Whether a call can take the kernel: [..., G, IN] fp32 on the CPU, no bias, no autocast (which
    would make the reference a bf16 GEMM)."""
    return (module.bias is None and isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() >= 2
            and x.shape[-2] == module.n_groups and x.shape[-1] == module.in_features
            and x.dtype == module.weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"))


def block_key(module: DeepseekV4GroupedLinear) -> tuple[int, int, int]:
    """A grouped output projection's kernel key: (groups, IN, OUT of a group)."""
    return module.n_groups, module.in_features, module.out_features // module.n_groups


def _module_forward(self: DeepseekV4GroupedLinear, x: torch.Tensor) -> torch.Tensor:
    """forward of a patched DeepseekV4GroupedLinear."""
    kernel = self._ak_lookup(block_key(self), x.dtype) if runs_kernel(self, x) else None
    if kernel is None:
        return DeepseekV4GroupedLinear.forward(self, x)
    groups, d_in, d_out = block_key(self)
    return OP(x.reshape(-1, groups, d_in), self.weight, kernel).view(*x.shape[:-1], d_out)


class BlockLinearPatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        x = args[0] if args else None
        if not isinstance(module, DeepseekV4GroupedLinear) or not runs_kernel(module, x):
            return None
        groups, d_in, d_out = block_key(module)
        return Problem(self.spec.name, "default", (x.numel() // (groups * d_in), groups, d_in, d_out),
                       DType.from_torch(x.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        bind(module, lookup, self.spec.name, [(DeepseekV4GroupedLinear, "forward", _module_forward)])


PARTS = (BlockLinearPatch(SPEC),)
