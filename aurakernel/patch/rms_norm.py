"""The rms_norm kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.layout import like_layout, rows_layout
from ..ops.rms_norm import SPEC
from ..targets.host.library import built_kernel
from .base import Patch
from .install import install
from .torch_op import torch_op


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = rows_layout(x)
    outputs = {"y": torch.empty_like(x),
               "rstd": torch.empty(x.numel() // x.shape[-1], dtype=torch.float32, device=x.device)}
    inputs = {"x": x, "eps": eps}
    if weight is not None:
        inputs["weight"] = weight.detach().float().contiguous()
    built_kernel(kernel).run_forward(inputs, outputs)
    return outputs["y"], outputs["rstd"]


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = rows_layout(x)
    dy = like_layout(dy, x)
    inputs, grads = {"x": x}, {"x": torch.empty_like(x)}
    if weight is not None:
        inputs["weight"] = weight.detach().float().contiguous()
        grads["weight"] = torch.empty(x.shape[-1], dtype=torch.float32, device=x.device)
    built_kernel(kernel).run_backward(inputs, {"rstd": rstd}, {"y": dy}, grads)
    dw = grads["weight"].to(weight.dtype) if weight is not None else x.new_empty(0)
    return grads["x"], dw


def _fake_forward(x, weight, eps, kernel):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


def _fake_backward(dy, x, weight, rstd, kernel):
    return torch.empty_like(x), (weight.new_empty(weight.shape) if weight is not None else x.new_empty(0))


OP = torch_op("rms_norm", _forward, _backward, fake_forward=_fake_forward, fake_backward=_fake_backward,
              saved=("x", "weight"), consts=("kernel",), grads=("x", "weight"))


def _module_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """forward of a patched DeepseekV4RMSNorm / DeepseekV4UnweightedRMSNorm."""
    kernel = module._ak_lookup((x.shape[-1],), x.dtype) if x.device.type == "cpu" else None
    if kernel is None:
        return module._ak_reference_forward(x)
    weight = module.weight if isinstance(module, DeepseekV4RMSNorm) else None
    return rms_norm(x, weight, norm_eps(module), kernel)


def norm_eps(module: torch.nn.Module) -> float:
    """A V4 norm's epsilon: `variance_epsilon`, which transformers 5.24's unweighted norm called `eps`."""
    eps = getattr(module, "variance_epsilon", None)
    return float(module.eps if eps is None else eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, kernel: str) -> torch.Tensor:
    """RMSNorm through the kernel with source hash `kernel` (built earlier in this process)."""
    return OP(x, weight, eps, kernel)


class RmsNormPatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or x.dtype not in (d.torch for d in self.spec.dtypes):
            return None
        variant = "weighted" if isinstance(module, DeepseekV4RMSNorm) else "unweighted"
        return Problem(self.spec.name, variant, (x.numel() // x.shape[-1], x.shape[-1]), DType.from_torch(x.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        # state lives on the module (a bound method rebinds on deepcopy; a closure would not)
        if "_ak_reference_forward" not in module.__dict__:
            module._ak_reference_forward = module.forward
        module._ak_lookup = lookup
        install(module, "forward", _module_forward)


PARTS = (RmsNormPatch(SPEC),)
