"""The attention softmax with per-head sinks: what DeepSeek-V4's `eager_attention_forward` does
between its two matmuls (scale, add the mask, append the sink logit, subtract the max, softmax in
the scores' dtype, drop the sink, cast to the values' dtype), as one kernel each way.

The patch makes the attention modules of a patched model call `attention_dispatch` where their
code calls the module-level `eager_attention_forward` (patch.install.swap_globals, as rope does):
the same computation around the kernel; with a single shared KV head (V4's MQA) the two
matmuls also fold the heads into the rows instead of materialising `repeat_kv`'s copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from . import scoped
from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

SCALING = 512 ** -0.5   # V4's head_dim
AIV_MAX = 48            # the most vector cores of the Ascend targets (the backward's d sinks partials)

_TOL = {DType.fp32: {"probs": Tolerance(1e-6, 1e-5), "scores": Tolerance(1e-6, 1e-4), "sinks": Tolerance(1e-4, 1e-3)},
        DType.bf16: {"probs": Tolerance(4e-3, 1.6e-2), "scores": Tolerance(4e-3, 3.2e-2), "sinks": Tolerance(1e-2, 1e-2)},
        DType.fp16: {"probs": Tolerance(1e-3, 2e-3), "scores": Tolerance(1e-3, 4e-3), "sinks": Tolerance(1e-2, 1e-2)}}


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


# the transformers function the kernel replaces, captured before anything patched it
SWAP = scoped.FunctionSwap(v4, "eager_attention_forward")


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

SPEC = AttnSoftmaxSpec(
    name="attn_softmax",
    summary="attention softmax with per-head sinks between the two attention matmuls (scale, mask, sink, cast)",
    shape_meaning="BATCHxHEADSxSEQxKEYS",
    shape_rank=4,
    default_shape=(1, 64, 256, 320),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)
