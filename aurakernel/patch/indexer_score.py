"""The indexer_score kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.indexer_score import SPEC, CausalScorer, mask_future
from ..targets.host.library import built_kernel
from ..targets.host.ops.indexer_score import _bwd, _fwd, kept_products
from .base import Patch, bind
from .torch_op import torch_op


def _score_forward(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, limit: torch.Tensor | None,
                   kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, the products q.k where the plan keeps them for the backward: a residual). With `limit`
    ([B, S] int64, the causal rule) a query's entries past its limit are -inf and never computed."""
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    built = built_kernel(kernel)
    out, products = torch.empty(q.shape[0], q.shape[1], k.shape[1]), kept_products(built, q, k)
    _fwd(built, q, k, w, out, products, limit)
    return out, products


def _score_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, limit: torch.Tensor | None,
                    products: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    dq, dk, dw = torch.empty_like(q), torch.empty_like(k), torch.empty_like(w)
    _bwd(built_kernel(kernel), q, k, w, g.float().contiguous(), products, dq, dk, dw, limit)
    return dq, dk, dw


def _fake_forward(q, k, w, limit, kernel):
    return (q.new_empty(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float32),
            kept_products(built_kernel(kernel), q, k))


OP = torch_op("indexer_score", _score_forward, _score_backward, fake_forward=_fake_forward,
              saved=("q", "k", "w", "limit"), consts=("kernel",), grads=("q", "k", "w"))


def _kernel_for(scorer: DeepseekV4IndexerScorer, q: torch.Tensor, compressed_kv: torch.Tensor) -> str | None:
    if q.device.type != "cpu" or q.dtype != compressed_kv.dtype or compressed_kv.shape[1] == 0:
        return None
    lookup = getattr(scorer, "_ak_lookup", None)   # None: the scorer is not patched
    return lookup((q.shape[2], q.shape[3]), q.dtype) if lookup is not None else None


def _scorer_forward(self: DeepseekV4IndexerScorer, q, compressed_kv, hidden_states, ak_limit=None):
    """The scorer through the kernel; `ak_limit` (from causal_scores) masks each query's entries past its
    limit to -inf: in the kernel, their products never computed, else after the reference lines."""
    kernel = _kernel_for(self, q, compressed_kv)
    if kernel is None:
        scores = DeepseekV4IndexerScorer.forward(self, q, compressed_kv, hidden_states)
        return scores if ak_limit is None else mask_future(scores, ak_limit)
    weights = self.weights_proj(hidden_states).float() * self.weights_scaling
    return OP(q, compressed_kv, weights, ak_limit, kernel)


def causal_scores(scorer: DeepseekV4IndexerScorer, q: torch.Tensor, compressed_kv: torch.Tensor,
                  hidden_states: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """The scorer's scores with the indexer's causal rule applied: entries at or past `limit` ([B, S]:
    (position + 1) // compress_rate) are -inf. Through the kernel those products are never computed
    (about half of them over a sequence); else the scorer's own scores, masked as transformers masks them.
    Either way the scorer module is called, so its hooks (the indexer objective's) see the scores."""
    if getattr(scorer, "_ak_lookup", None) is None:   # not patched: transformers' scorer, then its mask
        return mask_future(scorer(q, compressed_kv, hidden_states), limit)
    return scorer(q, compressed_kv, hidden_states, ak_limit=limit.to(torch.int64).expand(q.shape[0], q.shape[1]).contiguous())


def _causal_scorer_forward(self: CausalScorer, q, k, hidden, limit):
    return causal_scores(self.scorer, q, k, hidden, limit)


class IndexerScorePatch(Patch):
    def call_problem(self, module, args):
        """The causal variant: a model's scorer is called by DeepseekV4Indexer, which masks each query's
        entries past its position (the patched indexer passes those limits to the kernel: causal_scores)."""
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
            return None
        q, k = args[0], args[1]
        if q.dtype not in (d.torch for d in self.spec.dtypes) or q.dim() != 4:
            return None
        return Problem(self.spec.name, "causal", (q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1]),
                       DType.from_torch(q.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        if isinstance(module, CausalScorer):   # the causal variant's timing module: its scorer, masked in the kernel
            bind(module.scorer, lookup, self.spec.name, [(DeepseekV4IndexerScorer, "forward", _scorer_forward)])
            bind(module, lookup, self.spec.name, [(CausalScorer, "forward", _causal_scorer_forward)])
            return
        bind(module, lookup, self.spec.name, [(DeepseekV4IndexerScorer, "forward", _scorer_forward)])


PARTS = (IndexerScorePatch(SPEC),)
