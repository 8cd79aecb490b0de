"""The cross_entropy kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch

from ..errors import UserError
from ..ops.cross_entropy import CrossEntropy, IGNORE, SPEC
from ..targets.host.library import built_kernel
from .base import Patch, bind
from .torch_op import torch_op


def _check_labels(labels: torch.Tensor, vocab: int) -> None:
    bad = ((labels < 0) & (labels != IGNORE)) | (labels >= vocab)
    if bool(bad.any()):
        raise UserError(f"label {int(labels[bad][0])} is out of range: labels are token ids in [0, {vocab}) "
                        f"or {IGNORE} (ignored)")


def _forward(logits: torch.Tensor, labels: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, lse): the per-row logsumexp is the backward's residual. The labels are checked
    here, inside the op, so a compiled graph keeps the check without a data-dependent branch."""
    _check_labels(labels, logits.shape[-1])
    rows = logits.shape[0]
    loss_rows, lse = torch.empty(rows), torch.empty(rows)
    built_kernel(kernel).call("fwd", logits, labels, loss_rows, lse, rows)
    n_valid = int((labels != IGNORE).sum())
    return (loss_rows.sum() / n_valid if n_valid else loss_rows.sum() * float("nan")), lse


def _backward(g: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, kernel: str) -> torch.Tensor:
    d = torch.empty_like(logits)
    scale = float(g) / max(int((labels != IGNORE).sum()), 1)
    built_kernel(kernel).call("bwd", logits, labels, lse, d, logits.shape[0], scale)
    return d


OP = torch_op("cross_entropy", _forward, _backward,
              fake_forward=lambda logits, labels, kernel: (logits.new_empty((), dtype=torch.float32),
                                                           logits.new_empty(logits.shape[0], dtype=torch.float32)),
              saved=("logits", "labels"), consts=("kernel",), grads=("logits",))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, kernel: str) -> torch.Tensor:
    """Mean cross-entropy of `logits` [..., V] against `labels` [...] through the kernel."""
    vocab = logits.shape[-1]
    flat, lab = logits.reshape(-1, vocab), labels.reshape(-1).long().contiguous()
    return OP(flat.contiguous(), lab, kernel)


def _module_forward(module, logits, labels):
    kernel = module._ak_lookup((logits.shape[-1],), logits.dtype) if logits.device.type == "cpu" else None
    if kernel is None:
        return CrossEntropy.forward(module, logits, labels)
    return cross_entropy(logits, labels, kernel)


class LossPatch(Patch):
    """A loss kernel's patch: its reference module's forward replaced by `forward`. The trainer's
    loss is no module of the model: the trainer calls the kernel itself, the profiler records its
    problem from the config, and the module is patched only where kernels are timed against it."""

    def __init__(self, spec, module_class: type[torch.nn.Module], forward):
        super().__init__(spec)
        self.module_class, self.forward = module_class, forward

    def call_problem(self, module, args):
        return None

    def patch(self, module: torch.nn.Module, lookup) -> None:
        bind(module, lookup, self.spec.name, [(self.module_class, "forward", self.forward)])


PARTS = (LossPatch(SPEC, CrossEntropy, _module_forward),)
