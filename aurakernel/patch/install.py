"""The one way a patch goes onto a module instance.

`install(module, attribute, fn)` binds `fn` as `module.<attribute>` (a bound method survives
deepcopy; a closure would keep pointing at the original module). `swap_globals(module, name=fn)`
makes the module's own code call `fn` where it calls the module-level function `name` (transformers'
`apply_rotary_pos_emb`, `eager_attention_forward`): the installed methods (or the class's forward)
run with a copy of their globals holding the replacement. Only that module instance sees it: another
model in the process keeps the reference, and there is no context to enter, so activation-checkpoint
recompute and torch.compile see the same code as the forward. A patch checks the preconditions
of the math it replaces with `require`: a module it does not cover stays on the reference
(`Refused`, reported by apply). A patched method that re-implements a transformers method (the
compressors' forwards, the decoder layer's) says so with `@copied_from(cls, attr, sha)`: `install`
refuses it when the installed transformers' source of that method is not the one it copied, so an
upstream change runs the reference instead of a stale copy.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
import types

import torch
from transformers.modeling_layers import GradientCheckpointingLayer


class Refused(Exception):
    """A module whose configuration the kernel's math does not cover (another activation, iteration
    count, epsilon...): its patch leaves it on the reference, and apply's report says why."""


def require(condition: bool, reason: str) -> None:
    """A precondition of the math a patch replaces; Refused(reason) when it does not hold."""
    if not condition:
        raise Refused(reason)


@functools.cache
def source_hash(cls: type, attribute: str) -> str:
    """The hash of `cls.<attribute>`'s source (its decorators unwrapped)."""
    return hashlib.sha256(inspect.getsource(inspect.unwrap(getattr(cls, attribute))).encode()).hexdigest()[:16]


def copied_from(cls: type, attribute: str, sha: str):
    """Mark a patched method as a re-implementation of transformers' `cls.<attribute>` whose source
    hashed to `sha` when it was copied (install refuses it once that source changes)."""
    def mark(fn):
        fn._ak_copied_from = (cls, attribute, sha)
        return fn
    return mark


_NAMESPACES: dict[tuple, types.ModuleType] = {}


def _namespace(origin: dict, replacements: dict) -> dict:
    """A copy of the module namespace `origin` with `replacements`, registered in sys.modules under
    a name of its own: torch.compile resolves (and guards) a function's globals through the module
    its `__name__` names, so the copy must be a module it can import, not a loose dict."""
    key = (origin["__name__"], tuple(sorted((name, id(fn)) for name, fn in replacements.items())))
    module = _NAMESPACES.get(key)
    if module is None:
        name = f"aurakernel.patch._swapped_{len(_NAMESPACES)}_{origin['__name__'].replace('.', '_')}"
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in origin.items() if k not in ("__name__", "__spec__", "__loader__")})
        module.__dict__.update(replacements)
        sys.modules[name] = _NAMESPACES[key] = module
    return module.__dict__


_CODES: dict[tuple, types.CodeType] = {}


def _own_code(code: types.CodeType, namespace: dict) -> types.CodeType:
    """A copy of `code` for the functions that run over `namespace`. torch.compile keeps its compiled
    frames on the code object, guarded but run with the caller's globals: had the swapped function
    shared the original's code, a frame compiled for the unpatched module (its `__compiled_fn_*`
    stored in the original globals) would be found for the patched one, and fail there or run the
    reference."""
    key = (code, namespace["__name__"])
    if key not in _CODES:
        _CODES[key] = code.replace()
    return _CODES[key]


def _with_globals(fn, replacements: dict):
    """`fn`'s code (a copy of its own) over a copy of its globals updated with `replacements`."""
    if not replacements:
        return fn
    namespace = _namespace(fn.__globals__, replacements)
    new = types.FunctionType(_own_code(fn.__code__, namespace), namespace, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    new.__module__ = fn.__module__
    return new


def _keeping_checkpointing(module: torch.nn.Module, fn):
    """transformers' GradientCheckpointingLayer checkpoints its class's forward (the wrapper its
    __init_subclass__ puts there), which a forward set on the instance would bypass: the instance's
    forward gets the same condition and the layer's own checkpoint function."""
    if not isinstance(module, GradientCheckpointingLayer):
        return fn

    @functools.wraps(fn)
    def checkpointed(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(functools.partial(fn, self, **kwargs), *args)
        return fn(self, *args, **kwargs)
    return checkpointed


def install(module: torch.nn.Module, attribute: str, fn) -> None:
    """module.<attribute> = fn bound to module, running with the module's swapped globals (and, for
    a forward of a checkpointing layer, still checkpointed when the model enables it)."""
    copied = getattr(fn, "_ak_copied_from", None)
    if copied is not None:
        cls, name, sha = copied
        require(source_hash(cls, name) == sha,
                f"transformers' {cls.__name__}.{name} is not the source this patch re-implements (it changed "
                f"since transformers 5.24): the module runs the reference")
    module.__dict__.setdefault("_ak_installed", {})[attribute] = fn
    method = _with_globals(fn, module.__dict__.get("_ak_globals", {}))
    if attribute == "forward":
        method = _keeping_checkpointing(module, method)
    setattr(module, attribute, types.MethodType(method, module))


def swap_globals(module: torch.nn.Module, **functions) -> None:
    """Make `module`'s methods call functions[name] where their code calls the global `name`."""
    module.__dict__.setdefault("_ak_globals", {}).update(functions)
    installed = dict(module.__dict__.get("_ak_installed", {}))
    # the class's own forward, unwrapped of decorators (transformers' deprecate_kwarg) so that its
    # code, not the wrapper's, reads the swapped globals
    installed.setdefault("forward", inspect.unwrap(type(module).forward))
    for attribute, fn in installed.items():
        install(module, attribute, fn)
