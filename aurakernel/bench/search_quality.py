"""Search quality of the planner: how close the MILP's pick comes to the fastest kernel of its space.

    aurakernel bench search-quality [--json] [--ops a,b] [--shapes-per-op N] [--max-candidates K]
                                    [--out DIR] [--db PATH]

Problems: every operator (its first variant; bf16 where it takes it, else its first dtype) at up to
three shapes, in this order:
  1. its default shape (`aurakernel ops`);
  2. fewer rows: the first extent >= 4 divided by 4 (thread split and per-tile costs weigh more);
  3. narrower rows: the last extent halved (chunking and per-row costs weigh more).
Candidates: the feasible choices of the operator's tiling model (the planner's ChoiceModel domains
and capacity constraints): all of them, or a uniform random sample of K (seeded per problem) that
always includes the MILP's pick. Each is built, verified with the tune loop's cases
(aurakernel.verify: a kernel that fails is never "best", it is listed under `failed`) and timed
fwd + bwd through the nn.Module path the trainer runs. All candidates of one problem are timed side
by side in the same interleaved rounds (aurakernel.measure.compare, medians); the pick runs twice
under two names, and the ratio of its two medians (`noise`) says how far apart two measurements of
one kernel land in that run: a pick_over_best within it is a tie.

Per row: pick_over_best = pick median / best median (1.0: the planner picked the fastest measured
kernel), pick_rank (1 = fastest of the verified candidates), solve_s (the MILP solve), plan_s (all
of solve_tiling, with the binding-constraint analysis), tune_s (plan + build + verify of the pick +
its share of the timing: what tuning by the planner costs), exhaustive_s (build + verify + timing of
every candidate of the space; extrapolated from the mean of those measured when the space was
sampled, flagged by exhaustive_estimated). Build times are this run's: a kernel already in the
build cache costs its load only, for the pick and the other candidates alike.

With --db, every verified, measured candidate is recorded in that tuning DB (status "measured", not
compared with eager, so never offered for swapping; an existing record of the same kernel is left
as it is): `aurakernel calibrate --fit` then fits the cost model to a space, not just to picks.
"""

from __future__ import annotations

import math
import random
import sqlite3
import time
from collections.abc import Callable

from .. import __version__
from ..db import Record, TuningDB
from ..dtypes import shape_text
from ..errors import UserError
from ..hardware import HardwareProfile, host_profile
from ..ops import OPS, OpSpec, Problem
from ..planner import solve_tiling
from ..planner.model import feasible_choices
from ..targets.host.candidates import Candidate, build_and_verify, time_side_by_side
from ..targets.host.ops import kernel_of as host_kernel
from .kernels import machine_info

SCHEMA = 1
SHAPES_PER_OP = 3
MAX_CANDIDATES = 16
ROW_KEYS = ("op", "variant", "shape", "dtype", "candidates_measured", "space_size", "pick_knobs", "best_knobs",
            "pick_over_best", "pick_rank", "noise", "solve_s", "plan_s", "tune_s", "exhaustive_s",
            "exhaustive_estimated", "failed")
SUMMARY_KEYS = ("pick_over_best_geomean", "pick_over_best_max", "solve_s_max")


def shapes(spec: OpSpec, variant: str) -> list[tuple[int, ...]]:
    """The default shape, then fewer rows, then narrower rows (module docstring); duplicates and
    shapes the operator does not accept are left out."""
    base = tuple(spec.default_shape_for(variant))
    lead = next((i for i, e in enumerate(base) if e >= 4), 0)
    fewer = base[:lead] + (max(1, base[lead] // 4),) + base[lead + 1:]
    narrower = base[:-1] + (max(1, base[-1] // 2),)
    out = []
    for shape in (base, fewer, narrower):
        try:
            spec.problem(shape_text(shape), spec.dtypes[0].value, variant)
        except UserError:
            continue
        if shape not in out:
            out.append(shape)
    return out


def problems(ops: list[str] | None = None, shapes_per_op: int = SHAPES_PER_OP) -> list[Problem]:
    out = []
    for name, spec in OPS.items():
        if ops is not None and name not in ops:
            continue
        variant = spec.variants[0]
        out.extend(spec.problem(shape_text(s), None, variant) for s in shapes(spec, variant)[:shapes_per_op])
    return out


def _sample(space: list[dict[str, int]], pick: dict[str, int], k: int, seed: str) -> list[dict[str, int]]:
    """The pick first, then up to k - 1 others drawn uniformly without replacement."""
    others = [c for c in space if c != pick]
    if len(others) > k - 1:
        others = random.Random(seed).sample(others, k - 1)
    return [pick, *others]


def _known(db: TuningDB, problem: Problem, source_hash: str) -> bool:
    with sqlite3.connect(db.path, timeout=30) as conn:
        return conn.execute(
            "SELECT 1 FROM records WHERE op=? AND variant=? AND shape=? AND dtype=? AND target='host'"
            " AND source_hash=? AND version=?", (problem.op, problem.variant, problem.shape_text,
                                                  problem.dtype.value, source_hash, __version__)).fetchone() is not None


def _record(db: TuningDB, problem: Problem, hw: HardwareProfile, cand: Candidate) -> None:
    """A measured candidate into the tuning DB, unless that kernel has a record already (INSERT OR
    REPLACE would overwrite a tune result with eager times)."""
    if _known(db, problem, cand.source_hash):
        return
    db.add(Record(op=problem.op, variant=problem.variant, shape=problem.shape_text, dtype=problem.dtype.value,
                  target="host", source_hash=cand.source_hash, hardware=hw.fingerprint(),
                  plan={"knobs": cand.knobs, "predicted_us": cand.predicted_us}, predicted_us=cand.predicted_us,
                  measured_us=cand.us, eager_us=None, compiled_us=None, verified=True, status="measured",
                  detail={"source": "bench search-quality", "verification": cand.summary}))


def problem_row(problem: Problem, hw: HardwareProfile, max_candidates: int = MAX_CANDIDATES, seed: int = 0,
                db: TuningDB | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Plan, enumerate, build, verify and time one problem's candidates: its row of the report."""
    spec = OPS[problem.op]
    model = host_kernel(spec).tiling_problem(problem, hw)
    t0 = time.perf_counter()
    plan = solve_tiling(model, op=problem.op, variant=problem.variant, shape=problem.shape,
                        dtype=problem.dtype.value, target="host", solver="highs")
    plan_s = time.perf_counter() - t0
    space = feasible_choices(model)
    pick = {k: plan.knobs[k] for k in model.domains}
    chosen = _sample(space, pick, max_candidates, f"{seed}|{problem.describe()}")
    cands = [Candidate(c, model.evaluate(c)[0] * 1e6) for c in chosen]
    for i, cand in enumerate(cands):
        if progress:
            progress(f"{problem.describe()}: build + verify {i + 1}/{len(cands)}")
        build_and_verify(spec, problem, cand, hw)
    good = [c for c in cands if c.failed is None]
    measure_s = 0.0
    noise = None
    if good:
        if progress:
            progress(f"{problem.describe()}: timing {len(good)} candidates side by side")
        hashes = {str(i): c.source_hash for i, c in enumerate(good)}
        pick_ok = cands[0].failed is None
        if pick_ok:   # the pick again under a second name: the run's own spread for one kernel
            hashes["pick-again"] = cands[0].source_hash
        t1 = time.perf_counter()
        timings = time_side_by_side(spec, problem, hashes, hw.cores)
        measure_s = time.perf_counter() - t1
        for i, c in enumerate(good):
            c.us = timings[str(i)]
        if pick_ok:
            a, b = timings["0"], timings["pick-again"]
            noise = max(a, b) / min(a, b)
        if db is not None:
            for c in good:
                _record(db, problem, hw, c)
    # per candidate: its build, its verification and its share of the timing rounds
    share = measure_s / (len(good) + (noise is not None)) if good else 0.0
    cost = [c.build_s + c.verify_s + (share if c.failed is None else 0.0) for c in cands]
    ranked = sorted(good, key=lambda c: c.us)
    best = ranked[0] if ranked else None
    picked = cands[0]
    return {
        "op": problem.op, "variant": problem.variant, "shape": problem.shape_text, "dtype": problem.dtype.value,
        "candidates_measured": len(good), "space_size": len(space),
        "pick_knobs": picked.knobs, "best_knobs": best.knobs if best else None,
        "pick_over_best": picked.us / best.us if best and picked.us else None,
        "pick_rank": ranked.index(picked) + 1 if picked.failed is None else None,
        "noise": noise, "solve_s": plan.solve_s, "plan_s": plan_s,
        "tune_s": plan_s + cost[0], "exhaustive_s": sum(cost) / len(cands) * len(space),
        "exhaustive_estimated": len(cands) < len(space),
        "pick_us": picked.us, "best_us": best.us if best else None, "pick_predicted_us": picked.predicted_us,
        "failed": [{"knobs": c.knobs, "reason": c.failed} for c in cands if c.failed is not None],
    }


def summarize(rows: list[dict]) -> dict:
    ratios = [r["pick_over_best"] for r in rows if r["pick_over_best"] is not None]
    return {"pick_over_best_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
            "pick_over_best_max": max(ratios) if ratios else None,
            "solve_s_max": max((r["solve_s"] for r in rows), default=None),
            "picks_unverified": sum(r["pick_rank"] is None for r in rows)}


def check_options(shapes_per_op: int, max_candidates: int) -> None:
    if not 1 <= shapes_per_op <= SHAPES_PER_OP:
        raise UserError(f"--shapes-per-op {shapes_per_op}: accepted is 1 to {SHAPES_PER_OP}")
    if max_candidates < 2:
        raise UserError(f"--max-candidates {max_candidates}: accepted is 2 or more (the pick and another)")


def run(ops: list[str] | None = None, shapes_per_op: int = SHAPES_PER_OP, max_candidates: int = MAX_CANDIDATES,
        seed: int = 0, db: TuningDB | None = None, problem_list: list[Problem] | None = None,
        hw: HardwareProfile | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """The benchmark over `problem_list` (default: problems(ops, shapes_per_op)); the JSON result."""
    check_options(shapes_per_op, max_candidates)
    hw = hw or host_profile()
    todo = problem_list if problem_list is not None else problems(ops, shapes_per_op)
    t0 = time.perf_counter()
    rows = [problem_row(p, hw, max_candidates, seed, db, progress) for p in todo]
    return {"schema": SCHEMA, "machine": machine_info(), "max_candidates": max_candidates, "seed": seed,
            "wall_s": time.perf_counter() - t0, **summarize(rows), "rows": rows}


def markdown(result: dict) -> str:
    def f(v, digits=2, suffix=""):
        return "-" if v is None else f"{v:.{digits}f}{suffix}"
    lines = ["| op | shape | dtype | measured / space | pick | best | pick / best | rank | noise | solve s | "
             "tune s | exhaustive s |", "|" + "---|" * 12]
    for r in result["rows"]:
        knobs = lambda k: "-" if k is None else ", ".join(f"{n}={v}" for n, v in k.items())  # noqa: E731
        lines.append(f"| {r['op']}[{r['variant']}] | {r['shape']} | {r['dtype']} | {r['candidates_measured']} / "
                     f"{r['space_size']} | {knobs(r['pick_knobs'])} | {knobs(r['best_knobs'])} | "
                     f"{f(r['pick_over_best'], 3)}x | {r['pick_rank'] or 'unverified'} | {f(r['noise'], 3)}x | "
                     f"{f(r['solve_s'], 3)} | {f(r['tune_s'], 1)} | {f(r['exhaustive_s'], 1)}"
                     f"{' (est.)' if r['exhaustive_estimated'] else ''} |")
    lines.append("")
    lines.append(f"pick / best: geomean {f(result['pick_over_best_geomean'], 3)}x, max "
                 f"{f(result['pick_over_best_max'], 3)}x; slowest solve {f(result['solve_s_max'], 3)} s; "
                 f"{result['wall_s']:.0f} s in all")
    for r in result["rows"]:
        for fail in r["failed"]:
            lines.append(f"FAILED {r['op']}[{r['variant']}] {r['shape']} {fail['knobs']}: {fail['reason']}")
    return "\n".join(lines)
