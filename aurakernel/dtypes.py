"""Small value types shared by every stage: dtypes and shapes, parsed and validated once."""

from __future__ import annotations

import enum
import re

import torch

from .errors import UserError


class DType(enum.Enum):
    """Element types a kernel can be built for. The value is the canonical short name."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"

    @property
    def torch(self) -> torch.dtype:
        return {DType.fp32: torch.float32, DType.bf16: torch.bfloat16, DType.fp16: torch.float16}[self]

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.fp32 else 2

    @classmethod
    def parse(cls, text: str, accepted: tuple[DType, ...] | None = None) -> DType:
        key = text.strip().lower()
        dtype = _DTYPE_ALIASES.get(key)
        accepted = accepted or tuple(cls)
        if dtype is None or dtype not in accepted:
            names = ", ".join(_ALIAS_TEXT[d] for d in accepted)
            raise UserError(f"unknown dtype {text!r}: accepted are {names}")
        return dtype

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        for d in cls:
            if d.torch == dtype:
                return d
        raise UserError(f"unsupported tensor dtype {dtype}: accepted are float32, bfloat16, float16")


_DTYPE_ALIASES = {
    "fp32": DType.fp32, "float32": DType.fp32, "float": DType.fp32,
    "bf16": DType.bf16, "bfloat16": DType.bf16,
    "fp16": DType.fp16, "float16": DType.fp16, "half": DType.fp16,
}
_ALIAS_TEXT = {DType.fp32: "fp32/float32", DType.bf16: "bf16/bfloat16", DType.fp16: "fp16/float16"}

_SHAPE_RE = re.compile(r"^[0-9]+(x[0-9]+)*$")


def bf16_patterns() -> torch.Tensor:
    """Every bf16 value, indexed by its 16-bit pattern: what a host kernel's lookup table is built
    over (a bf16 input has only these 65536)."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def parse_shape(text: str, rank: int | None = None, meaning: str = "") -> tuple[int, ...]:
    """Parse '4096x4096' into (4096, 4096): digits and 'x' only, every extent positive."""
    hint = f" (expected {meaning})" if meaning else ""
    if not _SHAPE_RE.match(text or ""):
        raise UserError(f"malformed shape {text!r}: use positive integers joined by 'x', e.g. 4096x4096{hint}")
    dims = tuple(int(d) for d in text.split("x"))
    if any(d <= 0 for d in dims):
        raise UserError(f"shape {text!r} has a non-positive extent: every extent must be >= 1{hint}")
    if any(d > 2**31 - 1 for d in dims):
        raise UserError(f"shape {text!r} has an extent above 2^31-1{hint}")
    if rank is not None and len(dims) != rank:
        raise UserError(f"shape {text!r} has {len(dims)} extents, this operator takes {rank}{hint}")
    return dims


def shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)

