"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input: the message names what was wrong and what is accepted."""


class PlanInfeasible(UserError):
    """The tiling model has no solution; the message names the violated constraint."""

    def __init__(self, constraint: str, detail: str):
        self.constraint = constraint
        super().__init__(f"no feasible plan: {constraint}: {detail}")


class BuildError(RuntimeError):
    """The system compiler rejected a rendered kernel (a bug in a template, not user input)."""
