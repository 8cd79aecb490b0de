"""Layout: which memory layout each tensor of a fused op group is stored in, and in which layout
each op reads it, as an assignment MILP over the group's tensor graph (Pyomo + HiGHS, or CP-SAT).

Layouts. Ascend: ND (row-major), NZ (fractal: 16-row x 32 B blocks, the Cube's native format, rows
and columns padded to the fractal) and T (transposed ND). Host: RM (row-major), CM (column-major)
and RM_PAD (row-major with the row pitch padded to the cache line / SIMD width).

The graph: tensors (2-D: rows x cols, element size) and ops (kind, inputs, outputs). A tensor is
written once, by its producer, in its stored layout; every op that reads it reads it in some layout,
and where that differs from the stored one a conversion kernel runs on that edge. Each access (op,
tensor) costs extra time per layout -- the Cube wants NZ, vector row kernels want ND, an unaligned
row tail costs the host a scalar remainder loop, padding costs bytes -- from the HardwareProfile
(`ascend_costs`, `host_costs`).

    x[t, l] in {0,1}        tensor t stored in layout l            sum_l x[t, l] = 1
    y[o, t, l] in {0,1}     op o reads t in layout l               sum_l y[o, t, l] = 1
    w[o, t, l, m] in [0,1]  stored l, read m (a transport between x and y: integral at the optimum)
                            sum_m w[o, t, l, m] = x[t, l],  sum_l w[o, t, l, m] = y[o, t, m]
    same layout             an elementwise op reads and writes every operand in one layout:
                            y[o, t, l] = x[u, l] for its inputs t and output u
    fixed                   a tensor at a standalone group's boundary is in the framework's layout
                            (ND / RM): x[t, fixed] = 1. Weights are free: converted once at load.
    minimise  sum_{o writes t} c_w[o, t, l] x[t, l] + sum_{o reads t} c_r[o, t, l] y[o, t, l]
              + sum conv[t, l, m] w[o, t, l, m]

Adjacent groups are solved together by `join`: a tensor one group writes and the next reads is then
inside the joined graph, no longer pinned to ND, so NZ can be kept across the boundary when that
saves the two conversions.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from ..errors import PlanInfeasible, UserError
from .model import one_pyomo_model_at_a_time

ASCEND_LAYOUTS = ("ND", "NZ", "T")
HOST_LAYOUTS = ("RM", "CM", "RM_PAD")
LAYOUT_SOLVERS = ("highs", "cpsat")
KINDS = ("matmul", "rowwise", "elementwise", "view")


@dataclass(frozen=True)
class TensorNode:
    name: str
    rows: int
    cols: int
    elem_bytes: int
    weight: bool = False           # a parameter: its layout is chosen once, at load time

    @property
    def bytes(self) -> int:
        return self.rows * self.cols * self.elem_bytes


@dataclass(frozen=True)
class OpNode:
    name: str
    kind: str                      # one of KINDS
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass
class TensorGraph:
    name: str
    tensors: dict[str, TensorNode]
    ops: list[OpNode]

    def __post_init__(self):
        written = set()
        for o in self.ops:
            if o.kind not in KINDS:
                raise ValueError(f"op {o.name}: kind {o.kind!r} is not one of {KINDS}")
            for t in (*o.inputs, *o.outputs):
                if t not in self.tensors:
                    raise ValueError(f"op {o.name}: unknown tensor {t}")
            for t in o.outputs:
                if t in written:
                    raise ValueError(f"tensor {t} has two producers")
                written.add(t)

    def producer(self, t: str) -> OpNode | None:
        return next((o for o in self.ops if t in o.outputs), None)

    def consumers(self, t: str) -> list[OpNode]:
        return [o for o in self.ops if t in o.inputs]

    def boundary(self) -> list[str]:
        """Activations the group exchanges with the framework: read but not written here, or
        written but not read here."""
        return [t for t, n in self.tensors.items() if not n.weight
                and (self.producer(t) is None or not self.consumers(t))]


def join(name: str, *graphs: TensorGraph) -> TensorGraph:
    """Adjacent groups as one graph: tensors with the same name are the same tensor."""
    tensors: dict[str, TensorNode] = {}
    for g in graphs:
        for t, n in g.tensors.items():
            if t in tensors and tensors[t] != n:
                raise ValueError(f"tensor {t} differs between the groups")
            tensors[t] = n
    return TensorGraph(name, tensors, [o for g in graphs for o in g.ops])


@dataclass
class LayoutProblem:
    """The MILP's data: allowed layouts, accesses and their costs (seconds)."""

    layouts: dict[str, tuple[str, ...]]                  # tensor -> layouts it may be stored in
    writes: list[tuple[str, str]]                        # (op, tensor)
    reads: list[tuple[str, str]]                         # (op, tensor)
    cost: dict[tuple[str, str, str], float]              # (op, tensor, layout) -> extra seconds of the access
    conversion: dict[tuple[str, str, str], float]        # (tensor, stored, read) -> seconds of a conversion
    same_layout: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)   # (op, inputs, output)
    fixed: dict[str, str] = field(default_factory=dict)  # tensor -> required stored layout

    def access_layouts(self, op: str, t: str) -> list[str]:
        return [l for l in self.layouts[t] if (op, t, l) in self.cost]

    def feasible(self, stored: dict[str, str], read: dict[tuple[str, str], str]) -> bool:
        """Does an assignment keep every rule (no solver)?"""
        return (all(stored[t] in self.layouts[t] for t in self.layouts)
                and all(stored[t] == l for t, l in self.fixed.items())
                and all((o, t, stored[t]) in self.cost for o, t in self.writes)
                and all((o, t, read[(o, t)]) in self.cost for o, t in self.reads)
                and all(read[(o, t)] == stored[out] for o, ins, out in self.same_layout for t in ins))

    def evaluate(self, stored: dict[str, str], read: dict[tuple[str, str], str]) -> float:
        total = sum(self.cost[(o, t, stored[t])] for o, t in self.writes)
        for o, t in self.reads:
            total += self.cost[(o, t, read[(o, t)])]
            if read[(o, t)] != stored[t]:
                total += self.conversion[(t, stored[t], read[(o, t)])]
        return total


@dataclass
class LayoutSolution:
    stored: dict[str, str]
    read: dict[tuple[str, str], str]
    conversions: list[tuple[str, str, str, str]]         # (tensor, op, from, to)
    objective: float                                      # seconds
    status: str
    solver: str
    solve_s: float


def solve_layout(p: LayoutProblem, solver: str = "highs", time_limit_s: float = 10.0) -> LayoutSolution:
    if solver not in LAYOUT_SOLVERS:
        raise UserError(f"unknown layout solver {solver!r}: accepted are {', '.join(LAYOUT_SOLVERS)}")
    for t, l in p.fixed.items():
        if l not in p.layouts[t]:
            raise PlanInfeasible(f"fixed layout of {t}", f"{l} is not among its layouts {p.layouts[t]}")
    for o, t in (*p.writes, *p.reads):
        if not p.access_layouts(o, t):
            raise PlanInfeasible(f"access {o} -> {t}", "the op accepts none of the tensor's layouts")
    for o, t in p.writes:
        if t not in p.fixed and not any((o, t, l) in p.cost for l in p.layouts[t]):
            raise PlanInfeasible(f"output {t} of {o}", "no layout the op can write")
    t0 = time.perf_counter()
    stored, read, status = (_solve_highs if solver == "highs" else _solve_cpsat)(p, time_limit_s)
    solve_s = time.perf_counter() - t0
    if stored is None:
        raise PlanInfeasible("layout " + status, f"{solver} found no layout assignment"
                             + (f" within {time_limit_s:g} s" if status == "time limit" else ""))
    assert p.feasible(stored, read), "layout solver returned an assignment that breaks a rule"
    conv = [(t, o, stored[t], read[(o, t)]) for o, t in p.reads if read[(o, t)] != stored[t]]
    return LayoutSolution(stored, read, conv, p.evaluate(stored, read), status, solver, solve_s)


def _write_layouts(p: LayoutProblem, t: str, writers: dict[str, str]) -> list[str]:
    o = writers.get(t)
    allowed = [l for l in p.layouts[t] if o is None or (o, t, l) in p.cost]
    return [p.fixed[t]] if t in p.fixed and p.fixed[t] in allowed else ([] if t in p.fixed else allowed)


@one_pyomo_model_at_a_time
def _solve_highs(p: LayoutProblem, time_limit_s: float):
    import pyomo.environ as pyo
    from pyomo.contrib.solver.common.factory import SolverFactory
    from pyomo.contrib.solver.common.results import TerminationCondition

    writers = {t: o for o, t in p.writes}
    m = pyo.ConcreteModel()
    xs = [(t, l) for t in p.layouts for l in _write_layouts(p, t, writers)]
    ys = [(o, t, l) for o, t in p.reads for l in p.access_layouts(o, t)]
    ws = [(o, t, l, k) for o, t in p.reads for l in _write_layouts(p, t, writers) for k in p.access_layouts(o, t)]
    m.x = pyo.Var(xs, domain=pyo.Binary)
    m.y = pyo.Var(ys, domain=pyo.Binary)
    m.w = pyo.Var(ws, bounds=(0, 1))
    m.c = pyo.ConstraintList()
    for t in p.layouts:
        m.c.add(sum(m.x[t, l] for l in _write_layouts(p, t, writers)) == 1)   # one stored layout
    for o, t in p.reads:
        m.c.add(sum(m.y[o, t, l] for l in p.access_layouts(o, t)) == 1)       # one read layout per access
        for l in _write_layouts(p, t, writers):                                # the transport w couples them
            m.c.add(sum(m.w[o, t, l, k] for k in p.access_layouts(o, t)) == m.x[t, l])
        for k in p.access_layouts(o, t):
            m.c.add(sum(m.w[o, t, l, k] for l in _write_layouts(p, t, writers)) == m.y[o, t, k])
    for o, ins, out in p.same_layout:   # elementwise: operands share the output's layout
        for t in ins:
            for l in p.access_layouts(o, t):
                m.c.add(m.y[o, t, l] == (m.x[out, l] if (out, l) in m.x else 0))
    us = 1e6   # microseconds keep the LP well scaled
    obj = sum(p.cost[(writers[t], t, l)] * us * m.x[t, l] for t, l in xs if t in writers)
    obj += sum(p.cost[(o, t, l)] * us * m.y[o, t, l] for o, t, l in ys)
    obj += sum(p.conversion[(t, l, k)] * us * m.w[o, t, l, k] for o, t, l, k in ws if l != k)
    m.obj = pyo.Objective(expr=obj, sense=pyo.minimize)
    res = SolverFactory("highs").solve(m, time_limit=time_limit_s, load_solutions=False,
                                       raise_exception_on_nonoptimal_result=False)
    tc = res.termination_condition
    if res.incumbent_objective is None:
        return None, None, "time limit" if tc == TerminationCondition.maxTimeLimit else "infeasible"
    res.solution_loader.load_vars()
    stored = {t: l for t, l in xs if pyo.value(m.x[t, l]) > 0.5}
    read = {(o, t): l for o, t, l in ys if pyo.value(m.y[o, t, l]) > 0.5}
    return stored, read, "optimal" if tc == TerminationCondition.convergenceCriteriaSatisfied else "feasible"


def _solve_cpsat(p: LayoutProblem, time_limit_s: float):
    from ortools.sat.python import cp_model

    writers = {t: o for o, t in p.writes}
    m = cp_model.CpModel()
    x = {(t, l): m.NewBoolVar(f"x_{t}_{l}") for t in p.layouts for l in _write_layouts(p, t, writers)}
    y = {(o, t, l): m.NewBoolVar(f"y_{o}_{t}_{l}") for o, t in p.reads for l in p.access_layouts(o, t)}
    for t in p.layouts:
        m.AddExactlyOne(x[t, l] for l in _write_layouts(p, t, writers))
    for o, t in p.reads:
        m.AddExactlyOne(y[o, t, l] for l in p.access_layouts(o, t))
    for o, ins, out in p.same_layout:
        for t in ins:
            for l in p.access_layouts(o, t):
                m.Add(y[o, t, l] == (x[out, l] if (out, l) in x else 0))
    ns = 1e10   # seconds -> integer tenths of a nanosecond
    terms = [round(p.cost[(writers[t], t, l)] * ns) * v for (t, l), v in x.items() if t in writers]
    terms += [round(p.cost[(o, t, l)] * ns) * v for (o, t, l), v in y.items()]
    for o, t in p.reads:   # conversion of an edge: both ends chosen (AND of two booleans)
        for l in _write_layouts(p, t, writers):
            for k in p.access_layouts(o, t):
                if l != k:
                    w = m.NewBoolVar(f"w_{o}_{t}_{l}_{k}")
                    m.AddBoolOr([x[t, l].Not(), y[o, t, k].Not(), w])
                    terms.append(round(p.conversion[(t, l, k)] * ns) * w)
    m.Minimize(sum(terms))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, None, "infeasible" if status == cp_model.INFEASIBLE else "time limit"
    stored = {t: l for (t, l), v in x.items() if solver.Value(v)}
    read = {(o, t): l for (o, t, l), v in y.items() if solver.Value(v)}
    return stored, read, "optimal" if status == cp_model.OPTIMAL else "feasible"


# --- costs from the hardware profile ------------------------------------------------------------------

def _problem(graph: TensorGraph, layouts_of, access_cost, conversion_cost, framework: str,
             standalone: bool) -> LayoutProblem:
    layouts = {t: layouts_of(n) for t, n in graph.tensors.items()}
    writes = [(o.name, t) for o in graph.ops for t in o.outputs]
    reads = [(o.name, t) for o in graph.ops for t in o.inputs]
    cost = {}
    for o in graph.ops:
        for role, t in [*((("in", i), t) for i, t in enumerate(o.inputs)), *((("out", i), t) for i, t in enumerate(o.outputs))]:
            for l in layouts[t]:
                c = access_cost(o, role, graph.tensors[t], l)
                if c is not None:
                    cost[(o.name, t, l)] = c
    conversion = {(t, a, b): conversion_cost(graph.tensors[t], a, b)
                  for t in graph.tensors for a, b in itertools.permutations(layouts[t], 2)}
    same = [(o.name, o.inputs, o.outputs[0]) for o in graph.ops if o.kind == "elementwise"]
    fixed = {t: framework for t in graph.boundary()} if standalone else {}
    return LayoutProblem(layouts, writes, reads, cost, conversion, same, fixed)


def ascend_costs(graph: TensorGraph, hw, standalone: bool = True) -> LayoutProblem:
    """The group on an Ascend profile. Extra time per access, in HBM-seconds of the bytes involved
    (s = 1 / HBM bandwidth; the factors are ESTIMATES of the documented behaviour):
      matmul   inputs NZ 0 (the Cube's fractals), ND or T 1.0 (re-laid into fractals through the UB
               on the way in); output NZ 0 (L0C is NZ), ND 0.25 (FixPipe converts on the fly), T 1.0
      rowwise  ND 0; NZ 0.5 of the padded bytes (a row spans many fractals: 32 B bursts at a 512 B
               stride); T 2.0 (a row is a strided column)
      elementwise  ND 0, T 0, NZ the padding's bytes; every operand in the output's layout
      view     ND only (a reshape of fractals is a real copy)
    Conversion on an edge: a TransData launch plus reading the source and writing the target."""
    s = 1.0 / (hw.memory["HBM"].bandwidth_gbps * 1e9)
    launch = hw.call_overhead_us * 1e-6

    def nz_bytes(n: TensorNode) -> int:
        c0 = 32 // n.elem_bytes
        return math.ceil(n.rows / 16) * 16 * math.ceil(n.cols / c0) * c0 * n.elem_bytes

    def nbytes(n: TensorNode, l: str) -> int:
        return nz_bytes(n) if l == "NZ" else n.bytes

    def layouts_of(n: TensorNode) -> tuple[str, ...]:
        return ("ND",) if min(n.rows, n.cols) == 1 else ASCEND_LAYOUTS   # a vector has one layout

    def access(o: OpNode, role, n: TensorNode, l: str) -> float | None:
        if o.kind == "matmul":
            if role[0] == "in":
                return 0.0 if l == "NZ" else 1.0 * n.bytes * s
            return {"NZ": 0.0, "ND": 0.25 * n.bytes * s, "T": 1.0 * n.bytes * s}[l]
        if o.kind == "rowwise":
            return {"ND": 0.0, "NZ": 0.5 * nz_bytes(n) * s, "T": 2.0 * n.bytes * s}[l]
        if o.kind == "elementwise":
            return (nz_bytes(n) - n.bytes) * s if l == "NZ" else 0.0
        return 0.0 if l == "ND" else None   # view

    def convert(n: TensorNode, a: str, b: str) -> float:
        return launch + (nbytes(n, a) + nbytes(n, b)) * s

    return _problem(graph, layouts_of, access, convert, "ND", standalone)


def host_costs(graph: TensorGraph, hw, standalone: bool = True) -> LayoutProblem:
    """The group on the host profile. s = 1 / (all-core streaming bandwidth); rows of a width that
    is not a multiple of the SIMD width end in a scalar remainder loop (one cycle per element of
    the SIMD width per row, an ESTIMATE) unless the pitch is padded:
      matmul   A: RM / RM_PAD 0, CM 1.0 (packing transposes it); B: CM 0 (K contiguous),
               RM / RM_PAD 0.5 (packed into panels); output RM / RM_PAD 0, CM 1.0
      rowwise  RM the tail loop; RM_PAD the pad bytes; CM 2.0 (strided)
      elementwise  same as rowwise but CM 0 (any common order); every operand in one layout
      view     RM only
    Conversions: a call plus reading and writing the tensor, twice that for a transpose."""
    s = 1.0 / (hw.stream_bandwidth(hw.cores))
    clock = hw.clock_ghz * 1e9
    line = max(64, hw.simd_bytes)

    def pitch(n: TensorNode) -> int:
        return math.ceil(n.cols * n.elem_bytes / line) * line

    def layouts_of(n: TensorNode) -> tuple[str, ...]:
        if min(n.rows, n.cols) == 1:
            return ("RM",)
        return HOST_LAYOUTS if pitch(n) != n.cols * n.elem_bytes else ("RM", "CM")   # padding changes nothing

    def tail(n: TensorNode) -> float:
        lanes = max(hw.simd_bytes // n.elem_bytes, 1)
        return n.rows * lanes / clock if n.cols % lanes else 0.0

    def pad(n: TensorNode) -> float:
        return n.rows * (pitch(n) - n.cols * n.elem_bytes) * s

    def access(o: OpNode, role, n: TensorNode, l: str) -> float | None:
        if o.kind == "matmul":
            if role == ("in", 1):
                return {"CM": 0.0, "RM": 0.5 * n.bytes * s, "RM_PAD": 0.5 * n.bytes * s}[l]
            return {"RM": 0.0, "RM_PAD": 0.0, "CM": 1.0 * n.bytes * s}[l]
        if o.kind in ("rowwise", "elementwise"):
            return {"RM": tail(n), "RM_PAD": pad(n), "CM": 0.0 if o.kind == "elementwise" else 2.0 * n.bytes * s}[l]
        return 0.0 if l == "RM" else None   # view

    def convert(n: TensorNode, a: str, b: str) -> float:
        factor = 2.0 if "CM" in (a, b) else 1.0
        return hw.call_overhead_us * 1e-6 + factor * 2 * n.bytes * s

    return _problem(graph, layouts_of, access, convert, "RM", standalone)


# --- the groups at the DeepSeek-V4-Flash shapes --------------------------------------------------------

V4_FLASH = {"hidden": 4096, "hc": 4, "vocab": 129280}


def mhc_pre_graph(tokens: int, hidden: int = V4_FLASH["hidden"], hc: int = V4_FLASH["hc"],
                  elem_bytes: int = 2) -> TensorGraph:
    """mhc_pre: the hc streams flattened to hc*D, an unweighted RMS, the (2 + hc) * hc mix matmul
    against a (2 + hc) * hc x hc*D fp32 weight, sigmoid/softmax + Sinkhorn (pre, post, comb), and
    the pre-weighted sum of the streams."""
    w, nmix = hc * hidden, (2 + hc) * hc
    t = {n.name: n for n in (
        TensorNode("streams", tokens * hc, hidden, elem_bytes),       # [T, hc, D] as stored by the layer
        TensorNode("x_flat", tokens, w, elem_bytes),
        TensorNode("x_norm", tokens, w, 4),
        TensorNode("w_mix", w, nmix, 4, weight=True),                  # read as B (K x N)
        TensorNode("mix", tokens, nmix, 4),
        TensorNode("pre", tokens, hc, 4), TensorNode("post", tokens, hc, 4),
        TensorNode("comb", tokens, hc * hc, 4),
        TensorNode("h", tokens, hidden, elem_bytes))}
    ops = [OpNode("flatten", "view", ("streams",), ("x_flat",)),
           OpNode("rms", "rowwise", ("x_flat",), ("x_norm",)),
           OpNode("mix_matmul", "matmul", ("x_norm", "w_mix"), ("mix",)),
           OpNode("sinkhorn", "rowwise", ("mix",), ("pre", "post", "comb")),
           OpNode("weighted_sum", "rowwise", ("x_flat", "pre"), ("h",))]
    return TensorGraph("mhc_pre", t, ops)


def cross_entropy_graph(tokens: int, hidden: int = V4_FLASH["hidden"], vocab: int = V4_FLASH["vocab"],
                        elem_bytes: int = 2) -> TensorGraph:
    """The loss: the LM head matmul (hidden x vocab weight) to logits, then softmax / CE per row."""
    t = {n.name: n for n in (
        TensorNode("h_final", tokens, hidden, elem_bytes),
        TensorNode("w_head", hidden, vocab, elem_bytes, weight=True),
        TensorNode("logits", tokens, vocab, elem_bytes),
        TensorNode("labels", tokens, 1, 8),
        TensorNode("loss_rows", tokens, 1, 4))}
    ops = [OpNode("lm_head", "matmul", ("h_final", "w_head"), ("logits",)),
           OpNode("softmax_ce", "rowwise", ("logits", "labels"), ("loss_rows",))]
    return TensorGraph("cross_entropy", t, ops)
