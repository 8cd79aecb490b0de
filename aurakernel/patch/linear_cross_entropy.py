"""The linear_cross_entropy kernel in a model: its torch op (custom op with autograd and fake
registrations), the patched reference module, and the call the trainer's loss makes."""

from __future__ import annotations

import torch

from ..ops.linear_cross_entropy import SPEC, LinearCrossEntropy
from ..targets.host.library import built_kernel
from ..targets.host.ops.linear_cross_entropy import forward as chunked_forward
from .cross_entropy import LossPatch, _check_labels
from .torch_op import torch_op


def _forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, and the residuals: the gradients of hidden and weight, for a loss gradient of 1)."""
    _check_labels(labels, weight.shape[0])
    k = built_kernel(kernel)
    return chunked_forward(k, hidden, weight, labels, k.meta["chunk_rows"])


def _backward(g: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    return dhidden * g, dweight * g


def _backward_in_place(g: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor,
                       kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager: the residuals become the gradients (scaled in place, not at all for a gradient of 1),
    so the weight gradient exists once at the peak, not twice."""
    if float(g) != 1.0:
        dhidden.mul_(g)
        dweight.mul_(g)
    return dhidden, dweight


OP = torch_op("linear_cross_entropy", _forward, _backward, eager_backward=_backward_in_place,
              fake_forward=lambda hidden, weight, labels, kernel: (hidden.new_empty((), dtype=torch.float32),
                                                                   torch.empty_like(hidden), torch.empty_like(weight)),
              fake_backward=lambda g, dhidden, dweight, kernel: (torch.empty_like(dhidden), torch.empty_like(dweight)),
              consts=("kernel",), grads=("hidden", "weight"))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, kernel: str) -> torch.Tensor:
    """Mean cross-entropy of `hidden` [..., H] @ `weight`^T [V, H] against `labels` [...], the
    logits a chunk at a time (never whole)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    return OP(flat, weight.contiguous(), labels.reshape(-1).long().contiguous(), kernel)


def _module_forward(module, hidden, labels):
    kernel = (module._ak_lookup((hidden.shape[-1], module.weight.shape[0]), hidden.dtype)
              if hidden.device.type == "cpu" else None)
    if kernel is None:
        return LinearCrossEntropy.forward(module, hidden, labels)
    return linear_cross_entropy(hidden, module.weight, labels, kernel)


PARTS = (LossPatch(SPEC, LinearCrossEntropy, _module_forward),)
