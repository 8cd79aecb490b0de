"""RMSNorm kernels against transformers' modules, forward and backward, with tails."""

import pytest
import torch

from aurakernel.targets.host.build import build_kernel
from aurakernel.ops import get_op
from aurakernel.ops.base import Problem
from aurakernel.patch.rms_norm import rms_norm
from aurakernel.targets.host.target import verify
from aurakernel.targets.host.ops import kernel_of as host_kernel

SPEC = get_op("rms_norm")


def cases(shape, dtype, variant, knobs):
    problem = SPEC.problem(shape, dtype, variant)
    return problem, [(p, build_kernel(SPEC, p, knobs)) for p in host_kernel(SPEC).verification_problems(problem, knobs, 16)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("variant", ["weighted", "unweighted"])
@pytest.mark.parametrize("shape,knobs", [
    ("300x1024", {"tile_rows": 8, "col_chunk": 256, "threads": 2}),     # rows not divisible by 8 x 2
    ("37x1003", {"tile_rows": 4, "col_chunk": 64, "threads": 2}),       # width off the SIMD grid, odd rows
    ("5x64", {"tile_rows": 16, "col_chunk": 16, "threads": 1}),         # fewer rows than one tile
])
def test_forward_and_backward_match_reference(dtype, variant, shape, knobs):
    problem, kernel_cases = cases(shape, dtype, variant, knobs)
    result = verify(SPEC, kernel_cases, seeds=(0, 1, 2))
    assert result.passed, result.summary
    tensors = {c.tensor for c in result.checks}
    assert "y" in tensors and "grad_x" in tensors
    assert ("grad_weight" in tensors) == (variant == "weighted")
    shapes = {c.shape for c in result.checks}
    assert any(s[-1] % 16 for s in shapes), "a width off the SIMD grid is always checked"


class _SkipLastRow:
    """A kernel that forgets to write its last output row: poisoning must expose it."""

    def __init__(self, kernel):
        self.k, self.meta = kernel, kernel.meta

    def call(self, name, *args):
        self.k.call(name, *args)
        out = args[2] if name == "fwd" else args[4]
        out.view(-1, out.shape[-1])[-1].fill_(float("nan"))


class _OffByEps:
    """A kernel whose numbers are slightly wrong (scales y by 1.01)."""

    def __init__(self, kernel):
        self.k, self.meta = kernel, kernel.meta

    def call(self, name, *args):
        self.k.call(name, *args)
        if name == "fwd":
            args[2].mul_(1.01)


@pytest.mark.parametrize("wrapper,reason", [(_SkipLastRow, "unwritten"), (_OffByEps, "outside tolerance")])
def test_verification_catches_broken_kernels(wrapper, reason):
    knobs = {"tile_rows": 4, "col_chunk": 64, "threads": 2}
    problem, kernel_cases = cases("33x256", "fp32", "weighted", knobs)
    broken = [(p, wrapper(k)) for p, k in kernel_cases]
    result = verify(SPEC, broken, seeds=(0,))
    assert not result.passed
    assert reason in result.summary


def test_kernel_that_writes_its_input_is_caught():
    class Clobber(_OffByEps):
        def call(self, name, *args):
            self.k.call(name, *args)
            if name == "fwd":
                args[0].view(-1)[0] += 1

    knobs = {"tile_rows": 4, "col_chunk": 64, "threads": 1}
    _, kernel_cases = cases("16x64", "fp32", "weighted", knobs)
    result = verify(SPEC, [(p, Clobber(k)) for p, k in kernel_cases], seeds=(0,))
    assert not result.passed
    assert any(c.reason == "kernel wrote to an input" for c in result.checks)


def test_strided_rows_are_normalised_in_place_layout():
    """The per-head q norm sees a transposed view: rows stay rows, the output keeps the layout."""
    knobs = {"tile_rows": 4, "col_chunk": 64, "threads": 2}
    kernel = build_kernel(SPEC, Problem("rms_norm", "unweighted", (8, 64), SPEC.dtypes[0]), knobs)
    q = torch.randn(2, 5, 3, 64).transpose(1, 2).requires_grad_(True)   # [B, H, S, D] view
    ref_q = q.detach().clone().requires_grad_(True)
    y = rms_norm(q, None, 1e-6, kernel.source_hash)
    ref = SPEC.module(Problem("rms_norm", "unweighted", (1, 64), SPEC.dtypes[0]))(ref_q)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    (dq,) = torch.autograd.grad(y, q, g)
    (ref_dq,) = torch.autograd.grad(ref, ref_q, g)
    torch.testing.assert_close(dq, ref_dq, atol=1e-5, rtol=1e-4)


def test_weight_gradient_keeps_weight_dtype():
    knobs = {"tile_rows": 4, "col_chunk": 64, "threads": 2}
    problem = Problem("rms_norm", "weighted", (16, 128), SPEC.dtypes[1])   # bf16 activations
    kernel = build_kernel(SPEC, problem, knobs)
    w = torch.nn.Parameter(torch.ones(128, dtype=torch.bfloat16))
    x = torch.randn(16, 128, dtype=torch.bfloat16, requires_grad=True)
    rms_norm(x, w, 1e-6, kernel.source_hash).sum().backward()
    assert w.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16


def test_torch_compile_traces_through_the_custom_op():
    knobs = {"tile_rows": 4, "col_chunk": 64, "threads": 2}
    problem = Problem("rms_norm", "weighted", (32, 64), SPEC.dtypes[0])
    kernel = build_kernel(SPEC, problem, knobs)
    w = torch.nn.Parameter(torch.rand(64) + 0.5)
    x = torch.randn(32, 64, requires_grad=True)

    h = kernel.source_hash

    def f(x, w):
        return rms_norm(x, w, 1e-6, h) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y = compiled(x, w)
    y.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
