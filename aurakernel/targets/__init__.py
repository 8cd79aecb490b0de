"""Targets: where a kernel runs. One package per target behind one protocol (Target): host (C with
OpenMP, built and timed on this CPU) and ascend (AscendC op projects, verified and estimated in the
emulator; built for real where CANN is). Each has its per-operator kernels under
targets/<target>/ops/<op>.py and its helpers beside them; the operator definitions they implement
live in aurakernel/ops/. The tune loop (agent.py) looks a target up by its profile's kind.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import UserError

if TYPE_CHECKING:
    from ..hardware import HardwareProfile
    from ..ops.base import OpSpec, Problem
    from .result import TuneResult


class Target(Protocol):
    kind: str
    swappable: bool        # its kernels run in this process: `apply` can swap them into a model
    writes_projects: bool  # `tune --out` / `autotune --out` take a folder that receives its sources
    times_nothing_here: bool   # its tune estimates instead of timing on this CPU: autotune runs problems side by side

    def supported(self, spec: OpSpec) -> bool:
        """Whether the operator has a kernel for this target."""

    def profiling_hardware(self, hw: HardwareProfile) -> HardwareProfile:
        """The machine autotune profiles the training step on (this one, for a target it cannot run)."""

    def tune(self, spec: OpSpec, problem: Problem, hw: HardwareProfile, *, target: str, solver: str,
             with_compiled: bool, with_compiled_kernel: bool = False, out_dir: Path | None = None,
             with_memory: bool = False, candidates: int = 1) -> TuneResult:
        """Plan, render, build, verify and measure (or estimate) one problem; with_memory, each
        measured candidate's peak memory too (TuneResult.peak_bytes); candidates > 1, the planner's
        that many best tilings timed (on an Ascend target: estimated) side by side, the fastest
        verified one kept."""

    def predicted_us(self, spec: OpSpec, problem: Problem, hw: HardwareProfile) -> float:
        """The planner's forward + backward time of the problem's kernel (no build, no run)."""

    def time_fused_against_apart(self, spec: OpSpec, problem: Problem, fused_hash: str, part_hashes: dict[str, str],
                                 hw: HardwareProfile) -> dict[str, float] | None:
        """A fused kernel ("fused") and its parts' kernels one after the other ("apart"), fwd + bwd
        timed side by side in microseconds; None where this target times nothing here."""


# profile kind -> the module whose TARGET implements it (imported on first use: each pulls in its kernels)
TARGETS = {"host": "aurakernel.targets.host.target", "ascend": "aurakernel.targets.ascend"}


def target_for(hw: HardwareProfile) -> Target:
    module = TARGETS.get(hw.kind)
    if module is None:
        raise UserError(f"profile {hw.name!r} is of kind {hw.kind!r}: kernels can be built for kinds "
                        f"{', '.join(TARGETS)}")
    return import_module(module).TARGET
