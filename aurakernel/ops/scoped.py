"""Swapping module-level functions (rope, the eager attention) without touching other models.

transformers calls these functions by name from its modeling module, so the swap replaces the
name with a dispatcher once, process-wide. The dispatcher runs a kernel only inside the forward of
a model that `apply` patched: hooks on that model's DeepseekV4Model set a context variable holding
the kernel lookups for the duration of its forward; everywhere else (another model, a reference
run in the same process) the original function runs.
"""

from __future__ import annotations

import contextvars

import torch

_ACTIVE: contextvars.ContextVar[dict] = contextvars.ContextVar("aurakernel_scoped", default={})


def current(op: str):
    """The kernel lookup for `op` in the model forward running now, or None."""
    return _ACTIVE.get().get(op)


def scope(module: torch.nn.Module, op: str, lookup) -> None:
    """Make `op`'s dispatcher use `lookup` inside `module`'s forward (replacing an earlier scope)."""
    hooks = module.__dict__.setdefault("_ak_scope_hooks", {})
    for h in hooks.pop(op, ()):
        h.remove()
    tokens = []

    def enter(mod, args):
        tokens.append(_ACTIVE.set({**_ACTIVE.get(), op: lookup}))

    def leave(mod, args, output):
        _ACTIVE.reset(tokens.pop())

    hooks[op] = (module.register_forward_pre_hook(enter), module.register_forward_hook(leave))


class FunctionSwap:
    """One module-level function: its original, its dispatcher, and a recorder for the profiler."""

    def __init__(self, namespace, name: str, dispatcher):
        self.namespace, self.name = namespace, name
        self.reference = getattr(namespace, name)     # captured before any swap
        self.dispatcher = dispatcher

    def install(self) -> None:
        setattr(self.namespace, self.name, self.dispatcher)

    def recording(self, on_call, problem_of, around=None):
        """Context manager: call on_call(problem_of(*args)) for each call (problem may be None);
        with `around`, each call runs inside the context manager around(problem)."""
        swap = self

        class _Recorder:
            def __enter__(self):
                self.saved = getattr(swap.namespace, swap.name)
                inner = self.saved

                def recording(*args, **kwargs):
                    problem = problem_of(*args, **kwargs)
                    if problem is not None:
                        on_call(problem)
                    if around is None:
                        return inner(*args, **kwargs)
                    with around(problem):
                        return inner(*args, **kwargs)
                setattr(swap.namespace, swap.name, recording)
                return self

            def __exit__(self, *exc):
                setattr(swap.namespace, swap.name, self.saved)
                return False
        return _Recorder()
