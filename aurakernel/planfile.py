"""The kernel plan file that `aurakernel autotune` writes and `aurakernel.apply` reads.

It lists, per (op, variant, compile-time extents, dtype), the knob values of a verified kernel
that beat the eager reference, the source hash it was verified with, and its measurements; and
the groups that were not tuned, with the reason. JSON, written atomically.
"""

from __future__ import annotations

import json
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from .version import __version__
from .errors import UserError
from .paths import read_json_object, write_text_atomic

FORMAT = 1


@dataclass
class PlanEntry:
    op: str
    variant: str
    kernel_key: list[int]        # compile-time extents (e.g. [cols] for rms_norm)
    dtype: str
    shape: str                   # the shape it was tuned and measured at
    knobs: dict[str, int]
    source_hash: str
    predicted_us: float | None = None
    measured_us: float | None = None
    eager_us: float | None = None
    compiled_us: float | None = None
    binding_constraint: str = ""

    @property
    def speedup_vs_eager(self) -> float | None:
        return self.eager_us / self.measured_us if self.eager_us and self.measured_us else None


@dataclass
class KernelPlan:
    target: str
    kernels: list[PlanEntry] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)   # {"op", "variant", "shape", "dtype", "reason"}
    profile: list[dict] = field(default_factory=list)   # the ranked op groups autotune saw
    config: str = ""
    hardware: str = ""
    aurakernel: str = __version__
    created: float = field(default_factory=time.time)
    format: int = FORMAT

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=2))   # a killed autotune leaves no half plan

    @classmethod
    def load(cls, path: str | Path) -> KernelPlan:
        return cls.from_dict(read_json_object(path, "kernel plan"), str(path))

    @classmethod
    def from_dict(cls, d: dict, where: str = "kernel plan") -> KernelPlan:
        if not isinstance(d, dict) or d.get("format") != FORMAT or "kernels" not in d:
            raise UserError(f"{where}: not an AuraKernel plan (format {FORMAT} with a 'kernels' list)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}: a plan has {', '.join(sorted(known))}")
        if not isinstance(d["kernels"], list):
            raise UserError(f"{where}: 'kernels' must be a list of entries, got {type(d['kernels']).__name__}")
        kernels = [_entry(k, i, where) for i, k in enumerate(d["kernels"])]
        rest = {k: v for k, v in d.items() if k != "kernels"}
        return cls(kernels=kernels, **rest)


def _entry(k, i: int, where: str) -> PlanEntry:
    """One kernel entry, its knobs a mapping of integers and its extents a list of integers, or a
    one-line error naming the entry and the field."""
    known = {f.name for f in fields(PlanEntry)}
    what = f"{where}: kernels[{i}]"
    if not isinstance(k, dict):
        raise UserError(f"{what}: expected an object, got {type(k).__name__}")
    missing = sorted({f.name for f in fields(PlanEntry) if f.default is MISSING} - set(k))
    unknown = sorted(set(k) - known)
    if missing or unknown:
        raise UserError(f"{what}: " + "; ".join(([f"missing {', '.join(missing)}"] if missing else [])
                                                + ([f"unknown key(s) {', '.join(map(str, unknown))}"] if unknown else [])))
    if not isinstance(k["knobs"], dict):
        raise UserError(f"{what}: knobs must map knob names to integers, got {k['knobs']!r}")
    if not isinstance(k["kernel_key"], list):
        raise UserError(f"{what}: kernel_key must be a list of integers, got {k['kernel_key']!r}")
    try:
        return PlanEntry(**{**k, "knobs": {str(n): _int(v) for n, v in k["knobs"].items()},
                            "kernel_key": [_int(v) for v in k["kernel_key"]]})
    except (TypeError, ValueError) as exc:
        raise UserError(f"{what}: {exc}") from None


def _int(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an integer, got {v!r}")
    return v
