"""AscendKernel: what one operator's AscendC kernel tells the Ascend target.

The target (targets/ascend/__init__.py) plans the kernel's UB partition from its `phases` (per-phase
UB and pipe work of the kernel as rows x cols), renders templates/ascendc/<template_dir>/ with its
`params`, and runs it in the emulator with `run`. A kernel whose template renders the solved
pipeline schedule (planner/schedule.py) declares `compute_waits_scalar`; the plan then carries
<phase>_prefetch and <phase>_<queue>_buffers knobs, and the plain CopyIn / Compute / CopyOut order
is the fallback.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

from ...ops.base import Problem, Tensors
from ...parts import Part, Registry
from ...planner.ascend import CubeWork, VectorWork
from ...planner.model import ChoiceModel, Constraint, Phase


# operator name -> its kernel: the built-in ones (ops/__init__.py) and those registered from outside
KERNELS: Registry[AscendKernel] = Registry("an AscendC kernel", "has no AscendC kernel yet")


class AscendKernel(Part, ABC):
    registry = KERNELS
    split_cols: ClassVar[bool] = False   # the kernel streams a row in column tiles (rows wider than the UB)
    # the kernel takes any multiple of this many tile rows, not only powers of two (None: powers of two)
    tile_rows_step: ClassVar[int | None] = None
    # {phase: whether its compute step ends in scalar waits} for a template that renders the solved
    # pipeline schedule; None: the plain CopyIn / Compute / CopyOut order
    compute_waits_scalar: ClassVar[dict[str, bool] | None] = None
    # another operator's folder under templates/ascendc/ this kernel renders (mhc_head: mhc_pre's)
    template_dir: ClassVar[str | None] = None
    # the kernel's blocks meet in SyncAll: its launch is in batch mode (the tiling's SetScheduleMode(1),
    # rendered where the template's batch_mode is set, and the emulator's launch) and it declares the mix type
    syncs_cores: ClassVar[bool] = False
    # the operator's variants the kernel computes (None: all of them); plan() refuses the others by name
    variants: ClassVar[tuple[str, ...] | None] = None

    @property
    def folder(self) -> str:
        """The kernel's folder under templates/ascendc/."""
        return self.template_dir or self.spec.name

    @abstractmethod
    def phases(self, problem: Problem) -> list:
        """The planner's per-phase UB and pipe work (planner.ascend.AscendRowPhase)."""

    @abstractmethod
    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        """Typed values (int, float, bool, DType) handed to the templates."""

    def profile_params(self, problem: Problem, knobs: dict[str, int], hw) -> dict:
        """Template values that also depend on the profile's pipe figures (beside `params`); none by default."""
        return {}

    @abstractmethod
    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""

    def vector_floor(self, problem: Problem) -> dict[str, VectorWork]:
        """Per phase of `run`'s reports, the vector work the math cannot avoid (counted per element
        from the formulas, not from the template). Where it exceeds the phase's HBM traffic the phase
        is vector-bound and its roofline is that work; by default none (every phase HBM-bound)."""
        return {}

    def cube_model(self, problem: Problem, hw) -> ChoiceModel | None:
        """For a kernel with Cube phases (a mixed launch), the tiling model of those (their knobs beside
        the row-wise model's, planned by the same solver); None: every phase is row-wise on the vector cores."""
        return None

    def cube_backward(self, problem: Problem) -> bool:
        """Whether the backward runs on the Cube too (then `backward_model` is a phase of cube_model)."""
        return False

    def backward_model(self, problem: Problem, hw, domains: dict) -> tuple[Phase, list[Constraint]]:
        """The Cube backward's phase and its constraints (its knobs added to `domains`)."""
        raise NotImplementedError(f"{self.spec.name}: no Cube backward")

    def cube_choice_model(self, problem: Problem, hw, domains: dict, forward: Phase,
                          constraints: list[Constraint]) -> ChoiceModel:
        """cube_model's result: the forward's phase, and the backward's where it runs on the Cube."""
        phases = [forward]
        if self.cube_backward(problem):
            backward, more = self.backward_model(problem, hw, domains)
            phases.append(backward)
            constraints = constraints + more
        return ChoiceModel(domains, constraints, phases)

    def cube_floor(self, problem: Problem) -> dict[str, CubeWork]:
        """Per phase, the MACs of the matmuls its math needs, for a kernel that runs them on the Cube:
        where those at the Cube's peak exceed the phase's HBM traffic it is Cube-bound."""
        return {}

    def col_tiles(self, problem: Problem) -> list[int] | None:
        """The column tiles the kernel accepts; None: the planner's own (the whole row, or powers of two)."""
        return None

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        """The kernel's work as rows x cols for the planner: by default every dimension but the last are rows."""
        return math.prod(problem.shape[:-1]), problem.shape[-1]

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """For a (rows, cols) row-wise kernel: the plan's width with rows that leave a tail core and a
        tail tile, and a width that is not a multiple of 16 elements (the kernel takes any width)."""
        rows, cols = problem.shape
        tail_rows = min(rows, 2 * knobs["block_dim"] + 3)
        odd = cols + 3 if cols % 16 == 0 else cols
        return [Problem(problem.op, problem.variant, (tail_rows, cols), problem.dtype),
                Problem(problem.op, problem.variant, (min(rows, knobs["block_dim"] + 5), odd), problem.dtype)]
