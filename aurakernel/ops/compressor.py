"""Compressor pooling + kv_norm: the softmax-gated pooling of DeepSeek-V4's compressed attention
(DeepseekV4HCACompressor: non-overlapping windows of m=128; DeepseekV4CSACompressor and the
lightning indexer's own compressor: overlapping windows of 2m, m=4), followed by the RMSNorm.

The swap replaces those modules' forward in training (no cache) with the same code around one
kernel call; with a cache (generation) the reference runs.
"""

from __future__ import annotations

import torch
from torch.func import functional_call
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

EPS = 1e-6
CHANNEL_BLOCK = 64   # channels per block of the kernel's softmax-weight scratch (16 KB of it per 64 slots)


def _p_size(ratio: int, d: int, overlap: bool) -> int:
    """Elements of one window's softmax weights in the kernel's blocked layout (its PSIZE):
    slots (2m overlapping, m otherwise) x channels rounded up to whole CHANNEL_BLOCKs."""
    return (2 if overlap else 1) * ratio * -(-d // CHANNEL_BLOCK) * CHANNEL_BLOCK

_TOL = {
    DType.fp32: {"y": Tolerance(1e-5, 1e-5), "kv": Tolerance(1e-5, 1e-4), "gate": Tolerance(1e-5, 1e-4),
                 "position_bias": Tolerance(1e-4, 1e-3), "weight": Tolerance(1e-4, 1e-3)},
    DType.bf16: {"y": Tolerance(2e-2, 1.6e-2), "kv": Tolerance(4e-2, 3.2e-2), "gate": Tolerance(4e-2, 3.2e-2),
                 # summed over every window; the reference rounds each term to bf16 first
                 "position_bias": Tolerance(6e-2, 3e-2), "weight": Tolerance(6e-2, 3e-2)},
}
_TOL[DType.fp16] = {k: Tolerance(v.atol / 5, v.rtol / 5) for k, v in _TOL[DType.bf16].items()}


def pool_reference(kv, gate, position_bias, ratio: int, head_dim: int, overlap: bool):
    """transformers 5.24's pooling (training path, no cache), verbatim up to the kv_norm call."""
    batch = kv.shape[0]
    usable = (kv.shape[1] // ratio) * ratio
    chunk_kv, chunk_gate = kv[:, :usable], gate[:, :usable]
    n_windows = chunk_kv.shape[1] // ratio
    chunk_kv = chunk_kv.view(batch, n_windows, ratio, -1)
    chunk_gate = chunk_gate.view(batch, n_windows, ratio, -1) + position_bias
    if not overlap:
        return (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2)
    new_kv = chunk_kv.new_zeros((batch, n_windows, 2 * ratio, head_dim))
    new_gate = chunk_gate.new_full((batch, n_windows, 2 * ratio, head_dim), float("-inf"))
    new_kv[:, :, ratio:] = chunk_kv[..., head_dim:]
    new_gate[:, :, ratio:] = chunk_gate[..., head_dim:]
    if n_windows > 1:
        new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, :head_dim]
        new_gate[:, 1:, :ratio] = chunk_gate[:, :-1, :, :head_dim]
    return (new_kv * new_gate.softmax(dim=2, dtype=torch.float32).to(new_kv.dtype)).sum(dim=2)


class CompressorPool(torch.nn.Module):
    """Pooling + kv_norm, the unit the kernel replaces (timing reference)."""

    def __init__(self, ratio: int, head_dim: int, overlap: bool):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        self.kv_norm = v4.DeepseekV4RMSNorm(head_dim, eps=EPS)

    def forward(self, kv, gate, position_bias):
        return self.kv_norm(pool_reference(kv, gate, position_bias, self.ratio, self.head_dim, self.overlap))


class CompressorSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[2:]

    def default_shape_for(self, variant: str) -> tuple[int, ...]:
        return (1, 1024, 4, 512) if variant == "csa" else (1, 32, 128, 512)   # 4096 tokens, V4 head_dim

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        batch, windows, ratio, d = problem.shape
        dk = 2 * d if problem.variant == "csa" else d
        seq = windows * ratio + ratio // 2          # a tail shorter than a window: not pooled
        g = torch.Generator().manual_seed(seed)
        return {"kv": torch.randn(batch, seq, dk, generator=g).to(problem.dtype.torch),
                "gate": (torch.randn(batch, seq, dk, generator=g) * 2).to(problem.dtype.torch),
                "position_bias": torch.randn(ratio, dk, generator=g) * 0.5,
                "weight": 1.0 + 0.3 * torch.randn(d, generator=g)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("kv", "gate", "position_bias", "weight")

    def module_call(self, problem: Problem, inputs: Tensors):
        mod = CompressorPool(problem.shape[2], problem.shape[3], problem.variant == "csa")
        with torch.no_grad():
            mod.kv_norm.weight.copy_(inputs["weight"])
        return mod, (inputs["kv"], inputs["gate"], inputs["position_bias"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        mod, args = self.module_call(problem, inputs)
        return {"y": functional_call(mod, {"kv_norm.weight": inputs["weight"]}, args)}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    def work(self, problem: Problem, backward: bool) -> Work:
        batch, windows, ratio, d = problem.shape
        dk = 2 * d if problem.variant == "csa" else d
        e = problem.dtype.itemsize
        tokens = batch * windows * ratio
        return Work(tokens * dk * e * (6 if backward else 2) + batch * windows * d * e, tokens * dk * 12)

SPEC = CompressorSpec(
    name="compressor",
    summary="compressed attention's softmax pooling with position bias (CSA overlapping / HCA) + kv_norm RMSNorm",
    shape_meaning="BATCHxWINDOWSxRATIOxHEAD_DIM",
    shape_rank=4,
    default_shape=(1, 32, 128, 512),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("hca", "csa"),
)
