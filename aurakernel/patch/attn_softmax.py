"""The attn_softmax kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import functools

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from ..dtypes import DType
from ..ops.attn_softmax import SWAP, SCALING, SPEC, SinkSoftmax
from ..ops.base import Problem
from ..targets.host.library import built_kernel
from .base import Patch
from .install import install, swap_globals
from .torch_op import torch_op


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




def call_problem(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The attention softmax problem of one call (for the profiler's recorder)."""
    if query.dim() != 4 or query.dtype not in (d.torch for d in SPEC.dtypes):
        return None
    batch, heads, seq, _ = query.shape
    return Problem("attn_softmax", "default", (batch, heads, seq, key.shape[2]), DType.from_torch(query.dtype))


class AttnSoftmaxPatch(Patch):
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


PARTS = (AttnSoftmaxPatch(SPEC),)
