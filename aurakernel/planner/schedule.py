"""Pipeline schedule of a tiled kernel (OR-Tools CP-SAT): in which order the loop body issues its
stages, how far ahead copies are issued (prefetch distance) and how many buffers each queue gets.

A kernel's loop runs the same stages for every tile: copy-in (MTE2), compute steps (Vector, Scalar,
Cube), copy-out (MTE3). Each unit runs its instructions in order, the units run in parallel, and the
scalar unit issues every instruction in program order -- so a stage that ends in a scalar wait (a
reduction read back with GetValue after WaitFlag<V_S>) holds back everything issued after it.
Whether copy-in(i + 1) can run under compute(i) therefore depends on the body's order, not only on
the buffer count. The model (a modulo schedule: every tile repeats tile 0's timetable shifted by the
initiation interval II):

    data       stages s (body order = a topological order), unit u_s, cycles d_s per tile
    variables  II >= 0; t_s >= 0: start of stage s of tile 0 (tile j starts it at t_s + j*II);
               lead_s in [0, max_lead_s]: stage s of tile j is issued in loop iteration j - lead_s
               (copy-in with lead 1 = CopyIn(i + 1) issued in iteration i: prefetch distance 1);
               B_q in [1, max_q] buffers of queue q (one boolean per value)
    issue order  instance (s, j) precedes (s', j') in program order iff
               (j - lead_s, pos_s) < (j' - lead_s', pos_s') lexicographically. For a pair of stages
               and a tile distance D the boolean after[x, y, D] = "(y, D) is issued after (x, 0)" is
               reified from  D - lead_y + lead_x >= (0 if pos_y > pos_x else 1)
    data       t_c >= t_p + d_p                                   for every edge p -> c (same tile)
    leads      lead_p >= lead_c for every edge (a consumer is never issued before its producer)
    pipes      after[x, y, D] => t_y + D*II >= t_x + d_x     for x, y on the same unit (in-order queue)
    issuer     after[x, y, D] => t_y + D*II >= t_x + d_x     for x that blocks the issuer (scalar wait)
               (D over [-R, R + 1], R = the largest lead: beyond it `after` is constant and the
               constraint implied by D = R + 1)
    buffers    tile j + B_q reuses tile j's buffer (round robin):  B_q = v  =>  t_p + v*II >= t_c + d_c
               for producer p (allocates at its start) and last consumer c (frees at its end);
               program order: at the producer's issue lead_p - lead_c + 1 tiles are allocated and
               not yet freed, so B_q >= lead_p - lead_c + 1
    UB         sum_q B_q * bytes_q <= the UB left beside the kernel's other buffers
    minimise   (tiles - 1) * II + L,  L >= t_s + d_s: the steady state plus prologue/epilogue (one
               tile's latency), then (tie-break) fewer buffers and shorter leads

`simulate` replays a (leads, buffers) choice instance by instance under the same rules (as soon as
possible, no periodicity), which checks the solver's answer and predicts any order's cycles, e.g.
the plain CopyIn(i), Compute(i), CopyOut(i) loop (all leads 0).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..errors import PlanInfeasible, UserError

UNITS = ("MTE2", "MTE3", "Vector", "Scalar", "Cube")
TIE_BREAK = 1000   # objective weight of one cycle against one buffer or one iteration of lead


@dataclass(frozen=True)
class Stage:
    name: str
    unit: str                      # one of UNITS
    cycles: int                    # per tile
    inputs: tuple[str, ...] = ()   # stages of the same tile whose results it reads
    blocks_issuer: bool = False    # ends in a scalar wait: nothing issued after it starts before it ends
    max_lead: int = 0              # how many iterations ahead of its tile's last stage it may be issued

    @property
    def blocking(self) -> bool:    # the scalar unit is the issuer: its own stages block it
        return self.blocks_issuer or self.unit == "Scalar"


@dataclass(frozen=True)
class Queue:
    name: str
    producer: str                  # allocates a buffer at its start
    consumers: tuple[str, ...]     # the last of them frees it at its end
    bytes: int                     # one buffer
    max_buffers: int = 3


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]      # body order: every stage after the stages it reads
    queues: tuple[Queue, ...]
    tiles: int                     # tiles one core runs
    ub_budget: int                 # bytes the queues may take together

    def __post_init__(self):
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"stage names must be unique and present: {names}")
        pos = {n: i for i, n in enumerate(names)}
        for s in self.stages:
            if s.unit not in UNITS:
                raise ValueError(f"stage {s.name}: unit {s.unit!r} is not one of {UNITS}")
            if s.cycles < 0 or s.max_lead < 0:
                raise ValueError(f"stage {s.name}: negative cycles or lead")
            for i in s.inputs:
                if pos.get(i, len(names)) >= pos[s.name]:
                    raise ValueError(f"stage {s.name} reads {i}, which is not an earlier stage")
        for q in self.queues:
            if q.producer not in pos or not q.consumers or any(c not in pos for c in q.consumers):
                raise ValueError(f"queue {q.name}: unknown producer or consumer stage")
            if any(pos[c] <= pos[q.producer] for c in q.consumers) or q.max_buffers < 1:
                raise ValueError(f"queue {q.name}: consumers must follow the producer; max_buffers >= 1")
        if self.tiles < 1:
            raise ValueError("a pipeline runs at least one tile")

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def last_consumer(self, q: Queue) -> str:
        pos = {s.name: i for i, s in enumerate(self.stages)}
        return max(q.consumers, key=pos.__getitem__)


@dataclass
class Schedule:
    leads: dict[str, int]          # stage -> iterations ahead (copy-in's lead = prefetch distance)
    buffers: dict[str, int]        # queue -> buffer count
    ii: int                        # steady-state initiation interval, cycles
    latency: int                   # one tile, first start to last end (prologue + epilogue)
    cycles: int                    # predicted: (tiles - 1) * II + latency
    starts: dict[str, int]         # stage -> start of tile 0
    status: str                    # "optimal" or "feasible" (time limit hit with an incumbent)
    solve_s: float
    plain: bool = False            # every lead 0: the plain CopyIn / Compute / CopyOut order
    simulated: int = 0             # cycles of the same order replayed without periodicity
    extra: dict = field(default_factory=dict)

    def body(self, pipeline: Pipeline) -> list[str]:
        """The loop body in issue order, e.g. ['copy_in(i+1)', 'compute(i)', 'copy_out(i)']."""
        out = []
        for s in pipeline.stages:
            lead = self.leads[s.name]
            out.append(f"{s.name}(i+{lead})" if lead else f"{s.name}(i)")
        return out

    def to_dict(self, pipeline: Pipeline) -> dict:
        return {"body": self.body(pipeline), "leads": dict(self.leads), "buffers": dict(self.buffers),
                "ii": self.ii, "latency": self.latency, "cycles": self.cycles, "simulated": self.simulated,
                "status": self.status, "solve_s": self.solve_s}


def _issue_after(pos_x: int, pos_y: int, d: int, lead_x: int, lead_y: int) -> bool:
    """Is instance (y, tile d) issued after (x, tile 0)?"""
    g = d - lead_y + lead_x
    return g > 0 or (g == 0 and pos_y > pos_x)


def solve_schedule(pipeline: Pipeline, time_limit_s: float = 10.0) -> Schedule:
    """The CP-SAT modulo schedule of `pipeline` (see the module docstring); PlanInfeasible when no
    buffer assignment fits the UB budget or the time limit passes without an answer."""
    from ortools.sat.python import cp_model

    if time_limit_s <= 0:
        raise UserError(f"time limit must be positive, got {time_limit_s}")
    least = sum(q.bytes for q in pipeline.queues)
    if least > pipeline.ub_budget:
        raise PlanInfeasible("UB capacity (queues)", f"one buffer per queue needs {least:,} B, "
                                                     f"{pipeline.ub_budget:,} B are left for queues")
    stages = pipeline.stages
    pos = {s.name: i for i, s in enumerate(stages)}
    d = {s.name: int(s.cycles) for s in stages}
    total = sum(d.values())
    R = max(s.max_lead for s in stages)
    horizon = (R + 2) * max(total, 1)

    m = cp_model.CpModel()
    ii = m.NewIntVar(0, max(total, 1), "II")
    t = {s.name: m.NewIntVar(0, horizon, f"t_{s.name}") for s in stages}
    lead = {s.name: m.NewIntVar(0, s.max_lead, f"lead_{s.name}") for s in stages}
    span = m.NewIntVar(0, horizon + total, "L")

    # data: a stage starts after the stages it reads (same tile); never issued before them
    for s in stages:
        m.Add(span >= t[s.name] + d[s.name])
        for p in s.inputs:
            m.Add(t[s.name] >= t[p] + d[p])
            m.Add(lead[p] >= lead[s.name])
    # per unit, the work of one tile fits in one interval (a redundant cut that speeds the search)
    for u in UNITS:
        on_u = [d[s.name] for s in stages if s.unit == u]
        if on_u:
            m.Add(ii >= sum(on_u))

    # pipes run in issue order; a blocking stage holds back everything issued after it
    for x in stages:
        for y in stages:
            same_unit = x.unit == y.unit
            if not (same_unit or x.blocking):
                continue
            for dist in range(-R, R + 2):
                if x.name == y.name and dist <= 0:
                    continue
                thr = 0 if pos[y.name] > pos[x.name] else 1
                g = dist - lead[y.name] + lead[x.name]
                after = m.NewBoolVar(f"after_{x.name}_{y.name}_{dist}")
                m.Add(g >= thr).OnlyEnforceIf(after)
                m.Add(g <= thr - 1).OnlyEnforceIf(after.Not())
                m.Add(t[y.name] + dist * ii >= t[x.name] + d[x.name]).OnlyEnforceIf(after)

    # buffers: round-robin reuse in time, enough of them for what program order keeps allocated
    nbuf, pick = {}, {}
    for q in pipeline.queues:
        c = pipeline.last_consumer(q)
        nbuf[q.name] = m.NewIntVar(1, q.max_buffers, f"B_{q.name}")
        pick[q.name] = {v: m.NewBoolVar(f"B_{q.name}_{v}") for v in range(1, q.max_buffers + 1)}
        m.AddExactlyOne(pick[q.name].values())
        m.Add(nbuf[q.name] == sum(v * b for v, b in pick[q.name].items()))
        for v, b in pick[q.name].items():
            m.Add(t[q.producer] + v * ii >= t[c] + d[c]).OnlyEnforceIf(b)
        m.Add(nbuf[q.name] >= lead[q.producer] - lead[c] + 1)
    m.Add(sum(q.bytes * nbuf[q.name] for q in pipeline.queues) <= pipeline.ub_budget)

    tie = sum(nbuf.values()) + sum(lead.values())
    m.Minimize(TIE_BREAK * ((pipeline.tiles - 1) * ii + span) + tie)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1   # deterministic answers
    t0 = time.perf_counter()
    status = solver.Solve(m)
    solve_s = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            raise PlanInfeasible("UB capacity (queues)", "no buffer counts satisfy the schedule and the UB budget")
        raise PlanInfeasible("time limit", f"CP-SAT found no schedule within {time_limit_s:g} s")
    leads = {s.name: solver.Value(lead[s.name]) for s in stages}
    buffers = {q.name: solver.Value(nbuf[q.name]) for q in pipeline.queues}
    ii_v, span_v = solver.Value(ii), solver.Value(span)
    sched = Schedule(leads=leads, buffers=buffers, ii=ii_v, latency=span_v,
                     cycles=(pipeline.tiles - 1) * ii_v + span_v,
                     starts={s.name: solver.Value(t[s.name]) for s in stages},
                     status="optimal" if status == cp_model.OPTIMAL else "feasible", solve_s=solve_s,
                     plain=not any(leads.values()))
    sched.simulated = simulate(pipeline, leads, buffers)
    # the periodic timetable is one feasible execution: running as soon as possible cannot be slower
    assert sched.simulated <= sched.cycles, (sched.simulated, sched.cycles)
    return sched


def simulate(pipeline: Pipeline, leads: dict[str, int], buffers: dict[str, int]) -> int:
    """Cycles of `pipeline.tiles` tiles issued in the order `leads` gives, each instance as soon as
    its unit (in order), its inputs, the issuer (blocking stages issued before it) and its buffer
    (round robin: tile j - B's last consumer) allow. ValueError if program order would allocate
    more buffers than a queue has."""
    stages = pipeline.stages
    pos = {s.name: i for i, s in enumerate(stages)}
    for q in pipeline.queues:
        need = leads[q.producer] - leads[pipeline.last_consumer(q)] + 1
        if buffers[q.name] < need:
            raise ValueError(f"queue {q.name}: lead {leads[q.producer]} keeps {need} buffers allocated, "
                             f"it has {buffers[q.name]}")
    order = sorted(((j - leads[s.name], pos[s.name], j, s) for s in stages for j in range(pipeline.tiles)),
                   key=lambda e: (e[0], e[1]))
    unit_free = {u: 0 for u in UNITS}
    issuer = 0
    end: dict[tuple[str, int], int] = {}
    produced_by = {q.producer: q for q in pipeline.queues}
    for _, _, j, s in order:
        start = max(unit_free[s.unit], issuer)
        for p in s.inputs:
            start = max(start, end[(p, j)])
        q = produced_by.get(s.name)
        if q is not None and j - buffers[q.name] >= 0:
            start = max(start, end[(pipeline.last_consumer(q), j - buffers[q.name])])
        end[(s.name, j)] = start + s.cycles
        unit_free[s.unit] = start + s.cycles
        if s.blocking:
            issuer = start + s.cycles
    return max(end.values())


def plain(pipeline: Pipeline, buffers: int) -> dict:
    """The fallback order (every lead 0) with `buffers` per queue: its simulated cycles."""
    leads = {s.name: 0 for s in pipeline.stages}
    counts = {q.name: min(buffers, q.max_buffers) for q in pipeline.queues}
    return {"leads": leads, "buffers": counts, "cycles": simulate(pipeline, leads, counts)}


# --- the AscendC row-wise kernels (planner/ascend.py's model) as pipelines --------------------------

def ascend_row_pipeline(phase, rows: int, cols: int, elem_bytes: int, knobs: dict[str, int], hw, *,
                        split_cols: bool, compute_waits_scalar: bool, max_buffers: int = 3,
                        max_prefetch: int = 2) -> Pipeline:
    """One phase (an AscendRowPhase) of a row-wise AscendC kernel at the tiling's knobs as a
    copy-in -> compute -> copy-out pipeline, per tile, with the figures the emulator charges.
    `compute_waits_scalar`: the compute step reads reductions back on the scalar unit (a V_S wait)."""
    figures = hw.ascend_pipes(knobs["block_dim"])
    tr, ch, ct = knobs.get(f"{phase.name}_tile_rows", knobs["tile_rows"]), knobs["chunk"], knobs.get("col_tile", cols)
    rb = math.ceil(rows / knobs["block_dim"])
    tiles = rb * math.ceil(cols / ct) if split_cols and ct < cols else math.ceil(rb / tr)
    width = min(ct, cols)
    pitch = math.ceil(width * elem_bytes / 32) * 32

    def align32(b: float) -> int:
        return int(math.ceil(b / 32) * 32)

    def mte(copies: int, nbytes: float) -> int:
        return int(math.ceil(copies * figures.mte_latency + nbytes / figures.mte_bytes_per_cycle))

    elems = tr * width
    repeats = elems * 4 / 256
    vector = repeats * (phase.fast_ops_per_elem + figures.vec_slow_factor * phase.slow_ops_per_elem) \
        + tr * math.ceil(width / min(ch, width)) * phase.instrs_per_chunk * figures.vec_issue \
        + phase.instrs_per_tile * figures.vec_issue
    shared_in = (1 if phase.tile_in_bytes else 0) + phase.side_copies(tiles) / max(1, tiles)   # as planner/ascend.py
    stages = [Stage("copy_in", "MTE2", mte(phase.streams_in + shared_in, phase.streams_in * tr * pitch + phase.tile_in_bytes),
                    max_lead=max_prefetch),
              Stage("compute", "Vector", int(math.ceil(vector)), inputs=("copy_in",),
                    blocks_issuer=compute_waits_scalar)]
    in_bytes = phase.streams_in * tr * pitch + phase.side_in_bytes(tr) + align32(phase.tile_in_bytes)
    queues = [Queue("in", "copy_in", ("compute",), in_bytes, max_buffers)]
    if phase.streams_out:
        stages.append(Stage("copy_out", "MTE3", mte(phase.streams_out, phase.streams_out * tr * pitch),
                            inputs=("compute",)))
        queues.append(Queue("out", "compute", ("copy_out",), phase.streams_out * tr * pitch
                            + align32(tr * phase.small_out_bytes), max_buffers))
    # the UB beside the queues, as planner/ascend.py counts it
    fixed = (align32(phase.resident_bytes) + phase.work_buffers * ch * 4 + align32((8 + ch * 4 / 256) * 4)
             + math.ceil(phase.f32_tiles * tr * align32(width * 4)))
    return Pipeline(tuple(stages), tuple(queues), tiles, figures.ub_usable - fixed)


# --- the schedule as knobs of a plan, and back as typed template values ----------------------------

def schedule_knobs(schedules: dict[str, Schedule]) -> dict[str, int]:
    """Plan knobs of solved phase schedules: <phase>_prefetch (copy-in's lead over compute) and
    <phase>_<queue>_buffers."""
    out = {}
    for phase, s in schedules.items():
        out[f"{phase}_prefetch"] = int(s.leads["copy_in"] - s.leads["compute"])
        for q, b in s.buffers.items():
            out[f"{phase}_{q}_buffers"] = int(b)
    return out


def phase_schedule(knobs: dict[str, int], phase: str, queues: tuple[str, ...], max_buffers: int = 3) -> dict[str, int]:
    """The schedule values a template renders for `phase`, validated: the solved ones if the plan
    has them, else the plain order (prefetch 0) with the tiling's `buffers` per queue."""
    out = {"prefetch": int(knobs.get(f"{phase}_prefetch", 0))}
    for q in queues:
        out[f"{q}_buffers"] = int(knobs.get(f"{phase}_{q}_buffers", knobs["buffers"]))
        if not 1 <= out[f"{q}_buffers"] <= max_buffers:
            raise ValueError(f"{phase} queue {q}: {out[f'{q}_buffers']} buffers, accepted 1..{max_buffers}")
    if not 0 <= out["prefetch"] < out.get("in_buffers", 1):
        raise ValueError(f"{phase}: prefetch {out['prefetch']} needs more than that many input buffers "
                         f"({out.get('in_buffers')})")
    return out
