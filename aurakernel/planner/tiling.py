"""Tiling: choose tile extents, buffer/chunk sizes and the core split of one fused kernel.

The OpSpec describes its tiling problem as a ChoiceModel (planner/model.py): candidate values per
knob, capacity constraints per memory level summed over every buffer the kernel holds at once,
and per-phase pipe times from the cost model. This module solves it, checks the answer, and names
the binding constraint: the capacity whose removal would make the kernel faster, or otherwise the
pipe (memory, vector, ...) that bounds the time.

`time_limit_s` bounds the whole call: the solve gets it, and the searches that name a culprit or a
binding constraint (one re-solve per constraint) share what is left; a search cut short says so.
A solve stopped by the limit returns its incumbent (status "feasible"), or PlanInfeasible("time
limit") when it had none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field

from ..errors import PlanInfeasible, UserError
from .model import ChoiceModel, relaxed, solve

TilingProblem = ChoiceModel

# a relaxed constraint counts as binding only if it would save more than this share of the time
BINDING_GAIN = 0.005


@dataclass
class Plan:
    """The solver's answer for (op, variant, shape, dtype, target)."""

    op: str
    variant: str
    shape: tuple[int, ...]
    dtype: str
    target: str
    knobs: dict[str, int]
    predicted_us: float
    pipes_us: dict[str, dict[str, float]]     # phase -> pipe -> microseconds
    binding_constraint: str
    solver: str
    solve_s: float
    status: str
    schedule: dict = field(default_factory=dict)   # phase -> its pipeline schedule (planner/schedule.py)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        d["knobs"] = {k: int(v) for k, v in d["knobs"].items()}
        return cls(**d)

    @property
    def key(self) -> str:
        blob = json.dumps([self.op, self.variant, self.shape, self.dtype, self.target, self.knobs], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _check_each_constraint(model: ChoiceModel) -> None:
    """A constraint no candidate can meet makes the model infeasible on its own: say which."""
    for c in model.constraints:
        least = c.usage.minimum()
        if least > c.limit:
            raise PlanInfeasible(c.name, f"{c.formula} needs at least {least:,.0f} B, "
                                         f"the limit is {c.limit:,.0f} B")


def _droppable(model: ChoiceModel) -> list[int]:
    """The constraints (by position) some candidate breaks: one every candidate meets binds nothing,
    and re-solving without it (a solve per constraint) cannot change the answer."""
    return [i for i, c in enumerate(model.constraints) if max(c.usage.table.values()) > c.limit * (1 + 1e-9)]


def _culprit(model: ChoiceModel, solver: str, deadline: float) -> str:
    drops = _droppable(model)
    tried = relaxed(model, solver, drops, deadline, until=lambda sol: sol.choice is not None)
    for i, sol in tried.items():
        if sol.choice is not None:
            return model.constraints[i].name
    if len(tried) < len(drops):
        return "the constraints together (the search for one stopped at the time limit)"
    return "the constraints together"


def _binding(model: ChoiceModel, choice: dict[str, int], objective: float,
             solver: str, deadline: float) -> str:
    best_gain, best = 0.0, None
    drops = _droppable(model)
    tried = relaxed(model, solver, drops, deadline)
    if len(tried) < len(drops):
        return "not analysed (time limit)"
    for i, sol in tried.items():
        c = model.constraints[i]
        if sol.objective is not None:
            gain = (objective - sol.objective) / objective
            if gain > max(best_gain, BINDING_GAIN):
                best_gain, best = gain, c
    if best is not None:
        used = best.usage.value(choice)
        return f"{best.name} ({best.formula} = {used:,.0f} of {best.limit:,.0f} B)"
    # no capacity holds it back: the slowest pipe of the costliest phase bounds the time
    _, detail = model.evaluate(choice)
    phase, pipes = max(detail.items(), key=lambda kv: max(kv[1].values()))
    pipe = max((k for k in pipes if k != "overhead"), key=lambda k: pipes[k])
    if pipes["overhead"] > pipes[pipe]:
        return f"call overhead ({phase})"
    return f"{pipe} ({phase})"


def solve_tiling(model: ChoiceModel, *, op: str, variant: str, shape: tuple[int, ...], dtype: str,
                 target: str, solver: str = "highs", time_limit_s: float = 10.0, explain: bool = True) -> Plan:
    """The model's optimal knobs and predicted time; with `explain`, also the constraint that binds
    (a solve per constraint, with it dropped: most of the time for models with many constraints, and
    unneeded where only the predicted time is wanted)."""
    if any(not vals for vals in model.domains.values()):
        empty = [k for k, vals in model.domains.items() if not vals]
        raise UserError(f"no candidate values for knob(s) {', '.join(empty)} at shape {shape}")
    _check_each_constraint(model)
    deadline = time.perf_counter() + time_limit_s
    sol = solve(model, solver, time_limit_s)
    if sol.choice is None:
        if sol.status == "timeout":
            raise PlanInfeasible("time limit", f"{solver} found no plan within {time_limit_s:g} s")
        culprit = _culprit(model, solver, deadline)
        raise PlanInfeasible(culprit, "no combination of knob values satisfies it together with the others")
    assert model.feasible(sol.choice), "solver returned an assignment that violates a capacity"
    objective, detail = model.evaluate(sol.choice)
    binding = _binding(model, sol.choice, objective, solver, deadline) if explain else "not analysed"
    return Plan(
        op=op, variant=variant, shape=tuple(shape), dtype=dtype, target=target,
        knobs=dict(sorted(sol.choice.items())), predicted_us=objective * 1e6,
        pipes_us={ph: {p: v * 1e6 for p, v in pipes.items()} for ph, pipes in detail.items()},
        binding_constraint=binding, solver=solver, solve_s=sol.solve_s, status=sol.status,
    )
