"""The grouped_linear kernel in a model: its torch ops (custom ops with autograd and fake
registrations) and the experts' calls of transformers' `_grouped_linear` made to reach it."""

from __future__ import annotations

import functools

import torch

from ..ops.grouped_linear import SPEC, SWAP, GroupedLinearReference, call_problem  # noqa: F401 - the profiler's recorder
from ..targets.host.library import built_kernel
from .base import Patch
from .experts import swap_into_experts
from .torch_op import torch_op


def _forward(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, kernel: str) -> torch.Tensor:
    x = x.contiguous()
    y = x.new_empty(x.shape[0], weight.shape[1])
    built_kernel(kernel).run_forward({"x": x, "weight": weight.detach().contiguous(), "offsets": offsets.contiguous()},
                                     {"y": y})
    return y


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    grads = {"x": torch.empty_like(x), "weight": torch.empty_like(weight, memory_format=torch.contiguous_format)}
    built_kernel(kernel).run_backward({"x": x, "weight": weight.detach().contiguous(), "offsets": offsets.contiguous()},
                                      {}, {"y": dy.contiguous()}, grads)
    return grads["x"], grads["weight"]


def _fake_forward(x, weight, offsets, kernel):
    return x.new_empty(x.shape[0], weight.shape[1])


def _fake_backward(dy, x, weight, offsets, kernel):
    return torch.empty_like(x), torch.empty_like(weight)


OP = torch_op("grouped_linear", _forward, _backward, fake_forward=_fake_forward, fake_backward=_fake_backward,
              saved=("x", "weight", "offsets"), consts=("kernel",), grads=("x", "weight"))


def runs_kernel(input, weight, offs, bias, is_transposed) -> bool:
    """Whether a call can take the kernel: fp32 on the CPU without autocast, no bias, W as [experts,
    OUT, IN] and one int32 offset per expert."""
    return (bias is None and not is_transposed and input.device.type == "cpu" and input.dim() == 2
            and weight.dim() == 3 and input.dtype == weight.dtype == torch.float32 and input.shape[1] == weight.shape[2]
            and offs.dtype == torch.int32 and offs.dim() == 1 and offs.shape[0] == weight.shape[0]
            and not torch.is_autocast_enabled("cpu"))


def dispatch(lookup, input, weight, offs, bias=None, is_transposed=False):
    """`_grouped_linear` in a patched module: the kernel planned for (IN, OUT) where one fits the
    call, else transformers' own."""
    if runs_kernel(input, weight, offs, bias, is_transposed):
        kernel = lookup((weight.shape[2], weight.shape[1]), input.dtype)
        if kernel is not None:
            return OP(input, weight, offs, kernel)
    return SWAP.reference(input, weight, offs, bias=bias, is_transposed=is_transposed)


class GroupedLinearPatch(Patch):
    def call_problem(self, module, args):
        return None   # a function, not a module: the profiler records it through SWAP.recording

    def patch(self, module: torch.nn.Module, lookup) -> None:
        """The experts (their grouped_mm forward, patch/experts.py's, which calls `_grouped_linear` by
        its module-level name) or GroupedLinearReference call the kernel."""
        swap_into_experts(module, self.spec.name, GroupedLinearReference,
                          _grouped_linear=functools.partial(dispatch, lookup))


PARTS = (GroupedLinearPatch(SPEC),)
