"""The LM head and the loss in one: mean cross-entropy of `hidden @ weight^T` against the labels,
as the trainer computes it (transformers' lm_head, logits upcast to fp32, ignore_index -100).

Unfused, a step holds the whole [tokens, vocab] logits several times over (129280 wide in V4: the
bf16 logits, their fp32 copy, the log-softmax, its gradient, the gradient in bf16: 10 GB at 4096
tokens). A fused kernel computes them a chunk of tokens at a time and never holds more than one
chunk: the logits of the chunk, the loss of its rows and their gradient in place of the logits,
then the chunk's share of the hidden-state and weight gradients. The backward work is done in the
forward (the loss is a scalar: its backward only scales what the forward computed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work
from .cross_entropy import IGNORE

# bf16 gradients: the unfused reference's own error against an fp64 computation is about 1% of the
# gradients' largest magnitude (0.0007 of 0.07 at 37x40x5003: bf16 logits, bf16 d logits, bf16 GEMM
# outputs), and the kernel's is the same; two such results differ by up to twice that
_TOL = {DType.fp32: {"loss": Tolerance(1e-5, 1e-5), "hidden": Tolerance(1e-6, 1e-4), "weight": Tolerance(1e-6, 1e-4)},
        DType.bf16: {"loss": Tolerance(1e-3, 1e-3), "hidden": Tolerance(2e-3, 2e-2), "weight": Tolerance(2e-3, 2e-2)}}


def reference_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What the trainer computes without the kernel: lm_head, then the loss over fp32 logits."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)


class LinearCrossEntropy(torch.nn.Module):
    """The reference: the LM head (no bias) and the mean cross-entropy of its fp32-upcast logits."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=dtype))

    def forward(self, hidden, labels):
        return reference_loss(hidden, self.weight, labels)


class LinearCrossEntropySpec(OpSpec):
    covers_group = True   # the profiler's cross_entropy group: the LM head and the loss
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        tokens, hidden, vocab = problem.shape
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, vocab, (tokens,), generator=g)
        labels[torch.rand(tokens, generator=g) < 0.1] = IGNORE    # padding / prompt tokens
        # logits of about 4 standard deviations, as a trained head gives
        return {"hidden": torch.randn(tokens, hidden, generator=g).to(problem.dtype.torch),
                "weight": (torch.randn(vocab, hidden, generator=g) * (4 / hidden**0.5)).to(problem.dtype.torch),
                "labels": labels}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("hidden", "weight")

    def module(self, problem: Problem, inputs: Tensors) -> LinearCrossEntropy:
        _, hidden, vocab = problem.shape
        mod = LinearCrossEntropy(hidden, vocab, problem.dtype.torch)
        with torch.no_grad():
            mod.weight.copy_(inputs["weight"])
        return mod

    def module_call(self, problem: Problem, inputs: Tensors):
        return self.module(problem, inputs), (inputs["hidden"], inputs["labels"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"loss": reference_loss(inputs["hidden"], inputs["weight"], inputs["labels"])}

    def visible_outputs(self) -> tuple[str, ...]:
        return ("loss",)

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    def work(self, problem: Problem, backward: bool) -> Work:
        """The minimum: hidden and weight read, their gradients written; the logits never reach
        memory. Three GEMMs (logits, hidden and weight gradients), all done in the forward."""
        tokens, hidden, vocab = problem.shape
        e = problem.dtype.itemsize
        if backward:   # scaling the gradients the forward computed by the loss's gradient
            return Work(2 * (tokens + vocab) * hidden * e, (tokens + vocab) * hidden)
        return Work(2 * (tokens + vocab) * hidden * e, 6 * tokens * hidden * vocab + 8 * tokens * vocab)


SPEC = LinearCrossEntropySpec(
    name="linear_cross_entropy",
    summary="LM head + cross-entropy in token chunks: the [tokens, vocab] logits are never held whole",
    shape_meaning="TOKENSxHIDDENxVOCAB: tokens x hidden width x vocabulary",
    shape_rank=3,
    default_shape=(1024, 1024, 16384),
    dtypes=(DType.fp32, DType.bf16),
    variants=("default",),
)
