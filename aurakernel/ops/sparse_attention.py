"""DeepSeek-V4's attention as what it attends to, not as transformers computes it.

transformers scores every query against every key ([B, H, S, S + T]) and then masks all but:
  - the sliding window: keys j with s - window < j <= s (the model's sliding-window causal mask);
  - CSA layers: the compressed entries the lightning indexer selected for the query (`top_k_indices
    [B, S, k]`, -1 = none; the compressor turns them into a dense `block_bias`);
  - HCA layers: every compressed entry that is causally ready, entry < (s + 1) // ratio;
plus one learned sink logit per head in the softmax's denominator, with one shared KV head (K = V).

The operator computes exactly that, from the pieces (q after RoPE [B, H, S, D], the window's kv
[B, S, D], the compressed kv [B, T, D], the indices), and returns the attention interface's output
[B, S, H, D]. Its reference is transformers' own `eager_attention_forward` on the dense mask the
model builds, so a kernel is checked against the code it replaces. A kernel keeps only the per-row
logsumexp for the backward: nothing of size S x S or S x T exists.

Problem shape BATCHxHEADSxSEQxDIMxWINDOWxEXTRA: EXTRA is the indexer's top-k (csa: its inputs select
from T = SEQ / 4 entries, V4's CSA ratio), the compression ratio (hca: T = SEQ / ratio) or 1
(sliding: no compressed entries).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from ..dtypes import DType
from ..errors import UserError
from .base import OpSpec, Problem, Tensors, Tolerance, Work

CSA_RATIO = 4   # V4's compress_rates["compressed_sparse_attention"]: how many entries a csa problem's inputs have

# fp32 y: the logits are D-term dot products summed in order (the kernels' register-blocked GEMMs), so
# their rounding grows as sqrt(D): at V4's D = 512 (inputs of std 2, logits of std 4) y is off by ~1e-6
# typically and up to 4.6e-5 over 16M elements (1x16x2048x512 sliding, against float64), where
# torch's GEMM, summing in blocks, stays within 5e-6; at D = 64 the old 2e-5 held
_TOL = {DType.fp32: Tolerance(8e-5, 1e-4), DType.bf16: Tolerance(2e-2, 2e-2)}
_TOL_GRAD = {DType.fp32: Tolerance(5e-5, 2e-4), DType.bf16: Tolerance(4e-2, 4e-2)}


def entries_of(problem: Problem) -> int:
    """T, the compressed entries of a problem's inputs."""
    _, _, seq, _, _, extra = problem.shape
    if problem.variant == "csa":
        return seq // CSA_RATIO
    if problem.variant == "hca":
        return seq // extra
    return 0


def window_mask(seq: int, window: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The model's sliding-window causal mask [S, S]: 0 where s - window < j <= s, -inf elsewhere."""
    pos = torch.arange(seq, device=device)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    return torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def block_bias(variant: str, batch: int, seq: int, entries: int, extra: int, indices: torch.Tensor | None,
               dtype: torch.dtype = torch.float32, device=None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The compressor's dense block bias [B, 1, S, T] (DeepseekV4CSACompressor / HCACompressor.forward,
    transformers 5.24): 0 where a query may see an entry, -inf elsewhere. `positions` [B, S]: the
    queries' position ids (default 0..S-1), which hca's causal rule reads."""
    if variant == "hca":
        pos = positions if positions is not None else torch.arange(seq, device=device).view(1, -1)
        ready = (pos + 1) // extra                                           # [B or 1, S]
        hidden = torch.arange(entries, device=device).view(1, 1, 1, -1) >= ready.unsqueeze(1).unsqueeze(-1)
        return torch.zeros(batch, 1, seq, entries, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))
    valid = indices >= 0
    safe = torch.where(valid, indices, torch.full_like(indices, entries))
    bias = torch.full((batch, 1, seq, entries + 1), float("-inf"), dtype=dtype, device=device)
    bias.scatter_(-1, safe.unsqueeze(1), 0.0)
    return bias[..., :entries]


class SparseAttention(nn.Module):
    """The reference: DeepseekV4Attention's attention call, from q and kv after RoPE to the
    interface's output, through transformers' eager_attention_forward on the dense mask."""

    def __init__(self, heads: int, window: int, variant: str, extra: int):
        super().__init__()
        self.sinks = nn.Parameter(torch.zeros(heads))
        self.num_key_value_groups = heads
        self.window, self.variant, self.extra = window, variant, extra

    def forward(self, q, kv, compressed_kv=None, indices=None):
        return sparse_attention_reference(self, q, kv, compressed_kv, indices, q.shape[-1] ** -0.5)


def sparse_attention_reference(module, q, kv, compressed_kv, indices, scaling):
    batch, _, seq, _ = q.shape
    mask = window_mask(seq, module.window, device=q.device).expand(batch, 1, seq, seq)
    keys = kv.unsqueeze(1)
    if compressed_kv is not None:
        entries = compressed_kv.shape[1]
        bias = block_bias(module.variant, batch, seq, entries, module.extra, indices, device=q.device)
        mask = torch.cat([mask, bias], dim=-1)
        keys = torch.cat([keys, compressed_kv.unsqueeze(1)], dim=2)
    out, _ = v4.eager_attention_forward(module, q, keys, keys, mask, scaling=scaling)
    return out


def random_indices(batch: int, seq: int, entries: int, topk: int, generator: torch.Generator) -> torch.Tensor:
    """What the lightning indexer hands the attention: top-k picks among the causally ready entries
    (entry < (s + 1) // 4), in no particular order, -1 where fewer are ready than k."""
    k = max(min(topk, entries), 1)
    ready = (torch.arange(seq) + 1) // CSA_RATIO
    scores = torch.rand(batch, seq, max(entries, 1), generator=generator)
    scores = scores.masked_fill(torch.arange(max(entries, 1)).view(1, 1, -1) >= ready.view(1, -1, 1), -1.0)
    picks = scores.topk(k, dim=-1).indices
    return torch.where(picks >= ready.view(1, -1, 1), torch.full_like(picks, -1), picks)


class SparseAttentionSpec(OpSpec):
    fuses_matmuls = True   # its scope is the attention call: q k^T and p v are the kernel's
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        batch, heads, seq, dim, window, extra = problem.shape
        return (heads, dim, window, extra)

    def default_shape_for(self, variant: str) -> tuple[int, ...]:
        # V4-Flash widths at 2048 tokens and 16 of its 64 heads: eager's dense scores fit in memory
        return {"csa": (1, 16, 2048, 512, 128, 512), "hca": (1, 16, 2048, 512, 128, 128),
                "sliding": (1, 16, 2048, 512, 128, 1)}[variant]

    def check_shape(self, shape: tuple[int, ...]) -> None:
        if shape[5] < 1:
            raise UserError(f"sparse_attention EXTRA {shape[5]} must be >= 1 (top-k for csa, ratio for hca, 1 for sliding)")

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        batch, heads, seq, dim, window, extra = problem.shape
        g = torch.Generator().manual_seed(seed)
        dt = problem.dtype.torch
        inputs = {"q": (torch.randn(batch, heads, seq, dim, generator=g) * 2).to(dt),
                  "kv": (torch.randn(batch, seq, dim, generator=g) * 2).to(dt),
                  "sinks": torch.randn(heads, generator=g)}
        entries = entries_of(problem)
        if problem.variant != "sliding":
            inputs["compressed_kv"] = (torch.randn(batch, max(entries, 1), dim, generator=g) * 2).to(dt)[:, :entries]
        if problem.variant == "csa":
            idx = random_indices(batch, seq, entries, extra, g)
            if idx.shape[-1] > 1:   # a repeated pick in some rows: the dense mask sees it once, so must a kernel
                rows = torch.rand(batch, seq, generator=g) < 0.2
                idx[..., 1] = torch.where(rows, idx[..., 0], idx[..., 1])
            inputs["indices"] = idx
        return inputs

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("q", "kv", "sinks") + (("compressed_kv",) if problem.variant != "sliding" else ())

    def module_of(self, problem: Problem, inputs: Tensors) -> SparseAttention:
        _, heads, _, _, window, extra = problem.shape
        module = SparseAttention(heads, window, problem.variant, extra)
        with torch.no_grad():
            module.sinks.copy_(inputs["sinks"])
        return module

    def module_call(self, problem: Problem, inputs: Tensors):
        return self.module_of(problem, inputs), (inputs["q"], inputs["kv"], inputs.get("compressed_kv"),
                                                 inputs.get("indices"))

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        """transformers' eager attention; for bf16 inputs computed in fp32 from them (and the output
        rounded to bf16): eager's own bf16 path rounds the scores to bf16 before the softmax, which
        puts it 6x further from the exact result than a kernel accumulating in fp32 (max abs error
        0.10 against 0.016 at |y| <= 8, measured on the default inputs), and a tolerance loose
        enough for that would hide a kernel's bugs."""
        _, heads, _, _, window, extra = problem.shape
        # the sinks input itself (not a copy in a Parameter), so its gradient is the reference's
        module = SimpleNamespace(sinks=inputs["sinks"], num_key_value_groups=heads, training=False, window=window,
                                 variant=problem.variant, extra=extra)
        ckv = inputs.get("compressed_kv")
        y = sparse_attention_reference(module, inputs["q"].float(), inputs["kv"].float(),
                                       ckv.float() if ckv is not None else None, inputs.get("indices"),
                                       problem.shape[3] ** -0.5)
        return {"y": y.to(problem.dtype.torch)}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return (_TOL if output == "y" else _TOL_GRAD)[dtype]

    def keys_per_query(self, problem: Problem) -> float:
        """Mean keys a query attends to: its window (shorter at the start) plus compressed entries."""
        _, _, seq, _, window, extra = problem.shape
        w = min(window, seq)
        win = (w * (w + 1) / 2 + (seq - w) * window) / seq
        if problem.variant == "csa":
            return win + min(extra, entries_of(problem))
        if problem.variant == "hca":
            return win + entries_of(problem) / 2
        return win

    def work(self, problem: Problem, backward: bool) -> Work:
        batch, heads, seq, dim, _, _ = problem.shape
        e = problem.dtype.itemsize
        entries = entries_of(problem)
        rows = batch * heads * seq
        tensors = (2 * rows * dim + batch * (seq + entries) * dim) * e + rows * 4   # q, out, kv, ckv, lse
        if problem.variant == "csa":
            tensors += batch * seq * min(problem.shape[5], entries) * 8
        flops = 4 * rows * dim * self.keys_per_query(problem)   # q k^T and p v
        return Work(tensors * (2 if backward else 1), int(flops * (2.5 if backward else 1)))


SPEC = SparseAttentionSpec(
    name="sparse_attention",
    summary="V4 attention over the window and the selected / ready compressed entries only (sinks, shared KV)",
    shape_meaning="BATCHxHEADSxSEQxDIMxWINDOWxEXTRA (EXTRA: top-k for csa, compress ratio for hca, 1 for sliding)",
    shape_rank=6,
    default_shape=(1, 16, 2048, 512, 128, 512),
    dtypes=(DType.fp32, DType.bf16),
    variants=("csa", "hca", "sliding"),
)
