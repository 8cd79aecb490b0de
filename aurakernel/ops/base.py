"""OpSpec: what one operator is, independent of any target.

An OpSpec says what the operator computes (its reference: the transformers code it replaces),
which problems (shape, dtype, variant) it accepts, how to make inputs for one, how much memory
traffic and arithmetic it needs at minimum (for the roofline and the cost model) and how closely a
kernel must match the reference. How a target computes it lives in targets/<target>/ops/<op>.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..dtypes import DType, parse_shape, shape_text
from ..errors import UserError

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Work:
    """Minimum traffic and arithmetic of one call: what a perfectly fused kernel must do.
    `in_place_bytes`: the part of bytes_moved that is memory read and written back where it lies
    (an optimizer's state), which streams at the machine's in-place rate, not a copy's."""

    bytes_moved: int
    flops: int
    in_place_bytes: int = 0

    def floor_seconds(self, hw) -> float:
        """The traffic's time at the calibrated rates: the in-place part at the in-place rate, the
        rest at the stream (copy) rate."""
        rest = self.bytes_moved - self.in_place_bytes
        return rest / hw.stream_bandwidth(hw.cores) + self.in_place_bytes / hw.inplace_bandwidth(hw.cores)

    @property
    def intensity(self) -> float:
        return self.flops / max(self.bytes_moved, 1)


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


@dataclass(frozen=True)
class Problem:
    """One tuning problem: operator, variant, shape, dtype. Hashable; the DB and plans key on it."""

    op: str
    variant: str
    shape: tuple[int, ...]
    dtype: DType

    @property
    def shape_text(self) -> str:
        return shape_text(self.shape)

    def describe(self) -> str:
        suffix = "" if self.variant == "default" else f"[{self.variant}]"
        return f"{self.op}{suffix} {self.shape_text} {self.dtype.value}"


@dataclass
class OpSpec(ABC):
    name: str
    summary: str
    shape_meaning: str                 # what each extent of --shape means, e.g. "ROWSxCOLS"
    shape_rank: int
    default_shape: tuple[int, ...]
    dtypes: tuple[DType, ...]
    variants: tuple[str, ...]

    # --- problems -----------------------------------------------------------------------------
    @property
    def default_dtype(self) -> DType:
        """bf16 where the operator takes it (V4 trains in it), else its first dtype."""
        return DType.bf16 if DType.bf16 in self.dtypes else self.dtypes[0]

    def problem(self, shape_text_: str | None, dtype_text: str | None = None, variant: str | None = None) -> Problem:
        """The problem of CLI-style arguments; None: the operator's default shape / dtype / variant
        (an empty shape is malformed, not the default)."""
        dtype = DType.parse(dtype_text, self.dtypes) if dtype_text is not None else self.default_dtype
        variant = variant or self.variants[0]
        if variant not in self.variants:
            raise UserError(f"unknown variant {variant!r} of {self.name}: accepted are {', '.join(self.variants)}")
        shape = (parse_shape(shape_text_, self.shape_rank, self.shape_meaning)
                 if shape_text_ is not None else self.default_shape_for(variant))
        self.check_shape(shape)
        return Problem(self.name, variant, tuple(shape), dtype)

    def default_shape_for(self, variant: str) -> tuple[int, ...]:
        """The shape `tune` uses without --shape (V4-Flash widths, rows scaled to run in seconds)."""
        return self.default_shape

    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Operator-specific limits on a shape; raise UserError naming what is accepted."""

    @abstractmethod
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        """The extents baked into a kernel at compile time (others are runtime arguments)."""

    # --- semantics ----------------------------------------------------------------------------
    @abstractmethod
    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        """Fresh random inputs (and parameters) for one check."""

    @abstractmethod
    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        """Names of the inputs that receive gradients."""

    @abstractmethod
    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        """Outputs computed by the code the kernel replaces (autograd-enabled)."""

    @abstractmethod
    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        ...

    # --- cost ---------------------------------------------------------------------------------
    @abstractmethod
    def work(self, problem: Problem, backward: bool) -> Work:
        ...

    def grad_slack(self, problem: Problem, inputs: Tensors, grad_outputs: Tensors) -> Tensors:
        """Per-element extra allowance on gradients where the reference itself is discontinuous (a
        ReLU at a product that is zero to rounding: either side's gradient is right). Default none."""
        return {}

    def visible_outputs(self) -> tuple[str, ...]:
        """Outputs the reference also produces (the rest, e.g. saved statistics, are internal)."""
        return ("y",)

    def grad_outputs(self) -> tuple[str, ...]:
        """The visible outputs a gradient flows back through (not, e.g., integer indices)."""
        return self.visible_outputs()

    # folders searched for this operator's templates after templates/ (a third-party operator's own)
    template_dirs: ClassVar[tuple] = ()
    # the kernel replaces the matmuls of its scope too (the sparse attention's q k^T and p v): the
    # modeled profile takes them out of the matmul bucket where the kernel runs
    fuses_matmuls: ClassVar[bool] = False
    # the kernel computes its whole profiler group (linear_cross_entropy: the LM head and the loss),
    # so the group's planned time is its alone, not added to the other kernels of the group
    covers_group: ClassVar[bool] = False
    # the operators one call of this kernel computes together, across profiler groups (mhc_post_pre:
    # an mhc_post and the mhc_pre after it): its problems are listed beside theirs, which already
    # count for their groups' planned time, so its own is not added
    fuses: ClassVar[tuple[str, ...]] = ()

    # --- the reference as a module: timing uses the same nn.Module path the trainer runs ---------
    @abstractmethod
    def module_call(self, problem: Problem, inputs: Tensors) -> tuple[torch.nn.Module, tuple]:
        """The reference module loaded with the inputs' parameters, and the args to call it with."""

    def module_steps(self, problem: Problem):
        """The reference module for one set of inputs, and step_of(module) -> a zero-argument
        forward + backward through that module (or a patched copy of it) on those inputs."""
        inputs = self.make_inputs(problem, seed=1234)
        module, args = self.module_call(problem, inputs)
        diff_ids = {id(inputs[name]) for name in self.differentiable(problem) if name in inputs}
        # only the differentiable inputs need gradients (rope's cos/sin, for one, never do)
        args = tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and id(a) in diff_ids else a
                     for a in args)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        with torch.no_grad():
            out = module(*args)
        outs = list(out) if isinstance(out, tuple | list) else [out]
        grad_out = [torch.randn_like(o) for o in outs[: len(self.grad_outputs())]]

        def step_of(mod):
            wrt = leaves + list(mod.parameters())

            def step():  # grads are returned, never accumulated into .grad: same work for every candidate
                o = mod(*args)
                os_ = list(o) if isinstance(o, tuple | list) else [o]
                return torch.autograd.grad(os_[: len(grad_out)], wrt, grad_out, allow_unused=True)
            return step
        return module, step_of
