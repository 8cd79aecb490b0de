"""Patch: how one operator's kernel takes the place of code in a model.

A Patch says which problem a call of a module poses (`call_problem`, for the profiler), how to
make a module run the kernel (`patch`: its forward dispatches per call through `lookup(kernel_key,
torch dtype)` -> a kernel's source hash, or None for the reference), where else in a model it goes
(`sites`, beyond the DeepSeek-V4 table in deepseek_v4.py) and how its kernel is timed against the
reference (`timing_candidates`). The kernels themselves run as torch.library custom ops (torch_op.py)
installed through install.py.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod

import torch

from ..ops.base import Problem
from ..parts import Part, Registry
from .install import install

# operator name -> its patch: the built-in ones (deepseek_v4.py) and those registered from outside
PATCHES: Registry[Patch] = Registry("a patch", "has no patch")


def bind(module: torch.nn.Module, lookup, op: str, methods) -> None:
    """Patch `module` for `op`: of (class, attribute, function) triples, the first whose class the
    module is gets `module.<attribute>` = function (patch.install); `lookup` is stored for it."""
    for cls, attribute, fn in methods:
        if isinstance(module, cls):
            module._ak_lookup = lookup
            install(module, attribute, fn)
            return
    raise TypeError(f"{op} cannot patch {type(module).__name__}")


def compiled_step(candidates: dict, notes: dict, name: str, step) -> None:
    """Run a torch.compile'd step once (compiling it outside the timed rounds) and add it as a
    candidate; a step that cannot compile is reported in `notes`, not fatal."""
    try:
        step()
        candidates[name] = step
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot compile is reported, not fatal
        notes[name] = f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


class Patch(Part, ABC):
    registry = PATCHES

    @abstractmethod
    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        """The problem a call of `module` with `args` poses (for the profiler), or None."""

    @abstractmethod
    def patch(self, module: torch.nn.Module, lookup) -> None:
        """Make `module` run kernels: lookup(kernel_key, torch dtype) -> source hash or None
        (None: run the reference)."""

    def patch_model(self, model: torch.nn.Module, patched: list[torch.nn.Module]) -> None:
        """After apply has patched `patched` (this operator's modules of `model`): anything the patch
        needs at the model's level (e.g. a hook on its forward). Default: nothing."""

    def patch_parts(self, module: torch.nn.Module, lookups: dict) -> None:
        """A fused operator's (OpSpec.fuses) reference module made to run the kernels of the ops it
        fuses, one after the other: lookups maps each of those ops to a lookup as `patch` takes. What
        autotune times the fused kernel against."""
        raise NotImplementedError(f"{self.spec.name} fuses no operators: it has no parts to patch")

    def sites(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, tuple[int, ...] | None]]:
        """(name, module, variant, kernel_key or None: per call) of each module of `model` this operator
        patches beyond the DeepSeek-V4 table (deepseek_v4.py, which covers the built-in operators): how a
        third-party operator says where it goes."""
        return []

    def timing_candidates(self, problem: Problem, kernel_hash: str, with_compiled: bool,
                          with_compiled_kernel: bool = False):
        """Zero-argument callables to time side by side: "eager" (the reference module), "compiled"
        (torch.compile of it), "aurakernel" (the module patched with the kernel) and, with
        `with_compiled_kernel`, "aurakernel_compiled" (torch.compile of the patched module: the
        kernel's custom ops inside the compiled graph), each one forward + backward through the
        same nn.Module path the trainer runs. Returns (callables, notes)."""

        module, step_of = self.spec.module_steps(problem)
        candidates, notes = {"eager": step_of(module)}, {}

        def patched():
            ours = copy.deepcopy(module)
            self.patch(ours, lambda key, dtype: kernel_hash)
            return ours

        if with_compiled:
            compiled_step(candidates, notes, "compiled", step_of(torch.compile(copy.deepcopy(module))))
        candidates["aurakernel"] = step_of(patched())
        if with_compiled_kernel:
            compiled_step(candidates, notes, "aurakernel_compiled", step_of(torch.compile(patched())))
        return candidates, notes
