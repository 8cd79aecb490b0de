"""TuneResult: what tuning one problem on any target found (one type for every target)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ops.base import Problem
from ..planner import Plan
from ..verify import Verification


@dataclass
class TuneResult:
    problem: Problem
    target: str
    plan: Plan
    source_hash: str | None
    verification: Verification | None
    measured_us: float | None = None
    eager_us: float | None = None
    compiled_us: float | None = None
    aurakernel_compiled_us: float | None = None   # the kernel inside torch.compile (bench only)
    peak_bytes: dict = field(default_factory=dict)   # candidate -> allocator high-water mark of a fwd+bwd (bench only)
    status: str = "ok"
    reasons: list[str] = field(default_factory=list)
    # targets that estimate instead of run (AscendC in the emulator): the cycle estimate per phase
    # and its totals, and the op project's folder when one was written
    estimate: dict | None = None
    project_dir: str | None = None
    project_name: str | None = None   # its libraries' and torch ops' name (libak_<name>_ops.so, torch.ops.aurakernel.<name>_*)
    build_error: str | None = None   # the compiler's message when the build failed (recorded in the DB)
    # a fused kernel (OpSpec.fuses) against its parts' kernels one after the other, timed side by side
    # by autotune: {"fused": us, "apart": us}
    against_apart: dict | None = None

    @property
    def verified(self) -> bool:
        return bool(self.verification and self.verification.passed)

    @property
    def speedup_vs_eager(self) -> float | None:
        return self.eager_us / self.measured_us if self.eager_us and self.measured_us else None

    @property
    def speedup_vs_compiled(self) -> float | None:
        return self.compiled_us / self.measured_us if self.compiled_us and self.measured_us else None

    @property
    def usable(self) -> bool:
        """Safe and worth swapping in: verified and faster than eager."""
        return self.status == "ok"

    def to_json(self) -> dict:
        p = self.problem
        return {
            "op": p.op, "variant": p.variant, "shape": p.shape_text, "dtype": p.dtype.value, "target": self.target,
            "plan": self.plan.knobs, "binding_constraint": self.plan.binding_constraint,
            "predicted_us": self.plan.predicted_us, "predicted_pipes_us": self.plan.pipes_us,
            "measured_us": self.measured_us, "eager_us": self.eager_us, "compiled_us": self.compiled_us,
            "speedup_vs_eager": self.speedup_vs_eager, "speedup_vs_compiled": self.speedup_vs_compiled,
            "verified": self.verified,
            "verification": self.verification.summary if self.verification else None,
            "solver": self.plan.solver, "solve_s": self.plan.solve_s,
            "source_hash": self.source_hash, "status": self.status, "reasons": self.reasons,
        } | (self.estimate or {}) | ({"project_dir": self.project_dir, "project_name": self.project_name}
                                     if self.estimate is not None else {})
