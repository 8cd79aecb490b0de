"""Cross-entropy over the full vocabulary (129280 in the real configs), as the trainer computes
its loss and transformers' ForCausalLMLoss does: logits upcast to fp32, mean over the tokens that
are not ignore_index (-100).

The kernel reads each row in the logits' own dtype and reduces it in fp32, so the fp32 copy of a
whole batch of logits (and its log-softmax, and their gradients) is never materialised: forward
keeps one fp32 log-sum-exp per row, backward rebuilds softmax from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import DType
from ..errors import UserError
from ..patch.torch_op import torch_op
from ..targets.host.library import built_kernel
from .base import OpSpec, Problem, Tensors, Tolerance, Work, bind

IGNORE = -100

_TOL = {DType.fp32: {"loss": Tolerance(1e-5, 1e-5), "logits": Tolerance(1e-7, 1e-4)},
        DType.bf16: {"loss": Tolerance(1e-4, 1e-4), "logits": Tolerance(1e-5, 1.6e-2)},
        DType.fp16: {"loss": Tolerance(1e-4, 1e-4), "logits": Tolerance(1e-6, 2e-3)}}


class CrossEntropy(torch.nn.Module):
    """The reference: mean cross-entropy of fp32-upcast logits, ignore_index -100."""

    def forward(self, logits, labels):
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)


class CrossEntropySpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, vocab = problem.shape
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, vocab, (rows,), generator=g)
        labels[torch.rand(rows, generator=g) < 0.1] = IGNORE    # padding / prompt tokens
        return {"logits": (torch.randn(rows, vocab, generator=g) * 4).to(problem.dtype.torch), "labels": labels}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("logits",)

    def module_call(self, problem: Problem, inputs: Tensors):
        return CrossEntropy(), (inputs["logits"], inputs["labels"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"loss": CrossEntropy()(inputs["logits"], inputs["labels"])}

    def visible_outputs(self) -> tuple[str, ...]:
        return ("loss",)

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    def work(self, problem: Problem, backward: bool) -> Work:
        rows, vocab = problem.shape
        e = problem.dtype.itemsize
        return Work(rows * vocab * e * (2 if backward else 1), rows * vocab * (6 if backward else 8))

    def call_problem(self, module, args):
        return None   # the trainer's loss is not a module: the profiler records it from the config

    def patch(self, module: torch.nn.Module, lookup) -> None:
        bind(module, lookup, self.name, [(CrossEntropy, "forward", _module_forward)])


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


SPEC = CrossEntropySpec(
    name="cross_entropy",
    summary="mean cross-entropy over the full vocabulary, fp32 reduction without an fp32 copy of the logits",
    shape_meaning="ROWSxVOCAB: tokens x vocabulary",
    shape_rank=2,
    default_shape=(512, 129280),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)
