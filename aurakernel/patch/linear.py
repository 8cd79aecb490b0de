"""The linear kernel in a model: its torch ops (custom ops with autograd and fake registrations) and
the patched forward of a bias-free torch.nn.Linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.linear import SPEC
from ..targets.host.library import built_kernel
from .base import Patch
from .install import install
from .torch_op import torch_op


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t's rows as one contiguous [rows, features] matrix (a view where t already is one)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


def _forward(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> torch.Tensor:
    rows = _rows(x)
    y = rows.new_empty(rows.shape[0], weight.shape[0])
    built_kernel(kernel).run_forward({"x": rows, "weight": weight.detach().contiguous()}, {"y": y})
    return y.view(*x.shape[:-1], weight.shape[0])


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _rows(x)
    # dx in x's shape, the kernel writing through a [rows, IN] view: a gradient autograd receives as a
    # view it cannot add another consumer's gradient to in place (several projections read one input)
    dx = x.new_empty(x.shape)
    grads = {"x": dx.view(rows.shape), "weight": torch.empty_like(weight, memory_format=torch.contiguous_format)}
    built_kernel(kernel).run_backward({"x": rows, "weight": weight.detach().contiguous()}, {}, {"y": _rows(dy)}, grads)
    return dx, grads["weight"]


def _fake_forward(x, weight, kernel):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fake_backward(dy, x, weight, kernel):
    return torch.empty_like(x), torch.empty_like(weight)


OP = torch_op("linear", _forward, _backward, fake_forward=_fake_forward, fake_backward=_fake_backward,
              saved=("x", "weight"), consts=("kernel",), grads=("x", "weight"))


def is_plain_linear(module: torch.nn.Module) -> bool:
    """An nn.Linear that computes x W^T (+ b): not a subclass with a forward of its own (V4's grouped
    output projection is one)."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def runs_kernel(module: torch.nn.Linear, x) -> bool:
    """Whether a call can take the kernel: no bias, fp32 x and weight on the CPU, no autocast (which
    would make the reference a bf16 GEMM)."""
    return (module.bias is None and isinstance(x, torch.Tensor) and x.device.type == "cpu"
            and x.dtype == module.weight.dtype == torch.float32 and x.dim() >= 1
            and not torch.is_autocast_enabled("cpu"))


def _module_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """forward of a patched torch.nn.Linear."""
    kernel = module._ak_lookup((module.in_features, module.out_features), x.dtype) if runs_kernel(module, x) else None
    if kernel is None:
        return F.linear(x, module.weight, module.bias)
    return OP(x, module.weight, kernel)


class LinearPatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        x = args[0] if args else None
        if not is_plain_linear(module) or not runs_kernel(module, x):
            return None
        return Problem(self.spec.name, "default", (x.numel() // x.shape[-1], module.in_features, module.out_features),
                       DType.from_torch(x.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        if not is_plain_linear(module):
            raise TypeError(f"linear cannot patch {type(module).__name__}: not a plain torch.nn.Linear")
        module._ak_lookup = lookup
        install(module, "forward", _module_forward)


PARTS = (LinearPatch(SPEC),)
