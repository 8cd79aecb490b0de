"""Planner depth: the CP-SAT pipeline schedule (and the emulator showing its benefit on the
AscendC cross-entropy kernel), the layout assignment MILP, and the solvers' robustness (time limits,
infeasibility, SCIP agreeing with HiGHS and CP-SAT)."""

import dataclasses
import itertools
import random
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from aurakernel.errors import PlanInfeasible
from aurakernel.hardware import load_profile
from aurakernel.ops import OPS, get_op
from aurakernel.planner import solve_tiling
from aurakernel.planner.layout import (LayoutProblem, OpNode, TensorGraph, TensorNode, ascend_costs,
                                       cross_entropy_graph, host_costs, join, mhc_pre_graph, solve_layout)
from aurakernel.planner.ascend import pipelined
from aurakernel.planner.model import SOLVERS, ChoiceModel, Constraint, Phase, Term, solve
from aurakernel.planner.schedule import Pipeline, Queue, Stage, simulate, solve_schedule
from aurakernel.targets.ascend import model as ascend_model
from aurakernel.targets.host.ops import kernel_of as host_kernel

ASCEND = load_profile("ascend910b2")


# --- pipeline schedule ------------------------------------------------------------------------------

def three_stage(ci=4, c=10, co=3, tiles=10, blocking=True, budget=100) -> Pipeline:
    stages = (Stage("copy_in", "MTE2", ci, max_lead=2),
              Stage("compute", "Vector", c, ("copy_in",), blocks_issuer=blocking),
              Stage("copy_out", "MTE3", co, ("compute",)))
    return Pipeline(stages, (Queue("in", "copy_in", ("compute",), 1), Queue("out", "compute", ("copy_out",), 1)),
                    tiles, budget)


def test_prefetch_hides_the_copy_under_a_blocking_compute():
    """Compute ends in a scalar wait: the plain order runs copy-in and compute one after the other
    (II = 4 + 10), copy-in(i+1) issued before compute(i) runs under it (II = 10)."""
    p = three_stage()
    s = solve_schedule(p)
    assert s.leads == {"copy_in": 1, "compute": 0, "copy_out": 0} and s.buffers == {"in": 2, "out": 2}
    assert s.ii == 10 and s.latency == 17 and s.cycles == 9 * 10 + 17 == s.simulated
    assert s.body(p) == ["copy_in(i+1)", "compute(i)", "copy_out(i)"]
    plain = simulate(p, {"copy_in": 0, "compute": 0, "copy_out": 0}, {"in": 2, "out": 2})
    assert plain == 10 * 14 + 3


def test_plain_order_suffices_when_compute_does_not_block():
    s = solve_schedule(three_stage(blocking=False))
    assert s.plain and s.ii == 10 and s.buffers == {"in": 2, "out": 2}   # double buffering alone overlaps


def test_ub_budget_limits_buffers_and_prefetch():
    s = solve_schedule(three_stage(budget=2))          # one buffer per queue: nothing can overlap
    assert s.plain and s.buffers == {"in": 1, "out": 1} and s.ii == 14
    with pytest.raises(PlanInfeasible, match="UB capacity"):
        solve_schedule(three_stage(budget=1))
    with pytest.raises(ValueError, match="keeps 2 buffers"):
        simulate(three_stage(), {"copy_in": 1, "compute": 0, "copy_out": 0}, {"in": 1, "out": 1})


def test_solved_order_is_the_best_order_by_exhaustive_replay():
    """On random pipelines the CP-SAT choice replays (instance by instance, as soon as possible) as
    fast as the best of every (prefetch, buffer counts) choice that fits the budget."""
    rng = random.Random(7)
    for _ in range(20):
        d = [rng.randint(1, 20) for _ in range(3)]
        p = three_stage(*d, tiles=rng.randint(2, 12), blocking=rng.random() < 0.6, budget=rng.choice([3, 4, 5, 100]))
        s = solve_schedule(p)
        best = min(simulate(p, {"copy_in": lead, "compute": 0, "copy_out": 0}, {"in": bi, "out": bo})
                   for lead, bi, bo in itertools.product(range(3), range(1, 4), range(1, 4))
                   if bi + bo <= p.ub_budget and bi >= lead + 1)
        assert s.simulated == best, (d, p, s)
        assert s.simulated <= s.cycles


def test_row_model_drains_the_last_tile_and_the_short_one_exposes_least():
    """The row model's fill and drain (`pipelined`): a copy-bound loop exposes its first copy and its
    last tile's vector work, so a core's short tile costs least last; per-tile parts (copy latency,
    per-tile instructions) count the same as per-row ones for equal tiles; two buffers make a
    vector-bound loop's copies wait for tile i - 2's vector work, and its vector work for tile
    i - out_buffers' copy out."""
    copy_bound = ((0.0, 50.0), (0.0, 20.0))   # (per-tile part, per-row total): copy 10, vector 4 a tile
    assert pipelined(copy_bound, [10] * 5, 50) == pytest.approx(54)
    assert pipelined(((50.0, 0.0), (20.0, 0.0)), [10] * 5, 50) == pytest.approx(54)
    assert pipelined(copy_bound, [12, 12, 12, 12, 2], 50) == pytest.approx(53.6)   # short last
    assert pipelined(copy_bound, [2, 12, 12, 12, 12], 50) == pytest.approx(54.8)   # short first
    assert pipelined(((0.0, 5.0), (0.0, 50.0)), [10] * 5, 50) == pytest.approx(51)
    # vector, scalar and copy out alike: with two output tiles the vector unit waits for tile i - 2's
    # copy out, which waits for its scalar stage; a third output tile (out_buffers) removes the wait
    chained = ((0.0, 5.0), (0.0, 30.0), (0.0, 30.0), (0.0, 30.0))
    assert pipelined(chained, [10] * 5, 50) == pytest.approx(55)
    assert pipelined(chained, [10] * 5, 50, out_buffers=3) == pytest.approx(43)


def test_router_backward_model_counts_its_scalar_scatter():
    """The router's backward scatters each row's K gradients on the scalar unit (reading experts and
    gradients 64 bits at a time): the row model has that pipe, at the emulator's cycles per op."""
    spec = get_op("router")
    problem = spec.problem("8192x256x6", "bf16", "hash")
    model = ascend_model(spec, problem, ASCEND)
    knobs = {"block_dim": 48, "buffers": 2, "chunk": 64, "col_tile": 256, "tile_rows": 24, "forward_tile_rows": 64}
    _, pipes = model.evaluate(knobs)
    ops_per_row = 2 * 2 + 6   # experts and gradients (6 x 16 bits: two 64-bit reads each), six writes
    cycles = -(-8192 // 48) * ops_per_row * ASCEND.ascend_pipes(48).scalar_op
    assert pipes["backward"]["Scalar"] == pytest.approx(cycles / (ASCEND.clock_ghz * 1e9))
    assert "Scalar" not in pipes["forward"]


def test_cross_entropy_plan_carries_the_schedule():
    from aurakernel.targets import ascend
    spec = OPS["cross_entropy"]
    problem = spec.problem("1024x129280", "bf16", "default")
    plan = ascend.plan(spec, problem, ASCEND, target="ascend910b2", solver="highs")
    fwd = plan.schedule["forward"]
    assert plan.knobs["forward_prefetch"] == 1 and plan.knobs["forward_in_buffers"] == 2
    assert fwd["body"] == ["copy_in(i+1)", "compute(i)"] and fwd["status"] == "optimal"
    assert fwd["cycles"] < 0.6 * fwd["plain_cycles"]
    assert plan.schedule["backward"]["cycles"] <= plan.schedule["backward"]["plain_cycles"]


def forward_in_emulator(exe, knobs, logits, labels):
    """The forward kernel alone: per-row loss and lse, and the emulator's report."""
    from aurakernel import emulator
    from aurakernel.emulator import from_bytes, to_bytes
    from aurakernel.planner.ascend import row_split
    rows, vocab = logits.shape
    block_rows, block_dim = row_split(rows, knobs["block_dim"])
    tiling = struct.pack("<5Iif", rows, vocab, block_rows, knobs["col_tile"], knobs["chunk"], -100, 1.0)
    loss, lse = torch.full((rows,), float("nan")), torch.full((rows,), float("nan"))
    bufs = [to_bytes(logits), to_bytes(labels), to_bytes(loss), to_bytes(lse), bytearray(32), bytearray(tiling)]
    report = emulator.run(exe, block_dim, bufs)
    return from_bytes(bufs[2], loss), from_bytes(bufs[3], lse), report


def test_solved_schedule_beats_the_plain_order_in_the_emulator():
    """cross_entropy bf16 at the V4 vocabulary (8 rows: 16 column tiles per core): the emulator's
    cycle estimate of the solved forward (CopyIn(k+1) issued before Compute(k)) against the plain
    CopyIn / Compute / CopyOut order at the same tiling, both checked against the reference. (The
    backward's solved order is the plain one here; the solved kernels' forward and backward are
    verified by tests/test_ascendc.py, whose tune uses the scheduled plan.)"""
    from aurakernel.targets import ascend
    spec = OPS["cross_entropy"]
    problem = spec.problem("8x129280", "bf16", "default")
    plan = ascend.plan(spec, problem, ASCEND, target="ascend910b2", solver="highs")
    solved = plan.knobs
    plain = {k: v for k, v in solved.items() if not k.endswith(("_prefetch", "_buffers"))}
    assert solved["forward_prefetch"] == 1 and solved["backward_prefetch"] == 0
    inputs = spec.make_inputs(problem, 0)
    tail = spec.make_inputs(spec.problem("11x1000", "bf16", "default"), 1)   # a tail core, a short last tile
    cycles = {}
    with tempfile.TemporaryDirectory() as tmp:
        emus = {name: ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, Path(tmp) / name, ASCEND), ASCEND)
                for name, knobs in (("plain", plain), ("solved", solved))}
        assert "FWD_PREFETCH = 1;" in (Path(tmp) / "solved" / "cross_entropy_kernel.cpp").read_text()
        assert "FWD_PREFETCH = 0;" in (Path(tmp) / "plain" / "cross_entropy_kernel.cpp").read_text()
        with ThreadPoolExecutor(2) as pool:   # the two g++ builds side by side
            exes = dict(zip(emus, pool.map(lambda e: e.exe("fwd", 6), emus.values())))
        for name, knobs in (("plain", plain), ("solved", solved)):
            for x in (inputs, tail):
                logits, labels = x["logits"], x["labels"]
                loss, lse, report = forward_in_emulator(exes[name], knobs, logits, labels)
                assert report.ok, report.errors
                ref_lse = torch.logsumexp(logits.float(), dim=1)
                ref_loss = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")
                torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
                if x is inputs:
                    cycles[name] = report.cycles
    assert cycles["solved"] < 0.85 * cycles["plain"], cycles
    # the schedule's prediction tracks the emulator (the model leaves out the per-row epilogue)
    assert cycles["plain"] == pytest.approx(plan.schedule["forward"]["plain_cycles"], rel=0.1)
    assert cycles["solved"] == pytest.approx(plan.schedule["forward"]["cycles"], rel=0.1)


# --- layout -------------------------------------------------------------------------------------------

def chain(conversion: float) -> LayoutProblem:
    """a -op1-> b -op2-> c -op3-> d; op1 can only write A; op2 and op3 read at cost 5 in A, 0 in B;
    op2 is elementwise (it writes c in the layout it reads b in); a and d are pinned to A."""
    cost = {("op1", "a", "A"): 0, ("op1", "b", "A"): 0, ("op2", "c", "A"): 0, ("op2", "c", "B"): 0,
            ("op3", "d", "A"): 0}
    for op, t in (("op2", "b"), ("op3", "c")):
        cost[(op, t, "A")], cost[(op, t, "B")] = 5, 0
    conv = {(t, x, y): conversion for t in "abcd" for x, y in (("A", "B"), ("B", "A"))}
    return LayoutProblem({t: ("A", "B") for t in "abcd"},
                         writes=[("op1", "b"), ("op2", "c"), ("op3", "d")],
                         reads=[("op1", "a"), ("op2", "b"), ("op3", "c")],
                         cost=cost, conversion=conv, same_layout=[("op2", ("b",), "c")], fixed={"a": "A", "d": "A"})


@pytest.mark.parametrize("solver", ["highs", "cpsat"])
def test_layout_converts_once_when_that_beats_two_ops_in_a_bad_layout(solver):
    cheap = solve_layout(chain(3.0), solver)
    assert cheap.objective == pytest.approx(3.0)          # convert b once, op2 and op3 run in B
    assert cheap.stored["c"] == "B" and cheap.conversions == [("b", "op2", "A", "B")]
    dear = solve_layout(chain(20.0), solver)              # a conversion dearer than 5 + 5: stay in A
    assert dear.objective == pytest.approx(10.0) and dear.conversions == []
    assert set(dear.stored.values()) == {"A"}


def test_layout_milp_matches_exhaustive_enumeration():
    rng = random.Random(3)
    for _ in range(5):
        p = chain(rng.uniform(0, 12))
        for key in p.cost:
            p.cost[key] = rng.uniform(0, 6)
        best = min(p.evaluate(dict(zip("abcd", st)), dict(zip(p.reads, rd)))
                   for st in itertools.product("AB", repeat=4) for rd in itertools.product("AB", repeat=3)
                   if p.feasible(dict(zip("abcd", st)), dict(zip(p.reads, rd))))
        for solver in ("highs", "cpsat"):
            assert solve_layout(p, solver).objective == pytest.approx(best, rel=1e-6, abs=1e-9)


def test_keeping_nz_across_two_groups_wins():
    """y = x @ w1 in one group, z = y @ w2 in the next. Alone, each group hands y over in ND (the
    first writes it through FixPipe's NZ->ND, the second re-lays it into fractals); joined, y stays
    NZ and both costs go."""
    def group(name, a, w, out):
        t = {n.name: n for n in (TensorNode(a, 512, 1024, 2), TensorNode(w, 1024, 1024, 2, weight=True),
                                 TensorNode(out, 512, 1024, 2))}
        return TensorGraph(name, t, [OpNode(f"{name}_mm", "matmul", (a, w), (out,))])
    g1, g2 = group("g1", "x", "w1", "y"), group("g2", "y", "w2", "z")
    for solver in ("highs", "cpsat"):
        alone = sum(solve_layout(ascend_costs(g, ASCEND), solver).objective for g in (g1, g2))
        joined = solve_layout(ascend_costs(join("g12", g1, g2), ASCEND), solver)
        assert joined.stored["y"] == "NZ" and joined.stored["w1"] == joined.stored["w2"] == "NZ"
        y_bytes = 512 * 1024 * 2
        saved = 1.25 * y_bytes / (ASCEND.memory["HBM"].bandwidth_gbps * 1e9)
        assert alone - joined.objective == pytest.approx(saved, rel=1e-6)


@pytest.mark.parametrize("graph", [mhc_pre_graph(4096), cross_entropy_graph(4096)], ids=lambda g: g.name)
def test_v4_flash_groups_on_ascend_and_host(graph, host):
    sols = [solve_layout(ascend_costs(graph, ASCEND), s) for s in ("highs", "cpsat")]
    assert sols[0].objective == pytest.approx(sols[1].objective, rel=1e-6)
    stored = sols[0].stored
    assert all(stored[t] == "ND" for t in graph.boundary())          # the framework's layout at the edges
    weight = next(t for t, n in graph.tensors.items() if n.weight)
    assert stored[weight] == "NZ"                                     # the Cube's operand, converted at load
    hosts = [solve_layout(host_costs(graph, host), s) for s in ("highs", "cpsat")]
    assert hosts[0].objective == pytest.approx(hosts[1].objective, rel=1e-6)
    assert hosts[0].stored[weight] == "CM"                            # B with K contiguous for the GEMM


def test_host_pads_an_unaligned_intermediate(host):
    """Two row kernels over a 1004-wide fp32 tensor: the intermediate is padded to the cache line
    (16 bytes per row) rather than paying the unaligned tail twice; the ends stay row-major."""
    cols = 1004   # not a multiple of 8 or 16 lanes: a tail on AVX2 and on AVX-512
    assert cols % (host.simd_bytes // 4)
    t = {n.name: n for n in (TensorNode("a", 4096, cols, 4), TensorNode("b", 4096, cols, 4), TensorNode("c", 4096, cols, 4))}
    g = TensorGraph("pair", t, [OpNode("f", "rowwise", ("a",), ("b",)), OpNode("g", "rowwise", ("b",), ("c",))])
    sol = solve_layout(host_costs(g, host), "highs")
    assert sol.stored == {"a": "RM", "b": "RM_PAD", "c": "RM"}


# --- solver robustness --------------------------------------------------------------------------------

def test_three_solvers_agree_on_the_planner_models(host):
    spec = get_op("rms_norm")
    models = [host_kernel(spec).tiling_problem(spec.problem(s, d, v), host) for s, d, v in
              (("4096x4096", "bf16", "weighted"), ("1024x16384", "fp32", "unweighted"), ("7x7168", "bf16", "weighted"))]
    from aurakernel.targets import ascend
    for op, shape, variant in (("cross_entropy", "1024x129280", "default"), ("rms_norm", "8192x4096", "weighted")):
        s = OPS[op]
        models.append(ascend.model(s, s.problem(shape, "bf16", variant), ASCEND))
    assert SOLVERS == ("highs", "cpsat", "scip")
    for model in models:
        sols = {name: solve(model, name) for name in SOLVERS}
        assert all(s.status == "optimal" and model.feasible(s.choice) for s in sols.values())
        assert sols["scip"].objective == pytest.approx(sols["highs"].objective, rel=1e-6)
        assert sols["cpsat"].objective == pytest.approx(sols["highs"].objective, rel=1e-3)


def big_model(n=40, values=12, seed=5) -> ChoiceModel:
    """n knobs of `values` candidates, capacities over pairs of them, the max of n pairwise pipe terms."""
    rng = random.Random(seed)
    domains = {f"k{i}": list(range(values)) for i in range(n)}
    use = {k: [rng.randint(1, 100) for _ in range(values)] for k in domains}
    constraints = [Constraint(f"cap{j}", Term.of((f"k{i}", f"k{i + 1}"), domains,
                                                 lambda a, b, i=i: use[f"k{i}"][a] + use[f"k{i + 1}"][b]), 150, "pair")
                   for j, i in enumerate(range(0, n - 1, 2))]
    pipes = {f"p{i}": [Term.of((f"k{i}", f"k{(i + 1) % n}"), domains,
                               lambda a, b: rng.random() * 1e-6 + (values - a) * 1e-7)] for i in range(n)}
    return ChoiceModel(domains, constraints, [Phase("p", pipes, [Term.of(("k0",), domains, lambda a: 1e-7 * a)])])


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_tiny_time_limit_returns_the_incumbent_or_says_so(solver):
    model = big_model()
    limit = 0.05
    sol = solve(model, solver, time_limit_s=limit)
    # the limit is the solver's; building the model (Pyomo) comes on top of it
    assert sol.solve_s < limit + 5.0
    if sol.choice is None:
        assert sol.status == "timeout"
    else:
        assert sol.status in ("feasible", "optimal") and model.feasible(sol.choice)
    try:
        plan = solve_tiling(model, op="x", variant="v", shape=(1,), dtype="fp32", target="host", solver=solver,
                            time_limit_s=limit)
    except PlanInfeasible as exc:
        assert exc.constraint == "time limit" and f"within {limit:g} s" in str(exc)
    else:
        assert model.feasible(plan.knobs) and plan.status in ("feasible", "optimal")


@pytest.mark.parametrize("solver", SOLVERS)
def test_infeasibility_names_the_constraint_with_every_solver(solver):
    domains = {"a": [1, 2], "b": [1, 2]}
    model = ChoiceModel(domains, [
        Constraint("budget", Term.of(("a", "b"), domains, lambda a, b: a + b), 2.5, "a+b"),
        Constraint("coupling", Term.of(("a", "b"), domains, lambda a, b: 10 if a == b else 0), 5, "a==b"),
    ], [Phase("p", {"pipe": [Term.of(("a",), domains, lambda a: 1.0 / a)]})])
    assert solve(model, solver).status == "infeasible"
    with pytest.raises(PlanInfeasible) as exc:
        solve_tiling(model, op="x", variant="v", shape=(1,), dtype="fp32", target="host", solver=solver)
    assert exc.value.constraint in ("budget", "coupling")
    ub = dataclasses.replace(model.constraints[0], limit=1.0)          # alone unmeetable: named without a search
    with pytest.raises(PlanInfeasible, match="budget: a\\+b needs at least 2"):
        solve_tiling(ChoiceModel(domains, [ub], model.phases), op="x", variant="v", shape=(1,), dtype="fp32",
                     target="host", solver=solver)


def test_cli_solver_option_takes_scip(capsys):
    from aurakernel.cli import main
    assert main(["tune", "rms_norm", "--solver", "glpk"]) == 2
    assert "accepted are highs, cpsat, scip" in capsys.readouterr().err
    main(["tune", "--help"])
    assert "highs, cpsat or scip" in capsys.readouterr().out
