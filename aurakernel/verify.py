"""Prove a kernel equal to its reference, forward and backward.

Rules (from KernelBench-style evaluators that were gamed): fresh random inputs for every seed;
output and gradient buffers poisoned with NaN before the kernel runs, so an output it forgets to
write fails; shapes that exercise tails (rows not divisible by tile x threads, widths that are not a
multiple of the SIMD width); inputs checked unchanged afterwards; the reference computed
independently with autograd. An element passes when |kernel - ref| <= atol * s + rtol * |ref|,
s = max(1, rms(ref)): the atol follows the tensor's scale, since gradients of a norm grow with rstd.
The reference rounds too (bf16 intermediates of 80 and more carry errors of 0.1 and more): an
element outside that bound still passes when the kernel is within it of the exact result, the
reference recomputed in float64, widened by the reference's own error there. A kernel is held to
the accuracy of the code it replaces, not to that code's rounding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .ops.base import OpSpec, Problem

SEEDS = (0, 1, 2)


@dataclass
class Check:
    shape: tuple[int, ...]
    seed: int
    tensor: str          # "y" (forward output) or "grad_<input>"
    max_abs_err: float
    max_rel_err: float
    passed: bool
    reason: str = ""


@dataclass
class Verification:
    passed: bool
    checks: list[Check] = field(default_factory=list)

    @property
    def summary(self) -> str:
        failed = [c for c in self.checks if not c.passed]
        if not failed:
            shapes = sorted({c.shape for c in self.checks})
            return f"passed {len(self.checks)} checks over shapes {shapes} and seeds {sorted({c.seed for c in self.checks})}"
        c = failed[0]
        return (f"FAILED {len(failed)}/{len(self.checks)} checks; first: {c.tensor} at shape {c.shape} seed {c.seed}: "
                f"{c.reason or f'max abs err {c.max_abs_err:.3g}'}")

    def to_dict(self) -> dict:
        return {"passed": self.passed, "summary": self.summary, "checks": [asdict(c) for c in self.checks]}


def _allowed(r: torch.Tensor, atol: float, rtol: float, slack: torch.Tensor | None) -> torch.Tensor:
    """atol * max(1, RMS(ref)) + rtol * |ref| (+ slack), per element of the float64 reference r."""
    scale = max(1.0, float(r.pow(2).mean().sqrt())) if r.numel() else 1.0
    return atol * scale + rtol * r.abs() + (slack.double() if slack is not None else 0.0)


def _finite_part(truth: torch.Tensor, tensors: tuple, slack: torch.Tensor | None):
    """Where `truth` is infinite (masked scores) the output (tensors[0]) must be that same infinity:
    (how many are not, the tensors and slack at truth's finite elements, compared as numbers)."""
    infinite = torch.isinf(truth)
    if not infinite.any():
        return 0, tensors, slack
    wrong = int((tensors[0][infinite] != truth[infinite]).sum())
    return wrong, tuple(t[~infinite] for t in tensors), slack[~infinite] if slack is not None else None


def compare(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float,
            slack: torch.Tensor | None = None) -> tuple[float, float, bool, str]:
    """Max abs/rel error and whether every element is within atol * RMS(ref) + rtol * |ref| (+ slack:
    a per-element allowance where the math is discontinuous, see OpSpec.grad_slack)."""
    if out.shape != ref.shape:
        return float("inf"), float("inf"), False, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    o, r = out.detach().double(), ref.detach().double()
    if torch.isnan(o).any() and not torch.isnan(r).any():
        n = int(torch.isnan(o).sum())
        return float("nan"), float("nan"), False, f"{n} elements left unwritten or NaN (poisoned buffer)"
    n, (o, r), slack = _finite_part(r, (o, r), slack)
    if n:
        return float("inf"), float("inf"), False, f"{n} elements differ where the reference is infinite"
    err = (o - r).abs()
    ok = bool((err <= _allowed(r, atol, rtol, slack)).all())
    rel = float((err / r.abs().clamp_min(1e-12)).max()) if r.numel() else 0.0
    return float(err.max()) if err.numel() else 0.0, rel, ok, "" if ok else "outside tolerance"


def within_reference_error(out: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, atol: float, rtol: float,
                           slack: torch.Tensor | None = None) -> bool:
    """Every element within compare's bound of the exact result, plus the reference's distance from it."""
    if exact.shape != out.shape or torch.isnan(out).any():
        return False
    x = exact.detach().double()
    n, (o, r, x), slack = _finite_part(x, (out.detach().double(), ref.detach().double(), x), slack)
    if n:
        return False
    return bool(((o - x).abs() <= _allowed(r, atol, rtol, slack) + (r - x).abs()).all())


def _exact(spec: OpSpec, problem: Problem, inputs, grad_out, diff) -> tuple[dict, dict] | None:
    """The reference's outputs and gradients computed in float64 (None where it cannot run in it)."""
    wide = {k: (v.double() if v.is_floating_point() else v.clone()) for k, v in inputs.items()}
    for k in diff:
        wide[k].requires_grad_(True)
    try:
        out = spec.reference(problem, wide)
        with_grad = spec.grad_outputs()
        grads = (torch.autograd.grad([out[k] for k in with_grad], [wide[k] for k in diff],
                                     [grad_out[k].double() for k in with_grad], allow_unused=True) if diff else ())
    except (RuntimeError, TypeError):   # a reference whose modules hold parameters in one dtype
        return None
    return out, dict(zip(diff, grads))


def check_case(spec: OpSpec, problem: Problem, seed: int, run) -> list[Check]:
    """One (problem, seed) case: fresh inputs, the reference and its gradients with autograd, then
    `run(inputs, grad_out) -> (outputs, grads, error)` runs the kernel under test (any backend);
    its outputs and gradients are compared, and the inputs checked unchanged."""
    inputs = spec.make_inputs(problem, seed)
    pristine = {k: v.clone() for k, v in inputs.items()}
    diff = spec.differentiable(problem)

    ref_inputs = {k: (v.clone().requires_grad_(True) if k in diff else v.clone()) for k, v in inputs.items()}
    ref_out = spec.reference(problem, ref_inputs)
    g = torch.Generator().manual_seed(10_000 + seed)
    with_grad = spec.grad_outputs()
    grad_out = {k: torch.randn(ref_out[k].shape, generator=g).to(ref_out[k].dtype) for k in with_grad}
    ref_grads = (torch.autograd.grad([ref_out[k] for k in with_grad], [ref_inputs[k] for k in diff],
                                     [grad_out[k] for k in with_grad], allow_unused=True) if diff else ())

    outputs, grads, error = run(inputs, grad_out)
    if error:
        return [Check(problem.shape, seed, "kernel", float("nan"), float("nan"), False, error)]
    checks, compared = [], []
    for k in spec.visible_outputs():
        if not ref_out[k].is_floating_point():   # indices: exactly equal
            same = outputs[k].shape == ref_out[k].shape and torch.equal(outputs[k], ref_out[k])
            checks.append(Check(problem.shape, seed, k, 0.0 if same else float("inf"), 0.0, same,
                                "" if same else "integer output differs"))
            continue
        tol = spec.tolerance(problem.dtype, k)
        checks.append(Check(problem.shape, seed, k, *compare(outputs[k], ref_out[k].detach(), tol.atol, tol.rtol)))
        compared.append((checks[-1], outputs[k], ref_out[k], k, tol, None))
    slack = spec.grad_slack(problem, pristine, grad_out) if diff else {}
    for k, rg in zip(diff, ref_grads):
        tol = spec.tolerance(problem.dtype, k)
        ref = rg if rg is not None else torch.zeros_like(inputs[k])
        checks.append(Check(problem.shape, seed, f"grad_{k}",
                            *compare(grads[k], ref, tol.atol, tol.rtol, slack.get(k))))
        compared.append((checks[-1], grads[k], ref, f"grad_{k}", tol, slack.get(k)))
    exact = None
    for check, out, ref, name, tol, sl in compared:
        if check.passed or check.reason != "outside tolerance":
            continue
        exact = exact or _exact(spec, problem, pristine, grad_out, diff)
        if exact is None:
            break
        x = exact[0][name] if not name.startswith("grad_") else exact[1].get(name[5:])
        if x is not None and within_reference_error(out, ref, x, tol.atol, tol.rtol, sl):
            check.passed, check.reason = True, "within the reference's own rounding of the exact (float64) result"
    for k, before in pristine.items():
        if not torch.equal(inputs[k], before):
            checks.append(Check(problem.shape, seed, k, float("nan"), float("nan"), False, "kernel wrote to an input"))
    return checks
