"""The OR core: models that choose how a kernel is tiled, laid out and scheduled."""

from .tiling import Plan, TilingProblem, solve_tiling

__all__ = ["Plan", "TilingProblem", "solve_tiling"]
