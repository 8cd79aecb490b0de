"""The mhc_post_pre kernel in a model: its torch op (custom op with autograd and fake registrations),
the patched forward of a decoder layer's first stream update with the FFN's HyperConnection after it
(mhc_post.patch_layer's `_ak_post_pre`), and across layers (link_layers) a layer's last update with
the next layer's attention HyperConnection, which the model's forward hands on (_model_forward)."""

from __future__ import annotations

import torch
try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:   # a torch without torch.distributed: nothing is sharded
    FSDPModule = None
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4Model
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from ..ops import OPS
from ..ops.base import Problem, Tensors
from ..ops.mhc import PRE
from ..ops.mhc_post_pre import SPEC, MhcPostPre
from ..targets.host.library import built_kernel
from .base import PATCHES, Patch
from .install import Refused, copied_from, install
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


@merge_with_config_defaults
@capture_outputs
@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
@copied_from(DeepseekV4Model, "forward", "935e374990a41231")
def _model_forward(self: DeepseekV4Model, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                   inputs_embeds=None, use_cache=None, **kwargs) -> MoeModelOutputWithPast:
    """DeepseekV4Model.forward (transformers 5.24) whose layers hand their last stream update to the
    next one fused with its attention HyperConnection (`_ak_next`, link_layers): each layer but the
    first takes its HyperConnection's outputs from the layer before, each but the last returns them."""
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if use_cache and cache is None:
        cache = DynamicCache(config=self.config)
    if inputs_embeds is None:
        inputs_embeds = self.embed_tokens(input_ids)
    if position_ids is None:
        past_seen = cache.get_seq_length() if cache is not None else 0
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
        position_ids = position_ids.unsqueeze(0)
    if isinstance(attention_mask, dict):
        causal_mask = next(iter(attention_mask.values()))
    else:
        causal_mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=inputs_embeds,
                                                        attention_mask=attention_mask, cache=cache,
                                                        position_ids=position_ids)
    hidden_states = inputs_embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
    position_embeddings = {
        "main": self.rotary_emb(inputs_embeds, position_ids=position_ids, layer_type="main"),
        "compress": self.rotary_emb(inputs_embeds, position_ids=position_ids, layer_type="compress"),
    }
    apart = _layers_apart(self)
    carry = None
    for layer, fused in zip(self.layers, self._ak_next):
        fused = None if apart else fused
        link = {"ak_next": fused} if fused is not None else {}
        if carry is not None:
            link["ak_carry"] = carry
        out = layer(hidden_states, position_embeddings=position_embeddings, position_ids=position_ids,
                    attention_mask=causal_mask, input_ids=input_ids, cache=cache, **link, **kwargs)
        hidden_states, carry = (out[0], out[1:]) if fused is not None else (out, None)
    hidden_states = self.norm(self.hc_head(hidden_states))
    return MoeModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


def _layers_apart(model: DeepseekV4Model) -> bool:
    """Whether each layer must make its own HyperConnection: under transformers' checkpointing (it may
    be reentrant, where tensors handed across layers, not the checkpointed call's arguments, get no
    gradient), or with FSDP2-sharded layers (the next layer's parameters are gathered only for its
    own forward)."""
    if model.training and torch.is_grad_enabled() and any(layer.gradient_checkpointing for layer in model.layers):
        return True
    return FSDPModule is not None and any(isinstance(layer, FSDPModule) for layer in model.layers)


def link_layers(model: DeepseekV4Model, fused: list[DeepseekV4DecoderLayer]) -> None:
    """Where two consecutive layers both run the fused update (`fused`), the first's last stream
    update runs fused with the second's attention HyperConnection, on the same kernel (one pass over
    the streams less each way); the model's forward carries the result across (_model_forward)."""
    layers, fused_ids = list(model.layers), {id(layer) for layer in fused}
    nexts = [None] * len(layers)
    for i, (layer, after) in enumerate(zip(layers, layers[1:])):
        if id(layer) in fused_ids and id(after) in fused_ids:
            update = MhcPostPre(after.attn_hc, layer._ak_post)
            update._ak_lookup = layer._ak_post_pre._ak_lookup
            install(update, "forward", _fused_forward)
            nexts[i] = update
    if not any(nexts):
        return
    try:
        install(model, "forward", _model_forward)
    except Refused:   # another transformers' model forward: the layers stay apart
        return
    object.__setattr__(model, "_ak_next", nexts)   # not submodules: they hold the layers' own


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

    def patch_model(self, model: torch.nn.Module, patched: list[torch.nn.Module]) -> None:
        layers = [m for m in patched if isinstance(m, DeepseekV4DecoderLayer)]
        for sub in model.modules():
            if isinstance(sub, DeepseekV4Model) and "_ak_next" not in sub.__dict__:
                link_layers(sub, layers)

    def patch_parts(self, module: MhcPostPre, lookups: dict) -> None:
        """The stream update on mhc_post's kernel, then the HyperConnection on mhc_pre's."""
        PATCHES.of(OPS["mhc_post"]).patch(module.update, lookups["mhc_post"])
        PATCHES.of(OPS["mhc_pre"]).patch(module.hc, lookups["mhc_pre"])


PARTS = (MhcPostPrePatch(SPEC),)
