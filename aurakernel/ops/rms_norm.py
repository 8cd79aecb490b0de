"""RMSNorm: transformers' DeepseekV4RMSNorm (weighted) and DeepseekV4UnweightedRMSNorm.

Where DeepSeek-V4 uses it (hidden D, mHC width 4D): attn/ffn norms and the final norm (D),
q_a_norm (q_lora_rank), kv_norm and the compressor's and indexer's kv_norm (head dims), the
per-head q norm (unweighted, head_dim) and the mHC input norms (unweighted, fp32, 4D).
"""

from __future__ import annotations

import torch
from torch.func import functional_call
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4RMSNorm,
    DeepseekV4UnweightedRMSNorm,
)

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

EPS = 1e-6

_TOL = {
    DType.fp32: {"y": Tolerance(1e-5, 1e-5), "x": Tolerance(2e-5, 1e-4), "weight": Tolerance(1e-4, 1e-4)},
    DType.bf16: {"y": Tolerance(2e-2, 1.6e-2), "x": Tolerance(4e-2, 3.2e-2), "weight": Tolerance(1e-2, 2e-3)},
    DType.fp16: {"y": Tolerance(2e-3, 2e-3), "x": Tolerance(4e-3, 4e-3), "weight": Tolerance(1e-2, 2e-3)},
}


class RmsNormSpec(OpSpec):
    def check_shape(self, shape):
        pass

    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return (problem.shape[1],)

    # --- semantics ----------------------------------------------------------------------------
    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, cols = problem.shape
        g = torch.Generator().manual_seed(seed)
        # a per-row scale spreads the rstd values, so a wrong row statistic cannot hide
        scale = torch.rand(rows, 1, generator=g) * 3 + 0.1
        x = (torch.randn(rows, cols, generator=g) * scale).to(problem.dtype.torch)
        inputs = {"x": x}
        if problem.variant == "weighted":
            inputs["weight"] = 1.0 + 0.5 * torch.randn(cols, generator=g)
        return inputs

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("x", "weight") if problem.variant == "weighted" else ("x",)

    def module(self, problem: Problem) -> torch.nn.Module:
        if problem.variant == "weighted":
            return DeepseekV4RMSNorm(problem.shape[1], eps=EPS)
        return DeepseekV4UnweightedRMSNorm(eps=EPS)

    def module_call(self, problem: Problem, inputs: Tensors):
        mod = self.module(problem)
        if problem.variant == "weighted":
            with torch.no_grad():
                mod.weight.copy_(inputs["weight"])
        return mod, (inputs["x"],)

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        mod = self.module(problem)
        params = {"weight": inputs["weight"]} if problem.variant == "weighted" else {}
        return {"y": functional_call(mod, params, (inputs["x"],))}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    # --- cost ---------------------------------------------------------------------------------
    def work(self, problem: Problem, backward: bool) -> Work:
        rows, cols = problem.shape
        e = problem.dtype.itemsize
        weighted = problem.variant == "weighted"
        if not backward:
            return Work(rows * cols * e * 2 + rows * 4 + (cols * 4 if weighted else 0), 4 * rows * cols)
        return Work(rows * cols * e * 3 + rows * 4 + (cols * 8 if weighted else 0), 8 * rows * cols)

    def visible_outputs(self) -> tuple[str, ...]:
        return ("y",)

SPEC = RmsNormSpec(
    name="rms_norm",
    summary="RMSNorm over the last dim, weighted (DeepseekV4RMSNorm) or unweighted (DeepseekV4UnweightedRMSNorm)",
    shape_meaning="ROWSxCOLS: rows (tokens, or tokens x heads) x normalised width",
    shape_rank=2,
    default_shape=(4096, 4096),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("weighted", "unweighted"),
)
