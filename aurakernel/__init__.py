"""AuraKernel: an automated kernel optimizer for full-parameter DeepSeek-V4 training.

profile -> plan (MILP/CP) -> render (Jinja) -> build -> verify -> measure -> record -> swap.
"""

from .version import __version__


def apply(model, plan, **kwargs):
    """Patch a DeepseekV4ForCausalLM with the kernels of a plan (a path or a loaded KernelPlan).

    Returns an ApplyReport: what was swapped, and what stayed on the reference and why.
    """
    from .swap import apply as _apply

    return _apply(model, plan, **kwargs)


def patch_deepseek_v4(plan, **kwargs):
    """Patch every DeepSeek-V4 model built from now on with the kernels of a plan (like Liger's
    apply_liger_kernel_to_<model>); returns a ClassPatch (a context manager, `.undo()`, `.reports`)."""
    from .swap import patch_deepseek_v4 as _patch

    return _patch(plan, **kwargs)


def register(*parts):
    """Add a third-party operator (its OpSpec and its kernels) to the library; see aurakernel/ops/__init__.py."""
    from .ops import register as _register

    return _register(*parts)


__all__ = ["__version__", "apply", "patch_deepseek_v4", "register"]
