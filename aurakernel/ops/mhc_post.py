"""mHC post: the stream update at the end of each DeepseekV4DecoderLayer sub-block,

    new_streams = post (x) block_output + comb^T @ streams

written inline in DeepseekV4DecoderLayer.forward (twice per layer). The kernel is one pass over
the streams forward and one backward (all four gradients together). Swapping patches the layer's
forward to route both updates through an `MhcPost` module (Liger-style: the layer's code is
repeated with that one expression replaced).
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

from ..dtypes import DType
from ..patch.install import install
from ..patch.torch_op import torch_op
from ..targets.host.library import built_kernel
from .base import OpSpec, Problem, Tensors, Tolerance, Work
from .layout import like_layout

_TOL = {
    DType.fp32: {n: Tolerance(1e-5, 1e-5) for n in ("y", "out", "h")} | {n: Tolerance(1e-4, 1e-4) for n in ("post", "comb")},
    DType.bf16: {n: Tolerance(2e-2, 1.6e-2) for n in ("y", "out", "h")} | {n: Tolerance(2e-2, 2e-2) for n in ("post", "comb")},
    DType.fp16: {n: Tolerance(2e-3, 2e-3) for n in ("y", "out", "h")} | {n: Tolerance(2e-3, 2e-3) for n in ("post", "comb")},
}


class MhcPost(torch.nn.Module):
    """The reference: DeepseekV4DecoderLayer's stream update, verbatim."""

    def forward(self, post, comb, block_output, hidden_states):
        dtype = hidden_states.dtype
        return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden_states)


class MhcPostSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, hc, d = problem.shape
        g = torch.Generator().manual_seed(seed)
        comb = torch.rand(rows, hc, hc, generator=g)
        return {"post": 2 * torch.rand(rows, hc, generator=g), "comb": comb / comb.sum(-1, keepdim=True),
                "out": torch.randn(rows, d, generator=g).to(problem.dtype.torch),
                "h": torch.randn(rows, hc, d, generator=g).to(problem.dtype.torch)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("post", "comb", "out", "h")

    def module_call(self, problem: Problem, inputs: Tensors):
        return MhcPost(), (inputs["post"], inputs["comb"], inputs["out"], inputs["h"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": MhcPost()(inputs["post"], inputs["comb"], inputs["out"], inputs["h"])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    def work(self, problem: Problem, backward: bool) -> Work:
        rows, hc, d = problem.shape
        e = problem.dtype.itemsize
        if not backward:
            return Work(rows * ((2 * hc + 1) * d * e + (hc + hc * hc) * 4), rows * d * hc * (2 * hc + 2))
        return Work(rows * ((3 * hc + 2) * d * e + 2 * (hc + hc * hc) * 4), rows * d * hc * (4 * hc + 4))

    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        h = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if h is None or h.dim() < 3 or h.dtype not in (d.torch for d in self.dtypes):
            return None
        hc, d = h.shape[-2], h.shape[-1]
        return Problem(self.name, "default", (h.numel() // (hc * d), hc, d), DType.from_torch(h.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        if isinstance(module, DeepseekV4DecoderLayer):
            module._ak_post = MhcPost()
            self.patch(module._ak_post, lookup)
            install(module, "forward", _layer_forward)
            return
        module._ak_lookup = lookup
        install(module, "forward", _post_forward)


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


def _post_forward(module: MhcPost, post, comb, block_output, hidden_states):
    key = tuple(hidden_states.shape[-2:])
    kernel = (module._ak_lookup(key, hidden_states.dtype)
              if hidden_states.device.type == "cpu" and block_output.dtype == hidden_states.dtype else None)
    if kernel is None:
        return MhcPost.forward(module, post, comb, block_output, hidden_states)
    return OP(post, comb, block_output, hidden_states, kernel)


def _layer_forward(self: DeepseekV4DecoderLayer, hidden_states, input_ids=None, **kwargs):
    """DeepseekV4DecoderLayer.forward (transformers 5.24) with both stream updates through _ak_post."""
    post, comb, collapsed = self.attn_hc(hidden_states)
    attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
    hidden_states = self._ak_post(post, comb, attn_output, hidden_states)
    post, comb, collapsed = self.ffn_hc(hidden_states)
    mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
    return self._ak_post(post, comb, mlp_output, hidden_states)


SPEC = MhcPostSpec(
    name="mhc_post",
    summary="mHC post (DeepseekV4DecoderLayer): post-weighted block output + comb^T @ streams",
    shape_meaning="ROWSxHCxD: tokens x streams (hc_mult) x hidden",
    shape_rank=3,
    default_shape=(2048, 4, 4096),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)
