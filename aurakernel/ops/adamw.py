"""AdamW: the optimizer update over every parameter (torch.optim.AdamW semantics, fp32 params and
states), as one streaming kernel per parameter instead of ~13 eager ops each. `FusedAdamW` is a
drop-in torch.optim.Optimizer (same hyper-parameters and state_dict layout as torch's AdamW)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from ..dtypes import DType
from ..targets.host.library import built_kernel
from .base import OpSpec, Problem, Tensors, Tolerance, Work, compiled_step

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
        return Work(0 if backward else n * 4 * 7, 0 if backward else n * 14)

    def module_call(self, problem, inputs):
        raise TypeError("adamw is an optimizer, not a module: see FusedAdamW")

    def timing_candidates(self, problem: Problem, kernel_hash: str, with_compiled: bool,
                          with_compiled_kernel: bool = False):
        """One optimizer step over one parameter of the problem's size: torch's AdamW (for-loop),
        torch.compile of that step, FusedAdamW (an optimizer step, which no model graph holds: there
        is no compiled-kernel candidate)."""
        inputs = self.make_inputs(problem, seed=1234)

        def make(cls, **extra):
            p = torch.nn.Parameter(inputs["p"].clone())
            p.grad = inputs["g"].clone()
            opt = cls([p], **HYPER, **extra)
            opt.step()  # creates the state
            return opt

        eager = make(torch.optim.AdamW, foreach=False)
        candidates, notes = {"eager": eager.step}, {}
        if with_compiled:
            compiled_step(candidates, notes, "compiled", torch.compile(make(torch.optim.AdamW, foreach=False).step))
        ours = make(FusedAdamW, kernel=kernel_hash)
        candidates["aurakernel"] = ours.step
        return candidates, notes

    def call_problem(self, module, args):
        return None

    def patch(self, module, lookup) -> None:
        raise TypeError("adamw is swapped by building the optimizer with FusedAdamW, not by patching a module")


def update(kernel, p, g, m, v, step: int, hyper: dict, out=None) -> None:
    """One AdamW step of (p, m, v) with gradient g through `kernel`; in place unless `out` is given."""
    beta1, beta2 = hyper["betas"]
    lr = hyper["lr"]
    step_size = lr / (1 - beta1 ** step)
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    po, mo, vo = out if out is not None else (p, m, v)
    kernel.call("update", p, g, m, v, po, mo, vo, p.numel(), lr, beta1, beta2, hyper["eps"],
                hyper["weight_decay"], step_size, bc2_sqrt)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW through the tuned `adamw` kernel for fp32 dense parameters; any other
    parameter (bf16, sparse gradient) takes torch's functional AdamW step, so nothing is left out."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, kernel: str):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.kernel = kernel

    @torch.no_grad()
    def step(self, closure=None):

        loss = closure() if closure is not None else None
        k = built_kernel(self.kernel)
        for group in self.param_groups:
            hyper = {n: group[n] for n in ("lr", "betas", "eps", "weight_decay")}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                g = p.grad
                # FSDP2 hands DTensor shards: the update is elementwise, so it runs on the local shard
                lp, lg, lm, lv = (_local(t) for t in (p, g, state["exp_avg"], state["exp_avg_sq"]))
                if (lp.dtype == torch.float32 and lg.dtype == torch.float32 and not lg.is_sparse
                        and all(t.is_contiguous() for t in (lp, lg, lm, lv)) and lp.device.type == "cpu"):
                    update(k, lp, lg, lm, lv, step, hyper)
                else:
                    torch.optim.adamw.adamw([p], [g], [state["exp_avg"]], [state["exp_avg_sq"]], [],
                                            [state["step"] - 1 + 1], foreach=False, amsgrad=False,
                                            beta1=hyper["betas"][0], beta2=hyper["betas"][1], lr=hyper["lr"],
                                            weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=False)
        return loss


SPEC = AdamWSpec(
    name="adamw",
    summary="the AdamW update (torch.optim.AdamW semantics), fp32 params and states, in place",
    shape_meaning="N: elements of the parameter",
    shape_rank=1,
    default_shape=(16_777_216,),
    dtypes=(DType.fp32,),
    variants=("default",),
)
