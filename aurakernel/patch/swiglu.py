"""The swiglu kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from transformers.activations import SiLUActivation
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts, DeepseekV4MLP

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.swiglu import SPEC, SwigluReference
from ..targets.host.library import built_kernel
from ..targets.host.ops import swiglu as host
from ..targets.host.ops.swiglu import _halves
from .base import Patch, bind
from .experts import experts_forward
from .install import install, require
from .torch_op import torch_op


def _rows(first: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as [rows, I] views sharing one row stride, copying only when they cannot."""
    if up is None:   # packed gate_up [..., 2I] (the experts)
        gu = first.reshape(-1, first.shape[-1])
        return _halves(gu if gu.stride(-1) == 1 else gu.contiguous())
    inter = first.shape[-1]
    g2, u2 = first.reshape(-1, inter), up.reshape(-1, inter)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1 or g2.stride(0) != u2.stride(0):
        g2, u2 = g2.contiguous(), u2.contiguous()
    return g2, u2


def _forward(first: torch.Tensor, up: torch.Tensor | None, limit: float, kernel: str) -> torch.Tensor:
    """Packed: first = gate_up [..., 2I]; split: first = gate and up [..., I] (the shared expert)."""
    g2, u2 = _rows(first, up)
    rows, inter = g2.shape
    y = g2.new_empty(rows, inter)
    host.forward(built_kernel(kernel), g2, u2, g2.stride(0), y, rows, limit)
    return y.view(*first.shape[:-1], inter)


def _backward(dy: torch.Tensor, first: torch.Tensor, up: torch.Tensor | None, limit: float,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed gradient comes back packed, so autograd does not stitch two halves together."""
    g2, u2 = _rows(first, up)
    rows, inter = g2.shape
    dy = dy.reshape(rows, inter).contiguous().to(g2.dtype)
    if up is None:
        out = g2.new_empty(rows, 2 * inter)
        dgate, dup = _halves(out)
        host.backward(built_kernel(kernel), g2, u2, g2.stride(0), dy, dgate, dup, out.stride(0), rows, limit)
        return out.view(first.shape), first.new_empty(0)
    dgate, dup = g2.new_empty(rows, inter), g2.new_empty(rows, inter)
    host.backward(built_kernel(kernel), g2, u2, g2.stride(0), dy, dgate, dup, inter, rows, limit)
    return dgate.view(first.shape), dup.view(up.shape)


def _fake_forward(first, up, limit, kernel):
    inter = first.shape[-1] // 2 if up is None else first.shape[-1]
    return first.new_empty(*first.shape[:-1], inter)


OP = torch_op("swiglu", _forward, _backward, fake_forward=_fake_forward,
              saved=("first", "up"), consts=("limit", "kernel"), grads=("first", "up"))


def swiglu(gate: torch.Tensor, up: torch.Tensor | None, limit: float, kernel: str) -> torch.Tensor:
    """silu(gate.clamp(max=limit)) * up.clamp(-limit, limit); with up=None, `gate` is a packed gate_up."""
    return OP(gate, up, float(limit), kernel)


def _kernel_for(module, inter: int, x: torch.Tensor):
    if x.device.type != "cpu":
        return None
    return module._ak_lookup((inter,), x.dtype)


def _experts_gate(self: DeepseekV4Experts, gate_up: torch.Tensor) -> torch.Tensor:
    kernel = _kernel_for(self, gate_up.shape[-1] // 2, gate_up)
    if kernel is None:
        return DeepseekV4Experts._apply_gate(self, gate_up)
    return swiglu(gate_up, None, self.limit, kernel)


def _mlp_forward(self: DeepseekV4MLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    kernel = _kernel_for(self, self.intermediate_size, gate) if gate.dtype == up.dtype else None
    if kernel is None:
        return self.down_proj(self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit))
    return self.down_proj(swiglu(gate, up, self.limit, kernel))


def _reference_forward(self: SwigluReference, gate_up: torch.Tensor) -> torch.Tensor:
    kernel = _kernel_for(self, gate_up.shape[-1] // 2, gate_up)
    if kernel is None:
        return self.experts._apply_gate(gate_up)
    return swiglu(gate_up, None, self.limit, kernel)


class SwigluPatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or x.dtype not in (d.torch for d in self.spec.dtypes):
            return None
        if isinstance(module, DeepseekV4Experts):
            # the experts see every routed (token, expert) pair: rows = tokens x top-k
            inter = module.intermediate_dim
            top_k = args[1].shape[-1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else 1
            rows = x.shape[0] * top_k
        else:
            inter = module.intermediate_size
            rows = x.numel() // x.shape[-1]
        return Problem(self.spec.name, "default", (rows, inter), DType.from_torch(x.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        act = module.experts.act_fn if isinstance(module, SwigluReference) else getattr(module, "act_fn", None)
        require(isinstance(act, SiLUActivation | torch.nn.SiLU),
                f"hidden_act is {type(act).__name__}: the swiglu kernel computes SiLU")
        bind(module, lookup, self.spec.name, [(DeepseekV4Experts, "_apply_gate", _experts_gate),
                                         (DeepseekV4MLP, "forward", _mlp_forward),
                                         (SwigluReference, "forward", _reference_forward)])
        if isinstance(module, DeepseekV4Experts):
            install(module, "forward", experts_forward)


PARTS = (SwigluPatch(SPEC),)
