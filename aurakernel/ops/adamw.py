"""AdamW: the optimizer update over every parameter (torch.optim.AdamW semantics, fp32 params and
states), as one streaming kernel per parameter instead of ~13 eager ops each. `FusedAdamW` is a
drop-in torch.optim.Optimizer (same hyper-parameters and state_dict layout as torch's AdamW)."""

from __future__ import annotations

import torch

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work

HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
ELEMS_PER_ROW = 1024   # the planner sees the flat parameter as rows of this many elements


def _torch_adamw_step(p, g, m, v, step: int, hyper: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: torch.optim.AdamW (single-tensor path) taking step `step` from state (m, v)."""
    p = p.clone()
    p.grad = g.clone()
    opt = torch.optim.AdamW([p], foreach=False, fused=False, **hyper)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


class AdamWSpec(OpSpec):
    step = 5   # the step verification takes (bias corrections away from 1)

    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return ()

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        (n,) = problem.shape
        g = torch.Generator().manual_seed(seed)
        return {"p": torch.randn(n, generator=g), "g": torch.randn(n, generator=g) * 0.1,
                "m": torch.randn(n, generator=g) * 0.05, "v": torch.rand(n, generator=g) * 0.01}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ()

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        p, m, v = _torch_adamw_step(inputs["p"], inputs["g"], inputs["m"], inputs["v"], self.step, HYPER)
        return {"p": p, "m": m, "v": v}

    def visible_outputs(self) -> tuple[str, ...]:
        return ("p", "m", "v")

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return Tolerance(1e-6, 1e-5)

    def work(self, problem: Problem, backward: bool) -> Work:
        (n,) = problem.shape
        if backward:
            return Work(0, 0)
        return Work(n * 4 * 7, n * 14, in_place_bytes=n * 4 * 6)   # p, m, v read and written back; g read

    def module_call(self, problem, inputs):
        raise TypeError("adamw is an optimizer, not a module: see FusedAdamW")

SPEC = AdamWSpec(
    name="adamw",
    summary="the AdamW update (torch.optim.AdamW semantics), fp32 params and states, in place",
    shape_meaning="N: elements of the parameter",
    shape_rank=1,
    default_shape=(16_777_216,),
    dtypes=(DType.fp32,),
    variants=("default",),
)
