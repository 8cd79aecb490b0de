"""A small discrete-choice MILP and its two solvers (Pyomo + HiGHS, OR-Tools CP-SAT).

Formulation (every tiling model in AuraKernel has this shape):

    knobs k with candidate values V_k;  x[k,v] in {0,1},  sum_v x[k,v] = 1          (one value each)
    a term over knobs K is a table c[t] over value tuples t in prod_{k in K} V_k. For |K| = 1 it is
        linear in x; for |K| > 1 it gets cell weights z[t] in [0,1] with the marginal constraints
        sum_{t : t_k = v} z[t] = x[k,v]  for every k in K, v in V_k,
        which force z to the single cell picked by the x (so z needs no integrality), and its value
        is sum_t c[t] z[t]                                                               (exact)
    capacity j:        usage_term_j <= limit_j                                       (per memory level)
    phase p, pipe q:   T_p >= sum of the pipe's terms                         (epigraph of the max)
    minimise           sum_p (T_p + sum of the phase's additive terms)

CP-SAT needs integers: coefficients are scaled to integer nanoseconds / bytes and z are booleans.
SCIP (pyscipopt) and HiGHS (through Pyomo) solve the same MILP with continuous z.

Every solve honours its time limit: the answer is then the incumbent (status "feasible") or, when
the solver found none in time, status "timeout" with no choice -- never a silent wait.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from dataclasses import dataclass, field

from ..errors import UserError

SOLVERS = ("highs", "cpsat", "scip")


@dataclass(frozen=True)
class Term:
    """A cost or usage that depends on some knobs: table maps value tuples (in knob order) to a number."""

    knobs: tuple[str, ...]
    table: dict[tuple[int, ...], float]

    def value(self, choice: dict[str, int]) -> float:
        return self.table[tuple(choice[k] for k in self.knobs)]

    def minimum(self) -> float:
        return min(self.table.values())

    @staticmethod
    def of(knobs: tuple[str, ...], domains: dict[str, list[int]], fn) -> Term:
        cells = itertools.product(*(domains[k] for k in knobs))
        return Term(tuple(knobs), {cell: float(fn(*cell)) for cell in cells})


@dataclass(frozen=True)
class Constraint:
    name: str
    usage: Term
    limit: float
    formula: str  # human-readable usage formula, for messages


@dataclass
class Phase:
    """One kernel launch (e.g. forward or backward): its time is the slowest pipe plus overheads."""

    name: str
    pipes: dict[str, list[Term]]
    additive: list[Term] = field(default_factory=list)


@dataclass
class ChoiceModel:
    domains: dict[str, list[int]]
    constraints: list[Constraint]
    phases: list[Phase]

    def evaluate(self, choice: dict[str, int]) -> tuple[float, dict[str, dict[str, float]]]:
        """Objective and per-phase pipe times of one assignment (no solver)."""
        total, detail = 0.0, {}
        for ph in self.phases:
            pipes = {name: sum(t.value(choice) for t in terms) for name, terms in ph.pipes.items()}
            extra = sum(t.value(choice) for t in ph.additive)
            pipes["overhead"] = extra
            detail[ph.name] = pipes
            total += max(v for k, v in pipes.items() if k != "overhead") + extra
        return total, detail

    def feasible(self, choice: dict[str, int], skip: str | None = None) -> bool:
        return all(c.usage.value(choice) <= c.limit * (1 + 1e-9)
                   for c in self.constraints if c.name != skip)


@dataclass
class Solution:
    status: str                   # "optimal", "feasible", "infeasible", "timeout"
    choice: dict[str, int] | None
    objective: float | None
    solve_s: float


def solve(model: ChoiceModel, solver: str = "highs", time_limit_s: float = 10.0,
          drop: str | None = None) -> Solution:
    """Solve the model (optionally without constraint `drop`) with the named solver."""
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}: accepted are {', '.join(SOLVERS)}")
    if not time_limit_s > 0:
        raise UserError(f"the solver time limit must be positive, got {time_limit_s!r} s")
    t0 = time.perf_counter()
    sol = {"highs": _solve_highs, "cpsat": _solve_cpsat, "scip": _solve_scip}[solver](model, time_limit_s, drop)
    sol.solve_s = time.perf_counter() - t0
    if sol.choice is not None:  # re-evaluate exactly (CP-SAT works on rounded coefficients)
        sol.objective = model.evaluate(sol.choice)[0]
    return sol


def _cells(term: Term, domains: dict[str, list[int]]):
    return list(itertools.product(*(domains[k] for k in term.knobs)))


def _time_scale(model: ChoiceModel) -> float:
    """The factor the objective's seconds are multiplied by for the LP: microseconds, or coarser where
    the slowest candidate runs for seconds (HiGHS misjudges a model with coefficients of 1e9 as infeasible)."""
    longest = max((v for ph in model.phases for terms in (*ph.pipes.values(), ph.additive) for t in terms
                   for v in t.table.values()), default=0.0)
    scale = 1e6
    while longest * scale > 1e5:
        scale /= 10
    return scale


_PYOMO = threading.Lock()


def one_pyomo_model_at_a_time(solve):
    """Pyomo's model building is not thread-safe: solves through it wait for each other (autotune
    tunes an emulated target's problems on several threads)."""
    @functools.wraps(solve)
    def serialised(*args, **kwargs):
        with _PYOMO:
            return solve(*args, **kwargs)
    return serialised


@one_pyomo_model_at_a_time
def _solve_highs(model: ChoiceModel, time_limit_s: float, drop: str | None) -> Solution:
    import pyomo.environ as pyo
    from pyomo.contrib.solver.common.factory import SolverFactory
    from pyomo.contrib.solver.common.results import TerminationCondition

    m = pyo.ConcreteModel()
    xs = {(k, v) for k, vals in model.domains.items() for v in vals}
    m.x = pyo.Var(sorted(xs), domain=pyo.Binary)
    m.one_value = pyo.ConstraintList()
    for k, vals in model.domains.items():
        m.one_value.add(sum(m.x[k, v] for v in vals) == 1)

    m.z = pyo.Block()
    m.marginals = pyo.ConstraintList()
    counter = itertools.count()

    def expr(term: Term):
        # in the units _time_scale picks, which keep the LP well scaled
        if len(term.knobs) == 1:
            k = term.knobs[0]
            return sum(term.table[(v,)] * m.x[k, v] for v in model.domains[k])
        cells = _cells(term, model.domains)
        name = f"z{next(counter)}"
        z = pyo.Var(range(len(cells)), bounds=(0, 1))
        m.z.add_component(name, z)
        for pos, k in enumerate(term.knobs):
            for v in model.domains[k]:
                m.marginals.add(sum(z[i] for i, c in enumerate(cells) if c[pos] == v) == m.x[k, v])
        return sum(term.table[c] * z[i] for i, c in enumerate(cells))

    m.capacity = pyo.ConstraintList()
    for c in model.constraints:
        if c.name != drop:
            m.capacity.add(expr(c.usage) <= c.limit)
    m.T = pyo.Var(range(len(model.phases)), domain=pyo.NonNegativeReals)
    m.epigraph = pyo.ConstraintList()
    objective = 0
    scale = _time_scale(model)
    for i, ph in enumerate(model.phases):
        for terms in ph.pipes.values():
            m.epigraph.add(m.T[i] >= sum(expr(t) * scale for t in terms))
        objective = objective + m.T[i] + sum(expr(t) * scale for t in ph.additive)
    m.obj = pyo.Objective(expr=objective, sense=pyo.minimize)

    opt = SolverFactory("highs")
    res = opt.solve(m, time_limit=time_limit_s, load_solutions=False, raise_exception_on_nonoptimal_result=False)
    tc = res.termination_condition
    if tc in (TerminationCondition.provenInfeasible, TerminationCondition.infeasibleOrUnbounded):
        return Solution("infeasible", None, None, 0.0)
    if res.incumbent_objective is None:
        status = "timeout" if tc == TerminationCondition.maxTimeLimit else "infeasible"
        return Solution(status, None, None, 0.0)
    res.solution_loader.load_vars()
    choice = {k: v for (k, v) in sorted(xs) if pyo.value(m.x[k, v]) > 0.5}
    status = "optimal" if tc == TerminationCondition.convergenceCriteriaSatisfied else "feasible"
    return Solution(status, choice, None, 0.0)


def _solve_cpsat(model: ChoiceModel, time_limit_s: float, drop: str | None) -> Solution:
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    x = {(k, v): m.NewBoolVar(f"x_{k}_{v}") for k, vals in model.domains.items() for v in vals}
    for k, vals in model.domains.items():
        m.AddExactlyOne(x[k, v] for v in vals)

    def expr(term: Term, scale: float):
        if len(term.knobs) == 1:
            k = term.knobs[0]
            return sum(round(term.table[(v,)] * scale) * x[k, v] for v in model.domains[k])
        cells = _cells(term, model.domains)
        z = [m.NewBoolVar("z") for _ in cells]
        for pos, k in enumerate(term.knobs):
            for v in model.domains[k]:
                m.Add(sum(z[i] for i, c in enumerate(cells) if c[pos] == v) == x[k, v])
        return sum(round(term.table[c] * scale) * z[i] for i, c in enumerate(cells))

    for c in model.constraints:
        if c.name != drop:
            m.Add(expr(c.usage, 1.0) <= math.floor(c.limit))
    ns = 1e9  # seconds -> integer nanoseconds
    objective = 0
    for ph in model.phases:
        horizon = sum(max(t.table.values()) for terms in ph.pipes.values() for t in terms)
        T = m.NewIntVar(0, int(math.ceil(horizon * ns)) + 1, f"T_{ph.name}")
        for terms in ph.pipes.values():
            m.Add(T >= sum(expr(t, ns) for t in terms))
        objective = objective + T + sum(expr(t, ns) for t in ph.additive)
    m.Minimize(objective)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1  # deterministic answers
    status = solver.Solve(m)
    if status == cp_model.INFEASIBLE:
        return Solution("infeasible", None, None, 0.0)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solution("timeout", None, None, 0.0)
    choice = {k: v for (k, v), var in x.items() if solver.Value(var)}
    return Solution("optimal" if status == cp_model.OPTIMAL else "feasible", choice, None, 0.0)


def _solve_scip(model: ChoiceModel, time_limit_s: float, drop: str | None) -> Solution:
    """The HiGHS formulation (continuous z, microsecond epigraphs) through pyscipopt."""
    from pyscipopt import SCIP_PARAMSETTING, Model, quicksum

    m = Model("tiling")
    m.hideOutput()
    m.setParam("limits/time", time_limit_s)
    m.setParam("randomization/randomseedshift", 0)   # deterministic answers
    # the marginal formulation is nearly integral: SCIP's default root cuts cost seconds (5 s on the
    # cross_entropy UB model) and buy nothing; the fast setting solves it in under one
    m.setSeparating(SCIP_PARAMSETTING.FAST)
    x = {(k, v): m.addVar(vtype="B", name=f"x_{k}_{v}") for k, vals in model.domains.items() for v in vals}
    for k, vals in model.domains.items():
        m.addCons(quicksum(x[k, v] for v in vals) == 1)

    def expr(term: Term, scale: float, limit: float | None = None):
        # a capacity cell beyond the limit is excluded outright: its (often huge, "never fits")
        # coefficient would otherwise wreck SCIP's numerics
        def coef(value: float) -> float:
            return 0.0 if limit is not None and value > limit else value * scale
        if len(term.knobs) == 1:
            k = term.knobs[0]
            for v in model.domains[k]:
                if limit is not None and term.table[(v,)] > limit:
                    m.chgVarUb(x[k, v], 0.0)
            return quicksum(coef(term.table[(v,)]) * x[k, v] for v in model.domains[k])
        cells = _cells(term, model.domains)
        z = [m.addVar(lb=0.0, ub=0.0 if limit is not None and term.table[c] > limit else 1.0) for c in cells]
        for pos, k in enumerate(term.knobs):
            for v in model.domains[k]:
                m.addCons(quicksum(z[i] for i, c in enumerate(cells) if c[pos] == v) == x[k, v])
        return quicksum(coef(term.table[c]) * z[i] for i, c in enumerate(cells))

    for c in model.constraints:
        if c.name != drop:
            m.addCons(expr(c.usage, 1.0, c.limit) <= c.limit)
    objective = 0
    for ph in model.phases:
        T = m.addVar(lb=0.0, name=f"T_{ph.name}")
        for terms in ph.pipes.values():
            m.addCons(T >= quicksum(expr(t, 1e6) for t in terms))
        objective = objective + T + quicksum(expr(t, 1e6) for t in ph.additive)
    m.setObjective(objective, "minimize")
    m.optimize()
    status = m.getStatus()
    if status == "infeasible":
        return Solution("infeasible", None, None, 0.0)
    if m.getNSols() == 0:
        return Solution("timeout" if status in ("timelimit", "userinterrupt") else "infeasible", None, None, 0.0)
    best = m.getBestSol()
    choice = {k: v for (k, v), var in x.items() if m.getSolVal(best, var) > 0.5}
    return Solution("optimal" if status == "optimal" else "feasible", choice, None, 0.0)


def feasible_choices(model: ChoiceModel) -> list[dict[str, int]]:
    choices = (dict(zip(model.domains, c)) for c in itertools.product(*model.domains.values()))
    return [c for c in choices if model.feasible(c)]


def runners_up(model: ChoiceModel, pick: dict[str, int], n: int | None = None) -> list[tuple[dict[str, int], float]]:
    """The model's n best feasible tilings after the pick (None: all of them), with their predicted
    seconds (ties in domain order); the pick is told apart on the model's own knobs (a plan's may
    carry more)."""
    mine = {k: pick[k] for k in model.domains}
    ranked = sorted(((c, model.evaluate(c)[0]) for c in feasible_choices(model) if c != mine), key=lambda cs: cs[1])
    return ranked if n is None else ranked[:n]
