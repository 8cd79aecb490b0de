"""Memory-layout helpers shared by the row-wise kernels' torch bindings."""

from __future__ import annotations

import torch


def dense(t: torch.Tensor) -> bool:
    """True when the elements fill a gap-free block of memory in some order of the dims."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def rows_layout(t: torch.Tensor) -> torch.Tensor:
    """Row kernels only need each row contiguous and rows packed: any dense layout with a unit
    last stride qualifies (e.g. the per-head q norm's transposed view); otherwise copy."""
    if t.stride(-1) == 1 and dense(t):
        return t
    return t.contiguous()


def like_layout(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`t` with the same strides as `ref`, copying only when they differ (kernels walk both with one offset)."""
    if t.stride() == ref.stride():
        return t
    return torch.empty_like(ref).copy_(t)
