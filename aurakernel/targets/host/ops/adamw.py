"""The host C kernel of adamw (templates/host/): its tiling model, template values and C calls.

Where the time goes (benchmarks/breakdown.py, 16 M fp32 parameters, 2-core Xeon, AVX-512): at the
minimum traffic (1.00x alone: parameter, gradient and both moments read, three written, once).
In a model the optimizer's step was a call per parameter, each with its step counter's update and
.item(), the thread wake-up and the bookkeeping: the tiny model's step (118 tensors, 4.8 M elements,
AVX2 EPYC) took 5.2 ms against the 3.5 ms its traffic takes at the in-place rate. FusedAdamW now
hands a group's tensors to one call (ak_adamw_many: their blocks dealt to the threads as one range)
and counts the steps with one foreach add: 3.85 ms (torch's AdamW: 13.6 ms for-loop and foreach).
The trainer's gradient clip before it (torch.nn.utils.clip_grad_norm_: a norm call per tensor, then a
mul_ per tensor, one more read and write of every gradient) is FusedAdamW.clip_grad_norm_: the norm
in one call (ak_adamw_grad_sumsq), the scaling read into the update (grad_scale). The tiny model's
clip + step (4.8 M parameters, 118 tensors, Zen 4, alternating 60 times): 6.20 -> 5.06 ms.
"""

from __future__ import annotations

import math

import torch

from ....ops.adamw import ELEMS_PER_ROW, HYPER, SPEC
from ....ops.base import Problem, Tensors
from ....planner.costmodel import RowwisePhase, rowwise_model
from ..kernel import HostKernel
from ..library import Entry


def _scalars(step: int, hyper: dict) -> tuple[float, ...]:
    """The kernel's scalar arguments: lr, beta1, beta2, eps, weight decay, step size, sqrt(1 - beta2^t)."""
    beta1, beta2 = hyper["betas"]
    lr = hyper["lr"]
    return (lr, beta1, beta2, hyper["eps"], hyper["weight_decay"], lr / (1 - beta1 ** step),
            math.sqrt(1 - beta2 ** step))


def update(kernel, p, g, m, v, step: int, hyper: dict, out=None) -> None:
    """One AdamW step of (p, m, v) with gradient g through `kernel`; in place unless `out` is given."""
    po, mo, vo = out if out is not None else (p, m, v)
    kernel.call("update", p, g, m, v, po, mo, vo, p.numel(), *_scalars(step, hyper))


def _table(tensors) -> torch.Tensor:
    """The kernel's [count][5] table: each (p, g, m, v)'s four addresses and element count."""
    return torch.tensor([[t.data_ptr() for t in four] + [four[0].numel()] for four in tensors], dtype=torch.int64)


def update_many(kernel, tensors: list[tuple[torch.Tensor, ...]], step: int, hyper: dict, grad_scale: float = 1.0) -> None:
    """One AdamW step, in place, of every (p, g, m, v) in `tensors` (fp32, contiguous, on the CPU), all
    at the same step count: one kernel call for all of them, each gradient read times `grad_scale`."""
    if not tensors:
        return
    kernel.call("update_many", _table(tensors), len(tensors), *_scalars(step, hyper), grad_scale)


def grad_sumsq(kernel, grads: list[torch.Tensor]) -> float:
    """The sum of squares of every element of `grads` (fp32, contiguous, on the CPU), in one kernel call."""
    if not grads:
        return 0.0
    return kernel.call("grad_sumsq", _table([(g, g, g, g) for g in grads]), len(grads))


class AdamWHost(HostKernel):
    knob_docs = {"tile_rows": "blocks of 1024 elements per OpenMP chunk", "threads": "OpenMP threads"}
    entries = {"update": Entry("ak_adamw", ("ptr",) * 7 + ("i64",) + ("f32",) * 7),
               "update_many": Entry("ak_adamw_many", ("ptr", "i64") + ("f32",) * 8),
               "grad_sumsq": Entry("ak_adamw_grad_sumsq", ("ptr", "i64"), "f64")}

    def tiling_problem(self, problem: Problem, hw):
        rows = max(1, math.ceil(problem.shape[0] / ELEMS_PER_ROW))
        phases = [RowwisePhase("update", 7 * 4 * ELEMS_PER_ROW, 14 * ELEMS_PER_ROW, 0, 0, 0, 0)]
        return rowwise_model(rows, ELEMS_PER_ROW, phases, hw, fixed={"col_chunk": ELEMS_PER_ROW})

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"block": int(knobs["tile_rows"]) * ELEMS_PER_ROW, "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {k: torch.empty_like(inputs[k]) for k in ("p", "m", "v")}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        update(kernel, inputs["p"], inputs["g"], inputs["m"], inputs["v"], self.spec.step, HYPER,
               out=(outputs["p"], outputs["m"], outputs["v"]))

    def run_backward(self, kernel, inputs, outputs, grad_outputs, grads) -> None:
        raise TypeError("adamw has no backward")

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        odd = knobs.get("tile_rows", 1) * ELEMS_PER_ROW * knobs.get("threads", 1) * 2 + 13
        return [problem, Problem(problem.op, problem.variant, (min(problem.shape[0], odd),), problem.dtype),
                Problem(problem.op, problem.variant, (7,), problem.dtype)]


PARTS = (AdamWHost(SPEC),)
