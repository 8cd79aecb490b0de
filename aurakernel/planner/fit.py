"""Fit the cost model's coefficients to measurements by least squares (`aurakernel calibrate --fit`).

Every cost model in the planner is linear in its coefficients pipe by pipe: a phase takes its
slowest pipe plus additive overheads, each pipe a fixed part plus coefficients x features. The
features of one measured plan are read off the operator's own ChoiceModel evaluated at basis
coefficients (all zero: the fixed part; one at a time at 1: that coefficient's feature), so the fit
shares the planner's formulas instead of copying them, and checks that the decomposition gives
back the model's own numbers at the current coefficients.

    minimise   sum_i ((pred_i(theta) - y_i) / y_i)^2  +  lam * sum_j ((theta_j - prior_j) / unit_j)^2
    s.t.       theta >= 0,     pred_i(theta) = sum_phases max_pipes (F theta + c)  +  (G theta + g)

Relative errors, because measured times span microseconds to milliseconds. The small pull towards
the current coefficients (the prior) keeps a coefficient the data never exercises (a pipe that
bounds no measured kernel) where it was instead of at an arbitrary value. pred is convex and
piecewise linear in theta. Fixing each phase's slowest pipe makes it linear, but a pipe that bounds
no record at the start would then never be seen (a coefficient set far too low stays there), so
the max is first smoothed: tau * y * log sum exp(pipe / (tau * y)), tau annealed from 0.3 down to
0, which lets every pipe near the top pull on its coefficients. At each level: Gauss-Newton rounds,
each a non-negative least-squares problem solved exactly (by enumerating supports: there are only a
handful of coefficients), stepping towards its answer while the (smoothed) objective falls.

Data:
  host      verified, measured records of the tuning DB (`aurakernel tune`, `autotune`,
            `bench search-quality --db`): pred = the plan's fwd+bwd time, y = its measured median.
  ascend*   emulator runs of sampled feasible tilings of every operator with an AscendC kernel, at
            reduced shapes: per pipe of a double-buffered run, the planner's MTE2/MTE3/Vector terms
            against the emulator's busy cycles of that pipe (the count scales); per run, the
            planner's time against the emulator's cycle estimate plus the launch overhead the
            planner charges and the emulator does not model (all scales, and the fill and
            single-buffer overlap ones only from these).
Reported: Spearman rank correlation of predicted vs measured time before and after the fit, over
all records (in sample, and k-fold cross-validated: each record predicted by coefficients fitted
without it) and within a problem (the mean over problems with 3 or more records: the ranking the
MILP's pick depends on, where problem size cannot carry the correlation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from ..hardware import HardwareProfile
from .model import ChoiceModel, feasible_choices
from ..targets.host.ops import kernel_of as host_kernel

LAMBDA = 1e-4          # weight of the pull to the prior: one unit away costs as much as a 1% error on one record
MAX_ROUNDS = 20       # Gauss-Newton rounds per smoothing level
TAUS = (0.3, 0.1, 0.03, 0.01, 0.0)   # smoothing of the max over pipes, in relative time, down to none
FOLDS = 5

# coefficient: the magnitude a deviation from the prior is measured in (regularisation unit)
HOST_COEFFICIENTS = {
    "dram_time_scale": 1.0,          # x the calibrated streaming time
    "l2_time_scale": 1.0,            # x the L2 re-read time
    "vector_cycles_per_elem": 0.25,
    "chunk_overhead_cycles": 12.0,
    "tile_overhead_ns": 40.0,
    "phase_overhead_us": 10.0,       # per phase, beyond the ctypes call (custom op + autograd dispatch)
}
ASCEND_COEFFICIENTS = {"mte_copy_scale": 1.0, "mte_byte_scale": 1.0, "vec_repeat_scale": 1.0,
                       "vec_slow_scale": 1.0, "vec_issue_scale": 1.0, "fill_scale": 1.0, "serial_mte_scale": 1.0}
HOST_STATUSES = ("ok", "slower", "measured")   # verified kernels with a measured time
ASCEND_MAX_ELEMS = 1 << 21                     # calibration shapes: a few seconds per emulated run


# --- the least-squares engine ------------------------------------------------------------------

Linear = tuple[np.ndarray, float]   # (features, fixed part): value = features @ theta + fixed


@dataclass
class Observation:
    """One measured time and the model's prediction of it as a function of the coefficients."""

    phases: list[list[Linear]]       # per phase, per pipe
    additive: Linear                 # overheads, summed over the phases
    target: float                    # measured seconds
    group: str                       # one measured kernel: cross-validation folds keep it together
    primary: bool = True             # counts for the rank correlation (per-pipe rows do not)
    problem: str = ""                # (op, variant, shape, dtype): the planner ranks within one

    def predict(self, theta: np.ndarray, tau: float = 0.0) -> float:
        """The predicted seconds; tau > 0 smooths each phase's max over pipes (module docstring)."""
        t = float(self.additive[0] @ theta + self.additive[1])
        for pipes in self.phases:
            vals = np.array([float(f @ theta + c) for f, c in pipes])
            t += _smooth_max(vals, tau * self.target)[0]
        return t

    def linearize(self, theta: np.ndarray, tau: float = 0.0) -> Linear:
        """(row, const) with predict(theta') ~ row @ theta' + const near theta: exact while each
        phase's slowest pipe stays the slowest (tau = 0)."""
        row = self.additive[0].copy()
        for pipes in self.phases:
            vals = np.array([float(f @ theta + c) for f, c in pipes])
            weights = _smooth_max(vals, tau * self.target)[1]
            row = row + sum(w * f for w, (f, _) in zip(weights, pipes))
        return row, self.predict(theta, tau) - float(row @ theta)


def _smooth_max(vals: np.ndarray, scale: float) -> tuple[float, np.ndarray]:
    """max(vals) for scale 0, else scale * log(sum(exp(vals / scale))); and its gradient (the
    weight of each entry: one-hot on the max for scale 0)."""
    top = int(np.argmax(vals))
    if scale <= 0:
        return float(vals[top]), np.eye(len(vals))[top]
    e = np.exp((vals - vals[top]) / scale)
    return float(vals[top] + scale * np.log(e.sum())), e / e.sum()


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0, exactly: the optimum is the least-squares solution on its own
    support, so the best non-negative one over all supports is it (2^n solves, n is small)."""
    n = a.shape[1]
    if n > 12:
        raise ValueError(f"nnls by support enumeration is for a few coefficients, not {n}")
    best, best_x = math.inf, np.zeros(n)
    for mask in range(1 << n):
        idx = [j for j in range(n) if mask >> j & 1]
        x = np.zeros(n)
        if idx:
            sol = np.linalg.lstsq(a[:, idx], b, rcond=None)[0]
            if (sol < 0).any():
                continue
            x[idx] = sol
        r = float(np.sum((a @ x - b) ** 2))
        if r < best:
            best, best_x = r, x
    return best_x


def _objective(obs: list[Observation], theta, prior, unit, lam, tau: float = 0.0) -> float:
    err = sum(((o.predict(theta, tau) - o.target) / o.target) ** 2 for o in obs)
    return err + lam * float(np.sum(((theta - prior) / unit) ** 2))


def fit_coefficients(obs: list[Observation], prior: np.ndarray, unit: np.ndarray,
                     lam: float = LAMBDA) -> np.ndarray:
    """Non-negative coefficients minimising the relative squared error (module docstring)."""
    ridge_a = np.diag(np.sqrt(lam) / unit)
    ridge_b = np.sqrt(lam) * prior / unit
    theta = prior.astype(float).copy()
    for tau in TAUS:
        current = _objective(obs, theta, prior, unit, lam, tau)
        for _ in range(MAX_ROUNDS):
            rows, rhs = [], []
            for o in obs:
                row, const = o.linearize(theta, tau)
                rows.append(row / o.target)
                rhs.append((o.target - const) / o.target)
            answer = nnls(np.vstack([np.array(rows), ridge_a]), np.concatenate([np.array(rhs), ridge_b]))
            step = 1.0
            while step > 1e-3:   # a Gauss-Newton step is a guess where pipes overtake: accept only descent
                trial = theta + step * (answer - theta)
                value = _objective(obs, trial, prior, unit, lam, tau)
                if value < current * (1 - 1e-9):
                    theta, current = trial, value
                    break
                step /= 2
            else:
                break
    return theta


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):   # ties share their average rank
        tie = x == value
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(a, b) -> float | None:
    """Spearman rank correlation (None when undefined: fewer than 3 points or a constant side)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return None
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def cross_validated(obs: list[Observation], prior, unit, folds: int = FOLDS, seed: int = 0) -> float | None:
    """Spearman of held-out predictions: groups split into folds, each fold predicted by a fit on
    the others."""
    groups = sorted({o.group for o in obs})
    k = min(folds, len(groups))
    if k < 2:
        return None
    random.Random(seed).shuffle(groups)
    fold_of = {g: i % k for i, g in enumerate(groups)}
    pred, meas = [], []
    for i in range(k):
        theta = fit_coefficients([o for o in obs if fold_of[o.group] != i], prior, unit)
        for o in obs:
            if fold_of[o.group] == i and o.primary:
                pred.append(o.predict(theta))
                meas.append(o.target)
    return spearman(pred, meas)


# --- reading observations off a ChoiceModel -----------------------------------------------------

def basis_models(build: Callable[[dict[str, float]], ChoiceModel], names: list[str],
                 current: np.ndarray) -> list[ChoiceModel]:
    """The model at all-zero coefficients, at each unit vector, and at the current ones."""
    zero = dict.fromkeys(names, 0.0)
    return ([build(zero)] + [build({**zero, n: 1.0}) for n in names]
            + [build(dict(zip(names, map(float, current))))])


def _values(model: ChoiceModel, choice: dict[str, int]) -> list[tuple[dict[str, float], float]]:
    return [({name: sum(t.value(choice) for t in terms) for name, terms in ph.pipes.items()},
             sum(t.value(choice) for t in ph.additive)) for ph in model.phases]


class NonLinear(RuntimeError):
    """A model's time at a choice is not linear in the coefficients (its decomposition does not give it back)."""


def decompose(models: list[ChoiceModel], choice: dict[str, int],
              current: np.ndarray) -> list[tuple[str, dict[str, Linear], Linear]]:
    """Per phase: each pipe and the phase's overheads as (features, fixed part)."""
    n = len(current)
    vals = [_values(m, choice) for m in models]
    out = []
    for p, phase in enumerate(models[0].phases):
        zero_pipes, zero_add = vals[0][p]
        pipes = {}
        for name, fixed in zero_pipes.items():
            f = np.array([vals[1 + j][p][0][name] - fixed for j in range(n)])
            pipes[name] = (f, fixed)
        add = (np.array([vals[1 + j][p][1] - zero_add for j in range(n)]), zero_add)
        # the model must be linear in the coefficients: the decomposition gives back its numbers
        now_pipes, now_add = vals[-1][p]
        for name, (f, c) in [*pipes.items(), ("overheads", add)]:
            want = now_add if name == "overheads" else now_pipes[name]
            got = float(f @ current + c)
            if abs(got - want) > 1e-9 + 1e-6 * abs(want):
                raise NonLinear(f"cost model not linear in its coefficients: {phase.name} {name} "
                                   f"is {want:.6g} s, its decomposition {got:.6g} s")
        out.append((phase.name, pipes, add))
    return out


def in_domain(model: ChoiceModel, knobs: dict) -> dict[str, int] | None:
    """The model's knobs out of a plan's, or None when the plan is no choice of this model."""
    try:
        choice = {k: int(knobs[k]) for k in model.domains}
    except (KeyError, TypeError, ValueError):
        return None
    return choice if all(v in model.domains[k] for k, v in choice.items()) else None


# --- the report ------------------------------------------------------------------------------

@dataclass
class FitReport:
    target: str
    records: int
    needed: int
    skipped: dict[str, int]
    before: dict[str, float]
    after: dict[str, float]
    spearman_before: float | None
    spearman_after: float | None
    spearman_cv: float | None
    spearman_within_before: float | None
    spearman_within_after: float | None
    problems_ranked: int                 # problems with >= 3 records (the within-problem correlation)
    median_rel_err_before: float
    median_rel_err_after: float
    path: str | None = None
    source: str = ""
    kept_because: str | None = None      # why the fitted coefficients were not adopted (None: they were, or no write)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def worse_than_before(self) -> str | None:
        """Why the fit must not replace the coefficients, or None: it ranks the records worse than they
        do, in sample, predicting each record without it (cross-validated: what the next plans face),
        or within a problem (what the MILP's pick rests on). The planner would plan worse with it: a
        coefficient the records cannot pin down may land at an edge (a per-chunk cost of 0 had the
        host plan cross_entropy's 129280 columns in chunks of 16, 2x slower than eager)."""
        pairs = (("in sample", self.spearman_after), ("cross-validated", self.spearman_cv))
        worse = [f"{name} {after:.3f}" for name, after in pairs
                 if self.spearman_before is not None and after is not None and after < self.spearman_before]
        if (self.spearman_within_before is not None and self.spearman_within_after is not None
                and self.spearman_within_after < self.spearman_within_before):
            worse.append(f"within a problem {self.spearman_within_after:.3f} against {self.spearman_within_before:.3f}")
        if not worse:
            return None
        return (f"the fit ranks the records worse than the current coefficients ({', '.join(worse)}, against "
                f"{self.spearman_before:.3f} now)")


def _fit_report(target: str, obs: list[Observation], names: list[str], prior: dict[str, float],
                units: dict[str, float], records: int, needed: int, skipped: Counter, source: str) -> FitReport:
    p = np.array([prior[n] for n in names], float)
    u = np.array([max(abs(prior[n]), units[n]) for n in names], float)
    theta = fit_coefficients(obs, p, u)
    primary = [o for o in obs if o.primary]
    meas = [o.target for o in primary]
    before = [o.predict(p) for o in primary]
    after = [o.predict(theta) for o in primary]
    rel = lambda pred: float(np.median([abs(x - y) / y for x, y in zip(pred, meas)]))  # noqa: E731
    by_problem: dict[str, list[int]] = {}
    for i, o in enumerate(primary):
        by_problem.setdefault(o.problem, []).append(i)
    ranked = [ix for ix in by_problem.values() if len(ix) >= 3]

    def within(pred) -> float | None:
        rhos = [r for ix in ranked if (r := spearman([pred[i] for i in ix], [meas[i] for i in ix])) is not None]
        return float(np.mean(rhos)) if rhos else None
    return FitReport(target=target, records=records, needed=needed, skipped=dict(skipped),
                     before={n: float(v) for n, v in zip(names, p)},
                     after={n: float(f"{v:.6g}") for n, v in zip(names, theta)},
                     spearman_before=spearman(before, meas), spearman_after=spearman(after, meas),
                     spearman_cv=cross_validated(obs, p, u), spearman_within_before=within(before),
                     spearman_within_after=within(after), problems_ranked=len(ranked),
                     median_rel_err_before=rel(before),
                     median_rel_err_after=rel(after), source=source)


# --- host: the tuning DB ------------------------------------------------------------------------

def host_prior(hw: HardwareProfile) -> dict[str, float]:
    from .costmodel import DEFAULTS
    cm = {**DEFAULTS, **hw.costmodel}
    return {n: float(cm[n]) for n in HOST_COEFFICIENTS}


def host_observations(db_path: Path, hw: HardwareProfile) -> tuple[list[Observation], Counter]:
    """One observation per verified, measured host record whose plan is a choice of the operator's
    current tiling model; `skipped` counts the others by reason."""
    skipped: Counter = Counter()
    if not Path(db_path).is_file():
        return [], skipped
    from ..db import TuningDB, plan_knobs
    from ..ops import OPS

    frame = TuningDB(db_path, readonly=True).frame()
    names = list(HOST_COEFFICIENTS)
    prior = host_prior(hw)
    current = np.array([prior[n] for n in names])
    models: dict[tuple, list[ChoiceModel] | None] = {}
    obs = []
    for _, r in frame.iterrows():
        if r["target"] != "host":
            continue   # other targets are fitted from their own measurements
        if not r["verified"] or r["status"] not in HOST_STATUSES or not r["measured_us"] or r["measured_us"] <= 0:
            skipped["not a verified, measured kernel"] += 1
            continue
        spec = OPS.get(r["op"])
        key = (r["op"], r["variant"], r["shape"], r["dtype"])
        if key not in models:
            try:
                problem = spec.problem(r["shape"], r["dtype"], r["variant"]) if spec else None
            except UserError:
                problem = None
            models[key] = None if problem is None else basis_models(
                lambda cm, spec=spec, problem=problem: host_kernel(spec).tiling_problem(
                    problem, dataclasses.replace(hw, costmodel={**hw.costmodel, **cm})), names, current)
        if models[key] is None:
            skipped["operator or shape no longer accepted"] += 1
            continue
        knobs = plan_knobs(r["plan"])
        if knobs is None:
            skipped["plan column not a JSON object with knobs"] += 1
            continue
        choice = in_domain(models[key][0], knobs)
        if choice is None:
            skipped["plan outside the current tiling model"] += 1
            continue
        try:
            parts = decompose(models[key], choice, current)
        except NonLinear:   # e.g. a knob whose one value the model derives from a coefficient
            skipped["tiling model not linear in the coefficients at this plan"] += 1
            continue
        obs.append(Observation([list(pipes.values()) for _, pipes, _ in parts],
                               (sum(a[0] for _, _, a in parts), sum(a[1] for _, _, a in parts)),
                               float(r["measured_us"]) * 1e-6, group=f"{key}|{sorted(choice.items())}",
                               problem=str(key)))
    return obs, skipped


def host_min_records() -> int:
    return 2 * len(HOST_COEFFICIENTS)


def fit_host(db_path: Path | str, hw: HardwareProfile | None = None, write: bool = True) -> FitReport:
    """Fit the host cost model to the tuning DB; with `write`, store the coefficients in this
    machine's calibration (the planner reads them through hardware.host_profile)."""
    from ..hardware import host_profile, load_calibration, save_calibration

    hw = hw or host_profile()
    obs, skipped = host_observations(Path(db_path), hw)
    need = host_min_records()
    if len(obs) < need:
        raise UserError(
            f"calibrate --fit needs at least {need} verified, measured host records in {db_path}; it has "
            f"{len(obs)}: add some with `aurakernel tune OP --shape ...`, `aurakernel autotune`, or "
            f"`aurakernel bench search-quality --db {db_path}` (records every candidate it measures)")
    report = _fit_report("host", obs, list(HOST_COEFFICIENTS), host_prior(hw), HOST_COEFFICIENTS,
                         len(obs), need, skipped, str(db_path))
    if write:
        cal = load_calibration()
        if cal is None:
            raise UserError("this machine has no calibration to fit into: run `aurakernel calibrate` first")
        report.kept_because = report.worse_than_before()
        if report.kept_because is not None:
            return report
        cal["costmodel"] = report.after
        cal["costmodel_fit"] = {"fitted_at": time.time(), "records": report.records, "db": str(db_path),
                                "spearman_before": report.spearman_before, "spearman_after": report.spearman_after,
                                "spearman_cv": report.spearman_cv, "spearman_within_before": report.spearman_within_before,
                                "spearman_within_after": report.spearman_within_after}
        report.path = str(save_calibration(cal))
    return report


# --- Ascend: the emulator -------------------------------------------------------------------------

@dataclass
class AscendSample:
    """One emulated kernel: per phase, the cycle estimate and the busy cycles of each pipe."""

    op: str
    variant: str
    shape: str
    dtype: str
    knobs: dict[str, int]
    phases: dict[str, dict] = field(default_factory=dict)   # phase -> {"cycles", "busy": {pipe: cycles}}


def calibration_problem(spec, hw: HardwareProfile):
    """The operator's default shape with its leading extent cut to at most ASCEND_MAX_ELEMS elements."""
    from ..dtypes import shape_text
    shape = list(spec.default_shape_for(spec.variants[0]))
    rest = math.prod(shape[1:])
    shape[0] = max(1, min(shape[0], ASCEND_MAX_ELEMS // max(rest, 1)))
    return spec.problem(shape_text(tuple(shape)), None, spec.variants[0])


def ascend_samples(target: str, n: int, seed: int = 0, progress=None) -> tuple[list[AscendSample], Counter]:
    """`n` emulator runs: feasible tilings drawn uniformly (seeded) per operator with an AscendC
    kernel, round robin over the operators, each run forward and backward at its calibration shape."""
    from ..targets import ascend
    from ..errors import BuildError
    from ..hardware import load_profile
    from ..ops import OPS

    hw = load_profile(target, fitted=False)
    if hw.kind != "ascend":
        raise UserError(f"target {target!r} is a {hw.kind} profile: --fit --target takes host or an Ascend profile")
    rng = random.Random(seed)
    pools = []
    for spec in OPS.values():
        if ascend.supported(spec):
            problem = calibration_problem(spec, hw)
            choices = feasible_choices(ascend.model(spec, problem, hw))
            rng.shuffle(choices)
            # a kernel's Cube phases are planned by their own model: held at its plan, not fitted here
            cube = ascend.cube_plan(spec, problem, hw, target=target, solver="highs")
            fixed = cube.knobs if cube is not None else {}
            pools.append((spec, problem, [{**c, **fixed} for c in choices]))
    samples, failed = [], Counter()
    for i in range(n):
        spec, problem, choices = pools[i % len(pools)]
        if not choices:
            continue
        knobs = choices.pop()
        if progress:
            progress(f"{i + 1}/{n} {problem.describe()} {knobs}")
        try:
            with tempfile.TemporaryDirectory(prefix=f"ak-fit-{spec.name}-") as tmp:
                project = ascend.render_project(spec, problem, knobs, Path(tmp), hw)
                reports = ascend.emulate(spec, problem, knobs, ascend.Emulated(spec, project, hw))
        except BuildError:
            failed["emulator build failed"] += 1
            continue
        if any(r.errors for r in reports.values()):
            failed["emulator reported an error"] += 1
            continue
        samples.append(AscendSample(problem.op, problem.variant, problem.shape_text, problem.dtype.value, knobs,
                                    {ph: {"cycles": r.cycles, "busy": r.pipe_cycles()} for ph, r in reports.items()}))
    return samples, failed


def ascend_observations(samples: list[AscendSample], hw: HardwareProfile) -> list[Observation]:
    """Per sample: the run (planner time vs the emulator's estimate + launch) and, per phase, each
    pipe the planner models against the emulator's busy cycles of it."""
    from ..targets import ascend
    from ..ops import OPS

    names = list(ASCEND_COEFFICIENTS)
    current = np.array([float(hw.costmodel.get(n, 1.0)) for n in names])
    clock = hw.clock_ghz * 1e9
    launch = hw.call_overhead_us * 1e-6
    obs = []
    for s in samples:
        spec = OPS[s.op]
        problem = spec.problem(s.shape, s.dtype, s.variant)
        models = basis_models(lambda cm, spec=spec, problem=problem: ascend.model(
            spec, problem, dataclasses.replace(hw, costmodel={**hw.costmodel, **cm})), names, current)
        choice = in_domain(models[0], s.knobs)
        if choice is None:
            continue
        group = f"{s.op}|{s.shape}|{sorted(s.knobs.items())}"
        parts = decompose(models, choice, current)
        total = sum(s.phases[name]["cycles"] for name, _, _ in parts) / clock + launch * len(parts)   # the row-wise phases
        obs.append(Observation([list(pipes.values()) for _, pipes, _ in parts],
                               (sum(a[0] for _, _, a in parts), sum(a[1] for _, _, a in parts)), total, group,
                               problem=f"{s.op}|{s.variant}|{s.shape}|{s.dtype}"))
        if choice["buffers"] == 2:   # single-buffered, the planner has no separate pipe terms
            for phase, pipes, _ in parts:
                busy = s.phases[phase]["busy"]
                zero = (np.zeros(len(names)), 0.0)
                obs.extend(Observation([[pipes[p]]], zero, busy[p] / clock, group, primary=False)
                           for p in ("MTE2", "MTE3", "Vector") if busy[p] > 0)
    return obs


def ascend_min_samples() -> int:
    # a run gives one cycle estimate and up to six pipe counters; the fill and single-buffer scales
    # rest on the estimates alone, and both buffer depths have to turn up among the runs
    return 10


def fit_ascend(target: str, samples: list[AscendSample], write: bool = True, skipped: Counter | None = None) -> FitReport:
    """Fit the Ascend planner's count scales to emulator samples; with `write`, store them as the
    target's overlay in the cache dir (hardware.load_profile applies it; profiles/*.yaml untouched)."""
    from ..hardware import costmodel_overlay_path, load_profile
    from ..paths import write_text_atomic

    need = ascend_min_samples()
    if len(samples) < need:
        raise UserError(f"calibrate --fit --target {target} needs at least {need} emulator samples; it got "
                        f"{len(samples)}: run it with --samples {max(need, 15)} (a C++ compiler is required)")
    hw = load_profile(target)
    obs = ascend_observations(samples, hw)
    prior = {n: float(hw.costmodel.get(n, 1.0)) for n in ASCEND_COEFFICIENTS}
    report = _fit_report(target, obs, list(ASCEND_COEFFICIENTS), prior, ASCEND_COEFFICIENTS, len(samples), need,
                         skipped or Counter(), "emulator")
    if write:
        report.kept_because = report.worse_than_before()
    if write and report.kept_because is None:
        path = costmodel_overlay_path(target)
        write_text_atomic(path, json.dumps({
            "target": target, "costmodel": report.after,
            "fit": {"fitted_at": time.time(), "samples": report.records, "spearman_before": report.spearman_before,
                    "spearman_after": report.spearman_after, "spearman_cv": report.spearman_cv,
                    "spearman_within_before": report.spearman_within_before,
                    "spearman_within_after": report.spearman_within_after}}, indent=2))
        report.path = str(path)
    return report
