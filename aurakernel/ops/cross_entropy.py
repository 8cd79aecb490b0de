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
from .base import OpSpec, Problem, Tensors, Tolerance, Work

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

SPEC = CrossEntropySpec(
    name="cross_entropy",
    summary="mean cross-entropy over the full vocabulary, fp32 reduction without an fp32 copy of the logits",
    shape_meaning="ROWSxVOCAB: tokens x vocabulary",
    shape_rank=2,
    default_shape=(512, 129280),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)
