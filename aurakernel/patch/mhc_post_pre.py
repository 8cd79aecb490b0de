"""The mhc_post_pre kernel in a model: its torch op (custom op with autograd and fake registrations)
and the patched forward of a decoder layer's first stream update with the FFN's HyperConnection
after it (mhc_post.patch_layer's `_ak_post_pre`)."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

from ..ops import OPS
from ..ops.base import Problem, Tensors
from ..ops.mhc import PRE
from ..ops.mhc_post_pre import SPEC, MhcPostPre
from ..targets.host.library import built_kernel
from .base import PATCHES, Patch
from .install import install
from .mhc import fp32_params, require_kernel_math
from .mhc_post import patch_layer, streams_problem, update_kernel
from .torch_op import torch_op


def _inputs(post, comb, out, h, fn, base, scale) -> Tensors:
    hc, d = h.shape[-2], h.shape[-1]
    return {"post": post.float().contiguous().view(-1, hc), "comb": comb.float().contiguous().view(-1, hc, hc),
            "out": out.contiguous().view(-1, d), "h": h.contiguous().view(-1, hc, d), **fp32_params(fn, base, scale)}


def _forward(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor, fn: torch.Tensor,
             base: torch.Tensor, scale: torch.Tensor, kernel: str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(streams, next_post, next_comb, y, and the residuals mix, rstd)."""
    k = built_kernel(kernel)
    inputs = _inputs(post, comb, out, h, fn, base, scale)
    outputs = k.empty_outputs(None, inputs)
    k.run_forward(inputs, outputs)
    lead, hc, d = h.shape[:-2], h.shape[-2], h.shape[-1]
    return (outputs["streams"].view(h.shape), outputs["next_post"].view(*lead, hc),
            outputs["next_comb"].view(*lead, hc, hc), outputs["y"].view(*lead, d), outputs["mix"], outputs["rstd"])


def _backward(g_streams: torch.Tensor, d_next_post: torch.Tensor, d_next_comb: torch.Tensor, dy: torch.Tensor,
              post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor, fn: torch.Tensor,
              base: torch.Tensor, scale: torch.Tensor, mix: torch.Tensor, rstd: torch.Tensor, streams: torch.Tensor,
              next_post: torch.Tensor, next_comb: torch.Tensor, y: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor]:
    inputs = _inputs(post, comb, out, h, fn, base, scale)
    rows, hc, d = inputs["h"].shape

    def grad(g, dtype, *shape):   # an output no gradient reached is a zero gradient
        return g.to(dtype).contiguous().view(rows, *shape) if g is not None else torch.zeros(rows, *shape, dtype=dtype)

    grad_outputs = {"streams": grad(g_streams, h.dtype, hc, d), "y": grad(dy, h.dtype, d),
                    "next_post": grad(d_next_post, torch.float32, hc),
                    "next_comb": grad(d_next_comb, torch.float32, hc, hc)}
    # the gradients of out and h in their inputs' shapes, the kernel writing through [rows, ...] views: a
    # gradient autograd receives as a view it cannot add the other branch's gradient to in place (h is
    # also mhc_pre's x), so it would allocate the sum and make one more pass
    d_out, d_h = out.new_empty(out.shape), h.new_empty(h.shape)
    grads = {name: (d_out if name == "out" else d_h).view(t.shape) if name in ("out", "h") else torch.empty_like(t)
             for name, t in inputs.items()}
    built_kernel(kernel).run_backward(inputs, {"streams": streams.contiguous().view(rows, hc, d), "mix": mix,
                                               "rstd": rstd}, grad_outputs, grads)
    return (grads["post"].view(post.shape).to(post.dtype), grads["comb"].view(comb.shape).to(comb.dtype),
            d_out, d_h, grads["fn"].to(fn.dtype), grads["base"].to(base.dtype), grads["scale"].to(scale.dtype))


def _fake_forward(post, comb, out, h, fn, base, scale, kernel):
    lead, hc, d = h.shape[:-2], h.shape[-2], h.shape[-1]
    rows, f32 = h.numel() // (hc * d), torch.float32
    return (h.new_empty(h.shape), h.new_empty(*lead, hc, dtype=f32), h.new_empty(*lead, hc, hc, dtype=f32),
            h.new_empty(*lead, d), h.new_empty(rows, PRE.nout(hc), dtype=f32), h.new_empty(rows, dtype=f32))


_ARGS = ("post", "comb", "out", "h", "fn", "base", "scale")


# the backward reads the streams (mhc_pre's x) from the saved outputs: no copy kept as a residual
OP = torch_op("mhc_post_pre", _forward, _backward, fake_forward=_fake_forward, outputs=4, saved=_ARGS,
              consts=("kernel",), grads=_ARGS, save_outputs=True)


def _fused_forward(module: MhcPostPre, post, comb, block_output, hidden_states):
    kernel = update_kernel(module, block_output, hidden_states)
    if kernel is None:
        return MhcPostPre.forward(module, post, comb, block_output, hidden_states)
    hc = module.hc
    return OP(post, comb, block_output, hidden_states, hc.fn, hc.base, hc.scale, kernel)


class MhcPostPrePatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        # a layer's call: its streams in; the fused module's: (post, comb, block output, streams)
        at = 0 if isinstance(module, DeepseekV4DecoderLayer) else 3
        return streams_problem(self.spec, args[at] if len(args) > at else None)

    def patch(self, module: torch.nn.Module, lookup) -> None:
        if isinstance(module, DeepseekV4DecoderLayer):
            require_kernel_math(module.ffn_hc)
            patch_layer(module)
            module = module._ak_post_pre
        module._ak_lookup = lookup
        install(module, "forward", _fused_forward)

    def patch_parts(self, module: MhcPostPre, lookups: dict) -> None:
        """The stream update on mhc_post's kernel, then the HyperConnection on mhc_pre's."""
        PATCHES.of(OPS["mhc_post"]).patch(module.update, lookups["mhc_post"])
        PATCHES.of(OPS["mhc_pre"]).patch(module.hc, lookups["mhc_pre"])


PARTS = (MhcPostPrePatch(SPEC),)
