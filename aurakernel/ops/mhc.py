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
from ..patch.install import install, require
from ..patch.torch_op import torch_op
from ..targets.host.library import built_kernel
from .base import OpSpec, Problem, Tensors, Tolerance, Work
from .layout import rows_layout

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

    # --- swapping -----------------------------------------------------------------------------
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or x.dim() < 3 or x.dtype not in (d.torch for d in self.dtypes):
            return None
        hc, d = x.shape[-2], x.shape[-1]
        return Problem(self.name, "default", (x.numel() // (hc * d), hc, d), DType.from_torch(x.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        hc_eps = module.eps if isinstance(module, DeepseekV4HyperHead) else module.hc_eps
        iters = getattr(module, "hc_sinkhorn_iters", ITERS)
        require(iters == ITERS and hc_eps == EPS and module.input_norm.eps == EPS,
                f"hc_sinkhorn_iters {iters}, hc_eps {hc_eps}, rms_norm_eps {module.input_norm.eps}: the mhc kernel "
                f"computes {ITERS} Sinkhorn iterations with both epsilons {EPS}")
        if "_ak_reference_forward" not in module.__dict__:
            module._ak_reference_forward = module.forward
        module._ak_lookup = lookup
        install(module, "forward", _module_forward)


# --- the kernel as a torch op ---------------------------------------------------------------------

def _spec_of(module) -> MhcSpec:
    return HEAD if isinstance(module, DeepseekV4HyperHead) else PRE


def _params(module):
    if isinstance(module, DeepseekV4HyperHead):
        return module.hc_fn, module.hc_base, module.hc_scale
    return module.fn, module.base, module.scale


def _run_forward(spec: MhcSpec, x, fn, base, scale, kernel: str) -> Tensors:
    x = rows_layout(x)
    outputs = built_kernel(kernel).empty_outputs(None, {"x": x.view(-1, x.shape[-2], x.shape[-1])})
    built_kernel(kernel).run_forward({"x": x, **_fp32_params(fn, base, scale)}, outputs)
    return outputs


def _fp32_params(fn, base, scale) -> Tensors:
    return {name: t.detach().float().contiguous() for name, t in (("fn", fn), ("base", base), ("scale", scale))}


def _run_backward(spec: MhcSpec, grads_out: dict, x, fn, base, scale, mix, rstd, kernel: str):
    """(dx, dfn, dbase, dscale), each in its input's dtype."""
    x = rows_layout(x)
    hc, d = x.shape[-2], x.shape[-1]
    rows = rstd.numel()
    gout = {name: g.float().contiguous().view(rows, *([hc] * (1 if name == "post" else 2)))
            for name, g in grads_out.items() if name != "y"}
    gout["y"] = grads_out["y"].to(x.dtype).contiguous().view(rows, d)
    p32 = _fp32_params(fn, base, scale)
    grads = {"x": torch.empty_like(x), **{name: torch.empty_like(t) for name, t in p32.items()}}
    built_kernel(kernel).run_backward({"x": x, **p32}, {"mix": mix, "rstd": rstd}, gout, grads)
    return grads["x"], grads["fn"].to(fn.dtype), grads["base"].to(base.dtype), grads["scale"].to(scale.dtype)


def _pre_forward(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post, comb, y, mix, rstd): mix and rstd are residuals for the backward."""
    out = _run_forward(PRE, x, fn, base, scale, kernel)
    lead, hc = x.shape[:-2], x.shape[-2]
    return (out["post"].view(*lead, hc), out["comb"].view(*lead, hc, hc), out["y"].view(*lead, x.shape[-1]),
            out["mix"], out["rstd"])


def _pre_backward(d_post: torch.Tensor, d_comb: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, fn: torch.Tensor,
                  base: torch.Tensor, scale: torch.Tensor, mix: torch.Tensor, rstd: torch.Tensor,
                  kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_backward(PRE, {"post": d_post, "comb": d_comb, "y": dy}, x, fn, base, scale, mix, rstd, kernel)


def _head_forward(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mix, rstd)."""
    out = _run_forward(HEAD, x, fn, base, scale, kernel)
    return out["y"].view(*x.shape[:-2], x.shape[-1]), out["mix"], out["rstd"]


def _head_backward(dy: torch.Tensor, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   mix: torch.Tensor, rstd: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run_backward(HEAD, {"y": dy}, x, fn, base, scale, mix, rstd, kernel)


def _fake_residuals(spec: MhcSpec, x):
    rows = x.numel() // (x.shape[-2] * x.shape[-1])
    return x.new_empty(rows, spec.nout(x.shape[-2]), dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


def _fake_pre_forward(x, fn, base, scale, kernel):
    lead, hc = x.shape[:-2], x.shape[-2]
    f32 = torch.float32
    return (x.new_empty(*lead, hc, dtype=f32), x.new_empty(*lead, hc, hc, dtype=f32), x.new_empty(*lead, x.shape[-1]),
            *_fake_residuals(PRE, x))


def _fake_head_forward(x, fn, base, scale, kernel):
    return (x.new_empty(*x.shape[:-2], x.shape[-1]), *_fake_residuals(HEAD, x))


_SAVED = ("x", "fn", "base", "scale")
_GRADS = ("x", "fn", "base", "scale")


def _module_forward(module: torch.nn.Module, hidden_streams: torch.Tensor):
    """forward of a patched DeepseekV4HyperConnection / DeepseekV4HyperHead."""
    key = tuple(hidden_streams.shape[-2:])
    kernel = module._ak_lookup(key, hidden_streams.dtype) if hidden_streams.device.type == "cpu" else None
    if kernel is None:
        return module._ak_reference_forward(hidden_streams)
    op = HEAD_OP if isinstance(module, DeepseekV4HyperHead) else PRE_OP
    return op(hidden_streams, *_params(module), kernel)


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

PRE_OP = torch_op("mhc_pre", _pre_forward, _pre_backward, fake_forward=_fake_pre_forward, outputs=3,
                  saved=_SAVED, consts=("kernel",), grads=_GRADS)
HEAD_OP = torch_op("mhc_head", _head_forward, _head_backward, fake_forward=_fake_head_forward, outputs=1,
                   saved=_SAVED, consts=("kernel",), grads=_GRADS)
