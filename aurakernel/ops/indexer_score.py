"""The lightning indexer's scoring: transformers' DeepseekV4IndexerScorer,

    score[b, s, t] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t]) * index_head_dim^-0.5,
    w = weights_proj(hidden) * index_n_heads^-0.5   (that small projection stays a matmul)

fused so the [B, S, H, T] products are never materialised. Its top-k stays torch.topk on these
scores in the indexer; the scores match the reference to fp32 rounding, so only entries whose
reference scores are equal to rounding can be picked differently (a test pins this down).

Variant `causal`: the scores as DeepseekV4Indexer takes them to its top-k, each query's entries at or
past limit[b, s] = (position + 1) // compress_rate (the windows not complete at its position) masked to
-inf. The kernel never computes those products: about half of them over a sequence. Its inputs add
`limit` (positions 0..S-1 and the ratio S // T, as a training sequence has them).

On Ascend targets (templates/ascendc/indexer_score/) both directions are mixed kernels: the products
on the Cube (q . k with the ReLU on the way out of L0C; in the backward q . k again, coef . k and
coef^T . q), the heads' weighted sum and the coefficients on the vector cores. With fp32 q and k the
backward stays on the vector unit (the Cube path needs LoadData's 16-bit fractal transposes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

HIDDEN = 64   # hidden size of the test inputs (the weights projection's input)

# scores and the weights' gradients are fp32; q's and k's gradients come back in their own dtype
_TOL = {DType.fp32: {"q": Tolerance(1e-5, 1e-4), "k": Tolerance(1e-5, 1e-4)},
        DType.bf16: {"q": Tolerance(2e-2, 1.6e-2), "k": Tolerance(2e-2, 1.6e-2)},
        DType.fp16: {"q": Tolerance(2e-3, 2e-3), "k": Tolerance(2e-3, 2e-3)}}
_FP32_OUT = Tolerance(1e-4, 1e-3)


def _scorer(heads: int, dim: int) -> DeepseekV4IndexerScorer:
    cfg = DeepseekV4Config(hidden_size=HIDDEN, index_n_heads=heads, index_head_dim=dim, num_hidden_layers=1,
                           vocab_size=8, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    return DeepseekV4IndexerScorer(cfg)


class IndexerScoreSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[2:4]

    def default_shape_for(self, variant: str) -> tuple[int, ...]:
        return (1, 512, 64, 128, 128) if variant == "causal" else self.default_shape   # causal: V4's ratio 4

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        batch, seq, heads, dim, entries = problem.shape
        g = torch.Generator().manual_seed(seed)
        dt = problem.dtype.torch
        out = {"q": torch.randn(batch, seq, heads, dim, generator=g).to(dt),
               "k": torch.randn(batch, entries, dim, generator=g).to(dt),
               "hidden": torch.randn(batch, seq, HIDDEN, generator=g),
               "proj": torch.randn(heads, HIDDEN, generator=g) * 0.2}
        if problem.variant == "causal":
            out["limit"] = causal_limit(batch, seq, entries)
        return out

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("q", "k", "hidden", "proj")

    def module_call(self, problem: Problem, inputs: Tensors):
        mod = _scorer(problem.shape[2], problem.shape[3])
        with torch.no_grad():
            mod.weights_proj.weight.copy_(inputs["proj"])
        if problem.variant == "causal":
            return CausalScorer(mod), (inputs["q"], inputs["k"], inputs["hidden"], inputs["limit"])
        return mod, (inputs["q"], inputs["k"], inputs["hidden"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        mod = _scorer(problem.shape[2], problem.shape[3])
        y = functional_call(mod, {"weights_proj.weight": inputs["proj"]}, (inputs["q"], inputs["k"], inputs["hidden"]))
        return {"y": mask_future(y, inputs["limit"]) if problem.variant == "causal" else y}

    def grad_slack(self, problem: Problem, inputs: Tensors, grad_outputs: Tensors) -> Tensors:
        """ReLU kinks: where q . k is zero to fp32 rounding (|q . k| <= n u |q| |k|, the worst-case
        error of an n-term fp32 sum, u = 2^-24) the summation order decides the ReLU's side, so the
        gradient may or may not pass that product; the allowance is what passing it adds:
        |g w c| |k| into dq and |g w c| |q| into dk."""
        q, k = inputs["q"].double(), inputs["k"].double()
        prod = torch.einsum("bshd,btd->bsht", q, k)
        bound = q.shape[3] * 2.0**-24 * q.norm(dim=-1).unsqueeze(-1) * k.norm(dim=-1).unsqueeze(1).unsqueeze(1)
        w = self.weights(inputs["hidden"], inputs["proj"], q.shape[2]).double() * q.shape[3] ** -0.5
        coef = (prod.abs() <= bound) * grad_outputs["y"].double().unsqueeze(2).abs() * w.abs().unsqueeze(-1)
        return {"q": torch.einsum("bsht,btd->bshd", coef, k.abs()), "k": torch.einsum("bsht,bshd->btd", coef, q.abs())}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype].get(output, _FP32_OUT if dtype is not DType.fp32 else Tolerance(1e-5, 1e-4))

    def work(self, problem: Problem, backward: bool) -> Work:
        batch, seq, heads, dim, entries = problem.shape
        e = problem.dtype.itemsize
        scored = int(causal_limit(batch, seq, entries).sum()) if problem.variant == "causal" else batch * seq * entries
        flops = 2 * heads * dim * scored
        return Work(batch * (seq * heads * dim + entries * dim) * e * (2 if backward else 1) + batch * seq * entries * 4,
                    flops * (2 if backward else 1))

    @staticmethod
    def weights(hidden, proj, heads):
        return F.linear(hidden, proj).float() * heads**-0.5

def causal_limit(batch: int, seq: int, entries: int) -> torch.Tensor:
    """[B, S] int64: the entries each query of a training sequence sees, (s + 1) // ratio with the
    ratio S // T (at most T)."""
    ratio = max(1, seq // max(entries, 1))
    return ((torch.arange(seq) + 1) // ratio).clamp(max=entries).expand(batch, seq).contiguous()


def mask_future(scores: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """DeepseekV4Indexer's causal rule: entries at or past a query's limit to -inf."""
    entries = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(entries.view(1, 1, -1) >= limit.unsqueeze(-1), float("-inf"))


class CausalScorer(torch.nn.Module):
    """The timing module of the causal variant: the scorer, then the indexer's mask (transformers' lines)."""

    def __init__(self, scorer: DeepseekV4IndexerScorer):
        super().__init__()
        self.scorer = scorer

    def forward(self, q, k, hidden, limit):
        return mask_future(self.scorer(q, k, hidden), limit)


SPEC = IndexerScoreSpec(
    name="indexer_score",
    summary="lightning indexer scores: heads-weighted ReLU(q . k), without the [B,S,H,T] intermediate",
    shape_meaning="BATCHxSEQxHEADSxDIMxENTRIES: queries x indexer heads x index_head_dim x compressed entries",
    shape_rank=5,
    default_shape=(1, 512, 64, 128, 256),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default", "causal"),
)
