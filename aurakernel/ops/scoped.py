"""Module-level functions of transformers' DeepSeek-V4 code that operators replace (rope, the eager
attention): the original, captured before anything patched it, and a recorder for the profiler.
Patched models call kernels through patch.install.swap_globals, not through this namespace."""

from __future__ import annotations


class FunctionSwap:
    """One module-level function: its original and a recorder for the profiler."""

    def __init__(self, namespace, name: str):
        self.namespace, self.name = namespace, name
        self.reference = getattr(namespace, name)     # captured before any recording

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
