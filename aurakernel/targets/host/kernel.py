"""HostKernel: what one operator's C kernel (templates/host/<op>.c.j2) tells the host target.

The target plans the kernel's knobs from its `tiling_problem` (a MILP over this machine's caches
and cores), renders the template with `render_params`, builds it (library.py) and calls its C
`entries` through `run_forward` / `run_backward` on preallocated buffers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from ...ops.base import Problem, Tensors
from ...parts import Part, Registry
from .library import Entry, Kernel

if TYPE_CHECKING:
    from ...hardware import HardwareProfile
    from ...planner.tiling import TilingProblem


# operator name -> its kernel: the built-in ones (ops/__init__.py) and those registered from outside
KERNELS: Registry[HostKernel] = Registry("a host kernel", "has no host kernel")


class HostKernel(Part, ABC):
    registry = KERNELS
    entries: ClassVar[dict[str, Entry]] = {}     # the C entry points, by the name run_* call them with
    knob_docs: ClassVar[dict[str, str]] = {}     # what each planned knob means
    # the template can write its outputs by streaming stores (_stream.h.j2; rowwise_model's `stream`
    # knob, given streamed=streams_outputs): tune times both values (measured_knobs), as the model
    # cannot tell how much of a kernel waits on memory on a given CPU
    streams_outputs: ClassVar[bool] = False

    def template(self) -> str:
        """Template path under templates/ (or a spec's own template_dirs)."""
        return f"host/{self.spec.name}.c.j2"

    @abstractmethod
    def tiling_problem(self, problem: Problem, hw: HardwareProfile) -> TilingProblem:
        """The knobs and their cost / capacity model on `hw` (the planner's input)."""

    @abstractmethod
    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict[str, Any]:
        """Typed values (int, float, bool, DType) handed to the template."""

    @abstractmethod
    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        """Output buffers (forward outputs and whatever the backward needs saved)."""

    @abstractmethod
    def run_forward(self, kernel: Kernel, inputs: Tensors, outputs: Tensors) -> None:
        """Call the kernel's forward entry, writing into preallocated `outputs`."""

    @abstractmethod
    def run_backward(self, kernel: Kernel, inputs: Tensors, outputs: Tensors,
                     grad_outputs: Tensors, grads: Tensors) -> None:
        """Call the backward entry, writing into preallocated `grads` (one per differentiable input)."""

    def measured_knobs(self, problem: Problem) -> tuple[str, ...]:
        """Knobs of the tiling model whose values its costs cannot rank on this CPU (e.g. a table
        lookup against evaluating a function: it depends on the machine's loads). tune builds every
        value of each, the rest of the plan held, and keeps the fastest timed side by side."""
        return ("stream",) if self.streams_outputs else ()

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        """The tuned shape plus tails: rows not divisible by tile x threads, a width off the SIMD grid."""
        rows, cols = problem.shape[0], problem.shape[-1]
        tail_rows = knobs.get("tile_rows", 1) * knobs.get("threads", 1) * 3 + 1
        odd_cols = cols + 5 if cols % simd_elems == 0 else cols
        out = [problem, Problem(problem.op, problem.variant, (min(rows, tail_rows),) + problem.shape[1:], problem.dtype)]
        if odd_cols != cols:
            out.append(Problem(problem.op, problem.variant, (min(rows, tail_rows),) + problem.shape[1:-1] + (odd_cols,),
                               problem.dtype))
        return out
