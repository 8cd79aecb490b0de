"""Every kernel a `torch.library.custom_op`, so torch.compile (fullgraph) and FSDP2 trace through it.

A kernel's torch binding is two plain functions over tensors, with type hints:

    forward(*args)  -> (outputs..., residuals...)
    backward(*grad_outputs, *saved_inputs, *residuals, *consts) -> (grads of `grads` inputs...)
                                       (with save_outputs, the visible outputs after the residuals;
                                        with differentiable=k, only the first k outputs' gradients)

`TorchOp` registers them as `aurakernel::<name>_fwd` and `aurakernel::<name>_bwd` (schemas from the
type hints), their fake (meta) implementations, and the autograd formula joining them: the forward
saves the named inputs and its residuals (what the backward needs that the inputs do not give, e.g.
a row statistic) and hands the named constants (the kernel's source hash, scalars) on. A backward
returns one tensor per gradient input, shaped and typed like that input (an empty tensor where the
input was None); the fake backward follows that rule unless one is given.

Eager calls take an equivalent autograd.Function straight to the same two functions: the
dispatcher of a custom op costs about 30 us more per forward + backward, which small kernels notice.
Under torch.compile the custom ops are what Dynamo sees.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

NAMESPACE = "aurakernel"


class TorchOp:
    """One kernel's forward and backward as custom ops, with autograd; call it like its forward and
    get the outputs (residuals stay inside)."""

    def __init__(self, name: str, forward: Callable, backward: Callable | None = None, *,
                 fake_forward: Callable, fake_backward: Callable | None = None, outputs: int = 1,
                 saved: tuple[str, ...] = (), consts: tuple[str, ...] = (), grads: tuple[str, ...] = (),
                 save_outputs: bool = False, differentiable: int | None = None,
                 eager_backward: Callable | None = None):
        self.name, self.outputs, self.save_outputs = name, outputs, save_outputs
        # eager calls may take a backward that reuses its residuals' memory for the gradients (the
        # custom op's must be functional for torch.compile): a residual the size of a weight is then
        # not copied once more at the peak. A second backward through the same graph is refused by
        # autograd (the residuals' version counters moved), never silently wrong
        self._eager_backward = eager_backward
        # the first `differentiable` outputs take gradients; the rest (a statistic a caller may read)
        # are not differentiated and their gradients never reach the backward
        self.differentiable = outputs if differentiable is None else differentiable
        params = list(inspect.signature(forward).parameters)
        pos = {p: i for i, p in enumerate(params)}
        unknown = [n for n in (*saved, *consts, *grads) if n not in pos]
        if unknown:
            raise TypeError(f"{name}: {unknown} are not parameters of its forward {params}")
        self._saved, self._consts, self._grads = ([pos[n] for n in names] for names in (saved, consts, grads))
        self._n_args = len(params)
        self._forward_impl, self._backward_impl = forward, backward
        self.fwd = torch.library.custom_op(f"{NAMESPACE}::{name}_fwd", forward, mutates_args=())
        self.fwd.register_fake(fake_forward)
        self.bwd = None
        if backward is not None:
            self.bwd = torch.library.custom_op(f"{NAMESPACE}::{name}_bwd", backward, mutates_args=())
            self.bwd.register_fake(fake_backward or self._default_fake_backward)
            self.fwd.register_autograd(self._custom_backward, setup_context=self._save)
            self._function = self._autograd_function()

    # --- the autograd formula, shared by both paths ---------------------------------------------
    def _split(self, output) -> tuple[tuple, tuple]:
        """A forward's result as (visible outputs, residuals)."""
        output = output if isinstance(output, tuple) else (output,)
        return output[: self.outputs], output[self.outputs:]

    @staticmethod
    def _result(outs: tuple):
        return outs if len(outs) != 1 else outs[0]

    def backward_args(self, args: tuple, output, grad_outputs: tuple) -> tuple:
        """The backward op's arguments for one forward call (args -> output) and its output
        gradients: what the autograd formula passes (for opcheck and tests)."""
        visible, residuals = self._split(output)
        return (*grad_outputs[: self.differentiable], *(args[i] for i in self._saved), *residuals,
                *self._kept(visible), *(args[i] for i in self._consts))

    def _kept(self, visible: tuple) -> tuple:
        """Of the visible outputs, those the backward gets too (save_outputs), after the residuals."""
        return visible if self.save_outputs else ()

    def _save(self, ctx, inputs, output) -> None:
        """The autograd context of one forward call (also the custom op's setup_context, which torch
        calls with these keyword names)."""
        visible, residuals = self._split(output)
        ctx.save_for_backward(*[inputs[i] for i in self._saved], *residuals, *self._kept(visible))
        if self.differentiable < self.outputs:
            ctx.mark_non_differentiable(*visible[self.differentiable:])
        ctx.consts = tuple(inputs[i] for i in self._consts)
        ctx.none_inputs = tuple(inputs[i] is None for i in self._grads)   # their gradient is None

    def _place(self, grads, none_inputs) -> tuple:
        """The backward's gradients at their inputs' positions (None for non-gradient inputs)."""
        grads = grads if isinstance(grads, tuple) else (grads,)
        out = [None] * self._n_args
        for i, g, none in zip(self._grads, grads, none_inputs):
            out[i] = None if none else g
        return tuple(out)

    def _custom_backward(self, ctx, *grad_outputs):
        grads = self.bwd(*grad_outputs[: self.differentiable], *ctx.saved_tensors, *ctx.consts)
        return self._place(grads, ctx.none_inputs)

    def _default_fake_backward(self, *args):
        """Each gradient shaped and typed like its (saved) input; an empty tensor for a None input."""
        saved = dict(zip(self._saved, args[self.differentiable: self.differentiable + len(self._saved)]))
        if any(i not in saved for i in self._grads):
            raise TypeError(f"{self.name}: give a fake_backward (a gradient input is not saved)")
        grads = tuple(saved[i].new_empty(saved[i].shape) if saved[i] is not None else args[0].new_empty(0)
                      for i in self._grads)
        return grads if len(grads) != 1 else grads[0]

    def _autograd_function(self):
        op = self

        def forward(ctx, *args):
            output = op._forward_impl(*args)
            op._save(ctx, args, output)
            outs = op._split(output)[0]
            # _save marked the outputs past `differentiable`; integer ones (indices) are marked here
            integral = [o for o in outs[: op.differentiable] if not o.is_floating_point()]
            if integral:
                ctx.mark_non_differentiable(*integral)
            return op._result(outs)

        def backward(ctx, *grad_outputs):
            grads = (op._eager_backward or op._backward_impl)(*grad_outputs[: op.differentiable],
                                                              *ctx.saved_tensors, *ctx.consts)
            return op._place(grads, ctx.none_inputs)

        # named when created: autograd names the backward node (what profiles show) after the class
        function = type(f"{self.name}_kernel", (torch.autograd.Function,),
                        {"forward": staticmethod(forward), "backward": staticmethod(backward)})
        # Function.apply's own C implementation: its Python wrapper only adds what functorch's
        # transforms need (checked at each call) and cost ~5 us of a kernel call's ~50
        self._c_apply = super(torch.autograd.Function, function).apply
        return function

    def __call__(self, *args):
        """The visible outputs: through the custom op while compiling, else the eager Function."""
        if torch.compiler.is_compiling() or self.bwd is None:
            return self._result(self._split(self.fwd(*args))[0])
        if torch._C._are_functorch_transforms_active():
            return self._function.apply(*args)
        return self._c_apply(*args)


REGISTRY: dict[str, TorchOp] = {}


def torch_op(name: str, forward: Callable, backward: Callable | None = None, **kwargs) -> TorchOp:
    """Define (once per process) and register the custom ops of one kernel binding."""
    if name in REGISTRY:
        raise ValueError(f"torch op {name!r} is already defined")
    REGISTRY[name] = op = TorchOp(name, forward, backward, **kwargs)
    return op
