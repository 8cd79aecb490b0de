"""The indexer_score kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.indexer_score import SPEC
from ..targets.host.library import built_kernel
from ..targets.host.ops.indexer_score import _bwd, _fwd, kept_products
from .base import Patch, bind
from .torch_op import torch_op


def _score_forward(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, the products q.k where the plan keeps them for the backward: a residual)."""
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    built = built_kernel(kernel)
    out, products = torch.empty(q.shape[0], q.shape[1], k.shape[1]), kept_products(built, q, k)
    _fwd(built, q, k, w, out, products)
    return out, products


def _score_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, products: torch.Tensor,
                    kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    dq, dk, dw = torch.empty_like(q), torch.empty_like(k), torch.empty_like(w)
    _bwd(built_kernel(kernel), q, k, w, g.float().contiguous(), products, dq, dk, dw)
    return dq, dk, dw


def _fake_forward(q, k, w, kernel):
    return (q.new_empty(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float32),
            kept_products(built_kernel(kernel), q, k))


OP = torch_op("indexer_score", _score_forward, _score_backward, fake_forward=_fake_forward,
              saved=("q", "k", "w"), consts=("kernel",), grads=("q", "k", "w"))


def _scorer_forward(self: DeepseekV4IndexerScorer, q, compressed_kv, hidden_states):
    kernel = None
    if q.device.type == "cpu" and q.dtype == compressed_kv.dtype:
        kernel = self._ak_lookup((q.shape[2], q.shape[3]), q.dtype)
    if kernel is None or compressed_kv.shape[1] == 0:
        return DeepseekV4IndexerScorer.forward(self, q, compressed_kv, hidden_states)
    weights = self.weights_proj(hidden_states).float() * self.weights_scaling
    return OP(q, compressed_kv, weights, kernel)


class IndexerScorePatch(Patch):
    def call_problem(self, module, args):
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
            return None
        q, k = args[0], args[1]
        if q.dtype not in (d.torch for d in self.spec.dtypes) or q.dim() != 4:
            return None
        return Problem(self.spec.name, "default", (q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1]),
                       DType.from_torch(q.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        bind(module, lookup, self.spec.name, [(DeepseekV4IndexerScorer, "forward", _scorer_forward)])


PARTS = (IndexerScorePatch(SPEC),)
