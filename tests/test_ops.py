"""Every operator's kernel against the transformers code it replaces, forward and backward:
fp32 and bf16, tail shapes (rows not divisible by tile x threads, widths off the SIMD grid),
several seeds, NaN-poisoned outputs. Knobs come from the planner, as in real use."""

import pytest
import torch

from aurakernel.targets.host.build import build_kernel
from aurakernel.ops import OPS, get_op
from aurakernel.planner import solve_tiling
from aurakernel.targets.host.target import verify
from aurakernel.targets.host.ops import kernel_of as host_kernel

# small shapes per operator (rows x op extents) that still exercise tails
CASES = {
    "rms_norm": ["300x1024", "37x1003"],
    "mhc_pre": ["45x4x256", "19x4x131"],
    "mhc_head": ["45x4x256", "19x4x131"],
    "mhc_post": ["45x4x256", "19x4x131"],
    "mhc_post_pre": ["45x4x256", "19x4x131"],
    "swiglu": ["300x256", "37x131"],
    "adamw": ["100003", "4096"],
    "rope": ["37x4x64x16", "9x3x96x32"],
    "router": ["301x64x6", "1024x8x2"],
    "cross_entropy": ["67x1000", "5x50257"],
    # TOKENSxHIDDENxVOCAB: chunks of the planned rows plus a short last one, a vocabulary off the SIMD grid
    "linear_cross_entropy": ["300x64x1000", "37x40x5003"],
    # TOKENSxINxOUT: rows and columns off the register blocks, a narrow output, widths off the SIMD grid
    # and both widths past 1024 (A's blocks packed)
    "linear": ["300x96x64", "37x131x5", "300x1024x16", "33x1030x1027"],   # OUT <= 16: the narrow path
    # ROWSxEXPERTSxINxOUT: uneven groups, the first empty (make_inputs); more experts than rows (most empty)
    "grouped_linear": ["300x4x96x64", "37x3x131x5", "5x8x40x24"],
    # TOKENSxGROUPSxINxOUT: as linear's, two and three groups
    "block_linear": ["300x2x96x64", "37x3x131x5"],
    # TOKENSxEXPERTSxTOPKxHIDDEN: expert 0 never picked (an empty group), widths off the SIMD grid, more picks than
    # experts (repeats)
    "moe_permute": ["300x8x2x96", "37x5x3x131", "5x3x4x40"],
    # TOKENSxTOPKxHIDDEN
    "moe_unpermute": ["300x2x96", "37x3x131", "5x6x40"],
    "compressor": ["2x9x4x64", "1x3x16x40"],
    "indexer_score": ["2x19x4x32x23", "1x5x8x16x3"],
    "attn_softmax": ["2x4x37x53", "1x3x9x130"],
    # BxHxSxDxWINDOWxEXTRA: a window longer than the sequence, then a short one; D off the SIMD grid
    "sparse_attention": ["2x4x37x64x64x16", "1x3x70x40x8x8"],
}


def test_every_operator_has_cases():
    assert set(CASES) == set(OPS)


@pytest.mark.parametrize("op,shape,dtype", [(op, s, dt) for op, shapes in CASES.items() for s in shapes
                                             for dt in ("fp32", "bf16") if dt in {d.value for d in OPS[op].dtypes}])
def test_kernel_matches_reference(op, shape, dtype, host):
    spec = get_op(op)
    for variant in spec.variants:
        problem = spec.problem(shape, dtype, variant)
        plan = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op=op, variant=variant, shape=problem.shape,
                            dtype=dtype, target="host")
        cases = [(p, build_kernel(spec, p, plan.knobs))
                 for p in host_kernel(spec).verification_problems(problem, plan.knobs, host.simd_bytes // 4)]
        result = verify(spec, cases, seeds=(0, 1, 2))
        assert result.passed, f"{variant}: {result.summary}"
        tensors = {c.tensor for c in result.checks}
        assert set(spec.visible_outputs()) <= tensors
        assert {f"grad_{k}" for k in spec.differentiable(problem)} <= tensors


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_router_ties_go_exactly_as_torch_topk(dtype, host):
    """Rows full of exact ties (constant logits, a zero correction bias): the selected experts are
    torch.topk's own choice, not the kernel's lower-index preference."""
    import torch


    spec = get_op("router")
    problem = spec.problem("64x256x6", dtype, "topk")
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op="router", variant="topk", shape=problem.shape,
                        dtype=dtype, target="host")
    kernel = build_kernel(spec, problem, plan.knobs)
    inputs = spec.make_inputs(problem, seed=0)
    inputs["logits"][::2] = 0.5                        # every even row: all 256 experts tie
    inputs["logits"][1::4, 100:] = inputs["logits"][1::4, 100:101]   # many ties at the top in others
    inputs["bias"].zero_()
    ref = spec.reference(problem, inputs)
    out = kernel.empty_outputs(problem, inputs)
    kernel.run_forward(inputs, out)
    assert torch.equal(out["indices"], ref["indices"])
    torch.testing.assert_close(out["weights"], ref["weights"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_causal_indexer_computes_only_the_entries_each_query_sees(dtype, host):
    """indexer_score[causal]: each query's entries at or past its limit are -inf, and the kernel computes
    none of their products. Keys no query sees hold NaN (a product with them, even one multiplied by a
    zero gradient, would spread it), yet the scores and q's gradient are the reference's (computed with
    those keys at zero) and those keys' gradient is zero; limits vary per row (one row sees nothing)."""
    spec = get_op("indexer_score")
    problem = spec.problem("2x40x4x32x37", dtype, "causal")
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op="indexer_score", variant="causal",
                        shape=problem.shape, dtype=dtype, target="host")
    kernel = build_kernel(spec, problem, plan.knobs)
    inputs = spec.make_inputs(problem, 0)
    inputs["limit"] = torch.randint(0, 31, (2, 40), generator=torch.Generator().manual_seed(1))
    inputs["limit"][1, 7] = 0
    g = torch.randn(2, 40, 37)
    q, k = inputs["q"].clone().requires_grad_(), inputs["k"].clone()
    k[:, 30:] = 0.0
    k.requires_grad_()
    ref = spec.reference(problem, {**inputs, "q": q, "k": k})["y"]
    ref.backward(g)
    assert torch.isinf(ref).sum() > 0 and not torch.isnan(q.grad).any()
    inputs["k"] = inputs["k"].clone()
    inputs["k"][:, 30:] = float("nan")                   # no query's limit reaches these keys
    out = kernel.empty_outputs(problem, inputs)
    kernel.run_forward(inputs, out)
    grads = {n: torch.empty_like(inputs[n]) for n in ("q", "k", "hidden", "proj")}
    kernel.run_backward(inputs, out, {"y": g}, grads)
    tol = spec.tolerance(problem.dtype, "q")
    torch.testing.assert_close(out["y"], ref.detach(), atol=1e-4, rtol=1e-3)   # -inf exactly where the reference has it
    torch.testing.assert_close(grads["q"].float(), q.grad.float(), atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(grads["k"][:, :30].float(), k.grad[:, :30].float(), atol=tol.atol, rtol=tol.rtol)
    assert torch.equal(grads["k"][:, 30:].float(), torch.zeros(2, 7, 32))


def test_swiglu_bf16_lookup_follows_each_limit(host):
    """bf16 swiglu looks the gate's silu and its derivative up in a table built per limit: calls with
    two limits in turn (and back) each match transformers' gate at that limit, forward and backward,
    clamp edges included."""
    import torch

    from aurakernel.ops.swiglu import SwigluReference
    from aurakernel.targets.host.ops import swiglu as host_swiglu

    spec = get_op("swiglu")
    problem = spec.problem("67x96", "bf16", "default")
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op="swiglu", variant="default",
                        shape=problem.shape, dtype="bf16", target="host")
    kernel = build_kernel(spec, problem, plan.knobs)
    assert kernel.has("fwd_table") and kernel.has("bwd_table")
    gate_up = spec.make_inputs(problem, 0)["gate_up"]
    gate_up.view(-1)[2::53] = 7.0                       # on the second limit's edge
    dy = torch.randn(67, 96).to(torch.bfloat16)
    tol = spec.tolerance(problem.dtype, "y")
    for limit in (10.0, 7.0, 10.0):
        x = gate_up.clone().requires_grad_()
        ref = SwigluReference(96, limit)(x)
        ref.backward(dy)
        gate, up = gate_up[:, :96], gate_up[:, 96:]
        y = torch.empty(67, 96, dtype=torch.bfloat16)
        host_swiglu.forward(kernel, gate, up, gate_up.stride(0), y, 67, limit)
        grad = torch.empty_like(gate_up)
        host_swiglu.backward(kernel, gate, up, gate_up.stride(0), dy, grad[:, :96], grad[:, 96:], grad.stride(0), 67, limit)
        torch.testing.assert_close(y.float(), ref.float(), atol=tol.atol, rtol=tol.rtol)
        torch.testing.assert_close(grad.float(), x.grad.float(), atol=tol.atol, rtol=tol.rtol)


def test_router_score_table_is_torch_bitwise():
    """bf16 router kernels score logits by lookup (score_table): torch's sqrtsoftplus of every bf16
    bit pattern. torch must give each value those bits wherever it sits in a tensor (vector loops,
    odd-length tails, a lone element), or routing would differ from the reference's."""
    import torch
    from transformers.activations import ACT2FN

    from aurakernel.targets.host.ops.router import score_table
    table = score_table().view(torch.int16)
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for seed, drop in ((0, 0), (1, 7), (2, 13)):
        order = torch.randperm(65536, generator=torch.Generator().manual_seed(seed))[:65536 - drop]
        got = ACT2FN["sqrtsoftplus"](values[order].reshape(-1, 1) if seed == 2 else values[order]).view(torch.int16)
        assert torch.equal(got.flatten(), table[order])
    lone = torch.arange(0, 65536, 997)
    assert all(ACT2FN["sqrtsoftplus"](values[i:i + 1]).view(torch.int16)[0] == table[i] for i in lone.tolist())


def test_indexer_relu_kink_allowance_is_narrow():
    """The indexer's gradient allowance covers only products that are zero to fp32 rounding (where
    the ReLU's side is decided by summation order): almost every element gets none, and an error
    there still fails the comparison."""
    import torch

    from aurakernel.verify import compare
    spec = OPS["indexer_score"]
    problem = spec.problem("1x64x16x128x64", "bf16", None)
    inputs = spec.make_inputs(problem, 0)
    grad_out = {"y": torch.randn(1, 64, 64)}
    slack = spec.grad_slack(problem, inputs, grad_out)
    assert slack["q"].shape == inputs["q"].shape and slack["k"].shape == inputs["k"].shape
    # a kink widens one row of dq (of 64 products) and one row of dk (of 1024 products)
    assert float((slack["q"] > 0).float().mean()) < 0.01 and float((slack["k"] > 0).float().mean()) < 0.15
    ref = torch.randn(inputs["q"].shape)
    wrong = ref.clone()
    at = int(torch.nonzero(slack["q"].flatten() == 0)[0])
    wrong.view(-1)[at] += 0.5
    assert compare(wrong, ref, 2e-2, 1.6e-2, slack["q"])[2] is False
    assert compare(ref, ref, 2e-2, 1.6e-2, slack["q"])[2] is True


def test_masked_outputs_compare_exactly_where_the_reference_is_infinite():
    """Masked scores (-inf in the reference) must be the same infinity in the output; the finite rest
    is compared as numbers, its scale not swamped by the infinities."""
    from aurakernel.verify import compare
    ref = torch.tensor([[1.0, 2.0, float("-inf")], [0.5, float("-inf"), float("-inf")]])
    assert compare(ref.clone(), ref, 1e-5, 1e-5)[2] is True
    finite_there = ref.clone()
    finite_there[0, 2] = -1e30
    ok, why = compare(finite_there, ref, 1e-5, 1e-5)[2:]
    assert ok is False and "1 elements differ where the reference is infinite" in why
    off = ref.clone()
    off[1, 0] += 1e-3
    assert compare(off, ref, 1e-5, 1e-5)[2] is False
    wrong_sign = ref.clone()
    wrong_sign[1, 1] = float("inf")
    assert compare(wrong_sign, ref, 1e-5, 1e-5)[2] is False


def test_cross_entropy_plans_and_verifies_on_a_512_kb_l2_machine(host):
    """The AVX2 EPYC this project also runs on has 32 KB L1d and 512 KB L2 per core: V4's 129,280-wide
    vocabulary (250 KB of bf16 per row) does not stay in its L2 budget, so the kernel streams each row
    through L1 in column chunks. The plan on that machine's caches is feasible and its kernel verifies."""
    import dataclasses

    memory = dict(host.memory)
    memory["L1"] = dataclasses.replace(memory["L1"], capacity=32 * 1024)
    memory["L2"] = dataclasses.replace(memory["L2"], capacity=512 * 1024)
    epyc = dataclasses.replace(host, memory=memory)
    spec = get_op("cross_entropy")
    problem = spec.problem("6x129280", "bf16")
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, epyc), op="cross_entropy", variant="default",
                        shape=problem.shape, dtype="bf16", target="host")
    assert plan.knobs["col_chunk"] * 2 <= 32 * 1024   # a chunk of bf16 logits fits the L1
    result = verify(spec, [(problem, build_kernel(spec, problem, plan.knobs)),
                           (spec.problem("3x50257", "fp32"), build_kernel(spec, spec.problem("3x50257", "fp32"),
                                                                          plan.knobs))])
    assert result.passed, result.summary


def _coarse_reference_spec():
    """An operator whose reference rounds to quarters in its own dtype (as bf16 intermediates of 80 do)
    and is exact in float64: y = 1.01 x, dy/dx = 1.01."""
    from aurakernel.dtypes import DType
    from aurakernel.ops.base import OpSpec, Tolerance, Work

    class Coarse(OpSpec):
        def kernel_key(self, problem):
            return ()

        def make_inputs(self, problem, seed):
            return {"x": torch.randn(problem.shape, generator=torch.Generator().manual_seed(seed)) * 4}

        def differentiable(self, problem):
            return ("x",)

        def reference(self, problem, inputs):
            y = inputs["x"] * 1.01
            if y.dtype != torch.float64:
                y = y + ((y * 4).round() / 4 - y).detach()   # rounded values, the exact gradient
            return {"y": y}

        def tolerance(self, dtype, output):
            return Tolerance(1e-3, 1e-3)

        def work(self, problem, backward):
            return Work(0, 0)

        def module_call(self, problem, inputs):
            raise TypeError("not a module")

    return Coarse("coarse", "test", "N", 1, (64,), (DType.fp32,), ("default",))


def test_a_kernel_is_held_to_the_exact_result_not_to_the_references_rounding():
    """An element outside the tolerance of the reference passes when the kernel is that close to the
    float64 result, widened by the reference's own error there; a wrong kernel still fails."""

    from aurakernel.verify import check_case
    spec = _coarse_reference_spec()
    problem = spec.problem("256", "fp32", None)

    def kernel(scale):
        def run(inputs, grad_out):
            return {"y": inputs["x"] * scale}, {"x": grad_out["y"] * 1.01}, None
        return run
    exact = check_case(spec, problem, 0, kernel(1.01))
    assert all(c.passed for c in exact)
    second_look = "within the reference's own rounding of the exact (float64) result"
    assert [c.reason for c in exact if c.tensor == "y"] == [second_look]
    wrong = check_case(spec, problem, 0, kernel(1.03))   # 2% off: beyond the reference's rounding of 1/8
    assert [c.passed for c in wrong if c.tensor == "y"] == [False]
    assert [c.reason for c in wrong if c.tensor == "grad_x"] == [""]   # within tolerance of the reference: no second look



@pytest.mark.parametrize("by_group", [0, 1])
def test_grouped_linear_takes_offsets_as_clamped_group_ends(by_group, host):
    """Offsets out of order or past the rows (a caller's bug, or a batch routed to no expert) never
    make the kernel read or write outside its buffers: each group ends at its offset clamped into
    [the previous end, rows], rows past the last group come out zero, an empty group's dW is zero;
    whether the threads share each GEMM or take whole groups."""
    spec = get_op("grouped_linear")
    problem = spec.problem("10x3x8x4", "fp32")
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op="grouped_linear", variant="default",
                        shape=problem.shape, dtype="fp32", target="host")
    kernel = build_kernel(spec, problem, {**plan.knobs, "by_group": by_group, "threads": 2})
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(10, 8, generator=g), torch.randn(3, 4, 8, generator=g), torch.randn(10, 4, generator=g)
    for offsets, ends in (([6, 2, 1000], [6, 6, 10]), ([-5, 4, 7], [0, 4, 7]), ([], [])):
        inputs = {"x": x, "weight": w[:len(offsets)].contiguous(), "offsets": torch.tensor(offsets, dtype=torch.int32)}
        y = torch.full((10, 4), float("nan"))
        kernel.run_forward(inputs, {"y": y})
        grads = {"x": torch.full_like(x, float("nan")), "weight": torch.full_like(inputs["weight"], float("nan"))}
        kernel.run_backward(inputs, {}, {"y": dy}, grads)
        want_y, want_dx, want_dw, lo = torch.zeros(10, 4), torch.zeros(10, 8), torch.zeros_like(inputs["weight"]), 0
        for e, hi in enumerate(ends):
            want_y[lo:hi] = x[lo:hi] @ w[e].T
            want_dx[lo:hi] = dy[lo:hi] @ w[e]
            want_dw[e] = dy[lo:hi].T @ x[lo:hi]
            lo = hi
        torch.testing.assert_close(y, want_y)
        torch.testing.assert_close(grads["x"], want_dx)
        torch.testing.assert_close(grads["weight"], want_dw)

def _planned(op: str, shape: str, host):
    spec = get_op(op)
    problem = spec.problem(shape, "fp32")
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op=op, variant="default", shape=problem.shape,
                        dtype="fp32", target="host")
    return build_kernel(spec, problem, {**plan.knobs, "threads": 2})


def test_moe_permute_sorts_out_of_range_experts_after_every_group(host):
    """Expert ids outside [0, E) (expert parallelism's sentinels, or a caller's bug) are rows after
    every group, in token order, and out of the offsets (as transformers' histc leaves them); the
    groups keep their tokens' order; the backward still brings each pair's gradient home."""
    kernel = _planned("moe_permute", "6x4x2x16", host)
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[0, 5], [-1, 3], [3, 0], [4, 1], [2, 2], [7, 1]])
    inputs = {"hidden": torch.randn(6, 16, generator=g), "top_k_index": ids}
    out = {"selected": torch.full((12, 16), float("nan")), "offsets": torch.full((4,), -9, dtype=torch.int32),
           "rows": torch.full((12,), -9, dtype=torch.int64)}
    kernel.run_forward(inputs, out)
    flat = ids.reshape(-1)
    assert out["offsets"].tolist() == [2, 4, 6, 8]
    order = [s for e in range(4) for s in range(12) if flat[s] == e] + [s for s in range(12) if not 0 <= flat[s] < 4]
    assert out["rows"].tolist() == [order.index(s) for s in range(12)]
    assert torch.equal(out["selected"], inputs["hidden"][torch.tensor(order) // 2])
    d_sel = torch.randn(12, 16, generator=g)
    grads = {"hidden": torch.full((6, 16), float("nan"))}
    kernel.run_backward(inputs, out, {"selected": d_sel}, grads)
    torch.testing.assert_close(grads["hidden"], torch.zeros(6, 16).index_add_(0, torch.tensor(order) // 2, d_sel))


def test_moe_unpermute_takes_rows_that_are_not_a_permutation_without_leaving_its_buffers(host):
    """rows out of range are clamped into it; where two pairs name one row the last one owns it and
    the other's weight gradient is zero; a row no pair names gets a zero gradient: every output is
    written and nothing outside the buffers is touched."""
    kernel = _planned("moe_unpermute", "3x2x16", host)
    g = torch.Generator().manual_seed(1)
    proj, w = torch.randn(6, 16, generator=g), torch.rand(3, 2, generator=g)
    rows = torch.tensor([9, 0, -4, 2, 1, 0])   # -> 5, 0, 0, 2, 1, 0: rows 3 and 4 unnamed, row 0 named thrice
    clamped = rows.clamp(0, 5)
    inputs = {"proj": proj, "top_k_weights": w, "rows": rows}
    y = torch.full((3, 16), float("nan"))
    kernel.run_forward(inputs, {"y": y})
    torch.testing.assert_close(y, (proj[clamped].view(3, 2, 16) * w.unsqueeze(-1)).sum(1))
    dy = torch.randn(3, 16, generator=g)
    grads = {"proj": torch.full_like(proj, float("nan")), "top_k_weights": torch.full_like(w, float("nan"))}
    kernel.run_backward(inputs, {}, {"y": dy}, grads)
    want_dproj, want_dw = torch.zeros_like(proj), torch.zeros(6)
    for r, s in {int(r): s for s, r in enumerate(clamped)}.items():   # each row's last pair owns it
        want_dproj[r] = dy[s // 2] * w.reshape(-1)[s]
        want_dw[s] = dy[s // 2] @ proj[r]
    torch.testing.assert_close(grads["proj"], want_dproj)
    torch.testing.assert_close(grads["top_k_weights"], want_dw.view(3, 2))


def test_linear_cases_take_every_way_of_sharing_a_gemm():
    """The linear cases above run each way the kernel shares a GEMM between two threads (rows,
    columns, the sum's depth) and A both read in place and packed: the template's split_of and
    PACK_A_STRIDE are mirrored by the model's, which says which GEMM goes which way."""
    from aurakernel.targets.host.ops.linear import PACK_A_STRIDE, gemms, split_of

    ways, packed = set(), set()
    for shape in CASES["linear"]:
        problem = get_op("linear").problem(shape, "fp32")
        for phase in gemms(problem).values():
            for g in phase:
                ways.add(split_of(g, 2))
                packed.add(g.a_stride >= PACK_A_STRIDE)
    assert ways == {"rows", "cols", "depth"} and packed == {True, False}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_indexer_kept_and_recomputed_products_both_verify(dtype, host):
    """indexer_score's backward either reads the products the forward kept or computes them again
    (keep_products); both formulations match the reference, and only the kept one saves a tensor."""
    spec = get_op("indexer_score")
    problem = spec.problem("2x19x4x32x23", dtype)
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op="indexer_score", variant="default",
                        shape=problem.shape, dtype=dtype, target="host")
    for keep in (0, 1):
        knobs = {**plan.knobs, "keep_products": keep}
        cases = [(p, build_kernel(spec, p, knobs))
                 for p in host_kernel(spec).verification_problems(problem, knobs, host.simd_bytes // 4)]
        result = verify(spec, cases, seeds=(0, 1))
        assert result.passed, f"keep_products={keep}: {result.summary}"
        inputs = spec.make_inputs(problem, 0)
        out = cases[0][1].empty_outputs(problem, inputs)
        cases[0][1].run_forward(inputs, out)
        assert out["products"].numel() == (2 * 19 * 4 * 23 if keep else 0)


def test_indexer_keeps_its_products_only_where_memory_allows(host):
    """The planner keeps the products (a GEMM fewer in the backward) at the benchmark's shape and
    computes them again at V4-Flash's 4096 tokens, where they would take 1 GiB per CSA layer (on a
    machine of 24 GiB, as this project's)."""
    import dataclasses

    memory = dict(host.memory)
    memory["DRAM"] = dataclasses.replace(memory["DRAM"], capacity=24 * 2**30)
    host = dataclasses.replace(host, memory=memory)
    spec = get_op("indexer_score")
    small = spec.problem("1x512x64x128x256", "fp32")
    large = spec.problem("1x4096x64x128x1024", "bf16")
    picks = {p.shape: solve_tiling(host_kernel(spec).tiling_problem(p, host), op="indexer_score", variant="default",
                                   shape=p.shape, dtype=p.dtype.value, target="host").knobs["keep_products"]
             for p in (small, large)}
    assert picks == {small.shape: 1, large.shape: 0}


def test_fused_linear_loss_runs_its_gemms_on_the_faster_of_ours_and_torchs(host):
    """fp32 linear_cross_entropy's chunk GEMMs run on our blocked GEMM or on torch's (torch_gemm),
    planned by the two rates this machine's calibration measured; without a measurement of ours it
    keeps ours. Both formulations match the reference."""
    import dataclasses

    spec = get_op("linear_cross_entropy")
    problem = spec.problem("300x64x1000", "fp32")

    def pick(own):
        hw = dataclasses.replace(host, peak_tflops={**host.peak_tflops, "fp32": 0.1}, own_gemm_tflops=own)
        return solve_tiling(host_kernel(spec).tiling_problem(problem, hw), op=problem.op, variant="default",
                            shape=problem.shape, dtype="fp32", target="host").knobs
    ours = pick({"fp32": 0.12})
    assert ours["torch_gemm"] == 0 and pick({"fp32": 0.08})["torch_gemm"] == 1 and pick({})["torch_gemm"] == 0
    for torch_gemm in (0, 1):
        knobs = {**ours, "torch_gemm": torch_gemm}
        kernels = [(p, build_kernel(spec, p, knobs))
                   for p in host_kernel(spec).verification_problems(problem, knobs, host.simd_bytes // 4)]
        assert all(k.has("gemm") == (torch_gemm == 0) for _, k in kernels)
        result = verify(spec, kernels, seeds=(0,))
        assert result.passed, f"torch_gemm={torch_gemm}: {result.summary}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mhc_post_pre_backward_both_ways(dtype, host):
    """The fused backward runs mhc_post's rows on each tile's dx in cache where a column chunk is a
    whole stream (col_chunk >= D: no dx_pre written), else writes dx_pre whole and runs them after;
    each way verifies against the layer's code (the planner's knobs, with col_chunk forced each way)."""
    from aurakernel.targets.host.ops.mhc_post_pre import post_in_tiles

    spec = get_op("mhc_post_pre")
    problem = spec.problem("45x4x256", dtype)
    plan = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op="mhc_post_pre", variant="default",
                        shape=problem.shape, dtype=dtype, target="host")
    for col_chunk, whole in ((256, True), (64, False)):
        kernel = build_kernel(spec, problem, {**plan.knobs, "col_chunk": col_chunk})
        assert post_in_tiles(kernel) is whole
        result = verify(spec, [(problem, kernel)], seeds=(0, 1))
        assert result.passed, f"col_chunk {col_chunk}: {result.summary}"


@pytest.mark.parametrize("op,cached,beyond,checks", [
    ("mhc_post", "1024x4x256", "2048x4x4096", (("19x4x131", "bf16"), ("45x4x256", "fp32"))),   # 2 / 64 MB written
    ("moe_permute", "1024x8x2x256", "1024x256x6x4096", (("37x5x3x131", "bf16"), ("300x8x2x96", "fp32")))])  # 1 / 48 MB
def test_outputs_are_streamed_only_past_the_last_level_cache_and_are_the_same_either_way(op, cached, beyond, checks,
                                                                                          host):
    """Streaming stores are a choice only where a call's fresh outputs outgrow the last-level cache
    (below that the next kernel reads them from cache), and tune times both; built with them, the
    kernel writes the same bits as with plain stores, rows of every alignment and length included
    (odd widths: each row's bytes start and end off the 32 B grid)."""
    import dataclasses

    memory = dict(host.memory)
    memory["L3"] = dataclasses.replace(memory["L3"], capacity=32 * 2**20)
    machine = dataclasses.replace(host, memory=memory)
    spec = get_op(op)
    kernel = host_kernel(spec)
    domains = {shape: kernel.tiling_problem(spec.problem(shape, "bf16"), machine).domains["stream"]
               for shape in (cached, beyond)}
    assert domains == {cached: [0], beyond: [0, 1]}
    assert "stream" in kernel.measured_knobs(spec.problem(beyond, "bf16"))

    for shape, dtype in checks:
        problem = spec.problem(shape, dtype)
        knobs = {"tile_rows": 4, "threads": 2, "col_chunk": problem.shape[-1]}
        built = {st: build_kernel(spec, problem, {**knobs, "stream": st}) for st in (0, 1)}
        result = verify(spec, [(problem, built[1])], seeds=(0, 1))
        assert result.passed, result.summary
        inputs = spec.make_inputs(problem, 5)
        outs, grads = {}, {}
        for st, k in built.items():
            outs[st] = kernel.empty_outputs(problem, inputs)
            kernel.run_forward(k, inputs, outs[st])
            g_out = {o: torch.ones_like(outs[st][o]) for o in spec.grad_outputs()}
            grads[st] = {n: torch.full(inputs[n].shape, float("nan"), dtype=inputs[n].dtype)
                         for n in spec.differentiable(problem)}
            kernel.run_backward(k, inputs, outs[st], g_out, grads[st])
        assert all(torch.equal(outs[0][o], outs[1][o]) for o in outs[0])
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
