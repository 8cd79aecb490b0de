"""The one way a patch goes onto a module instance.

`install(module, attribute, fn)` binds `fn` as `module.<attribute>` (a bound method survives
deepcopy; a closure would keep pointing at the original module). `swap_globals(module, name=fn)`
makes the module's own code call `fn` where it calls the module-level function `name` (transformers'
`apply_rotary_pos_emb`, `eager_attention_forward`): the installed methods (or the class's forward)
run with a copy of their globals holding the replacement. Only that module instance sees it: another
model in the process keeps the reference, and there is no context to enter, so activation-checkpoint
recompute and torch.compile see the same code as the forward.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch


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


def _with_globals(fn, replacements: dict):
    """`fn`'s code over a copy of its globals updated with `replacements`."""
    if not replacements:
        return fn
    new = types.FunctionType(fn.__code__, _namespace(fn.__globals__, replacements), fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    new.__module__ = fn.__module__
    return new


def install(module: torch.nn.Module, attribute: str, fn) -> None:
    """module.<attribute> = fn bound to module, running with the module's swapped globals."""
    module.__dict__.setdefault("_ak_installed", {})[attribute] = fn
    swaps = module.__dict__.get("_ak_globals", {})
    setattr(module, attribute, types.MethodType(_with_globals(fn, swaps), module))


def swap_globals(module: torch.nn.Module, **functions) -> None:
    """Make `module`'s methods call functions[name] where their code calls the global `name`."""
    module.__dict__.setdefault("_ak_globals", {}).update(functions)
    installed = dict(module.__dict__.get("_ak_installed", {}))
    # the class's own forward, unwrapped of decorators (transformers' deprecate_kwarg) so that its
    # code, not the wrapper's, reads the swapped globals
    installed.setdefault("forward", inspect.unwrap(type(module).forward))
    for attribute, fn in installed.items():
        install(module, attribute, fn)
