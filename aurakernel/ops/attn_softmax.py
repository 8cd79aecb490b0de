"""The attention softmax with per-head sinks: what DeepSeek-V4's `eager_attention_forward` does
between its two matmuls (scale, add the mask, append the sink logit, subtract the max, softmax in
the scores' dtype, drop the sink, cast to the values' dtype), as one kernel each way.

The patch makes the attention modules of a patched model call `attention_dispatch` where their
code calls the module-level `eager_attention_forward` (patch.install.swap_globals, as rope does):
the same computation around the kernel; with a single shared KV head (V4's MQA) the two
matmuls also fold the heads into the rows instead of materialising `repeat_kv`'s copies.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from . import scoped
from ..dtypes import DType
from ..patch.install import install, swap_globals
from ..patch.torch_op import torch_op
from ..targets.host.library import built_kernel
from .base import OpSpec, Problem, Tensors, Tolerance, Work

SCALING = 512 ** -0.5   # V4's head_dim
AIV_MAX = 48            # the most vector cores of the Ascend targets (the backward's d sinks partials)

_TOL = {DType.fp32: {"probs": Tolerance(1e-6, 1e-5), "scores": Tolerance(1e-6, 1e-4), "sinks": Tolerance(1e-4, 1e-3)},
        DType.bf16: {"probs": Tolerance(4e-3, 1.6e-2), "scores": Tolerance(4e-3, 3.2e-2), "sinks": Tolerance(1e-2, 1e-2)},
        DType.fp16: {"probs": Tolerance(1e-3, 2e-3), "scores": Tolerance(1e-3, 4e-3), "sinks": Tolerance(1e-2, 1e-2)}}


def sink_softmax_reference(scores, attention_mask, sinks, scaling, value_dtype):
    """eager_attention_forward (transformers 5.24) from `attn_weights = matmul(q, k^T)` to the cast."""
    attn_weights = scores * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    sinks = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[-2], -1)
    combined_logits = torch.cat([attn_weights, sinks], dim=-1)
    combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
    return probs[..., :-1].to(value_dtype)


class SinkSoftmax(nn.Module):
    """Timing reference: the sink softmax of a [B, H, S, K] score block."""

    def __init__(self, heads: int):
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(heads))

    def forward(self, scores, mask):
        return sink_softmax_reference(scores, mask, self.sinks, SCALING, scores.dtype)


class AttnSoftmaxSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return ()

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        batch, heads, seq, keys = problem.shape
        g = torch.Generator().manual_seed(seed)
        scores = (torch.randn(batch, heads, seq, keys, generator=g) * 20).to(problem.dtype.torch)
        # a sliding-window causal pattern over the first keys, some compressed entries masked at random
        pos = torch.arange(seq)[:, None]
        key = torch.arange(keys)[None, :]
        blocked = ((key > pos) & (key < seq)) | ((torch.rand(seq, keys, generator=g) < 0.2) & (key >= seq))
        mask = torch.zeros(seq, keys).masked_fill(blocked, float("-inf")).expand(batch, 1, seq, keys).contiguous()
        return {"scores": scores, "mask": mask, "sinks": torch.randn(heads, generator=g)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("scores", "sinks")

    def module_call(self, problem: Problem, inputs: Tensors):
        mod = SinkSoftmax(problem.shape[1])
        with torch.no_grad():
            mod.sinks.copy_(inputs["sinks"])
        return mod, (inputs["scores"], inputs["mask"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"probs": sink_softmax_reference(inputs["scores"], inputs["mask"], inputs["sinks"], SCALING,
                                                inputs["scores"].dtype)}

    def visible_outputs(self) -> tuple[str, ...]:
        return ("probs",)

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    def work(self, problem: Problem, backward: bool) -> Work:
        batch, heads, seq, keys = problem.shape
        e = problem.dtype.itemsize
        n = batch * heads * seq * keys
        return Work(n * e * (3 if backward else 2) + batch * seq * keys * 4, n * (20 if backward else 12))

    def call_problem(self, module, args):
        return None   # a function, not a module: the profiler records it through SWAP.recording

    def patch(self, module: torch.nn.Module, lookup) -> None:
        if isinstance(module, SinkSoftmax):
            module._ak_lookup = lookup
            install(module, "forward", _sink_softmax_forward)
            return
        dispatch = functools.partial(attention_dispatch, lookup)
        for sub in module.modules():
            if isinstance(sub, v4.DeepseekV4Attention):
                swap_globals(sub, eager_attention_forward=dispatch)


def _mask_rows(mask, scores):
    """The mask as fp32 rows (b, s) -> [K] with unit stride, and its b and s strides (0: broadcast)."""
    if mask is None:
        return None, 0, 0
    batch, _, seq, keys = scores.shape
    m = mask.float() if mask.dtype != torch.float32 else mask
    m = m.expand(batch, 1, seq, keys)
    if m.stride(-1) != 1:
        m = m.contiguous()
    return m, m.stride(0), m.stride(2)


def _forward(scores: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor, scaling: float, kernel: str,
             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs in out_dtype, row max, row sum): the row statistics are the backward's residuals."""
    inputs = {"scores": scores.contiguous(), "mask": mask, "sinks": sinks, "scaling": scaling}
    outputs = built_kernel(kernel).empty_outputs(None, inputs)
    built_kernel(kernel).run_forward(inputs, outputs)
    probs = outputs["probs"]
    return (probs.to(out_dtype) if probs.dtype != out_dtype else probs), outputs["row_max"], outputs["row_sum"]


def _fake_forward(scores, mask, sinks, scaling, kernel, out_dtype):
    rows = scores.numel() // scores.shape[-1]
    return (scores.new_empty(scores.shape, dtype=out_dtype), scores.new_empty(rows, dtype=torch.float32),
            scores.new_empty(rows, dtype=torch.float32))


def _backward(dp: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor,
              row_max: torch.Tensor, row_sum: torch.Tensor, scaling: float,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scores.contiguous()
    grads = {"scores": torch.empty_like(scores), "sinks": torch.empty(sinks.shape)}
    built_kernel(kernel).run_backward({"scores": scores, "mask": mask, "sinks": sinks, "scaling": scaling},
                      {"row_max": row_max, "row_sum": row_sum}, {"probs": dp}, grads)
    return grads["scores"], grads["sinks"].to(sinks.dtype)


OP = torch_op("attn_softmax", _forward, _backward, fake_forward=_fake_forward, outputs=1,
              saved=("scores", "mask", "sinks"), consts=("scaling", "kernel"), grads=("scores", "sinks"))


def _sink_softmax_forward(self: SinkSoftmax, scores, mask):
    return OP(scores, mask, self.sinks, SCALING, self._ak_lookup((), scores.dtype), scores.dtype)


def attention_dispatch(lookup, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """eager_attention_forward with `lookup` bound (functools.partial): the sink softmax through a
    kernel when one fits the call, else the reference."""
    kernel = None
    if (dropout == 0.0 and query.device.type == "cpu" and key.shape[1] == 1
            and value.shape[1] == 1 and query.dtype == key.dtype):
        kernel = lookup((), query.dtype)
    if kernel is None:
        return SWAP.reference(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
    batch, heads, seq, dim = query.shape
    keys = key.shape[2]
    # one shared KV head: fold the heads into the rows, no repeat_kv copies
    scores = torch.matmul(query.reshape(batch, 1, heads * seq, dim), key.transpose(2, 3)).view(batch, heads, seq, keys)
    probs = OP(scores, attention_mask, module.sinks, float(scaling), kernel, value.dtype)
    out = torch.matmul(probs.view(batch, 1, heads * seq, keys), value).view(batch, heads, seq, -1)
    return out.transpose(1, 2).contiguous(), probs


SWAP = scoped.FunctionSwap(v4, "eager_attention_forward")


def call_problem(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The attention softmax problem of one call (for the profiler's recorder)."""
    if query.dim() != 4 or query.dtype not in (d.torch for d in SPEC.dtypes):
        return None
    batch, heads, seq, _ = query.shape
    return Problem("attn_softmax", "default", (batch, heads, seq, key.shape[2]), DType.from_torch(query.dtype))


SPEC = AttnSoftmaxSpec(
    name="attn_softmax",
    summary="attention softmax with per-head sinks between the two attention matmuls (scale, mask, sink, cast)",
    shape_meaning="BATCHxHEADSxSEQxKEYS",
    shape_rank=4,
    default_shape=(1, 64, 256, 320),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)
