"""The adamw kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from ..ops.adamw import HYPER, SPEC
from ..ops.base import Problem
from ..targets.host.library import built_kernel
from ..targets.host.ops.adamw import update_many
from .base import Patch, compiled_step


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
        """Per parameter group: the kernel's tensors (fp32, dense, contiguous, on the CPU) at one step
        count go in one kernel call (a call per tensor cost more than the update of a small model);
        any other parameter takes torch's functional AdamW."""
        loss = closure() if closure is not None else None
        k = built_kernel(self.kernel)
        for group in self.param_groups:
            hyper = {n: group[n] for n in ("lr", "betas", "eps", "weight_decay")}
            mine, steps = [], []   # the kernel's (p, g, m, v) and their step counters
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                g = p.grad
                # FSDP2 hands DTensor shards: the update is elementwise, so it runs on the local shard
                lp, lg, lm, lv = (_local(t) for t in (p, g, state["exp_avg"], state["exp_avg_sq"]))
                if (lp.dtype == torch.float32 and lg.dtype == torch.float32 and not lg.is_sparse
                        and all(t.is_contiguous() for t in (lp, lg, lm, lv)) and lp.device.type == "cpu"):
                    mine.append((lp, lg, lm, lv))
                    steps.append(state["step"])
                else:   # torch's AdamW step (its functional form counts the step itself)
                    adam([p], [g], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]], foreach=False,
                         decoupled_weight_decay=True, amsgrad=False, beta1=hyper["betas"][0],
                         beta2=hyper["betas"][1], lr=hyper["lr"], weight_decay=hyper["weight_decay"],
                         eps=hyper["eps"], maximize=False)
            if not mine:
                continue
            torch._foreach_add_(steps, 1)
            by_count: dict[int, list[tuple[torch.Tensor, ...]]] = {}   # parameters added later count fewer steps
            for count, tensors in zip(torch.stack(steps).tolist(), mine):
                by_count.setdefault(int(count), []).append(tensors)
            for count, tensors in by_count.items():
                update_many(k, tensors, count, hyper)
        return loss


class AdamWPatch(Patch):
    def timing_candidates(self, problem: Problem, kernel_hash: str, with_compiled: bool,
                          with_compiled_kernel: bool = False):
        """One optimizer step over one parameter of the problem's size: torch's AdamW (for-loop),
        torch.compile of that step, FusedAdamW (an optimizer step, which no model graph holds: there
        is no compiled-kernel candidate)."""
        inputs = self.spec.make_inputs(problem, seed=1234)

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


PARTS = (AdamWPatch(SPEC),)
