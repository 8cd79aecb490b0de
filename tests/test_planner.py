"""The tiling MILP: optimal against exhaustive enumeration, capacities respected, the same answer
from HiGHS and CP-SAT, binding and infeasible constraints named."""

import dataclasses
import itertools
import time

import pytest

from aurakernel.errors import PlanInfeasible
from aurakernel.ops import get_op
from aurakernel.planner import solve_tiling
from aurakernel.planner.model import ChoiceModel, Constraint, Phase, Term, solve
from aurakernel.targets.host.ops import kernel_of as host_kernel

SPEC = get_op("rms_norm")


def exhaustive(model):
    best = None
    keys = list(model.domains)
    for values in itertools.product(*(model.domains[k] for k in keys)):
        choice = dict(zip(keys, values))
        if model.feasible(choice):
            obj = model.evaluate(choice)[0]
            if best is None or obj < best[0]:
                best = (obj, choice)
    return best


def shrink(hw, level, capacity):
    memory = dict(hw.memory)
    memory[level] = dataclasses.replace(memory[level], capacity=capacity)
    return dataclasses.replace(hw, memory=memory)


@pytest.mark.parametrize("shape,dtype,variant", [("4096x4096", "bf16", "weighted"), ("1024x16384", "fp32", "unweighted"),
                                                 ("7x7168", "bf16", "weighted"), ("4096x64", "fp32", "unweighted")])
@pytest.mark.parametrize("solver", ["highs", "cpsat"])
def test_milp_finds_the_exhaustive_optimum(host, shape, dtype, variant, solver):
    problem = SPEC.problem(shape, dtype, variant)
    model = host_kernel(SPEC).tiling_problem(problem, host)
    sol = solve(model, solver)
    best_obj, _ = exhaustive(model)
    assert sol.status == "optimal"
    assert model.feasible(sol.choice)
    assert sol.objective == pytest.approx(best_obj, rel=1e-6 if solver == "highs" else 1e-3)


@pytest.mark.parametrize("solver", ["highs", "cpsat", "scip"])
def test_candidates_that_run_for_minutes_still_plan(solver):
    """A long problem (V4's csa attention at 65536 tokens) has candidates of hundreds of seconds beside
    overheads of microseconds: the solvers still find the exhaustive optimum (HiGHS called such a
    model in microseconds infeasible)."""
    domains = {"a": [1, 2, 4, 8, 16], "b": [16, 32, 64, 128, 256, 512], "c": [1, 2]}
    model = ChoiceModel(domains, [Constraint("cap", Term.of(("a", "b"), domains, lambda a, b: 4 * a * b), 16e6, "4ab")],
                        [Phase(name, {"compute": [Term.of(("a", "b", "c"), domains, lambda a, b, c: (500 + 37 * a + 1000 * a / b) / c),
                                                  Term.of(("a", "b", "c"), domains, lambda a, b, c: (3 + 50 / a + b / 100) / c)],
                                      "DRAM": [Term.of(("c",), domains, lambda c: 0.5 + 0.1 * c)]},
                               [Term.of(("a", "c"), domains, lambda a, c: 8e-5 * c + 2e-3 / a)]) for name in ("forward", "backward")])
    sol = solve(model, solver)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(exhaustive(model)[0], rel=1e-6 if solver == "highs" else 1e-3)


@pytest.mark.parametrize("solver", ["highs", "cpsat", "scip"])
def test_each_constraint_is_left_out_alone_where_two_share_a_name(solver):
    """A kernel's forward and backward both have a "UB capacity": the binding analysis re-solves
    without one at a time (by position, not name), the other still holding, and names the one whose
    removal gains most, with its own usage. The terms over one knob set share their cell weights."""
    from aurakernel.planner.model import relaxed
    domains = {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}
    pipe = [Term.of(("a", "b"), domains, lambda a, b: 10.0 / a), Term.of(("a", "b"), domains, lambda a, b: 1.0 / b)]
    model = ChoiceModel(domains, [Constraint("UB capacity", Term.of(("a",), domains, float), 2, "a"),
                                  Constraint("UB capacity", Term.of(("a", "b"), domains, lambda a, b: b), 3, "b")],
                        [Phase("forward", {"Vector": pipe})])
    tried = relaxed(model, solver, [0, 1], deadline=time.perf_counter() + 10)
    assert tried[0].choice == {"a": 4, "b": 3} and tried[1].choice == {"a": 2, "b": 4}
    plan = solve_tiling(model, op="x", variant="v", shape=(1,), dtype="fp32", target="host", solver=solver)
    assert plan.knobs == {"a": 2, "b": 3}
    assert plan.binding_constraint == "UB capacity (a = 2 of 2 B)"


def test_highs_and_cpsat_agree(host):
    problem = SPEC.problem("2048x7168", "bf16", "weighted")
    plans = [solve_tiling(host_kernel(SPEC).tiling_problem(problem, host), op="rms_norm", variant="weighted", shape=problem.shape,
                          dtype="bf16", target="host", solver=s) for s in ("highs", "cpsat")]
    assert plans[0].predicted_us == pytest.approx(plans[1].predicted_us, rel=1e-3)


def test_capacities_are_respected_and_bind(host):
    """With a small L2, big tiles no longer fit: the plan stays inside it and names it binding."""
    problem = SPEC.problem("4096x4096", "bf16", "weighted")
    small = shrink(host, "L2", 256 * 1024)      # 64 KiB usable at the 25 % cache fraction
    model = host_kernel(SPEC).tiling_problem(problem, small)
    plan = solve_tiling(model, op="rms_norm", variant="weighted", shape=problem.shape, dtype="bf16",
                        target="host")
    l2 = next(c for c in model.constraints if c.name == "L2 capacity")
    assert l2.usage.value(plan.knobs) <= l2.limit
    assert plan.knobs["tile_rows"] < max(model.domains["tile_rows"])
    assert plan.binding_constraint.startswith("L2 capacity")


def test_a_plan_without_its_explanation_is_the_same_plan(host):
    """predicted_us (the profiler's modeled step) skips the binding-constraint analysis, a solve per
    constraint: the knobs and the predicted time are those of the explained plan."""
    problem = SPEC.problem("4096x4096", "bf16", "weighted")
    model = host_kernel(SPEC).tiling_problem(problem, shrink(host, "L2", 256 * 1024))
    plans = [solve_tiling(model, op="rms_norm", variant="weighted", shape=problem.shape, dtype="bf16", target="host",
                          explain=explain) for explain in (True, False)]
    assert plans[0].knobs == plans[1].knobs and plans[0].predicted_us == plans[1].predicted_us
    assert plans[0].binding_constraint.startswith("L2 capacity") and plans[1].binding_constraint == "not analysed"


def test_l1_limits_the_column_chunk(host):
    """On a machine with ample bandwidth the loop overhead of small chunks is what costs, so the
    L1 that caps the chunk is the binding constraint."""
    problem = SPEC.problem("1024x16384", "fp32", "weighted")
    # an L2 that holds a tile of these 64 KB rows on any machine (512 KB ones included): the L1 binds
    tiny_l1 = shrink(shrink(host, "L1", 8 * 1024), "L2", max(host.memory["L2"].capacity, 2 * 2**20))
    tiny_l1 = dataclasses.replace(tiny_l1, stream_gbps={t: v * 100 for t, v in host.stream_gbps.items()})
    plan = solve_tiling(host_kernel(SPEC).tiling_problem(problem, tiny_l1), op="rms_norm", variant="weighted",
                        shape=problem.shape, dtype="fp32", target="host")
    per_col = 2 * 4 + 3 * 4                      # backward: weight + dw partial + x, dy, dx
    assert plan.knobs["col_chunk"] * per_col <= 8 * 1024 * host.costmodel["cache_fraction"]
    assert plan.binding_constraint.startswith("L1 capacity")


@pytest.mark.parametrize("shape,dtype", [("1024x4x256", "fp32"), ("1024x4x4096", "bf16")])
def test_mhc_chunks_are_planned_against_the_l3_share(host, shape, dtype):
    """mhc_pre's column chunks are GEMM calls (K = the chunk) that block for L1 and L2 themselves: the
    chunk is held to the L3 share, not the L2's (which capped it at 128 columns at every width, 1.2-1.4x
    slower than the widest chunks on the AVX2 EPYC), so the plan takes chunks of whole rows or wider.
    The x tile lives in that share too: the two are held to it together (a chunk as large as the whole
    share left no room for the tile; on the EPYC its backward ran 15% slower than at half the chunk)."""
    spec = get_op("mhc_pre")
    problem = spec.problem(shape, dtype)
    model = host_kernel(spec).tiling_problem(problem, host)
    assert not any(c.name.startswith("L2 capacity") for c in model.constraints)
    plan = solve_tiling(model, op="mhc_pre", variant="default", shape=problem.shape, dtype=dtype, target="host")
    assert plan.knobs["col_chunk"] >= min(1024, 4 * problem.shape[2])
    shared = next(c for c in model.constraints if c.name == "L3 capacity (tile and chunk)")
    assert shared.usage.value(plan.knobs) <= shared.limit


def test_infeasible_request_names_the_constraint(host):
    problem = SPEC.problem("64x2000000", "fp32", "weighted")   # one row is 8 MB: no tile fits in L2
    with pytest.raises(PlanInfeasible) as exc:
        solve_tiling(host_kernel(SPEC).tiling_problem(problem, host), op="rms_norm", variant="weighted",
                     shape=problem.shape, dtype="fp32", target="host")
    assert exc.value.constraint == "L2 capacity"
    assert "L2 capacity" in str(exc.value) and "limit" in str(exc.value)


def test_infeasible_combination_is_traced_to_a_constraint(host):
    """Each constraint alone can be met, not both: the culprit is found by dropping them in turn."""
    from aurakernel.planner.model import ChoiceModel, Constraint, Phase, Term
    from aurakernel.planner.tiling import solve_tiling as st

    domains = {"a": [1, 2], "b": [1, 2]}
    model = ChoiceModel(domains, [
        Constraint("budget", Term.of(("a", "b"), domains, lambda a, b: a + b), 2.5, "a+b"),
        Constraint("coupling", Term.of(("a", "b"), domains, lambda a, b: 10 if a == b else 0), 5, "a==b"),
    ], [Phase("p", {"pipe": [Term.of(("a",), domains, lambda a: 1.0 / a)]})])
    with pytest.raises(PlanInfeasible) as exc:
        st(model, op="x", variant="v", shape=(1,), dtype="fp32", target="host")
    assert exc.value.constraint in ("budget", "coupling")


def test_threads_follow_the_work(host):
    """A tiny problem is not worth a fork; a large one uses every core."""
    big = solve_tiling(host_kernel(SPEC).tiling_problem(SPEC.problem("8192x4096", "bf16", "weighted"), host), op="rms_norm",
                       variant="weighted", shape=(8192, 4096), dtype="bf16", target="host")
    small = solve_tiling(host_kernel(SPEC).tiling_problem(SPEC.problem("2x64", "fp32", "weighted"), host), op="rms_norm",
                         variant="weighted", shape=(2, 64), dtype="fp32", target="host")
    assert big.knobs["threads"] == host.cores
    assert small.knobs["threads"] == 1


def test_bandwidth_profile_changes_the_prediction(host):
    problem = SPEC.problem("4096x4096", "bf16", "weighted")
    slow = dataclasses.replace(host, stream_gbps={t: v / 2 for t, v in host.stream_gbps.items()})
    fast_plan = solve_tiling(host_kernel(SPEC).tiling_problem(problem, host), op="rms_norm", variant="weighted",
                             shape=problem.shape, dtype="bf16", target="host")
    slow_plan = solve_tiling(host_kernel(SPEC).tiling_problem(problem, slow), op="rms_norm", variant="weighted",
                             shape=problem.shape, dtype="bf16", target="host")
    assert slow_plan.predicted_us > 1.5 * fast_plan.predicted_us
