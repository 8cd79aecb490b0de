"""A small discrete-choice MILP and its two solvers (Pyomo + HiGHS, OR-Tools CP-SAT).

Formulation (every tiling model in AuraKernel has this shape):

    knobs k with candidate values V_k;  x[k,v] in {0,1},  sum_v x[k,v] = 1          (one value each)
    a term over knobs K is a table c[t] over value tuples t in prod_{k in K} V_k. For |K| = 1 it is
        linear in x; for |K| > 1 it gets cell weights z[t] in [0,1] with the marginal constraints
        sum_{t : t_k = v} z[t] = x[k,v]  for every k in K, v in V_k,
        which force z to the single cell picked by the x (so z needs no integrality), and its value
        is sum_t c[t] z[t]                                                               (exact)
        Every term over the same K shares one z (the same cell is picked for all of them), and the
        terms of one sum (a pipe's, a phase's additive ones) over the same K are added into one
        table first: sparse attention's Cube model has 26 terms over two knob sets, 17.9k cells
        each with its own z before, 1.1k now.
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
          drop: int | None = None) -> Solution:
    """Solve the model (optionally without its constraint number `drop`) with the named solver."""
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}: accepted are {', '.join(SOLVERS)}")
    if not time_limit_s > 0:
        raise UserError(f"the solver time limit must be positive, got {time_limit_s!r} s")
    solver_fn = {"highs": _solve_highs, "cpsat": _solve_cpsat, "scip": _solve_scip}[solver]
    return _timed(model, lambda: solver_fn(model, time_limit_s, drop))


def _timed(model: ChoiceModel, run) -> Solution:
    """run()'s Solution with its time and its objective evaluated exactly (CP-SAT works on rounded
    coefficients)."""
    t0 = time.perf_counter()
    sol = run()
    sol.solve_s = time.perf_counter() - t0
    if sol.choice is not None:
        sol.objective = model.evaluate(sol.choice)[0]
    return sol


def _cells(term: Term, domains: dict[str, list[int]]):
    return list(itertools.product(*(domains[k] for k in term.knobs)))


def _merged(terms) -> list[Term]:
    """The terms of one sum, those over the same knobs added into one table (in first-seen order)."""
    by_knobs: dict[tuple[str, ...], dict[tuple[int, ...], float]] = {}
    for t in terms:
        table = by_knobs.setdefault(t.knobs, {})
        for cell, v in t.table.items():
            table[cell] = table.get(cell, 0.0) + v
    return [Term(k, table) for k, table in by_knobs.items()]


class _CellWeights:
    """The z of each knob set, made once per model: `new_vars(n)` makes its n variables (in cell
    order), `marginal(zs, knob, value)` adds the constraint sum(zs) == x[knob, value]. Every term over
    that knob set reads the same z."""

    def __init__(self, domains: dict[str, list[int]], new_vars, marginal):
        self.domains, self.new_vars, self.marginal = domains, new_vars, marginal
        self.made: dict[tuple[str, ...], tuple[list, list]] = {}

    def of(self, term: Term) -> tuple[list, list]:
        """(cells, z) of the term's knob set."""
        if term.knobs not in self.made:
            cells = _cells(term, self.domains)
            z = self.new_vars(len(cells))
            for pos, k in enumerate(term.knobs):
                members: dict[int, list] = {v: [] for v in self.domains[k]}
                for i, c in enumerate(cells):
                    members[c[pos]].append(z[i])
                for v, zs in members.items():
                    self.marginal(zs, k, v)
            self.made[term.knobs] = (cells, z)
        return self.made[term.knobs]

    def linear(self, terms, x):
        """(coefficient, variable) pairs whose sum is the terms' sum: x[knob, value] for a one-knob
        term, the knob set's z for the others (the terms over one knob set added first)."""
        for term in _merged(terms):
            if len(term.knobs) == 1:
                k = term.knobs[0]
                yield from ((term.table[(v,)], x[k, v]) for v in self.domains[k])
            else:
                cells, z = self.of(term)
                yield from ((term.table[c], z[i]) for i, c in enumerate(cells))


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


class _HighsModel:
    """The model in Pyomo, built once, solved by HiGHS with any one capacity left out (deactivated,
    not rebuilt: the binding analysis solves it once per constraint)."""

    def __init__(self, model: ChoiceModel):
        import pyomo.environ as pyo
        from pyomo.contrib.solver.common.factory import SolverFactory

        self.pyo = pyo
        self.m = m = pyo.ConcreteModel()
        self.xs = sorted({(k, v) for k, vals in model.domains.items() for v in vals})
        m.x = pyo.Var(self.xs, domain=pyo.Binary)
        m.one_value = pyo.ConstraintList()
        for k, vals in model.domains.items():
            m.one_value.add(sum(m.x[k, v] for v in vals) == 1)

        m.z = pyo.Block()
        m.marginals = pyo.ConstraintList()
        counter = itertools.count()

        def new_vars(n: int):
            z = pyo.Var(range(n), bounds=(0, 1))
            m.z.add_component(f"z{next(counter)}", z)
            return [z[i] for i in range(n)]

        weights = _CellWeights(model.domains, new_vars, lambda zs, k, v: m.marginals.add(sum(zs) == m.x[k, v]))

        def expr(terms, scale: float = 1.0):   # in the units _time_scale picks, which keep the LP well scaled
            return sum(coef * scale * var for coef, var in weights.linear(terms, m.x))

        m.capacity = pyo.ConstraintList()
        self.capacity = [m.capacity.add(expr([c.usage]) <= c.limit) for c in model.constraints]
        m.T = pyo.Var(range(len(model.phases)), domain=pyo.NonNegativeReals)
        m.epigraph = pyo.ConstraintList()
        objective = 0
        scale = _time_scale(model)
        for i, ph in enumerate(model.phases):
            for terms in ph.pipes.values():
                m.epigraph.add(m.T[i] >= expr(terms, scale))
            objective = objective + m.T[i] + expr(ph.additive, scale)
        m.obj = pyo.Objective(expr=objective, sense=pyo.minimize)
        self.opt = SolverFactory("highs")

    def solve(self, time_limit_s: float, drop: int | None) -> Solution:
        from pyomo.contrib.solver.common.results import TerminationCondition

        if drop is not None:
            self.capacity[drop].deactivate()
        try:
            res = self.opt.solve(self.m, time_limit=time_limit_s, load_solutions=False,
                                 raise_exception_on_nonoptimal_result=False)
        finally:
            if drop is not None:
                self.capacity[drop].activate()
        tc = res.termination_condition
        if tc in (TerminationCondition.provenInfeasible, TerminationCondition.infeasibleOrUnbounded):
            return Solution("infeasible", None, None, 0.0)
        if res.incumbent_objective is None:
            status = "timeout" if tc == TerminationCondition.maxTimeLimit else "infeasible"
            return Solution(status, None, None, 0.0)
        res.solution_loader.load_vars()
        choice = {k: v for (k, v) in self.xs if self.pyo.value(self.m.x[k, v]) > 0.5}
        status = "optimal" if tc == TerminationCondition.convergenceCriteriaSatisfied else "feasible"
        return Solution(status, choice, None, 0.0)


def _solve_highs(model: ChoiceModel, time_limit_s: float, drop: int | None) -> Solution:
    return _with_highs_model(model, lambda solve_one: solve_one(time_limit_s, drop))


@one_pyomo_model_at_a_time
def _with_highs_model(model: ChoiceModel, use):
    """use(solve_one) with solve_one(time_limit_s, drop) solving one Pyomo model, built once."""
    return use(_HighsModel(model).solve)


def relaxed(model: ChoiceModel, solver: str, drops: list[int], deadline: float, until=lambda sol: False) -> dict[int, Solution]:
    """The model solved once without each of the constraints numbered in `drops`, in order, while
    time is left before `deadline` (perf_counter seconds) and until a solution meets `until`:
    {number: Solution} of the solves made. HiGHS builds the model once for all of them."""
    def each(solve_without) -> dict[int, Solution]:
        out = {}
        for i in drops:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            out[i] = sol = solve_without(i, left)
            if until(sol):
                break
        return out
    if solver == "highs":
        return _with_highs_model(model, lambda solve_one: each(lambda i, left: _timed(model, lambda: solve_one(left, i))))
    return each(lambda i, left: solve(model, solver, left, drop=i))


def _solve_cpsat(model: ChoiceModel, time_limit_s: float, drop: int | None) -> Solution:
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    x = {(k, v): m.NewBoolVar(f"x_{k}_{v}") for k, vals in model.domains.items() for v in vals}
    for k, vals in model.domains.items():
        m.AddExactlyOne(x[k, v] for v in vals)

    weights = _CellWeights(model.domains, lambda n: [m.NewBoolVar("z") for _ in range(n)],
                           lambda zs, k, v: m.Add(sum(zs) == x[k, v]))

    def expr(terms, scale: float):
        return sum(round(coef * scale) * var for coef, var in weights.linear(terms, x))

    for i, c in enumerate(model.constraints):
        if i != drop:
            m.Add(expr([c.usage], 1.0) <= math.floor(c.limit))
    ns = 1e9  # seconds -> integer nanoseconds
    objective = 0
    for ph in model.phases:
        horizon = sum(max(t.table.values()) for terms in ph.pipes.values() for t in terms)
        T = m.NewIntVar(0, int(math.ceil(horizon * ns)) + 1, f"T_{ph.name}")
        for terms in ph.pipes.values():
            m.Add(T >= expr(terms, ns))
        objective = objective + T + expr(ph.additive, ns)
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


def _solve_scip(model: ChoiceModel, time_limit_s: float, drop: int | None) -> Solution:
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

    weights = _CellWeights(model.domains, lambda n: [m.addVar(lb=0.0, ub=1.0) for _ in range(n)],
                           lambda zs, k, v: m.addCons(quicksum(zs) == x[k, v]))

    def expr(terms, scale: float, limit: float | None = None):
        # a capacity cell beyond the limit is excluded outright (its z, or its x, fixed at 0): its
        # (often huge, "never fits") coefficient would otherwise wreck SCIP's numerics
        pairs = list(weights.linear(terms, x))
        if limit is not None:
            for coef, var in pairs:
                if coef > limit:
                    m.chgVarUb(var, 0.0)
        return quicksum((0.0 if limit is not None and coef > limit else coef * scale) * var for coef, var in pairs)

    for i, c in enumerate(model.constraints):
        if i != drop:
            m.addCons(expr([c.usage], 1.0, c.limit) <= c.limit)
    objective = 0
    for ph in model.phases:
        T = m.addVar(lb=0.0, name=f"T_{ph.name}")
        for terms in ph.pipes.values():
            m.addCons(T >= expr(terms, 1e6))
        objective = objective + T + expr(ph.additive, 1e6)
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
