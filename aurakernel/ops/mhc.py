"""mHC pre and head: transformers' DeepseekV4HyperConnection and DeepseekV4HyperHead.

mhc_pre (twice per layer): flatten the hc streams, unweighted RMS, the (2 + hc) * hc mix
projection, sigmoid / scale / base for pre and post, softmax + Sinkhorn for the hc x hc comb,
and the pre-weighted sum of the streams. mhc_head (once, before the final norm) is the same
kernel with only the hc pre weights. One template serves both; the eager versions run ~900 tiny
ops per call (the Sinkhorn loop) forward and backward.
"""

from __future__ import annotations

import torch
from torch.func import functional_call
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

EPS = 1e-6
ITERS = 20

_TOL = {
    # y sums pre-weighted streams whose weights come from a W-long fp32 dot product: its rounding
    # (~1e-6 relative) moves y by ~1e-5 of the streams' scale
    DType.fp32: {"y": Tolerance(1e-4, 1e-5), "post": Tolerance(1e-5, 1e-5), "comb": Tolerance(1e-5, 1e-4),
                 "x": Tolerance(2e-5, 1e-4), "fn": Tolerance(1e-4, 1e-3), "base": Tolerance(1e-4, 1e-3),
                 "scale": Tolerance(1e-4, 1e-3)},
    DType.bf16: {"y": Tolerance(2e-2, 1.6e-2), "post": Tolerance(1e-3, 1e-3), "comb": Tolerance(1e-3, 1e-3),
                 "x": Tolerance(4e-2, 3.2e-2), "fn": Tolerance(1e-3, 1e-2), "base": Tolerance(1e-3, 1e-2),
                 "scale": Tolerance(1e-3, 1e-2)},
}
_TOL[DType.fp16] = {**_TOL[DType.bf16], "y": Tolerance(2e-3, 2e-3), "x": Tolerance(4e-3, 4e-3)}


def _config(hc: int, d: int) -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=d, hc_mult=hc, hc_sinkhorn_iters=ITERS, hc_eps=EPS, rms_norm_eps=EPS,
                            num_hidden_layers=1, vocab_size=8, layer_types=["sliding_attention"],
                            mlp_layer_types=["moe"])


class MhcSpec(OpSpec):
    head: bool = False

    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def nout(self, hc: int) -> int:
        return hc if self.head else (2 + hc) * hc

    # --- semantics ----------------------------------------------------------------------------
    def param_names(self) -> tuple[str, str, str]:
        return ("hc_fn", "hc_base", "hc_scale") if self.head else ("fn", "base", "scale")

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, hc, d = problem.shape
        g = torch.Generator().manual_seed(seed)
        row_scale = torch.rand(rows, 1, 1, generator=g) * 3 + 0.1
        n = self.nout(hc)
        return {
            "x": (torch.randn(rows, hc, d, generator=g) * row_scale).to(problem.dtype.torch),
            "fn": torch.randn(n, hc * d, generator=g) * (2.0 / (hc * d) ** 0.5),
            "base": torch.randn(n, generator=g) * 0.5,
            "scale": torch.rand(1 if self.head else 3, generator=g) + 0.5,
        }

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("x", "fn", "base", "scale")

    def module(self, problem: Problem) -> torch.nn.Module:
        cfg = _config(problem.shape[1], problem.shape[2])
        return DeepseekV4HyperHead(cfg) if self.head else DeepseekV4HyperConnection(cfg)

    def module_call(self, problem: Problem, inputs: Tensors):
        mod = self.module(problem)
        with torch.no_grad():
            for name, key in zip(self.param_names(), ("fn", "base", "scale")):
                getattr(mod, name).copy_(inputs[key])
        return mod, (inputs["x"].unsqueeze(0),)

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        mod = self.module(problem)
        params = dict(zip(self.param_names(), (inputs["fn"], inputs["base"], inputs["scale"])))
        out = functional_call(mod, params, (inputs["x"].unsqueeze(0),))
        if self.head:
            return {"y": out[0]}
        post, comb, y = out
        return {"post": post[0], "comb": comb[0], "y": y[0]}

    def visible_outputs(self) -> tuple[str, ...]:
        return ("y",) if self.head else ("post", "comb", "y")

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    # --- cost ---------------------------------------------------------------------------------
    def work(self, problem: Problem, backward: bool) -> Work:
        rows, hc, d = problem.shape
        e, w, n = problem.dtype.itemsize, hc * d, self.nout(hc)
        if not backward:
            return Work(rows * (w + d) * e + n * w * 4 + rows * (n + 1 + hc + hc * hc) * 4, rows * w * (2 * n + 3))
        return Work(rows * (2 * w + d) * e + 2 * n * w * 4 + rows * (2 * n + hc + hc * hc) * 4, rows * w * (4 * n + 8))


def _spec(name: str, head: bool) -> MhcSpec:
    spec = MhcSpec(
        name=name,
        summary=("final mHC collapse of the streams (DeepseekV4HyperHead): RMS, hc mixes, sigmoid, weighted sum"
                 if head else "mHC pre (DeepseekV4HyperConnection): RMS, mix projection, sigmoid, softmax + "
                              "20-step Sinkhorn, weighted sum of the streams"),
        shape_meaning="ROWSxHCxD: tokens x streams (hc_mult) x hidden",
        shape_rank=3,
        default_shape=(1024, 4, 4096),
        dtypes=(DType.fp32, DType.bf16, DType.fp16),
        variants=("default",),
    )
    spec.head = head
    return spec


PRE = _spec("mhc_pre", head=False)
HEAD = _spec("mhc_head", head=True)

