"""The mhc kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

from ..dtypes import DType
from ..ops.base import Problem, Tensors
from ..ops.layout import rows_layout
from ..ops.mhc import EPS, HEAD, ITERS, MhcSpec, PRE
from ..targets.host.library import built_kernel
from .base import Patch
from .install import install, require
from .rms_norm import norm_eps
from .torch_op import torch_op


def _spec_of(module) -> MhcSpec:
    return HEAD if isinstance(module, DeepseekV4HyperHead) else PRE


def _params(module):
    if isinstance(module, DeepseekV4HyperHead):
        return module.hc_fn, module.hc_base, module.hc_scale
    return module.fn, module.base, module.scale


def _run_forward(spec: MhcSpec, x, fn, base, scale, kernel: str) -> Tensors:
    x = rows_layout(x)
    outputs = built_kernel(kernel).empty_outputs(None, {"x": x.view(-1, x.shape[-2], x.shape[-1])})
    built_kernel(kernel).run_forward({"x": x, **fp32_params(fn, base, scale)}, outputs)
    return outputs


def fp32_params(fn, base, scale) -> Tensors:
    return {name: t.detach().float().contiguous() for name, t in (("fn", fn), ("base", base), ("scale", scale))}


def _run_backward(spec: MhcSpec, grads_out: dict, x, fn, base, scale, mix, rstd, kernel: str):
    """(dx, dfn, dbase, dscale), each in its input's dtype."""
    x = rows_layout(x)
    hc, d = x.shape[-2], x.shape[-1]
    rows = rstd.numel()
    gout = {name: g.float().contiguous().view(rows, *([hc] * (1 if name == "post" else 2)))
            for name, g in grads_out.items() if name != "y"}
    gout["y"] = grads_out["y"].to(x.dtype).contiguous().view(rows, d)
    p32 = fp32_params(fn, base, scale)
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


PRE_OP = torch_op("mhc_pre", _pre_forward, _pre_backward, fake_forward=_fake_pre_forward, outputs=3,
                  saved=_SAVED, consts=("kernel",), grads=_GRADS)


HEAD_OP = torch_op("mhc_head", _head_forward, _head_backward, fake_forward=_fake_head_forward, outputs=1,
                   saved=_SAVED, consts=("kernel",), grads=_GRADS)


def require_kernel_math(module: torch.nn.Module) -> None:
    """Refused unless the HyperConnection / HyperHead computes what the mhc kernels do."""
    hc_eps = module.eps if isinstance(module, DeepseekV4HyperHead) else module.hc_eps
    iters = getattr(module, "hc_sinkhorn_iters", ITERS)
    rms_eps = norm_eps(module.input_norm)
    require(iters == ITERS and hc_eps == EPS and rms_eps == EPS,
            f"hc_sinkhorn_iters {iters}, hc_eps {hc_eps}, rms_norm_eps {rms_eps}: the mhc kernel "
            f"computes {ITERS} Sinkhorn iterations with both epsilons {EPS}")


class MhcPatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or x.dim() < 3 or x.dtype not in (d.torch for d in self.spec.dtypes):
            return None
        hc, d = x.shape[-2], x.shape[-1]
        return Problem(self.spec.name, "default", (x.numel() // (hc * d), hc, d), DType.from_torch(x.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        require_kernel_math(module)
        if "_ak_reference_forward" not in module.__dict__:
            module._ak_reference_forward = module.forward
        module._ak_lookup = lookup
        install(module, "forward", _module_forward)


PARTS = (MhcPatch(PRE), MhcPatch(HEAD),)
