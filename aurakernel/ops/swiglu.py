"""Clamped SwiGLU: DeepseekV4Experts._apply_gate (routed experts, packed gate_up) and the same
activation in DeepseekV4MLP (the shared expert, separate gate and up projections).

    y = silu(gate.clamp(max=L)) * up.clamp(-L, L),   L = swiglu_limit (10 in V4)
"""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

LIMIT = 10.0

_TOL = {
    DType.fp32: Tolerance(1e-5, 1e-5),
    DType.bf16: Tolerance(2e-2, 1.6e-2),
    DType.fp16: Tolerance(2e-3, 2e-3),
}


def _experts(inter: int, limit: float = LIMIT) -> DeepseekV4Experts:
    cfg = DeepseekV4Config(hidden_size=8, moe_intermediate_size=inter, n_routed_experts=1, swiglu_limit=limit,
                           num_hidden_layers=1, vocab_size=8, layer_types=["sliding_attention"],
                           mlp_layer_types=["moe"])
    return DeepseekV4Experts(cfg)


class SwigluReference(torch.nn.Module):
    """transformers' own gate: DeepseekV4Experts._apply_gate on a packed [rows, 2I] gate_up."""

    def __init__(self, inter: int, limit: float = LIMIT):
        super().__init__()
        self.experts = _experts(inter, limit)
        self.limit = limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.experts._apply_gate(gate_up)


class SwigluSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, inter = problem.shape
        g = torch.Generator().manual_seed(seed)
        # wide enough that both clamps are active on some elements; exact limits included
        gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
        gate_up.view(-1)[:: 97] = LIMIT
        gate_up.view(-1)[1:: 89] = -LIMIT
        return {"gate_up": gate_up.to(problem.dtype.torch)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("gate_up",)

    def module_call(self, problem: Problem, inputs: Tensors):
        return SwigluReference(problem.shape[1]), (inputs["gate_up"],)

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": SwigluReference(problem.shape[1])(inputs["gate_up"])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype]

    def work(self, problem: Problem, backward: bool) -> Work:
        rows, inter = problem.shape
        e = problem.dtype.itemsize
        return Work(rows * inter * e * (5 if backward else 3), rows * inter * (20 if backward else 10))

SPEC = SwigluSpec(
    name="swiglu",
    summary="clamped SwiGLU of the routed experts (packed gate_up) and the shared expert",
    shape_meaning="ROWSxI: (token, expert) rows x moe_intermediate_size",
    shape_rank=2,
    default_shape=(8192, 2048),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)


