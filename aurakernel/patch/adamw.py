"""The adamw kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from ..ops.adamw import HYPER, SPEC
from ..ops.base import Problem
from ..targets.host.library import built_kernel
from ..targets.host.ops.adamw import grad_sumsq, update_many
from .base import Patch, compiled_step


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _kernel_grad(g: torch.Tensor | None) -> bool:
    """Whether the kernel reads gradient g as it is: a plain fp32 dense contiguous CPU tensor."""
    return (g is not None and type(g) is torch.Tensor and g.dtype == torch.float32 and not g.is_sparse
            and g.is_contiguous() and g.device.type == "cpu")


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW through the tuned `adamw` kernel for fp32 dense parameters; any other
    parameter (bf16, sparse gradient) takes torch's functional AdamW step, so nothing is left out.

    `clip_grad_norm_` is torch.nn.utils.clip_grad_norm_ over the optimizer's parameters with the
    gradients' scaling folded into the next `step` (the kernel reads each gradient times the clip's
    coefficient): one pass over the gradients for the norm, none for the scaling."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, kernel: str):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.kernel = kernel
        self._grad_scale = None   # a clip's coefficient the next step applies, and the gradients it was taken of

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this optimizer's parameters: returns the gradients' total
        norm (before clipping) and scales them by min(1, max_norm / (norm + 1e-6)). Where every gradient
        is the kernel's (fp32, dense, contiguous, on the CPU) and the norm is the 2-norm, the norm is one
        kernel call and the scaling is left to the next `step` (p.grad keeps its values until then;
        `zero_grad` drops it); otherwise it is torch's own call."""
        grads = self._grads()
        if float(norm_type) != 2.0 or not all(_kernel_grad(g) for g in grads):
            self._grad_scale = None
            return torch.nn.utils.clip_grad_norm_([p for group in self.param_groups for p in group["params"]],
                                                  max_norm, norm_type, error_if_nonfinite)
        pending = self._pending_scale(grads) if self._grad_scale is not None else 1.0
        total = torch.tensor(grad_sumsq(built_kernel(self.kernel), grads), dtype=torch.float64).sqrt().float() * pending
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)   # torch's clip_grads_with_norm_
        self._grad_scale = (float(coef) * pending, [(g, g._version) for g in grads])
        return total

    def _pending_scale(self, grads: list[torch.Tensor]) -> float:
        """The clip's coefficient for `grads`, which must be the very gradients it was taken of: a gradient
        replaced or changed in place since (another backward, a manual edit) would be scaled wrongly."""
        scale, taken = self._grad_scale
        if len(grads) != len(taken) or any(g is not t or g._version != v for g, (t, v) in zip(grads, taken)):
            raise RuntimeError("FusedAdamW: the gradients changed between clip_grad_norm_ and step (its scaling waits "
                               "for step); clip after the last backward, or call zero_grad to drop the clip")
        return scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grad_scale = None
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        """Per parameter group: the kernel's tensors (fp32, dense, contiguous, on the CPU) at one step
        count go in one kernel call (a call per tensor cost more than the update of a small model);
        any other parameter takes torch's functional AdamW. A pending clip's coefficient scales every
        gradient as it is read."""
        loss = closure() if closure is not None else None
        scale = self._pending_scale(self._grads()) if self._grad_scale is not None else 1.0
        self._grad_scale = None
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
                    adam([p], [g if scale == 1.0 else g * scale], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]], foreach=False,
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
                update_many(k, tensors, count, hyper, scale)
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
