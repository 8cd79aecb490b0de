"""The mhc_post kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

from ..dtypes import DType
from ..ops.base import Problem, Tensors
from ..ops.layout import like_layout
from ..ops.mhc_post import MhcPost, SPEC
from ..ops.mhc_post_pre import MhcPostPre
from ..targets.host.library import built_kernel
from .base import Patch
from .install import copied_from, install
from .torch_op import torch_op


def _inputs(post, comb, out, h) -> Tensors:
    return {"post": post.float().contiguous(), "comb": comb.float().contiguous(), "out": out.contiguous(),
            "h": h.contiguous()}


def _forward(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor, kernel: str) -> torch.Tensor:
    tensors = _inputs(post, comb, out, h)
    y = torch.empty_like(tensors["h"])
    built_kernel(kernel).run_forward(tensors, {"y": y})
    return y


def _backward(g: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = _inputs(post, comb, out, h)
    grads = {name: torch.empty_like(t) for name, t in tensors.items()}
    built_kernel(kernel).run_backward(tensors, {}, {"y": like_layout(g.to(h.dtype), tensors["h"])}, grads)
    return grads["post"].to(post.dtype), grads["comb"].to(comb.dtype), grads["out"], grads["h"]


OP = torch_op("mhc_post", _forward, _backward, fake_forward=lambda post, comb, out, h, kernel: h.new_empty(h.shape),
              saved=("post", "comb", "out", "h"), consts=("kernel",), grads=("post", "comb", "out", "h"))


def update_kernel(module, block_output: torch.Tensor, hidden_states: torch.Tensor) -> str | None:
    """The kernel a stream update (of `module`: its lookup) runs with for this call, or None: the reference."""
    if hidden_states.device.type != "cpu" or block_output.dtype != hidden_states.dtype:
        return None
    return module._ak_lookup(tuple(hidden_states.shape[-2:]), hidden_states.dtype)


def streams_problem(spec, h) -> Problem | None:
    """The problem a call over the streams `h` [..., hc, d] poses for `spec`, or None."""
    if not isinstance(h, torch.Tensor) or h.dim() < 3 or h.dtype not in (d.torch for d in spec.dtypes):
        return None
    hc, d = h.shape[-2], h.shape[-1]
    return Problem(spec.name, "default", (h.numel() // (hc * d), hc, d), DType.from_torch(h.dtype))


def _post_forward(module: MhcPost, post, comb, block_output, hidden_states):
    kernel = update_kernel(module, block_output, hidden_states)
    if kernel is None:
        return MhcPost.forward(module, post, comb, block_output, hidden_states)
    return OP(post, comb, block_output, hidden_states, kernel)


@copied_from(DeepseekV4DecoderLayer, "forward", "a46984c70748a453")
def _layer_forward(self: DeepseekV4DecoderLayer, hidden_states, input_ids=None, ak_carry=None, ak_next=None, **kwargs):
    """DeepseekV4DecoderLayer.forward (transformers 5.24) with both stream updates through _ak_post,
    the first together with the FFN's HyperConnection after it (_ak_post_pre: fused where the plan
    has an mhc_post_pre kernel, else the two one after the other). Across layers (the model's forward
    of mhc_post_pre.link_layers): `ak_carry` is this layer's attention HyperConnection of its streams,
    which the layer before made with its last update; `ak_next` is that update fused with the next
    layer's HyperConnection, and the layer then returns (streams, post, comb, collapsed)."""
    post, comb, collapsed = ak_carry if ak_carry is not None else self.attn_hc(hidden_states)
    attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
    hidden_states, post, comb, collapsed = self._ak_post_pre(post, comb, attn_output, hidden_states)
    mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
    if ak_next is not None:
        return ak_next(post, comb, mlp_output, hidden_states)
    return self._ak_post(post, comb, mlp_output, hidden_states)


def patch_layer(layer: DeepseekV4DecoderLayer) -> None:
    """Route `layer`'s stream updates through its own modules (on the reference until the mhc_post /
    mhc_post_pre patches give them a lookup): `_ak_post`, and `_ak_post_pre`, which runs `_ak_post`
    then the layer's `ffn_hc`. `_ak_post_pre` is kept outside the module tree (it holds ffn_hc,
    whose parameters must keep their one name in the state dict)."""
    if "_ak_post_pre" in layer.__dict__:
        return
    install(layer, "forward", _layer_forward)   # first: Refused (a changed transformers) leaves the layer as it was
    layer._ak_post = MhcPost()
    object.__setattr__(layer, "_ak_post_pre", MhcPostPre(layer.ffn_hc, layer._ak_post))


class MhcPostPatch(Patch):
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        return streams_problem(self.spec, args[0] if args else None)

    def patch(self, module: torch.nn.Module, lookup) -> None:
        if isinstance(module, DeepseekV4DecoderLayer):
            patch_layer(module)
            self.patch(module._ak_post, lookup)
            return
        module._ak_lookup = lookup
        install(module, "forward", _post_forward)


PARTS = (MhcPostPatch(SPEC),)
