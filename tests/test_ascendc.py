"""The AscendC backend: rendered kernels proven in the emulator, the emulator's hardware rules, and
the op project. No NPU here: the only allowed skips are the real CANN build without ASCEND_HOME_PATH
and the compile against the real AscendC headers without ASC_DEVKIT_PATH."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from aurakernel import emulator
from aurakernel.targets import ascend
from aurakernel.hardware import load_profile
from aurakernel.ops import OPS
from aurakernel.ops.sparse_attention import entries_of

ROOT = Path(__file__).parents[1]
HW = load_profile("ascend910b2")
SPREAD_TESTS = True   # xdist spreads these long emulator cases over its workers (conftest); the one shared fixture's
                      # tests (torch_headers) keep to one worker by their own xdist group


def planned_knobs(spec, problem) -> dict[str, int]:
    """The planner's knobs for `problem` on HW, without the binding analysis (a solve per capacity:
    ~7 s of sparse attention's plan) that a test of the kernel does not read."""
    return ascend.plan(spec, problem, HW, target="ascend910b2", solver="highs", explain=False).knobs


@pytest.mark.parametrize("op,variant,shape,dtype", [
    ("rms_norm", "weighted", "60x4096", "bf16"),       # V4-Flash hidden size
    ("rms_norm", "weighted", "60x7168", "bf16"),       # V4-Pro hidden size
    ("rms_norm", "unweighted", "60x16384", "bf16"),    # mHC width of V4-Flash (4 x 4096)
    ("rms_norm", "unweighted", "52x28672", "bf16"),    # mHC width of V4-Pro (4 x 7168)
    ("rms_norm", "weighted", "60x4096", "fp32"),
    ("rms_norm", "unweighted", "300x512", "bf16"),     # V4's per-head q norm: narrow rows, whole tiles
    ("rms_norm", "weighted", "300x512", "bf16"),       # the kv norm
    ("rms_norm", "weighted", "100x128", "fp32"),       # the indexer's width, fp32
    ("swiglu", "default", "60x2048", "bf16"),          # V4-Flash moe_intermediate_size
    ("swiglu", "default", "60x3072", "bf16"),          # V4-Pro moe_intermediate_size
    ("cross_entropy", "default", "60x129280", "bf16"),  # the V4 vocabulary: rows stream in column tiles
    ("mhc_post", "default", "60x4x4096", "bf16"),       # V4-Flash: 4 streams of 4096
    ("mhc_post", "default", "52x4x7168", "bf16"),       # V4-Pro: rows stream through in column tiles
    ("mhc_pre", "default", "60x4x4096", "bf16"),        # V4-Flash: 4 streams of 4096 against fn's column tiles
    ("mhc_pre", "default", "52x4x7168", "bf16"),        # V4-Pro
    ("mhc_head", "default", "60x4x4096", "bf16"),       # the same template, hc pre weights only
    ("mhc_pre", "default", "40x4x1024", "fp32"),        # fp32 on the Cube (fn itself, 16 x 8 fractals), the vector backward
    ("router", "topk", "60x256x6", "bf16"),             # V4-Flash: 256 routed experts, top-6
    ("router", "topk", "52x384x6", "bf16"),             # V4-Pro: 384 routed experts, top-6
    ("router", "hash", "60x256x6", "bf16"),             # the hash layers: tid2eid's experts
    ("router", "topk", "52x256x6", "fp32"),
    ("router", "topk", "44x512x12", "bf16"),            # 16 groups of 8 (four candidate lists merged), 16 sort lanes a row
    ("indexer_score", "default", "1x60x64x128x64", "bf16"),   # V4-Flash and V4-Pro: 64 heads x index_head_dim 128
    ("indexer_score", "default", "2x37x64x128x70", "fp32"),   # fp32 operands on the Cube: 16 x 8 fractals (vector backward)
    ("indexer_score", "default", "1x37x64x128x100", "fp16"),  # fp16: dq out of the Fixpipe as F322F16
    ("indexer_score", "causal", "1x60x64x128x15", "bf16"),    # DeepseekV4Indexer's causal rule: entries past a row's limit -inf
    ("rope", "default", "5x64x512x64", "bf16"),         # V4-Flash q: 64 heads of 512, rope slice 64
    ("rope", "default", "3x128x512x64", "bf16"),        # V4-Pro q: 128 heads
    ("rope", "default", "60x1x512x64", "fp32"),         # the shared kv head
    ("attn_softmax", "default", "1x64x1x640", "bf16"),   # V4-Flash: 64 heads, window 128 + top-k 512 keys
    ("attn_softmax", "default", "1x128x1x1152", "bf16"),  # V4-Pro: 128 heads, window 128 + top-k 1024 keys
    ("attn_softmax", "default", "1x64x1x640", "fp32"),
    ("compressor", "csa", "1x60x4x512", "bf16"),       # V4-Flash and V4-Pro CSA: m = 4, 2m slots, head_dim 512
    ("compressor", "hca", "1x8x128x512", "bf16"),      # V4-Flash and V4-Pro HCA: m = 128 (channels in tiles)
    ("compressor", "csa", "1x52x4x128", "fp32"),       # the lightning indexer's compressor: index_head_dim 128
    ("sparse_attention", "csa", "1x64x40x512x128x20", "bf16"),   # V4-Flash: 64 heads of 512, window 128, picks
    ("sparse_attention", "hca", "1x64x40x512x128x4", "bf16"),    # every ready entry (ratio 4 for entries at 40 tokens)
    ("sparse_attention", "csa", "1x128x40x512x128x20", "bf16"),  # V4-Pro: 128 heads (O and the Cube's tiles at their tightest)
    ("sparse_attention", "sliding", "1x16x40x128x128x1", "bf16"),
])
def test_kernel_matches_reference_in_emulator(op, variant, shape, dtype, tmp_path):
    spec = OPS[op]
    problem = spec.problem(shape, dtype, variant)
    result = ascend.tune(spec, problem, HW, target="ascend910b2", solver="highs", out_dir=tmp_path, explain=False)
    assert result.verified, result.verification.summary
    shapes = {c.shape for c in result.verification.checks}
    assert any(s[0] % HW.cores and s[1:] == problem.shape[1:] for s in shapes)   # a tail core
    assert any(s[-1] % 16 for s in shapes)                                        # a width that is not 16-aligned
    assert {c.tensor for c in result.verification.checks} >= {spec.visible_outputs()[0],
                                                             f"grad_{spec.differentiable(problem)[0]}"}
    d = result.to_json()
    assert 0 < d["ub_bytes"] <= HW.memory["UB"].capacity - 8192
    assert d["est_cycles"] > 0 and d["roofline_ratio"] > 0.5
    for name in ascend.PROJECT_FILES.values():
        assert (tmp_path / name.format(op=op)).is_file()


def test_sparse_attention_reads_each_rows_distinct_picks_and_spans_key_tiles():
    """The csa kernel gathers each listed entry once: the picks it reads are each row's distinct valid
    ones, ascending, then -1s, with their count (a repeated pick counts once in the dense mask too). Its
    verification covers positions with more keys than a tile, and fp32 is refused in one line (P V
    transposes K's fractals: 16-bit data only), by the planner too, before any capacity."""
    import torch
    from aurakernel.errors import PlanInfeasible
    from aurakernel.targets.ascend.ops.sparse_attention import compact_picks
    picks = torch.tensor([[[5, -1, 2, 5, 0], [-1, -1, -1, -1, -1], [3, 3, 3, 1, 4]]])
    listed, count = compact_picks(picks, entries=6)
    assert listed.dtype == torch.int32 and count.tolist() == [[3, 0, 3]]
    assert listed.tolist() == [[[0, 2, 5, -1, -1], [-1] * 5, [1, 3, 4, -1, -1]]]
    spec, kernel = OPS["sparse_attention"], ascend.kernel_of(OPS["sparse_attention"])
    problem = spec.problem("1x64x4096x512x128x512", "bf16", "csa")
    knobs = planned_knobs(spec, problem)
    for tile in ("kv_tile", "bwd_kv_tile"):   # the forward's and the backward's own key tiles
        assert any(p.shape[4] > knobs[tile] and p.shape[2] > knobs[tile] for p in kernel.verification_problems(problem, knobs))
    with pytest.raises(PlanInfeasible, match="16-bit"):
        kernel.params(spec.problem("1x64x4096x512x128x512", "fp32", "csa"), knobs)
    # the planner names what the kernel cannot compute, not the first capacity it would overflow
    for shape, dtype, what in (("1x64x40x512x128x20", "fp32", "dtype: fp32: the Cube kernel takes 16-bit"),
                               ("1x64x40x500x128x20", "bf16", "head_dim: 500 must be a multiple of 16")):
        with pytest.raises(PlanInfeasible, match=what):
            ascend.plan(spec, spec.problem(shape, dtype, "csa"), HW, target="ascend910b2", solver="highs")


def _emulated_with(spec, problem, knobs, knob, values, tmp_path, verify=lambda value: True):
    """Per value of one knob: both kernels rendered and run in the emulator at `problem` (and verified
    against the reference at it and its verification shapes where `verify(value)`): {value: reports}."""
    import torch
    kernel = ascend.kernel_of(spec)
    inputs = spec.make_inputs(problem, 0)
    grad_out = {"y": torch.randn(*spec.reference(problem, inputs)["y"].shape, generator=torch.Generator().manual_seed(1))}
    reports = {}
    for value in values:
        k = knobs | {knob: value}
        emu = ascend.Emulated(spec, ascend.render_project(spec, problem, k, tmp_path / str(value), HW), HW)
        if verify(value):
            result = ascend.verify(spec, [problem, *kernel.verification_problems(problem, k)], k, emu, seeds=(0,))
            assert result.passed, result.summary
        reports[value] = kernel.run(problem, k, inputs, grad_out, emu)[2]
    return reports


def test_sparse_attention_gathers_picks_a_short_gap_apart_in_one_copy(tmp_path):
    """With merge_gap > 0 the slots list the entries between two picks at most that far apart as holes
    (-2 - entry): the Cube gathers a run of picks and holes in one copy, the vector cores mask the holes
    out of the softmax (P = 0, so their key gradients are 0). Every pick stays listed once; both kernels
    verify against the reference; the forward's Cube gathers in fewer copies. The planner merges where
    picks are dense (V4-Flash at 1024 tokens: half the ready entries)."""
    import torch
    from aurakernel.targets.ascend.ops.sparse_attention import compact_picks, position_keys
    picks = torch.tensor([[[5, -1, 1, 3, 9, 10, 3], [-1] * 7]])
    slots, count = compact_picks(picks, entries=12, gap=2)
    assert count.tolist() == [[7, 0]] and slots.tolist() == [[[1, -4, 3, -6, 5, 9, 10], [-1] * 7]]
    slots, count = compact_picks(picks, entries=12, gap=3)   # 5 .. 9: three holes
    assert count.tolist() == [[10, 0]] and slots[0, 0].tolist() == [1, -4, 3, -6, 5, -8, -9, -10, 9, 10]
    dense = [position_keys("csa", 1024, 128, 128, gap) for gap in (0, 2)]
    assert dense[1][1] < dense[0][1] and sum(dense[1][0]) > sum(dense[0][0])   # fewer copies, more keys

    spec = OPS["sparse_attention"]
    assert planned_knobs(spec, spec.problem("1x64x1024x512x128x128", "bf16", "csa"))["merge_gap"] == 2
    problem = spec.problem("1x16x160x128x16x24", "bf16", "csa")   # 24 picks of up to 40 ready entries
    knobs = planned_knobs(spec, problem)
    reports = _emulated_with(spec, problem, knobs, "merge_gap", (0, 2), tmp_path, verify=lambda gap: gap > 0)
    gathered = {gap: sum(b.busy["MTE2"] for b in r["forward"].blocks if b.core == "AIC") for gap, r in reports.items()}
    assert gathered[2] < 0.8 * gathered[0]   # emulated: 178k against 242k cycles


def test_sparse_attention_vector_cores_gather_a_share_of_scattered_picks(tmp_path):
    """Where csa's picks are scattered (a long sequence: few picks among many ready entries), the gathers
    are a copy per pick, bound by each copy's latency on the Cube core's one MTE2 queue. With aiv_gather the
    two vector cores copy the last eighths of each tile's picks into a packed workspace slot and the Cube
    core takes those in one copy: both kernels verify against the reference (the backward still adds each
    pick's gradient at its own row), the Cube core's MTE2 is less busy and the forward takes fewer cycles.
    The planner gives the vector cores that share at V4-Flash's 65536 tokens, not at 1024 (dense picks:
    long runs, a few copies)."""
    spec = OPS["sparse_attention"]
    plans = {seq: ascend.plan(spec, spec.problem(f"1x64x{seq}x512x128x{picks}", "bf16", "csa"), HW, target="ascend910b2",
                              solver="highs", explain=False) for seq, picks in ((1024, 128), (65536, 512))}
    assert plans[1024].knobs["aiv_gather"] == 0 and plans[65536].knobs["aiv_gather"] > 0
    problem = spec.problem("1x16x512x128x16x24", "bf16", "csa")   # 24 picks of up to 128 ready entries
    knobs = planned_knobs(spec, problem)
    reports = _emulated_with(spec, problem, knobs | {"merge_gap": 0, "o_chunk": 64}, "aiv_gather", (0, 4), tmp_path,
                             verify=lambda share: share > 0)
    for phase in ("forward", "backward"):
        gathered = {share: max(b.busy["MTE2"] for b in r[phase].blocks if b.core == "AIC") for share, r in reports.items()}
        assert gathered[4] < 0.8 * gathered[0], (phase, gathered)
    assert reports[4]["forward"].cycles < reports[0]["forward"].cycles


@pytest.mark.parametrize("tiles", [{"kv_tile": 128, "bwd_kv_tile": 64},
                                   {"kv_tile": 64, "bwd_kv_tile": 128, "bwd_d_chunk": 32, "g_buffers": 2}])
def test_sparse_attention_kernels_tile_keys_each_their_own_way(tiles, tmp_path):
    """The forward and the backward take their own key tiles (the plan picks 128 for the forward and 64
    for the backward at V4-Flash shapes): with either one the larger, both verify against the reference
    over positions whose keys span tiles of each, on cores walking several positions (two tiles in
    flight across them)."""
    spec, kernel = OPS["sparse_attention"], ascend.kernel_of(OPS["sparse_attention"])
    problem = spec.problem("1x16x40x128x128x8", "bf16", "csa")
    knobs = planned_knobs(spec, problem) | tiles
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    problems = kernel.verification_problems(problem, knobs)
    assert any(p.shape[2] > 128 and p.shape[0] * p.shape[2] > 2 * HW.cores for p in problems)
    result = ascend.verify(spec, problems, knobs, emu, seeds=(0,))
    assert result.passed, result.summary
    assert {c.tensor for c in result.checks} >= {"y", "grad_q", "grad_kv", "grad_compressed_kv"}


def test_sparse_attention_forward_joins_a_short_last_tile_to_the_one_before(tmp_path):
    """hca's positions attend to a window of a whole key tile and a few compressed entries: as a tile of
    their own the entries cost a softmax, a P V and an O update as large as the window's. With pair_keys
    a last tile of that many keys joins the one before (its S and P V in Mmads of their own, added in
    L0C): the forward verifies against the reference over positions whose window is a ring in L1 with
    entries after it, and whose window spans tiles, and takes fewer emulated cycles; the planner picks it
    for V4-Flash's hca at 1024 tokens (up to 8 entries a position)."""
    from aurakernel.targets.ascend.ops.sparse_attention import position_tiles
    spec = OPS["sparse_attention"]
    assert [position_tiles(k, 64, 32) for k in (40, 64, 96, 97, 128, 160)] == [1, 1, 1, 2, 2, 2]
    assert planned_knobs(spec, spec.problem("1x64x1024x512x128x128", "bf16", "hca"))["pair_keys"] > 0
    problem = spec.problem("1x32x160x256x64x8", "bf16", "hca")   # window 64, up to 20 entries
    base = planned_knobs(spec, problem) | {"kv_tile": 64, "s_buffers": 1}
    cycles = {pk: r["forward"].cycles for pk, r in _emulated_with(spec, problem, base, "pair_keys", (0, 32), tmp_path).items()}
    assert cycles[32] < 0.96 * cycles[0], cycles   # emulated: 18.7k against 19.8k cycles


def test_sparse_attention_key_gradients_add_in_l2_where_they_fit(tmp_path, monkeypatch):
    """The backward's fp32 key-gradient accumulators take every position's atomic adds. Where they fit
    in half the L2 beside kv (V4-Flash at 1024 tokens; not at 65536) those adds are L2 traffic and only
    the converted gradients reach HBM; the emulated run counts them so, and the gradients are the same."""
    import torch
    from aurakernel.targets.ascend.ops.sparse_attention import SparseAttentionAscend
    spec, kernel = OPS["sparse_attention"], ascend.kernel_of(OPS["sparse_attention"])
    assert SparseAttentionAscend.gradients_stay_in_l2(spec.problem("1x64x1024x512x128x128", "bf16", "csa"), HW)
    assert not SparseAttentionAscend.gradients_stay_in_l2(spec.problem("1x64x65536x512x128x512", "bf16", "csa"), HW)
    problem = spec.problem("1x16x40x128x128x8", "bf16", "csa")
    knobs = planned_knobs(spec, problem)
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    inputs = spec.make_inputs(problem, 0)
    grad_out = {"y": torch.randn(*spec.reference(problem, inputs)["y"].shape, generator=torch.Generator().manual_seed(1))}

    def backward():
        _, grads, reports = kernel.run(problem, knobs, inputs, grad_out, emu)
        blocks = reports["backward"].blocks
        return grads, sum(b.gm_read + b.gm_written for b in blocks), sum(b.l2_bytes for b in blocks)

    in_l2, hbm_in_l2, l2_in_l2 = backward()
    monkeypatch.setattr(SparseAttentionAscend, "gradients_stay_in_l2", staticmethod(lambda problem, hw: False))
    in_hbm, hbm, l2 = backward()
    moved = hbm - hbm_in_l2   # the same bytes, from HBM to L2: about every position's fp32 key-gradient rows
    assert moved == l2_in_l2 - l2 and moved > 0.9 * 40 * spec.keys_per_query(problem) * 128 * 4
    for name in in_hbm:   # the atomic adds' order varies between runs: equal to bf16 rounding
        torch.testing.assert_close(in_l2[name], in_hbm[name])


def test_router_flags_exactly_the_rows_whose_kth_and_next_scores_tie(tmp_path):
    """With a zero bias, bf16 scores tie at the k-th place in many rows: the sorting kernel flags those
    rows (and only those: every other row's experts and weights are the reference's), so torch.topk
    decides them as it does in the reference. A row whose top 7 scores are +inf ties too (inf - inf
    is NaN: no difference told apart)."""
    import torch
    from transformers.activations import ACT2FN
    spec, kernel = OPS["router"], ascend.kernel_of(OPS["router"])
    problem = spec.problem("120x256x6", "bf16", "topk")
    knobs = planned_knobs(spec, problem)
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    logits = (torch.randn(120, 256, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    logits[3, 10:17] = float("inf")
    scores, bias = ACT2FN["sqrtsoftplus"](logits), torch.zeros(256)
    indices, weights, tie, report = kernel.select(problem, knobs, scores, bias, emu)
    assert report.ok, report.errors
    ranked = (scores.float() + bias).sort(dim=-1, descending=True).values
    want_tie = ranked[:, 5] == ranked[:, 6]
    assert 0 < int(want_tie.sum()) < 120 and want_tie[3]    # both kinds of row are here
    assert torch.equal(tie.bool(), want_tie)
    ref = spec.reference(problem, {"logits": logits, "bias": bias})
    clear = ~want_tie
    assert torch.equal(indices[clear], ref["indices"][clear])
    assert torch.equal(weights[clear], ref["weights"][clear])


def test_router_tiles_take_any_multiple_of_8_rows(tmp_path):
    """The router's compact tiles round rows up to 8, so its planner also weighs 24, 40, ... rows a
    tile (24 fits the UB where 32 does not: V4-Flash's 8192 tokens plan to it); a row-wise kernel
    without that step keeps powers of two. Verified at 24 rows: two tiles a core, the tail core's
    second one short."""
    spec, kernel = OPS["router"], ascend.kernel_of(OPS["router"])
    flash = spec.problem("8192x256x6", "bf16", "topk")
    assert {24, 40, 48} <= set(ascend.model(spec, flash, HW).domains["tile_rows"])
    assert planned_knobs(spec, flash)["tile_rows"] == 24
    norm = OPS["rms_norm"].problem("8192x4096", "bf16", "weighted")
    assert ascend.model(OPS["rms_norm"], norm, HW).domains["tile_rows"] == [1, 2, 4, 8, 16, 32, 64]
    problem = spec.problem("2300x256x6", "bf16", "topk")
    knobs = {**planned_knobs(spec, problem), "tile_rows": 24, "buffers": 2}
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
    assert result.passed, result.summary


def test_tune_candidates_keep_the_fastest_tiling_the_emulator_estimates(tmp_path):
    """`tune --target ascend910b2 --candidates N`: the planner's pick and the row model's next N - 1
    tilings are estimated in the emulator side by side and the fastest kept, verified, with every
    estimate named. V4-Flash's hash router at 4096 tokens (86 rows a core): the model's pick, 64-row
    forward tiles, emulates slower than 48-row ones (7.08 against 6.76 us), which the emulator finds."""
    import json
    from aurakernel.cli import app
    from typer.testing import CliRunner
    run = CliRunner().invoke(app, ["tune", "router", "--variant", "hash", "--shape", "4096x256x6", "--target",
                                   "ascend910b2", "--candidates", "6", "--db", str(tmp_path / "t.db"), "--json"])
    assert run.exit_code == 0, run.output
    result = json.loads(run.output)
    note = next(r for r in result["reasons"] if r.startswith("emulated the planner's 6 best tilings"))
    estimates = [float(part.rsplit(": ", 1)[1].split()[0]) for part in note.split(": ", 1)[1].split("; ")]
    assert len(estimates) == 6
    assert result["verified"] and result["est_us"] == pytest.approx(min(estimates), abs=0.006)   # the note rounds
    assert result["est_us"] < estimates[0]                  # the pick was not the fastest
    assert result["binding_constraint"].startswith("emulated: the fastest of the planner's 6 best")
    pick = planned_knobs(OPS["router"], OPS["router"].problem("4096x256x6", "bf16", "hash"))
    assert any(result["plan"][k] != pick[k] for k in ("tile_rows", "forward_tile_rows", "chunk", "buffers"))


def test_a_cube_plan_is_solved_once_per_problem_and_handed_out_as_copies(monkeypatch):
    """Each runner-up that `tune --candidates` estimates keeps the planner's Cube tiling: it is solved
    once per process for a problem, profile and solver (sparse attention's model takes ~10 s to solve
    and explain), and every caller gets a copy of its own, so one caller's edit reaches no other."""
    solved = []
    solve = ascend.solve_tiling
    monkeypatch.setattr(ascend, "solve_tiling", lambda *a, **k: solved.append(k["shape"]) or solve(*a, **k))
    monkeypatch.setattr(ascend, "_CUBE_PLANS", {})
    spec = OPS["indexer_score"]
    problem = spec.problem("1x96x64x128x256", "bf16")
    first = ascend.cube_plan(spec, problem, HW, target="ascend910b2", solver="highs")
    picked = dict(first.knobs)
    first.knobs["cube_rows"] = -1
    again = ascend.cube_plan(spec, problem, HW, target="ascend910b2", solver="highs")
    assert solved == [problem.shape] and again.knobs == picked
    ascend.cube_plan(spec, problem, HW, target="ascend910b2", solver="highs", explain=False)   # served explained
    other = spec.problem("1x96x64x128x512", "bf16")
    ascend.cube_plan(spec, other, HW, target="ascend910b2", solver="highs")
    ascend.cube_plan(spec, problem, load_profile("ascend910b4"), target="ascend910b4", solver="highs")
    assert solved == [problem.shape, other.shape, problem.shape]   # another problem, another profile: solved
    assert ascend.cube_plan(OPS["rms_norm"], OPS["rms_norm"].problem("64x4096", "bf16", "weighted"), HW,
                            target="ascend910b2", solver="highs") is None   # no Cube phases


@pytest.mark.parametrize("buffers", [1, 2])
def test_router_side_inputs_come_in_groups_of_tiles(buffers, tmp_path):
    """The experts and d weights come SIDE_TILES tiles a copy: on cores that walk 18 tiles of 8 rows
    (groups of 8, 8 and 2) and a tail core whose last group and last tile are short, the hash forward
    (at tile rows of its own) and the backward verify against the reference, one buffer or two."""
    from aurakernel.targets.ascend.ops.router import SIDE_TILES
    spec = OPS["router"]
    problem = spec.problem("2300x256x6", "bf16", "hash")
    knobs = {**planned_knobs(spec, problem),
             "tile_rows": 8, "forward_tile_rows": 16, "buffers": buffers, "block_dim": 16}
    per_core = -(-2300 // 16)
    assert per_core // 8 > 2 * SIDE_TILES and (2300 - 15 * per_core) % 8   # three groups, a short last tile
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
    assert result.passed, result.summary


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_router_backward_scatters_packed_gradients_and_sums_a_repeated_expert(dtype, tmp_path):
    """The backward's scalar unit reads a row's experts and gradients 64 bits at a time from the compact
    tiles the vector unit leaves (two experts, or 32 B / lanes gradients, a read) and writes them at
    their experts; a hash row that lists an expert twice takes the fp32 sum path. Rows of both kinds
    against autograd through the reference (float64), bf16 and fp32."""
    import torch
    spec, kernel = OPS["router"], ascend.kernel_of(OPS["router"])
    problem = spec.problem("60x256x6", dtype, "hash")
    knobs = planned_knobs(spec, problem)
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    inputs = spec.make_inputs(problem, 0)
    table = inputs["tid2eid"].clone()
    table[::2, 4] = table[::2, 1]                          # even token ids list an expert twice
    inputs["tid2eid"] = table
    repeated = inputs["input_ids"] % 2 == 0
    assert 0 < int(repeated.sum()) < 60                     # both kinds of row are here
    grad = torch.randn(60, 6, generator=torch.Generator().manual_seed(1)).to(problem.dtype.torch)
    _, grads, reports = kernel.run(problem, knobs, inputs, {"weights": grad}, emu)
    assert all(r.ok for r in reports.values()), [r.errors for r in reports.values()]
    logits = inputs["logits"].double().requires_grad_(True)
    weights = spec.reference(problem, {**inputs, "logits": logits})["weights"]
    (want,) = torch.autograd.grad(weights, logits, grad.double())
    got = grads["logits"].double()
    assert torch.equal(got != 0, want != 0)                  # exactly the rows' experts, a repeat once
    tol = 1e-2 if dtype == "bf16" else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_router_topk_refuses_more_candidates_than_one_merge_sorts():
    """The top-k kernel sorts the members of each row's top k + 1 groups (experts / 64 each) in at most
    one merge of four 32-structure lists: V4's top-6 of 256 (one list: 8 groups of 4) and 384 (16
    groups of 6, three lists), top-15 of 512 fit; top-16 of 512 would need 160 candidates a row and is
    refused in one line naming the limit."""
    from aurakernel.errors import UserError
    spec, kernel = OPS["router"], ascend.kernel_of(OPS["router"])
    knobs = {"tile_rows": 16, "buffers": 2, "block_dim": 48}
    assert [kernel.candidates(e, k) for e, k in ((256, 6), (384, 6), (512, 7), (512, 15))] == [32, 96, 64, 128]
    for shape in ("64x256x6", "64x384x6", "64x512x15"):
        kernel.params(spec.problem(shape, "bf16", "topk"), knobs)
    with pytest.raises(UserError, match=r"top-16 of 512 experts.*at most 128"):
        kernel.params(spec.problem("64x512x16", "bf16", "topk"), knobs)
    kernel.params(spec.problem("64x512x16", "bf16", "hash"), knobs)   # hash routing sorts nothing


def test_adamw_update_matches_torch_in_emulator(tmp_path):
    spec = OPS["adamw"]
    problem = spec.problem("8388608", "fp32", None)        # one 2048 x 4096 expert weight of V4-Flash
    result = ascend.tune(spec, problem, HW, target="ascend910b2", solver="highs", out_dir=tmp_path)
    assert result.verified, result.verification.summary
    sizes = {c.shape[0] for c in result.verification.checks}
    assert any(n % 1024 for n in sizes) and min(sizes) < 1024      # a short last row; less than one row
    assert {c.tensor for c in result.verification.checks} == {"p", "m", "v"}
    d = result.to_json()
    assert 0 < d["ub_bytes"] <= HW.memory["UB"].capacity - 8192 and d["roofline_ratio"] > 0.5
    assert (tmp_path / "adamw_kernel.cpp").is_file() and (tmp_path / "adamw_binding.cpp").is_file()


def test_mhc_forward_on_the_cube_reads_x_once_from_hbm(tmp_path):
    """mhc_pre's forward as a mixed kernel (bf16, V4-Flash's 4 x 4096 at 75 tokens: its 24 AI cores split
    W's columns, a short last token group): its outputs match transformers' DeepseekV4HyperConnection,
    and x comes from HBM once, by the Cube cores; the vector cores' second read of the same rows is
    L2 traffic (l2_vector_reads). Built without that mark, the same reads are HBM traffic: x twice."""
    import struct
    import torch
    from aurakernel.emulator import from_bytes, to_bytes, workspace
    from aurakernel.targets.ascend.ops.mhc import MhcAscend, fn_parts
    spec = OPS["mhc_pre"]
    problem = spec.problem("75x4x4096", "bf16", "default")
    knobs = planned_knobs(spec, problem)
    inputs = spec.make_inputs(problem, 0)
    ref = spec.reference(problem, inputs)
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    x = inputs["x"]
    rows, hc, d = x.shape
    n, aic = spec.nout(hc), knobs["cube_blocks"]
    round_rows, _, acc = MhcAscend.forward_rounds(rows, n, knobs["head_lanes"], aic)
    tiling = struct.pack("<7I3f3I", rows, d, rows, -(-d // knobs["col_tile"]), 1024, 0, 0, 1e-6, 1e-6, 1.0 / (hc * d), rows, 0,
                         round_rows)
    x_bytes = x.numel() * x.element_size()
    hbm = {}
    for marked in ((0,), ()):
        y = torch.full((rows, d), float("nan")).to(x.dtype)
        post, comb = torch.full((rows, hc), float("nan")), torch.full((rows, hc, hc), float("nan"))
        bufs = [to_bytes(x), to_bytes(fn_parts(inputs["fn"], x.dtype)), to_bytes(inputs["base"].float()),
                to_bytes(inputs["scale"].float()), to_bytes(y), to_bytes(post), to_bytes(comb),
                to_bytes(torch.zeros(n, rows)), to_bytes(torch.zeros(rows)), workspace(4 * acc), bytearray(tiling)]
        exe = emu.exe("fwd", 11, cores="mix_1_2", l2_args=(1, 9), l2_vector_reads=marked)
        report = emulator.run(exe, aic, bufs)
        assert report.ok, report.errors
        torch.testing.assert_close(from_bytes(bufs[4], y).float(), ref["y"].float(), rtol=1.6e-2, atol=2e-2)
        torch.testing.assert_close(from_bytes(bufs[5], post), ref["post"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(from_bytes(bufs[6], comb), ref["comb"], rtol=1e-4, atol=1e-4)
        hbm[marked] = sum(b.gm_read for b in report.blocks)
        aiv_l2 = sum(b.l2_bytes for b in report.blocks if b.core != "AIC")
        assert aiv_l2 >= (x_bytes if marked else 0)
    assert x_bytes <= hbm[(0,)] < x_bytes * 1.01
    assert hbm[()] == pytest.approx(2 * x_bytes, rel=0.01)


@pytest.mark.parametrize("op", ["mhc_pre", "mhc_head"])
def test_mhc_cube_kernels_over_several_rounds_and_tiles(op, tmp_path):
    """The mixed mHC kernels on 3 AI cores at 75 tokens of 4 x 1024: the forward's cores split W's 256
    fractal columns 85 / 85 / 86 and add their slices' sums into the accumulators; 8 head lanes on 6
    vector cores give two rounds (48 + 27 tokens), each of 16-token tiles, the last one short, so the
    AIVs take round 0 while the AICs work on round 1. The Cube backward deals W's column tiles out to the
    3 AI cores and each tile's d_fn accumulates in L0C over 5 super-tiles of every token, the last one
    short; forward and backward (x, fn, base, scale) match the reference."""
    spec = OPS[op]
    problem = spec.problem("75x4x1024", "bf16", "default")
    knobs = {**planned_knobs(spec, problem),
             "cube_blocks": 3, "cube_groups": 1, "head_lanes": 8, "bwd_groups": 1}
    from aurakernel.targets.ascend.ops.mhc import MhcAscend
    assert MhcAscend.forward_rounds(75, spec.nout(4), 8, 3)[:2] == (48, 8)
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
    assert result.passed, result.summary
    assert {"y", "grad_x", "grad_fn"} <= {c.tensor for c in result.checks}


def test_mhc_backward_keeps_many_blocks_in_step_between_its_cube_and_vector_cores(tmp_path):
    """mhc_pre's backward on 2 AI cores at 300 tokens (bf16): each core's bwd_head has 10 blocks of 16
    tokens, the last short, so its Cube's d_pre runs into the vector cores' flags back (it may lead them
    by 8 blocks) and each vector core consumes the flags of the other's blocks; the Cube backward's
    column tiles (several per core) read the parts from L1 after the first tile copied them, and its
    super-tiles' diag(-k) rows start where a core's tokens do. x's and fn's gradients match the
    reference, and no wait is left without its flag (a hang would be reported)."""
    spec = OPS["mhc_pre"]
    problem = spec.problem("300x4x512", "bf16", "default")
    knobs = {**planned_knobs(spec, problem),
             "cube_blocks": 2, "cube_groups": 1, "head_lanes": 8, "bwd_groups": 2, "bwd_k": 64}
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
    assert result.passed, result.summary
    assert {"grad_x", "grad_fn", "grad_base", "grad_scale"} <= {c.tensor for c in result.checks}


def test_mhc_backward_reads_x_from_the_l2_that_bwd_head_left_it_in(tmp_path, monkeypatch):
    """mhc_head's Cube backward reads x right after bwd_head read it whole: where x and dy fit in half
    the L2, that read is L2 traffic (HBM reads: dy and the small parts, not x); where they do not
    (V4-Flash at 65536 tokens: 2.5 GB) it is HBM traffic again."""
    from aurakernel.targets.ascend.ops.mhc import MhcAscend
    spec = OPS["mhc_head"]
    assert MhcAscend.x_stays_in_l2(spec.problem("1024x4x4096", "bf16", None), HW)
    assert not MhcAscend.x_stays_in_l2(spec.problem("65536x4x4096", "bf16", None), HW)
    problem = spec.problem("75x4x4096", "bf16", "default")
    knobs = {**planned_knobs(spec, problem),
             "cube_blocks": 3, "cube_groups": 1, "bwd_groups": 1}
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    x_bytes = 75 * 4 * 4096 * 2
    reads = {}
    for fits in (True, False):
        monkeypatch.setattr(MhcAscend, "x_stays_in_l2", staticmethod(lambda problem, hw, fits=fits: fits))
        report = ascend.emulate(spec, problem, knobs, emu)["backward"]
        assert report.ok, report.errors
        reads[fits] = sum(b.gm_read for b in report.blocks)
    assert reads[True] < 0.5 * x_bytes and reads[False] >= x_bytes


def _plan_and_emulate(op: str, variant: str, shape: str, tmp_path):
    """The plan at a shape and its kernels' emulated run: (plan, estimate_summary of the run)."""
    spec = OPS[op]
    problem = spec.problem(shape, "bf16", variant)
    plan = ascend.plan(spec, problem, HW, target="ascend910b2", solver="highs", explain=False)
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, plan.knobs, tmp_path, HW), HW)
    reports = ascend.emulate(spec, problem, plan.knobs, emu)
    assert all(r.ok for r in reports.values()), [r.errors for r in reports.values()]
    return plan, ascend.estimate_summary(reports, HW, None)


@pytest.mark.parametrize("op", ["mhc_pre", "mhc_head"])
def test_mhc_plan_predicts_each_launch_near_its_emulated_time(op, tmp_path):
    """What `aurakernel profile --target` charges for mHC is the plan's prediction: each of its three
    launches (forward, bwd_head, the Cube backward) is predicted within 0.8-1.3x of its emulated time
    at V4-Flash's 1024 tokens. Row-wise phases beside the Cube model counted the forward's vector side
    twice and bwd_head at the fp32 backward's NOUT products per element: 642 us for mhc_pre's 158."""
    plan, summary = _plan_and_emulate(op, "default", "1024x4x4096", tmp_path)
    emulated = summary["phases"]
    assert set(plan.pipes_us) == set(emulated) == {"forward", "backward_head", "backward"}
    for phase, pipes in plan.pipes_us.items():
        predicted = max(v for k, v in pipes.items() if k != "overhead") + pipes["overhead"]
        assert 0.8 < predicted / emulated[phase]["est_us"] < 1.3, (phase, predicted, emulated[phase]["est_us"])
    assert 0.8 < plan.predicted_us / sum(v["est_us"] for v in emulated.values()) < 1.3


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rms_norm_narrow_rows_run_whole_tiles(dtype, tmp_path):
    """Rows of V4's per-head norms (512 wide) run a whole tile at a time: several tiles per core of 3 rows,
    the last one short (the row sums, the rows' rstd blocks and dgamma's halving over the rows at odd
    counts), a width that ends inside a 64-lane segment; forward and backward match the reference, and
    neither kernel reads a value back on the scalar unit (the chunk loop did, a row at a time)."""
    spec = OPS["rms_norm"]
    problem = spec.problem("100x515", dtype, "weighted")
    knobs = {**planned_knobs(spec, problem), "tile_rows": 3, "block_dim": 16}
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
    assert result.passed, result.summary
    assert {"y", "grad_x", "grad_weight"} <= {c.tensor for c in result.checks}
    reports = ascend.emulate(spec, problem, knobs, emu)
    assert all(r.ok for r in reports.values())
    assert all(r.pipe_cycles().get("Scalar", 0) == 0 for r in reports.values())


@pytest.mark.parametrize("op,variant,shape", [("rms_norm", "unweighted", "65536x512"),
                                              ("cross_entropy", "default", "256x129280")])
def test_row_plan_charges_reads_and_writes_to_one_hbm_share(op, variant, shape, tmp_path):
    """A streaming kernel's copies in and its copies out draw on one share of HBM per core: the row-wise
    plan charges their bytes together (its HBM pipe, no less than either MTE pipe's bytes) and predicts
    within 0.8-1.3x of the emulator, which floors each core at that traffic. Charged each pipe alone at
    the share, the plan predicted rope 0.71x and cross_entropy 0.79x of their emulated times."""
    plan, summary = _plan_and_emulate(op, variant, shape, tmp_path)
    emulated = summary["est_us"]
    assert all("HBM" in pipes for pipes in plan.pipes_us.values())
    assert 0.8 < plan.predicted_us / emulated < 1.3, (plan.predicted_us, emulated)


def test_the_bound_is_the_larger_of_hbm_traffic_and_the_vector_work():
    """A kernel's roofline on Ascend: its HBM traffic at the busiest core's share of the bandwidth, or
    the vector work its math cannot avoid spread over every vector core (one 256 B repeat per cycle,
    a slow op at the profile's factor), whichever is larger, and which one it is."""
    from aurakernel.planner.ascend import VectorWork, bound_us, roofline_us
    one_us = HW.simd_bytes / 4 * HW.cores * HW.clock_ghz * 1e3      # fp32 element ops: 1 us on every core
    assert VectorWork(one_us).floor_us(HW) == pytest.approx(1.0)
    assert VectorWork(0, one_us).floor_us(HW) == pytest.approx(HW.ascend_pipes(HW.cores).vec_slow_factor)
    share = HW.memory["HBM"].bandwidth_gbps * 1e3 / HW.cores          # bytes per us of one core's share
    assert roofline_us(2 * share, HW) == pytest.approx(2.0)
    assert bound_us(2 * share, VectorWork(one_us), HW) == (pytest.approx(2.0), "HBM")
    assert bound_us(0.5 * share, VectorWork(one_us), HW) == (pytest.approx(1.0), "vector")
    assert bound_us(0.5 * share, None, HW) == (pytest.approx(0.5), "HBM")
    # mHC's backward on the vector unit (fp32 x): its NOUT products per element take longer than
    # streaming x in and dx out; 16-bit x leaves them to the Cube, as both forwards do the mix
    # projection, and the vector work left is under those streams
    mhc = ascend.kernel_of(OPS["mhc_pre"])
    for dtype, itemsize in (("fp32", 4), ("bf16", 2)):
        problem = OPS["mhc_pre"].problem("1024x4x4096", dtype, None)
        x_bytes = 1024 * 4 * 4096 * itemsize / HW.cores
        floors = mhc.vector_floor(problem)
        assert (floors["backward"].floor_us(HW) > roofline_us(2 * x_bytes, HW)) == (dtype == "fp32")
        assert floors["forward"].floor_us(HW) < roofline_us(x_bytes, HW)
        assert set(mhc.cube_floor(problem)) == ({"forward"} if dtype == "fp32" else {"forward", "backward"})


def test_the_true_bound_counts_the_ops_minimum_traffic_not_what_the_kernels_move():
    """Per pass, the op's minimum bytes at the whole chip's bandwidth (or what the kernels moved, where
    that is less): partials a kernel writes per core, a second read of x or cores left idle make it
    slower against the true bound, while each phase's own bound (its traffic) stays as it was."""
    from aurakernel.emulator import BlockReport, RunReport
    cycles_per_us = HW.clock_ghz * 1e3
    chip = HW.memory["HBM"].bandwidth_gbps * 1e3                     # bytes per us, every core streaming

    def report(bytes_per_core, cores, us):   # `cores` cores (of HW.cores) each moving bytes_per_core in `us`
        return RunReport([BlockReport({}, us * cycles_per_us, int(bytes_per_core), 0, 0, [], None, block=b)
                          for b in range(cores)])
    fwd = report(chip / HW.cores * 2, HW.cores, 2.5)                 # 2 us of traffic, all cores
    bwd = report(chip / HW.cores * 6, HW.cores // 2, 7.0)            # 3 us of traffic on half the cores
    minimum = {"forward": 2 * chip, "backward": 2 * chip}            # the op needs 2 us each way
    d = ascend.estimate_summary({"forward": fwd, "backward_tail": bwd}, HW, None, minimum=minimum)
    assert d["roofline_us"] == pytest.approx(4.0, rel=1e-4) and d["bound"] == "HBM"
    assert d["roofline_ratio"] == pytest.approx(9.5 / 4.0, rel=1e-4)
    assert d["phases"]["backward_tail"]["roofline_us"] == pytest.approx(6.0, rel=1e-4)   # its busiest core's share
    assert d["traffic_us"] == pytest.approx(8.0, rel=1e-4)
    # an op whose `work` over-counts: what the kernels moved is the floor
    d = ascend.estimate_summary({"update": fwd}, HW, None, minimum={"forward": 10 * chip, "backward": 0})
    assert d["roofline_us"] == pytest.approx(2.0, rel=1e-4)   # a phase not named backward... is the forward
    # the vector floor of a pass's phases, where it is larger than its traffic
    from aurakernel.planner.ascend import VectorWork
    one_us = HW.simd_bytes / 4 * HW.cores * cycles_per_us
    d = ascend.estimate_summary({"forward": fwd}, HW, None, {"forward": VectorWork(5 * one_us)}, minimum=minimum)
    assert (d["roofline_us"], d["bound"]) == (pytest.approx(5.0), "vector")


def test_plan_that_cannot_fit_ub_names_the_constraint():
    from aurakernel.errors import PlanInfeasible
    spec = OPS["rms_norm"]
    with pytest.raises(PlanInfeasible, match="UB capacity"):
        ascend.plan(spec, spec.problem("64x65536", "fp32", "weighted"), HW, target="ascend910b2", solver="highs")


KERNEL_HEAD = """#include "kernel_operator.h"
using namespace AscendC;
extern "C" __global__ __aicore__ void k(GM_ADDR x, GM_ADDR y) {
    GlobalTensor<float> xg; xg.SetGlobalBuffer((__gm__ float*)x, 64);
    GlobalTensor<float> yg; yg.SetGlobalBuffer((__gm__ float*)y, 64);
    TPipe pipe;
"""
BROKEN = {
    "UB capacity": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 200 * 1024);",
    "32 B alignment": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                      " Adds(t[3], t[3], 1.0f, 8);",
    "DataCopy 32 B": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                     " DataCopy(t, xg, 7);",
    "repeat <= 255": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                     " WholeReduceSum(t, t, 64, 300, 1, 1, 8);",
    "queue discipline: AllocTensor": "TQue<TPosition::VECIN, 1> q; pipe.InitBuffer(q, 1, 256);"
                                     " LocalTensor<float> a = q.AllocTensor<float>(); LocalTensor<float> b = q.AllocTensor<float>();",
    "queue discipline: DeQue": "TQue<TPosition::VECIN, 1> q; pipe.InitBuffer(q, 1, 256); LocalTensor<float> a = q.DeQue<float>();",
    "queue discipline: a SetFlag": "SetFlag<HardEvent::V_S>(GetTPipePtr()->FetchEventID(HardEvent::V_S));",
    # with a TPipe, IDs come from its pool: a queue's EnQue holds MTE2_V id 0 when the kernel picks it by hand
    "events: hand-picked": "TQue<TPosition::VECIN, 1> q; pipe.InitBuffer(q, 1, 256); LocalTensor<float> a = q.AllocTensor<float>();"
                           " DataCopy(a, xg, 64); q.EnQue(a); SetFlag<HardEvent::MTE2_V>(EVENT_ID0);",
    "events: not taken from the TPipe": "SetFlag<HardEvent::V_S>(EVENT_ID1); WaitFlag<HardEvent::V_S>(EVENT_ID1);",
    # a fetched ID is free only until a queue takes it: two users of MTE2_V id 0 at once
    "events: collide": "TQue<TPosition::VECIN, 1> q; pipe.InitBuffer(q, 1, 256); LocalTensor<float> a = q.AllocTensor<float>();"
                       " SetFlag<HardEvent::MTE2_V>(GetTPipePtr()->FetchEventID(HardEvent::MTE2_V)); DataCopy(a, xg, 64); q.EnQue(a);",
    "SyncAll: KERNEL_TYPE_MIX_AIV_1_0": "SyncAll();",
    # a WholeReduceSum result needs 4 B alignment, not 32: one at float 1 passes, one at a byte offset fails
    "4 B alignment": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                     " WholeReduceSum(t[1], t[64], 64, 1, 1, 1, 8);"
                     " WholeReduceSum(t.ReinterpretCast<uint8_t>()[2].ReinterpretCast<float>(), t[64], 64, 1, 1, 1, 8);",
    # a level-0 Add whose repeat stride walks past its 256-float tensor (4 repeats of 8 blocks)
    "UB bounds": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                 " Add(t, t, t, 64, 5, {1, 1, 1, 8, 8, 8});",
    "GM bounds": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                 " DataCopy(t, xg[32], 64);",
    "guard page": "((__gm__ float*)y)[64 + 1024] = 1.0f;",
    # data one pipe wrote, touched by another with no event between: read early (or raced) on the NPU
    "sync: MTE3 reads": "TQue<TPosition::VECIN, 1> q; pipe.InitBuffer(q, 1, 256); LocalTensor<float> t = q.AllocTensor<float>();"
                        " DataCopy(t, xg, 64); q.EnQue(t); LocalTensor<float> u = q.DeQue<float>(); Muls(u, u, 2.0f, 64);"
                        " DataCopy(yg, u, 64); q.FreeTensor(u);",
    # Fixpipe reading L0C before the Mmad that writes it is known to be done (no M_FIX event)
    "sync: FIX reads": "TBuf<TPosition::A2> a; pipe.InitBuffer(a, 512); TBuf<TPosition::B2> b; pipe.InitBuffer(b, 512);"
                       " TBuf<TPosition::CO1> c; pipe.InitBuffer(c, 1024);"
                       " Mmad(c.Get<float>(), a.Get<half>(), b.Get<half>(), MmadParams(16, 16, 16, 0, false, true));"
                       " Fixpipe<float, float, CFG_ROW_MAJOR>(yg, c.Get<float>(), FixpipeParamsV220(16, 4, 16, 16, false));",
    "sync: V reads": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                     " t.SetValue(0, 1.0f); Adds(t, t, 1.0f, 64);",
    # an atomic add of floats while SetAtomicAdd is set for half would add the bits as half
    "atomic: of another type": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                               " SetAtomicAdd<half>(); DataCopy(yg, t, 64);",
    # the Cube side: each of its buffers against its own capacity; the documented fractal alignment and
    # Mmad's limits; vector instructions on the UB only; the documented transpose takes half
    "L0A capacity": "TBuf<TPosition::A2> b; pipe.InitBuffer(b, 70 * 1024);",
    "512 B alignment": "TBuf<TPosition::A2> a; pipe.InitBuffer(a, 4096); TBuf<TPosition::B2> b; pipe.InitBuffer(b, 4096);"
                       " TBuf<TPosition::CO1> c; pipe.InitBuffer(c, 4096);"
                       " Mmad(c.Get<float>(), a.Get<half>()[16], b.Get<half>(), MmadParams(16, 16, 16, 0, false, true));",
    "Mmad: m 5000": "TBuf<TPosition::A2> a; pipe.InitBuffer(a, 4096); TBuf<TPosition::B2> b; pipe.InitBuffer(b, 4096);"
                    " TBuf<TPosition::CO1> c; pipe.InitBuffer(c, 4096);"
                    " Mmad(c.Get<float>(), a.Get<half>(), b.Get<half>(), MmadParams(5000, 16, 16, 0, false, true));",
    "position: Add takes a LocalTensor in UB": "TBuf<TPosition::A1> b; pipe.InitBuffer(b, 1024); LocalTensor<float> t = b.Get<float>();"
                                               " Add(t, t, t, 64);",
    "LoadData: ifTranspose with bfloat16_t": "TBuf<TPosition::A1> a; pipe.InitBuffer(a, 1024); TBuf<TPosition::B2> b; pipe.InitBuffer(b, 1024);"
                                             " LoadData(b.Get<bfloat16_t>(), a.Get<bfloat16_t>(), LoadData2DParams(0, 1, 0, 0, 0, true, 0));",
    # the repeated form merges four equal queues stored one after the other, nothing else
    "MrgSort: needs four valid queues": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 4096); LocalTensor<float> t = b.Get<float>();"
                                        " uint16_t n[4] = {8, 8, 8, 8};"
                                        " MrgSort(t[512], MrgSortSrcList<float>(t, t[16], t[48], t[64]), MrgSort4Info(n, false, 15, 2));",
    "MrgSort: dst overlaps queue 2": "TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 4096); LocalTensor<float> t = b.Get<float>();"
                                     " uint16_t n[4] = {8, 8, 0, 0};"
                                     " MrgSort(t[16], MrgSortSrcList<float>(t, t[32], t, t), MrgSort4Info(n, false, 3, 1));",
}


# the rules of the Cube side, on a Cube core (a vector core has no L1 / L0)
ON_THE_CUBE = {"sync: FIX reads", "L0A capacity", "512 B alignment", "Mmad: m 5000", "position: Add takes a LocalTensor in UB",
               "LoadData: ifTranspose with bfloat16_t"}


# Every broken kernel in one source, an entry each: one object compiled for all of them (each its own
# ~1.6 s compile before), linked per entry.
BROKEN_SOURCE = "".join(KERNEL_HEAD.replace(" void k(", f" void broken_{i}(") + "    " + body + "\n}\n"
                        for i, body in enumerate(BROKEN.values()))


@pytest.mark.parametrize("rule", list(BROKEN))
def test_each_hardware_rule_trips_on_a_broken_kernel(rule):
    entry = f"broken_{list(BROKEN).index(rule)}"
    exe = emulator.build(BROKEN_SOURCE, entry=entry, nargs=2, hw=HW, cores="aic" if rule in ON_THE_CUBE else "aiv")
    report = emulator.run(exe, 2, [bytearray(256), bytearray(256)])
    assert not report.ok
    assert rule.split(":")[0] in report.errors[0], report.errors
    if ":" in rule:
        assert rule.split(": ")[1] in report.errors[0], report.errors


def test_a_copy_into_a_freed_buffer_waits_for_the_free_in_program_order():
    """A queue's FreeTensor sets its event where the vector pipe reaches it: with one buffer, the next
    tile's copy in waits for everything the vector unit was given before the FreeTensor, not only for
    its last read of the buffer (the emulator once timed the latter: single buffering overlapped as
    if double-buffered). Freeing right after the last read lets the copy run under the rest."""
    def cycles(free_early: bool) -> float:
        free = "q.FreeTensor(u);"
        body = ("TQue<TPosition::VECIN, 1> q; pipe.InitBuffer(q, 1, 256);"
                " TBuf<TPosition::VECCALC> w; pipe.InitBuffer(w, 4096); LocalTensor<float> big = w.Get<float>();"
                " for (int i = 0; i < 4; ++i) { LocalTensor<float> t = q.AllocTensor<float>(); DataCopy(t, xg, 64);"
                " q.EnQue(t); LocalTensor<float> u = q.DeQue<float>(); Muls(big, u, 2.0f, 64);"
                + (free if free_early else "") + " for (int r = 0; r < 20; ++r) Adds(big, big, 1.0f, 1024);"
                + ("" if free_early else free) + " }")
        exe = emulator.build(KERNEL_HEAD + "    " + body + "\n}\n", entry="k", nargs=2, hw=HW)
        report = emulator.run(exe, 1, [bytearray(256), bytearray(256)])
        assert report.ok, report.errors
        return report.cycles
    early, late = cycles(True), cycles(False)
    copy = HW.ascend_pipes(1).mte_latency
    assert late >= early + 3 * copy   # three of the four copies in exposed


def test_the_header_exposes_only_what_an_npu_build_has():
    """The real kernel_operator.h brings no <cmath> into an NPU build: INFINITY or expf there fails to
    compile, so it fails here too (the router's -inf is a builtin)."""
    for name, use in (("INFINITY", "INFINITY"), ("expf", "expf(1.0f)"), ("exp", "std::exp(1.0f)")):
        with pytest.raises(emulator.BuildError, match=name):
            emulator.build(KERNEL_HEAD + f"    float v = {use}; (void)v;\n}}\n", entry="k", nargs=2, hw=HW)
    emulator.build(KERNEL_HEAD + "    float v = -__builtin_inff(); (void)v;\n}\n", entry="k", nargs=2, hw=HW)


# the templates' PipeWait (templates/ascendc/_kernel_common.h.j2), for the kernels below
PIPE_WAIT = """template <HardEvent E> void PipeWait() {
    const TEventID id = GetTPipePtr()->FetchEventID(E); SetFlag<E>(id); WaitFlag<E>(id);
}
"""


def _run_kernel(body: str, x: bytearray, block_dim: int = 1, batch_mode: bool = False):
    y = bytearray(256)
    source = KERNEL_HEAD.replace('extern "C"', PIPE_WAIT + 'extern "C"', 1) + body + "\n}\n"
    exe = emulator.build(source, entry="k", nargs=2, hw=HW, batch_mode=batch_mode)
    return emulator.run(exe, block_dim, [x, y]), y


def test_whole_reduce_max_strides_count_value_index_pairs():
    """dstRepStride 1 with ORDER_VALUE_INDEX: one (value, index) pair after the other, as the NPU
    writes them (the old element-count reading overlapped pair 1 with pair 0's index)."""
    import struct
    x = [float(i % 64) * (1 if i < 64 else -1) for i in range(128)]   # repeat 0: max 63 at lane 63
    x[64 + 5] = 7.0                                                    # repeat 1: max 7 at lane 5
    report, y = _run_kernel("""
    TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024);
    GlobalTensor<float> x2; x2.SetGlobalBuffer((__gm__ float*)x, 128);
    LocalTensor<float> v = b.Get<float>(), r = v[128];
    DataCopy(v, x2, 128);
    PipeWait<HardEvent::MTE2_V>();
    WholeReduceMax(r, v, 64, 2, 1, 1, 8, ReduceOrder::ORDER_VALUE_INDEX);
    PipeWait<HardEvent::V_MTE3>();
    DataCopy(yg, r, 8);""", bytearray(struct.pack("<128f", *x)))
    assert report.ok, report.errors
    v0, i0, v1, i1 = struct.unpack("<ffff", y[:16])
    assert (v0, v1) == (63.0, 7.0)
    assert struct.unpack("<II", struct.pack("<ff", i0, i1)) == (63, 5)   # the index in the value's bits


def test_sort32_and_mrgsort_order_as_documented():
    """Sort32 sorts each 32 (score, index) by score, largest first, equal scores in their order; Copy
    takes each list's top 8; a repeated MrgSort merges the four lists of each group (equal scores: the
    earlier queue's first). The structures are 8 B: the score's bits low, the index high."""
    import random
    import struct
    rng = random.Random(3)
    scores = [float(rng.randint(0, 20)) for _ in range(128)]          # many equal scores
    out = bytearray(128 * 8 + 32 * 8)                                 # the 4 sorted lists, the merge
    source = KERNEL_HEAD.replace("GlobalTensor<float> yg; yg.SetGlobalBuffer((__gm__ float*)y, 64);",
                                 "GlobalTensor<float> yg; yg.SetGlobalBuffer((__gm__ float*)y, 1024);")
    source = source.replace("xg.SetGlobalBuffer((__gm__ float*)x, 64)", "xg.SetGlobalBuffer((__gm__ float*)x, 128)")
    source = source.replace('extern "C"', PIPE_WAIT + 'extern "C"', 1) + """
    TBuf<TPosition::VECCALC> b, bi; pipe.InitBuffer(b, 8192); pipe.InitBuffer(bi, 512);
    LocalTensor<float> v = b.Get<float>(), sorted = v[256], top = v[768], merged = v[1024];
    LocalTensor<uint32_t> idx = bi.Get<uint32_t>();
    for (uint32_t i = 0; i < 128; ++i) idx.SetValue(i, 1000 + i);
    DataCopy(v, xg, 128);
    PipeWait<HardEvent::MTE2_V>();
    PipeWait<HardEvent::S_V>();
    Sort32(sorted, v, idx, 4);                                   /* 4 lists of 32 */
    Copy(top, sorted, 16, 4, CopyRepeatParams(1, 1, 2, 8));      /* the first 8 structures of each */
    uint16_t n[4] = {8, 8, 8, 8};
    MrgSort(merged, MrgSortSrcList<float>(top, top[16], top[32], top[48]), MrgSort4Info(n, false, 15, 1));
    PipeWait<HardEvent::V_MTE3>();
    DataCopy(yg, sorted, 256);
    DataCopy(yg[256], merged, 64);
}
"""
    exe = emulator.build(source, entry="k", nargs=2, hw=HW)
    report = emulator.run(exe, 1, [bytearray(struct.pack("<128f", *scores)), out])
    assert report.ok, report.errors

    def entries(raw, n):
        return [(struct.unpack("<f", raw[8 * i:8 * i + 4])[0], struct.unpack("<I", raw[8 * i + 4:8 * i + 8])[0])
                for i in range(n)]
    got = entries(out, 128)
    for r in range(4):
        want = sorted(((scores[i], 1000 + i) for i in range(32 * r, 32 * r + 32)), key=lambda e: -e[0])  # stable
        assert got[32 * r:32 * r + 32] == want
    tops = [got[32 * r:32 * r + 8] for r in range(4)]
    want = sorted((e for q in tops for e in q), key=lambda e: -e[0])   # stable: queue 1's equal scores first
    assert entries(out[256 * 4:], 32) == want


CUBE_MATMUL = """#include "kernel_operator.h"
using namespace AscendC;
using T = {t};
using TO = {to};
constexpr uint32_t M = {m}, N = {n}, K = {k}, C0 = 32 / sizeof(T);
constexpr uint32_t M1 = (M + 15) / 16, N1 = (N + 15) / 16, K1 = (K + C0 - 1) / C0;
extern "C" __global__ __aicore__ void k(GM_ADDR a, GM_ADDR b, GM_ADDR c) {{
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY);
    GlobalTensor<T> ag, bg;
    GlobalTensor<TO> cg;
    ag.SetGlobalBuffer((__gm__ T*)a, M * K);
    bg.SetGlobalBuffer((__gm__ T*)b, K * N);
    cg.SetGlobalBuffer((__gm__ TO*)c, M * N);
    TPipe pipe;
    TQue<TPosition::A1, 1> qa1;
    TQue<TPosition::B1, 1> qb1;
    TQue<TPosition::A2, 1> qa2;
    TQue<TPosition::B2, 1> qb2;
    TQue<TPosition::CO1, 1> qc;
    pipe.InitBuffer(qa1, 1, M1 * 16 * K1 * C0 * sizeof(T));
    pipe.InitBuffer(qb1, 1, N1 * 16 * K1 * C0 * sizeof(T));
    pipe.InitBuffer(qa2, 1, M1 * 16 * K1 * C0 * sizeof(T));
    pipe.InitBuffer(qb2, 1, N1 * 16 * K1 * C0 * sizeof(T));
    pipe.InitBuffer(qc, 1, M1 * N1 * 256 * sizeof(float));
    LocalTensor<T> a1 = qa1.AllocTensor<T>();          /* A [M][K] into L1 as NZ: column blocks of C0, M1 * 16 rows each */
    DataCopy(a1, ag, Nd2NzParams(1, M, K, 0, K, M1 * 16, 1, 1));
    qa1.EnQue(a1);
    LocalTensor<T> b1 = qb1.AllocTensor<T>();
    if constexpr ({transpose}) {{                        /* B [K][N]: its NZ fractals, transposed on the way to L0B */
        DataCopy(b1, bg, Nd2NzParams(1, K, N, 0, N, K1 * 16, 1, 1));
    }} else {{                                           /* B given as B^T [N][K]: its NZ fractals are L0B's */
        DataCopy(b1, bg, Nd2NzParams(1, N, K, 0, K, N1 * 16, 1, 1));
    }}
    qb1.EnQue(b1);
    a1 = qa1.DeQue<T>();
    LocalTensor<T> a2 = qa2.AllocTensor<T>();           /* L1 fractal (mb, kb) at kb * M1 + mb -> L0A at mb * K1 + kb */
    for (uint32_t mb = 0; mb < M1; ++mb) LoadData(a2[mb * K1 * 16 * C0], a1, LoadData2DParams(mb, K1, M1, 0, 0, false, 0));
    qa2.EnQue(a2);
    qa1.FreeTensor(a1);
    b1 = qb1.DeQue<T>();
    LocalTensor<T> b2 = qb2.AllocTensor<T>();
    if constexpr ({transpose}) {{                        /* L1 (kb, nb) at nb * K1 + kb -> L0B at kb * N1 + nb, transposed */
        for (uint32_t kb = 0; kb < K1; ++kb)
            LoadData(b2[kb * N1 * 256].template ReinterpretCast<half>(), b1.template ReinterpretCast<half>(),
                     LoadData2DParams(kb, N1, K1, 0, 0, true, 0));
    }} else {{
        LoadData(b2, b1, LoadData2DParams(0, K1 * N1, 1, 0, 0, false, 0));
    }}
    qb2.EnQue(b2);
    qb1.FreeTensor(b1);
    a2 = qa2.DeQue<T>();
    b2 = qb2.DeQue<T>();
    LocalTensor<float> c1 = qc.AllocTensor<float>();
    for (uint32_t r = 0; r < {passes}; ++r) Mmad(c1, a2, b2, MmadParams(M, N, K, 0, false, r == 0));   /* C = A B, then C += A B */
    qc.EnQue(c1);
    qa2.FreeTensor(a2);
    qb2.FreeTensor(b2);
    c1 = qc.DeQue<float>();
    FixpipeParamsV220 fp(N, M, M1 * 16, N, {relu});
    fp.quantPre = {quant};
    Fixpipe<TO, float, CFG_ROW_MAJOR>(cg, c1, fp);
    qc.FreeTensor(c1);
}}
"""


@pytest.mark.parametrize("m,n,k,dtype,transpose,passes,relu", [
    (37, 45, 70, "bf16", True, 1, False),     # tails in m, n and k; B transposed fractal by fractal into L0B
    (37, 45, 70, "bf16", False, 2, True),     # B given transposed; C accumulated (C += A B), ReLU on the way out
    (20, 33, 19, "fp32", False, 1, False),    # fp32 operands: 16 x 8 fractals
])
def test_a_matmul_through_l1_l0_mmad_and_fixpipe_matches_torch(m, n, k, dtype, transpose, passes, relu):
    """GM -> L1 (ND to NZ) -> L0A / L0B (LoadData) -> Mmad -> Fixpipe (NZ to ND, fp32 to the output
    dtype, ReLU): the fractal layouts as the documentation gives them, so a matmul computes A B."""
    import torch
    g = torch.Generator().manual_seed(m * n + k)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(m, k, generator=g).to(tdt), torch.randn(k, n, generator=g).to(tdt)
    ref = passes * (a.float() @ b.float())
    if relu:
        ref = ref.clamp_min(0)
    source = CUBE_MATMUL.format(t="bfloat16_t" if dtype == "bf16" else "float", to="bfloat16_t" if dtype == "bf16" else "float",
                                m=m, n=n, k=k, transpose="true" if transpose else "false", passes=passes,
                                relu="true" if relu else "false", quant="F322BF16" if dtype == "bf16" else "NoQuant")
    exe = emulator.build(source, entry="k", nargs=3, hw=HW, cores="aic")
    b_gm = b if transpose else b.t().contiguous()
    out = torch.full((m, n), float("nan")).to(tdt)
    bufs = [emulator.to_bytes(a.contiguous()), emulator.to_bytes(b_gm), emulator.to_bytes(out)]
    report = emulator.run(exe, 1, bufs)
    assert report.ok, report.errors
    got = emulator.from_bytes(bufs[2], out).float()
    if dtype == "bf16":
        torch.testing.assert_close(got, ref.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    busy = report.blocks[0].busy
    assert busy["MTE1"] > 0 and busy["Cube"] > 0 and busy["FIX"] > 0 and busy["MTE2"] > 0


def test_what_does_not_compile_on_the_npu_does_not_compile_here():
    """A LocalTensor's GetPhyAddr is an integer UB address on the NPU, and DataCopyExtParams has no
    4-argument constructor there."""
    for name, use in (("GetPhyAddr", "float* p = b.Get<float>().GetPhyAddr(); (void)p;"),
                      ("DataCopyExtParams", "DataCopyExtParams p(1, 32, 0, 0); (void)p;")):
        with pytest.raises(emulator.BuildError, match=name):
            emulator.build(KERNEL_HEAD + f"    TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 256); {use}\n}}\n",
                           entry="k", nargs=2, hw=HW)


def test_data_copy_pad_places_the_left_padding_before_the_data():
    """[leftPadding][data][rightPadding][dummy] per block: 2 floats of -1, then the 6 copied (the old
    reading put the data first and the padding after it)."""
    import struct
    report, y = _run_kernel("""
    TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 256);
    LocalTensor<float> t = b.Get<float>();
    DataCopyPad(t, xg, DataCopyExtParams(1, 6 * sizeof(float), 0, 0, 0), DataCopyPadExtParams<float>(true, 2, 0, -1.0f));
    PipeWait<HardEvent::MTE2_MTE3>();
    DataCopy(yg, t, 8);""", bytearray(struct.pack("<64f", *range(1, 65))))
    assert report.ok, report.errors
    assert struct.unpack("<8f", y[:32]) == (-1.0, -1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0)


def test_cast_rounds_to_the_target_precision_in_the_documented_modes():
    """float -> half with CAST_FLOOR / CEIL / TRUNC rounds to half's precision (2.7 -> 2.6992 / 2.7012),
    not to an integer (the old 2 / 3); float -> bfloat16_t has no CAST_NONE on A2/A3."""
    import struct
    cast = """
    TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024);
    LocalTensor<float> f = b.Get<float>(); LocalTensor<half> h = f[64].ReinterpretCast<half>();
    GlobalTensor<half> yh; yh.SetGlobalBuffer((__gm__ half*)y, 128);
    DataCopy(f, xg, 64);
    PipeWait<HardEvent::MTE2_V>();
    Cast(h, f, RoundMode::CAST_FLOOR, 16); Cast(h[16], f, RoundMode::CAST_CEIL, 16); Cast(h[32], f, RoundMode::CAST_TRUNC, 16);
    PipeWait<HardEvent::V_MTE3>();
    DataCopy(yh, h, 48);"""
    x = bytearray(struct.pack("<64f", *([2.7, -2.7] * 32)))
    report, y = _run_kernel(cast, x)
    assert report.ok, report.errors
    got = struct.unpack("<48e", y[:96])
    assert got[:2] == (2.69921875, -2.701171875)          # floor
    assert got[16:18] == (2.701171875, -2.69921875)       # ceil
    assert got[32:34] == (2.69921875, -2.69921875)        # trunc
    report, _ = _run_kernel("""
    TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 1024);
    LocalTensor<float> f = b.Get<float>(); LocalTensor<bfloat16_t> h = f[64].ReinterpretCast<bfloat16_t>();
    Cast(h, f, RoundMode::CAST_NONE, 16);""", bytearray(256))
    assert not report.ok and "not a combination" in report.errors[0]


def test_atomic_adds_of_every_block_to_one_gm_buffer_all_count():
    """SetAtomicAdd<float>: each of 8 blocks adds its (block + 1) x x into y, at once; DisableDmaAtomic
    turns it off again (the last plain copy of block 0 is not an add)."""
    import struct
    body = """
    TBuf<TPosition::VECCALC> b; pipe.InitBuffer(b, 256);
    LocalTensor<float> t = b.Get<float>();
    DataCopy(t, xg, 64);
    PipeWait<HardEvent::MTE2_V>();
    Muls(t, t, float(GetBlockIdx() + 1), 64);
    PipeWait<HardEvent::V_MTE3>();
    SetAtomicAdd<float>();
    DataCopy(yg, t, 64);
    DisableDmaAtomic();"""
    x = bytearray(struct.pack("<64f", *range(64)))
    report, y = _run_kernel(body, x, block_dim=8)
    assert report.ok, report.errors
    assert list(struct.unpack("<64f", y)) == [36.0 * i for i in range(64)]   # (1 + ... + 8) x


def test_sync_all_needs_the_mix_type_and_batch_mode():
    body = "    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0); SyncAll();"
    report, _ = _run_kernel(body, bytearray(256), block_dim=2)
    assert not report.ok and "batch mode" in report.errors[0]
    report, _ = _run_kernel(body, bytearray(256), block_dim=2, batch_mode=True)
    assert report.ok, report.errors


# y = 2 x over 64 floats: a copy in, a vector op, a copy out
DOUBLE = KERNEL_HEAD + """
    TQue<TPosition::VECIN, 1> q; pipe.InitBuffer(q, 1, 256);
    LocalTensor<float> t = q.AllocTensor<float>();
    DataCopy(t, xg, 64); q.EnQue(t);
    LocalTensor<float> u = q.DeQue<float>();
    Muls(u, u, 2.0f, 64);
    TEventID id = GetTPipePtr()->FetchEventID(HardEvent::V_MTE3); SetFlag<HardEvent::V_MTE3>(id); WaitFlag<HardEvent::V_MTE3>(id);
    DataCopy(yg, u, 64); q.FreeTensor(u);
}
"""


def test_correct_kernel_passes_and_counts_pipes():
    import struct
    exe = emulator.build(DOUBLE, entry="k", nargs=2, hw=HW)
    x = bytearray(struct.pack("<64f", *range(64)))
    y = bytearray(256)
    report = emulator.run(exe, 1, [x, y])
    assert report.ok, report.errors
    assert list(struct.unpack("<64f", y)) == [2.0 * i for i in range(64)]
    busy = report.blocks[0].busy
    assert busy["MTE2"] > 0 and busy["MTE3"] > 0 and busy["Vector"] > 0
    assert report.blocks[0].gm_read == 256 and report.blocks[0].gm_written == 256


def test_a_traced_run_writes_every_instruction_on_its_pipe(tmp_path, monkeypatch):
    """AK_TRACE=<file>: every core's instructions, per pipe, in issue order on that pipe, no two
    overlapping, summing to the pipe's busy cycles of the report, each named by the API call that
    issued it (two blocks of DOUBLE)."""
    import struct
    from collections import defaultdict
    exe = emulator.build(DOUBLE, entry="k", nargs=2, hw=HW)
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("AK_TRACE", str(trace))
    report = emulator.run(exe, 2, [bytearray(struct.pack("<64f", *range(64))), bytearray(256)])
    assert report.ok, report.errors
    lines = trace.read_text().splitlines()
    assert lines[0].startswith("#") and "2 blocks" in lines[0]
    spans, calls = defaultdict(list), defaultdict(list)
    for line in lines[1:]:
        block, core, pipe, start, end, call = line.split()
        spans[(int(block), core, pipe)].append((float(start), float(end)))
        calls[(int(block), pipe)].append(call)
    assert {b for b, _, _ in spans} == {0, 1} and {p for _, _, p in spans} == {"MTE2", "MTE3", "V"}
    assert calls[(1, "MTE2")] == ["DataCopy"] and calls[(1, "V")] == ["Muls"] and calls[(1, "MTE3")] == ["DataCopy"]
    names = {"V": "Vector", "S": "Scalar"}
    for (block, core, pipe), got in spans.items():
        assert all(s <= e <= s2 for (s, e), (s2, _) in zip(got, got[1:]))   # one at a time, in order
        busy = next(b.busy for b in report.blocks if b.block == block)
        assert sum(e - s for s, e in got) == pytest.approx(busy[names.get(pipe, pipe)], abs=0.5)


def test_templates_call_only_emulated_apis():
    """Every AscendC call in every kernel template is in the emulator's documented list (or defined
    by the template itself): no hallucinated API reaches a project."""
    documented = emulator.documented_apis()

    def with_includes(path: Path) -> str:   # the template and the shared parts it includes
        text = path.read_text()
        return text + "".join(with_includes(ROOT / "templates" / inc)
                              for inc in re.findall(r'\{%\s*include\s+"([^"]+)"', text))

    kernels = list((ROOT / "templates" / "ascendc").glob("*/kernel.cpp.j2"))
    assert len(kernels) >= 2
    for path in kernels:
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", with_includes(path), flags=re.S)   # code only
        own = set(re.findall(r"(?:class|inline\s+[\w<>:]+|void)\s+(\w+)\s*[({]", text))
        called = set(re.findall(r"\b([A-Z]\w*)\s*(?:<[^<>;()]*>)?\s*\(", text))
        unknown = called - documented - own - {"T"}
        assert not unknown, f"{path.name} calls APIs the emulator does not document: {sorted(unknown)}"


def test_cli_tune_ascend_json(tmp_path):
    aurakernel = [sys.executable, "-m", "aurakernel.cli"]
    out = subprocess.run([*aurakernel, "tune", "rms_norm", "--target", "ascend910b2", "--shape", "50x4096",
                          "--dtype", "bf16", "--out", str(tmp_path / "proj"), "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    for key in ("op", "shape", "dtype", "target", "plan", "binding_constraint", "predicted_us", "verified",
                "ub_bytes", "est_cycles", "est_us", "roofline_ratio", "traffic_us", "traffic_ratio"):
        assert key in d
    assert d["verified"] is True and d["target"] == "ascend910b2"
    assert (tmp_path / "proj" / "rms_norm_host.cpp").is_file()
    assert d["project_name"] == "rms_norm_weighted_bf16_4096"   # what it builds: libak_<name>_ops.so, torch.ops.aurakernel.<name>_*
    assert f'm.def("{d["project_name"]}_fwd(' in (tmp_path / "proj" / "rms_norm_binding.cpp").read_text()
    # the table: the true bound and the bound at the kernels' own traffic, side by side
    out = subprocess.run([*aurakernel, "tune", "rms_norm", "--target", "ascend910b2", "--shape", "50x4096",
                          "--dtype", "bf16"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "roofline bound" in out.stdout and "bound at its own traffic" in out.stdout


@pytest.mark.skipif(not os.environ.get("ASCEND_HOME_PATH"), reason="ASCEND_HOME_PATH is not set: no CANN toolkit to build with")
def test_project_builds_with_cann(tmp_path):
    spec = OPS["rms_norm"]
    problem = spec.problem("64x4096", "bf16", "weighted")
    the_plan = ascend.plan(spec, problem, HW, target="ascend910b2", solver="highs", explain=False)
    ascend.render_project(spec, problem, the_plan.knobs, tmp_path, HW)
    subprocess.run(["cmake", "-S", str(tmp_path), "-B", str(tmp_path / "build")], check=True)
    subprocess.run(["cmake", "--build", str(tmp_path / "build")], check=True)
    assert (tmp_path / "build" / f"libak_{ascend.project_name(spec, problem)}_ops.so").is_file()


@pytest.mark.timeout(1200)   # a cold build cache compiles every op's emulator kernels here (~3 min on 2 cores)
def test_autotune_ascend_writes_a_verified_project_per_supported_group(tmp_path):
    out = subprocess.run([sys.executable, "-m", "aurakernel.cli", "autotune", "--config", "trainer/configs/tiny.yaml",
                          "--target", "ascend910b2", "--out", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    # every op group of the tiny model (fp32, its own small widths) that has an AscendC kernel gets a verified
    # project; the fused LM head + loss (Cube work, not yet written), the fused mhc_post + mhc_pre and the
    # projections, the experts' grouped ones and their routing too (host kernels so far), are skipped, saying so, and so is the sparse attention, whose Cube
    # kernel takes 16-bit operands only (the tiny model trains in fp32)
    with_kernel = {name for name, spec in OPS.items() if ascend.supported(spec)}
    assert with_kernel >= set(OPS) - {"linear_cross_entropy", "mhc_post_pre", "linear", "grouped_linear", "block_linear",
                                      "moe_permute", "moe_unpermute"}
    assert {p["op"] for p in d["projects"]} == with_kernel - {"sparse_attention"}
    assert {s["op"] for s in d["skipped"]} == set(OPS) - with_kernel | {"sparse_attention"}
    for s in d["skipped"]:
        assert ("16-bit" if s["op"] == "sparse_attention" else "no ascend kernel") in s["reason"], s
    for p in d["projects"]:
        assert p["verified"] is True and p["est_us"] > 0
        assert (Path(p["project_dir"]) / f"{p['op']}_kernel.cpp").is_file()
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(d))


@pytest.mark.skipif(not os.environ.get("ASC_DEVKIT_PATH"),
                    reason="ASC_DEVKIT_PATH is not set: no asc-devkit checkout to compile the kernels against")
def test_every_kernel_compiles_against_the_real_ascendc_headers(tmp_path):
    """Every operator's rendered kernel parses against the real AscendC headers of an asc-devkit
    checkout (g++ -fsyntax-only for the 910B's architecture; the compiler's builtins declared by
    tests/asc_devkit_shim.h, the tiling structs generated by the checkout's own script), and a kernel
    using what an NPU build lacks (INFINITY) does not: the emulator's rules then hold on the NPU's API.
    Checked against the v8.5.0 and v9.0.0 releases (git archive <tag> include impl); later headers
    overload on address spaces, which g++ cannot tell apart."""
    root = Path(os.environ["ASC_DEVKIT_PATH"])
    generated = tmp_path / "generated"
    subprocess.run([sys.executable, str(root / "impl/adv_api/cmake/scripts/gen_kernel_tiling_data_def.py"),
                    str(root / "include/adv_api"), str(generated / "kernel_tiling" / "kernel_tiling.h")],
                   check=True, capture_output=True)
    includes = [root, root / "include", root / "include/basic_api", root / "include/utils", root / "include/adv_api",
                root / "impl", root / "impl/basic_api", root / "impl/utils", generated]

    def first_error(source: Path) -> str | None:
        proc = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-w", "-D__NPU_ARCH__=2201",
                               "-include", str(ROOT / "tests" / "asc_devkit_shim.h"), f"-I{source.parent}",
                               *(f"-I{d}" for d in includes), str(source)], capture_output=True, text=True)
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        return errors[0] if proc.returncode or errors else None

    compiled, failed = [], {}
    for name, spec in sorted(OPS.items()):
        if not ascend.supported(spec):
            continue
        for variant in spec.variants or [None]:
            problem = spec.problem(None, None, variant)
            knobs = planned_knobs(spec, problem)
            # and code the default plan leaves out: csa's vector cores gathering a share of the picks
            for extra in ([{}, {"aiv_gather": 4}] if (name, variant) == ("sparse_attention", "csa") else [{}]):
                project = ascend.render_project(spec, problem, knobs | extra, tmp_path / f"{name}-{variant}{len(extra)}", HW)
                error = first_error(project["kernel.cpp.j2"])
                (failed.__setitem__(f"{name}[{variant}] {extra}", error) if error else compiled.append(name))
    assert not failed, failed
    assert len(set(compiled)) >= 12   # every operator with an AscendC kernel
    bad = tmp_path / "bad" / "kernel.cpp"
    bad.parent.mkdir()
    bad.write_text(KERNEL_HEAD + "    float v = INFINITY; (void)v;\n}\n")
    assert "INFINITY" in (first_error(bad) or "")


# Each operator's tiling as the binding and the CANN host code make it (the rendered header's MakeTiling,
# a C++ call) and as the emulator runs packed it (Python): [(C++ call, bytes)] for a problem.
def _sparse_attention_tiling(kernel, p, knobs):
    call = (f"AkSparseAttentionMakeTiling({p.shape[0]}, {p.shape[2]}, {entries_of(p)}, {p.shape[4]}, {{}}, "
            "AK_PLAN_CUBE_BLOCKS)")
    widths = (p.shape[5], 24) if p.variant == "csa" else (p.shape[5],)   # csa: the compacted picks' width, any
    return [(call.format(w), kernel.tiling(p, knobs, w)) for w in widths]


def _indexer_score_tiling(kernel, p, knobs):
    call = f"AkIndexerScoreMakeTiling({p.shape[0]}, {p.shape[1]}, {p.shape[4]}, AK_PLAN_BLOCK_DIM, AK_PLAN_CUBE_BLOCKS)"
    geo = kernel.launch(p, knobs)   # and the workspaces the binding allocates, bytes
    return [(call, kernel.tiling(p, knobs)), (f"AkIndexerScoreFwdWorkspace({call})", struct.pack("<Q", geo.fwd_ws)),
            (f"AkIndexerScoreWorkspace({call})", struct.pack("<Q", geo.bwd_ws))]


def _rms_norm_tiling(kernel, p, knobs):
    rows, cols = p.shape
    return [(f"AkRmsNormMakeTiling({rows}, {cols}, AK_PLAN_BLOCK_DIM, 1e-6f)",
             kernel.tiling(p.dtype, rows, cols, knobs, eps=1e-6))]


def _swiglu_tiling(kernel, p, knobs):
    rows, inter = p.shape
    return [(f"AkSwigluMakeTiling({rows}, {inter}, AK_PLAN_BLOCK_DIM, 7.0f)", kernel.tiling(p.dtype, rows, inter, knobs, limit=7.0))]


def _router_tiling(kernel, p, knobs):
    rows, experts, _ = p.shape
    return [(f"AkRouterMakeTiling({rows}, {experts}, AK_PLAN_BLOCK_DIM, {str(logits).lower()}, 2.5f)",
             kernel.tiling(p.dtype, rows, experts, knobs, logits, scale=2.5)) for logits in (False, True)]


def _mhc_post_tiling(kernel, p, knobs):
    rows, _, d = p.shape
    return [(f"AkMhcPostMakeTiling({rows}, {d}, AK_PLAN_BLOCK_DIM)", kernel.tiling(p.dtype, rows, d, knobs))]


def _cross_entropy_tiling(kernel, p, knobs):
    rows, vocab = p.shape
    return [(f"AkCrossEntropyMakeTiling({rows}, {vocab}, AK_PLAN_BLOCK_DIM, 0.125f)", kernel.tiling(rows, vocab, knobs, 0.125))]


def _rope_tiling(kernel, p, knobs):
    from aurakernel.targets.ascend.ops.rope import ascend_tiling
    tokens, heads, d, r = p.shape   # x [1, H, S, D] as the attention's transposed view; cos/sin [1, S, R / 2]
    x_strides, cs_strides = (tokens * heads * d, d, heads * d, 1), (tokens * r // 2, r // 2, 1)
    return [(f"AkRopeMakeTiling(1, {heads}, {tokens}, {d}, {r}, {x_strides[0]}, {x_strides[1]}, {x_strides[2]}, "
             f"0, {cs_strides[1]}, AK_PLAN_BLOCK_DIM)",   # cos/sin of one batch row: stride 0, as the binding passes it
             ascend_tiling((1, heads, tokens, d), x_strides, cs_strides, r, p.dtype.itemsize, knobs)[0])]


def _attn_softmax_tiling(kernel, p, knobs):
    from aurakernel.targets.ascend.ops.attn_softmax import ascend_tiling
    batch, heads, seq, keys = p.shape
    cases = []
    for tile_rows, mask in (("tile_rows", None), ("backward_tile_rows", (seq * keys, keys)), ("tile_rows", (0, keys))):
        msb, mss = mask or (0, 0)
        cases.append((f"AkAttnSoftmaxMakeTiling({batch}, {heads}, {seq}, {keys}, {knobs[tile_rows]}, {str(mask is not None).lower()}, "
                      f"{msb}, {mss}, AK_PLAN_BLOCK_DIM, 0.0625f)",
                      ascend_tiling(p.shape, mask is not None, msb, mss, knobs, 0.0625, knobs[tile_rows])[0]))
    return cases


def _compressor_tiling(kernel, p, knobs):
    batch, windows, ratio, d = p.shape
    seq = windows * ratio + ratio // 2   # a tail shorter than a window, as the inputs have
    cases = []
    for ct, tile_win in ((kernel._geometry(p)[1], kernel._tile_win(p, knobs)), (d // 2, 3)):   # the plan's and another
        data, _, workspace, _ = kernel.tiling(batch, seq, ratio, d, p.variant, knobs, ct, tile_win)
        call = f"AkCompressorMakeTiling({batch}, {seq}, {d}, {ct}, {tile_win}, AK_PLAN_BLOCK_DIM)"
        cases += [(call, data), (f"AkCompressorWorkspaceFloats({call})", struct.pack("<Q", workspace // 4))]
    return cases


def _mhc_tiling(kernel, p, knobs):
    rows, _, d = p.shape
    call, geo = f"AkMhcMakeTiling({rows}, {d}, AK_PLAN_BLOCK_DIM, AK_PLAN_CUBE_BLOCKS)", kernel.launch(p, rows, d, knobs)
    return [(call, kernel.tiling(p, rows, d, knobs)),   # and the workspaces the binding allocates, fp32 elements
            (f"AkMhcBackwardWorkspaceFloats({call})", struct.pack("<Q", geo.ws_end)),
            (f"AkMhcAccumulatorFloats({call})", struct.pack("<Q", geo.acc_floats))]


def _adamw_tiling(kernel, p, knobs):
    (n,) = p.shape
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    return [(f"AkAdamWMakeTiling({n}, AK_PLAN_BLOCK_DIM, 3e-4, 0.9, 0.95, 1e-8, 0.1, {step})", kernel.tiling(n, knobs, step, hyper))
            for step in (1, 1000)]


# (op, variant, shape, dtype, a problem's [(C++ call, bytes)])
TILING_HEADERS = (("sparse_attention", "csa", "1x64x200x512x128x64", "bf16", _sparse_attention_tiling),
                  ("sparse_attention", "hca", "1x64x200x512x128x128", "bf16", _sparse_attention_tiling),
                  ("indexer_score", "default", "1x96x64x128x1024", "bf16", _indexer_score_tiling),
                  ("indexer_score", "default", "2x40x64x128x512", "fp32", _indexer_score_tiling),   # the vector backward
                  ("indexer_score", "causal", "2x1000x64x128x250", "bf16", _indexer_score_tiling),  # ranges of equal work
                  ("rms_norm", "weighted", "300x4096", "bf16", _rms_norm_tiling),
                  ("rms_norm", "unweighted", "1000x512", "bf16", _rms_norm_tiling),
                  ("swiglu", "default", "300x2048", "bf16", _swiglu_tiling),
                  ("router", "topk", "1000x256x8", "bf16", _router_tiling),
                  ("mhc_post", "default", "100x4x4096", "bf16", _mhc_post_tiling),
                  ("mhc_post", "default", "100x4x96", "bf16", _mhc_post_tiling),
                  ("cross_entropy", "default", "100x129280", "bf16", _cross_entropy_tiling),
                  ("rope", "default", "300x64x512x64", "bf16", _rope_tiling),
                  ("attn_softmax", "default", "1x64x40x320", "bf16", _attn_softmax_tiling),
                  ("compressor", "csa", "1x64x4x512", "bf16", _compressor_tiling),
                  ("compressor", "hca", "1x16x128x512", "bf16", _compressor_tiling),
                  ("mhc_pre", "default", "1000x4x4096", "bf16", _mhc_tiling),
                  ("mhc_pre", "default", "100x4x4096", "fp32", _mhc_tiling),   # the vector backward
                  ("mhc_head", "default", "100x4x4096", "bf16", _mhc_tiling),
                  ("adamw", "default", "1000003", "fp32", _adamw_tiling))


@pytest.mark.parametrize("op,variant,shape,dtype,tiling", TILING_HEADERS,
                         ids=[f"{o}-{v}-{s}-{d}" for o, v, s, d, _ in TILING_HEADERS])
def test_the_binding_launches_with_the_tiling_the_emulator_verified(tmp_path, op, variant, shape, dtype, tiling):
    """The binding and the CANN host code make a kernel's tiling with the rendered header's MakeTiling;
    the emulator runs pack theirs in Python. Compiled with g++ and run at the plan's shape and its
    verification shapes, the header gives the same bytes, so the NPU launches the kernels with the tiling
    that was verified (a Cube kernel's workspace is tied to it by the kernel's own static_asserts)."""
    from aurakernel.targets.ascend.ops import kernel_of
    spec = OPS[op]
    problem = spec.problem(shape, dtype, variant)
    knobs = planned_knobs(spec, problem)
    project = ascend.render_project(spec, problem, knobs, tmp_path, HW)
    kernel = kernel_of(spec)
    cases = [case for p in (problem, *kernel.verification_problems(problem, knobs)) for case in tiling(kernel, p, knobs)]
    harness = tmp_path / "harness.cpp"
    harness.write_text("#include <cstdio>\n#include \"" + project["tiling.h.j2"].name + "\"\nint main() {\n"
                       + "".join(f"    {{ auto t = {call}; const unsigned char* b = reinterpret_cast<const unsigned char*>(&t);"
                                 " for (unsigned i = 0; i < sizeof t; ++i) std::printf(\"%02x\", b[i]); std::printf(\"\\n\"); }\n"
                                 for call, _ in cases)
                       + "}\n")
    exe = tmp_path / "harness"
    subprocess.run([emulator.compiler(), "-std=c++17", f"-I{project['tiling.h.j2'].parent}", str(harness), "-o", str(exe)],
                   check=True, capture_output=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    assert got == [bytes(want).hex() for _, want in cases]


def test_projects_of_several_widths_load_side_by_side(tmp_path):
    """V4 normalises at several widths (hidden, q and kv LoRA ranks) and compresses two ways: a process
    loads one project per kernel. Their libraries (the loader would reuse a first library of the same
    name: the wrong kernel behind the second binding) and torch ops (torch refuses a second registration
    of a name) are named per kernel: operator, variant, dtype and widths."""
    names = {}
    for op, variant, shape, dtype in (("rms_norm", "weighted", "64x4096", "bf16"), ("rms_norm", "weighted", "64x512", "bf16"),
                                      ("rms_norm", "weighted", "64x512", "fp32"), ("compressor", "csa", "1x8x4x512", "bf16"),
                                      ("compressor", "hca", "1x8x128x512", "bf16")):
        spec = OPS[op]
        problem = spec.problem(shape, dtype, variant)
        out = tmp_path / f"{op}-{variant}-{shape}-{dtype}"
        project = ascend.render_project(spec, problem, planned_knobs(spec, problem),
                                        out, HW)
        cmake, binding = project["CMakeLists.txt.j2"].read_text(), project["binding.cpp.j2"].read_text()
        libs = set(re.findall(r"(?:ascendc_library|add_library)\((\w+) SHARED", cmake))
        ops = set(re.findall(r'm\.def\("(\w+)\(', binding))
        assert len(libs) == 2 and len(ops) == 2, (libs, ops)
        names[(op, variant, shape, dtype)] = libs | ops
    assert names[("rms_norm", "weighted", "64x512", "bf16")] == {"ak_rms_norm_weighted_bf16_512_kernels", "ak_rms_norm_weighted_bf16_512_ops",
                                                                  "rms_norm_weighted_bf16_512_fwd", "rms_norm_weighted_bf16_512_bwd"}
    every = [n for ns in names.values() for n in ns]
    assert len(every) == len(set(every))   # no two kernels share a library or an op name
    from aurakernel.codegen import Identifier
    with pytest.raises(ValueError, match="not an identifier"):
        Identifier("rms_norm; rm -rf")


@pytest.mark.parametrize("op_type, name", [
    # the documented conversion table (asc-devkit, custom-op naming rules) and its special cases
    ("AddCustom", "add_custom"), ("ReduceMaxCustom", "reduce_max_custom"), ("Conv2DCustom", "conv2_d_custom"),
    ("GatherV2Custom", "gather_v2_custom"), ("SplitVCustom", "split_v_custom"), ("TopKCustom", "top_k_custom"),
    ("AbcAAc", "abc_a_ac"), ("GRUCell", "gru_cell"), ("HTTPServerCustom", "http_server_custom"), ("Add", "add"),
    # ours: the widths' digits and the x between them stay as they are
    ("AkRouterTopkBf16256x6", "ak_router_topk_bf16256x6"), ("AkRmsNormWeightedBf16512Grad", "ak_rms_norm_weighted_bf16512_grad"),
])
def test_kernel_entries_are_named_as_the_custom_op_build_finds_them(op_type, name):
    """A msopgen project's build looks up each operator type's kernel by the type in lower snake case; a kernel
    named otherwise is not found for it on the NPU machine."""
    assert ascend.snake_case(op_type) == name


SHIM = ROOT / "tests" / "cann_shim"


@pytest.fixture(scope="module")
def torch_headers(tmp_path_factory):
    """The binding's compile flags: the installed torch's headers, precompiled once (the two tests that use
    them share an xdist group), and a folder for the per-kernel aclrtlaunch headers."""
    root = tmp_path_factory.mktemp("torch_headers")
    torch_dir = Path(__import__("torch").__file__).parent
    inc = [f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    pch = root / "torch_headers.h"
    pch.write_text("#include <torch/library.h>\n#include <ATen/ATen.h>\n")
    subprocess.run([emulator.compiler(), "-std=c++20", "-Wall", "-x", "c++-header", *inc, str(pch), "-o", f"{pch}.gch"],
                   check=True, capture_output=True)
    launch = root / "launch"
    launch.mkdir()
    return SimpleNamespace(flags=["-std=c++20", "-include", str(pch), f"-I{SHIM}", f"-I{launch}", *inc], launch=launch, lib=torch_dir / "lib")


def _launch_headers(binding: Path, launch: Path) -> None:
    """ascendc_library's aclrtlaunch_<kernel>.h for the binding's kernels: the shim's launch macro."""
    for header in re.findall(r'#include "(aclrtlaunch_\w+\.h)"', binding.read_text()):
        (launch / header).write_text('#include "aclrtlaunch.h"\n')


@pytest.mark.xdist_group("torch_headers")
def test_every_rendered_host_file_and_binding_compiles(tmp_path, torch_headers):
    """The CANN host code and the torch_npu binding are built only where CANN is; a template that renders
    C++ which does not compile would fail on the first NPU machine. Every operator's (the cases above)
    host file is compiled against tests/cann_shim's declarations of the CANN host API, and its binding
    against the installed torch's own headers (precompiled once) and the shim's torch_npu stream and
    launch macro: no error, and no warning in the rendered code. Each project registers CANN operator
    types of its own (OpDef classes named after the project), so two projects of one operator (another
    dtype, other widths, the other variant) installed side by side do not collide, and names its kernels
    after them as msopgen's build looks them up (the type in snake case; the binding launches those)."""
    problems, op_types, kernel_names = [], [], []
    for op, variant, shape, dtype, _ in TILING_HEADERS:
        spec = OPS[op]
        problem = spec.problem(shape, dtype, variant)
        out = tmp_path / f"{op}-{variant}-{shape}-{dtype}"
        out.mkdir()
        project = ascend.render_project(spec, problem, planned_knobs(spec, problem),
                                        out, HW)
        classes = re.findall(r"class (\w+) : public OpDef", project["host.cpp.j2"].read_text())
        assert classes and set(classes) <= {ascend.op_type(spec, problem), ascend.op_type(spec, problem) + "Grad"}, classes
        op_types += classes
        # msopgen's build finds each operator type's kernel by the type's snake case name
        entries = set(re.findall(r'extern "C" __global__ __aicore__ void (\w+)\(', project["kernel.cpp.j2"].read_text()))
        assert {ascend.snake_case(c) for c in classes} <= entries, (classes, entries)
        launched = set(re.findall(r"ACLRT_LAUNCH_KERNEL\((\w+)\)", binding_text := project["binding.cpp.j2"].read_text()))
        assert launched and launched <= entries, (launched, entries)
        assert set(re.findall(r'#include "aclrtlaunch_(\w+)\.h"', binding_text)) == launched
        kernel_names += entries
        binding = project["binding.cpp.j2"]
        _launch_headers(binding, torch_headers.launch)
        for source, flags in ((project["host.cpp.j2"], ["-std=c++20", f"-I{SHIM}"]), (binding, torch_headers.flags)):
            run = subprocess.run([emulator.compiler(), "-fsyntax-only", "-Wall", *flags, f"-I{out}", str(source)],
                                 capture_output=True, text=True)
            ours = [line for line in run.stderr.splitlines() if str(out) in line and ("error" in line or "warning" in line)]
            if run.returncode or ours:
                problems.append(f"{source.name} ({op} {variant} {dtype}): " + "; ".join(ours or run.stderr.splitlines()[-3:]))
    assert not problems, "\n".join(problems)
    assert len(op_types) == len(set(op_types)), sorted(op_types)
    assert len(kernel_names) == len(set(kernel_names)), sorted(kernel_names)   # no symbol exported by two projects


def _binding_on_cpu(project: dict, harness: str, torch_headers, tmp_path: Path) -> Path:
    """A program that includes the rendered binding (its tensor code runs on the CPU: ATen's ops are the
    NPU's too; the stream and the launches are stubs, nothing launches) with `harness`'s main, built against
    the installed libtorch."""
    binding = project["binding.cpp.j2"]
    _launch_headers(binding, torch_headers.launch)
    source = tmp_path / "harness.cpp"
    source.write_text(f'#include "{binding.name}"\n'
                      "void* c10_npu::NPUStream::stream(bool) const { return nullptr; }\n"
                      "c10_npu::NPUStream c10_npu::getCurrentNPUStream() { return {}; }\n"
                      "template <typename... Args> inline uint32_t ak_aclrt_launch(uint32_t, void*, Args...) { return 0; }\n"
                      + harness)
    exe = tmp_path / "harness"
    subprocess.run([emulator.compiler(), *torch_headers.flags, f"-I{binding.parent}", str(source), "-o", str(exe),
                    f"-L{torch_headers.lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_headers.lib}"],
                   check=True, capture_output=True)
    return exe


COMPACT_HARNESS = """#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>
/* argv: picks (raw int64 [B, S, K]), B, S, K, entries, output prefix: the binding's compact on the CPU */
int main(int argc, char** argv) {
    const int64_t b = std::atoll(argv[2]), s = std::atoll(argv[3]), k = std::atoll(argv[4]);
    std::vector<int64_t> raw(b * s * k);
    std::ifstream(argv[1], std::ios::binary).read(reinterpret_cast<char*>(raw.data()), raw.size() * 8);
    auto [slots, count, width] = compact(at::from_blob(raw.data(), {b, s, k}, at::kLong).clone(), std::atoll(argv[5]));
    std::ofstream(std::string(argv[6]) + ".slots", std::ios::binary).write(static_cast<const char*>(slots.data_ptr()), slots.numel() * 4);
    std::ofstream(std::string(argv[6]) + ".count", std::ios::binary).write(static_cast<const char*>(count.data_ptr()), count.numel() * 4);
    std::printf("%lld\\n", static_cast<long long>(width));
}
"""


@pytest.mark.xdist_group("torch_headers")
@pytest.mark.parametrize("gap", [0, 2])
def test_the_binding_compacts_the_picks_as_the_emulator_runs_do(tmp_path, torch_headers, gap):
    """csa's binding turns the indexer's picks into the kernels' slots with ATen ops (compact); the emulator
    runs use compact_picks (Python). Built against the installed libtorch and run on the CPU (ATen's ops are
    the NPU's too), the binding's gives the same slots, counts and width: repeated and -1 picks, runs merged
    with holes at the plan's merge_gap."""
    from aurakernel.ops.sparse_attention import random_indices
    from aurakernel.targets.ascend.ops.sparse_attention import compact_picks
    spec = OPS["sparse_attention"]
    problem = spec.problem("1x64x200x512x128x64", "bf16", "csa")
    knobs = {**planned_knobs(spec, problem), "merge_gap": gap}
    project = ascend.render_project(spec, problem, knobs, tmp_path / "project", HW)
    pad = int(re.search(r"SLOT_PAD = (\d+)", project["binding.cpp.j2"].read_text()).group(1))
    exe = _binding_on_cpu(project, COMPACT_HARNESS, torch_headers, tmp_path)
    import numpy as np
    import torch
    for seed, (batch, seq, entries, topk) in enumerate(((2, 200, 50, 64), (1, 96, 24, 8), (1, 40, 400, 16))):
        picks = random_indices(batch, seq, entries, topk, torch.Generator().manual_seed(seed))
        picks[0, -1, : picks.shape[-1] // 2] = picks[0, -1, -1]   # repeats
        picks.numpy().astype(np.int64).tofile(tmp_path / "picks")
        run = subprocess.run([str(exe), str(tmp_path / "picks"), *map(str, picks.shape), str(entries), str(tmp_path / "out")],
                             capture_output=True, text=True, check=True)
        slots, count = compact_picks(picks, entries, gap)
        got = np.fromfile(tmp_path / "out.slots", dtype=np.int32)
        assert int(run.stdout) == slots.shape[-1]
        assert (got[:pad] == -1).all() and np.array_equal(got[pad:], slots.flatten().numpy())
        assert np.array_equal(np.fromfile(tmp_path / "out.count", dtype=np.int32), count.flatten().numpy())


FN_PARTS_HARNESS = """#include <cstdlib>
#include <fstream>
#include <vector>
/* argv: fn (raw fp32 [NOUT, HC * D]), output: the binding's fn_parts for x of the plan's dtype, raw */
int main(int argc, char** argv) {
    std::vector<float> raw(NOUT * HC * D);
    std::ifstream(argv[1], std::ios::binary).read(reinterpret_cast<char*>(raw.data()), raw.size() * 4);
    at::Tensor parts = fn_parts(at::from_blob(raw.data(), {NOUT, HC * D}, at::kFloat).clone(), X_DTYPE);
    std::ofstream(argv[2], std::ios::binary).write(static_cast<const char*>(parts.data_ptr()), parts.nbytes());
}
"""


@pytest.mark.xdist_group("torch_headers")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_binding_splits_fn_as_the_emulator_runs_do(tmp_path, torch_headers, dtype):
    """mhc_pre's binding hands the Cube fn as parts in x's dtype (16-bit: hi + lo, rows padded to 16) with
    ATen ops; the emulator runs use fn_parts (Python). Built against libtorch and run on the CPU, the
    binding's parts are the same bytes."""
    import numpy as np
    import torch
    from aurakernel.targets.ascend.ops.mhc import fn_parts
    spec = OPS["mhc_pre"]
    problem = spec.problem("64x4x256", dtype, "default")
    project = ascend.render_project(spec, problem, planned_knobs(spec, problem),
                                    tmp_path / "project", HW)
    x_dtype = {"bf16": "at::kBFloat16", "fp32": "at::kFloat"}[dtype]
    exe = _binding_on_cpu(project, f"#define X_DTYPE {x_dtype}\n" + FN_PARTS_HARNESS, torch_headers, tmp_path)
    fn = torch.randn(spec.nout(4), 4 * 256, generator=torch.Generator().manual_seed(0))
    fn.numpy().astype(np.float32).tofile(tmp_path / "fn")
    subprocess.run([str(exe), str(tmp_path / "fn"), str(tmp_path / "parts")], check=True, capture_output=True)
    want = fn_parts(fn, problem.dtype.torch)
    got = (tmp_path / "parts").read_bytes()
    assert got == want.contiguous().view(torch.uint8).numpy().tobytes()


# A mixed kernel: per block the AIC multiplies A (16 x 32) by B^T into a GM workspace, signals its two
# AIVs (mode 2); each AIV scales its 8 rows by (its vector-core index + 1) and signals back.
MIX_MATMUL = """#include "kernel_operator.h"
using namespace AscendC;
extern "C" __global__ __aicore__ void k(GM_ADDR a, GM_ADDR b, GM_ADDR work, GM_ADDR y) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
    TPipe pipe;
    GlobalTensor<float> wg; wg.SetGlobalBuffer((__gm__ float*)work + GetBlockIdx() / GetTaskRatio() * 256, 256);
    if ASCEND_IS_AIC {
        GlobalTensor<half> ag, bg; ag.SetGlobalBuffer((__gm__ half*)a, 512); bg.SetGlobalBuffer((__gm__ half*)b, 512);
        TQue<TPosition::A1, 1> qa1, qb1; TQue<TPosition::A2, 1> qa2; TQue<TPosition::B2, 1> qb2; TQue<TPosition::CO1, 1> qc;
        pipe.InitBuffer(qa1, 1, 1024); pipe.InitBuffer(qb1, 1, 1024); pipe.InitBuffer(qa2, 1, 1024);
        pipe.InitBuffer(qb2, 1, 1024); pipe.InitBuffer(qc, 1, 1024);
        LocalTensor<half> a1 = qa1.AllocTensor<half>(), b1 = qb1.AllocTensor<half>();
        DataCopy(a1, ag, Nd2NzParams(1, 16, 32, 0, 32, 16, 1, 1)); DataCopy(b1, bg, Nd2NzParams(1, 16, 32, 0, 32, 16, 1, 1));
        qa1.EnQue(a1); qb1.EnQue(b1); a1 = qa1.DeQue<half>(); b1 = qb1.DeQue<half>();
        LocalTensor<half> a2 = qa2.AllocTensor<half>(), b2 = qb2.AllocTensor<half>();
        LoadData(a2, a1, LoadData2DParams(0, 2, 1, 0, 0, false, 0)); LoadData(b2, b1, LoadData2DParams(0, 2, 1, 0, 0, false, 0));
        qa2.EnQue(a2); qb2.EnQue(b2); qa1.FreeTensor(a1); qb1.FreeTensor(b1);
        a2 = qa2.DeQue<half>(); b2 = qb2.DeQue<half>();
        LocalTensor<float> c = qc.AllocTensor<float>();
        Mmad(c, a2, b2, MmadParams(16, 16, 32, 0, false, true));
        qc.EnQue(c); qa2.FreeTensor(a2); qb2.FreeTensor(b2); c = qc.DeQue<float>();
        Fixpipe<float, float, CFG_ROW_MAJOR>(wg, c, FixpipeParamsV220(16, 16, 16, 16, false));
        qc.FreeTensor(c);
        CrossCoreSetFlag<2, PIPE_FIX>(SET_ID);
        CrossCoreWaitFlag<2, PIPE_FIX>(DONE_ID);
    }
    if ASCEND_IS_AIV {
        GlobalTensor<float> yg; yg.SetGlobalBuffer((__gm__ float*)y + GetBlockIdx() * 128, 128);
        TBuf<TPosition::VECCALC> t; pipe.InitBuffer(t, 512);
        LocalTensor<float> v = t.Get<float>();
        CrossCoreWaitFlag<2, PIPE_MTE2>(0);
        DataCopy(v, wg[GetSubBlockIdx() * 128], 128);
        PipeWait<HardEvent::MTE2_V>();
        Muls(v, v, float(GetBlockIdx() + 1), 128);
        PipeWait<HardEvent::V_MTE3>();
        DataCopy(yg, v, 128);
        CrossCoreSetFlag<2, PIPE_MTE3>(1);
    }
}
"""


def _mix_run(source: str, block_dim: int = 2, cores: str = "mix_1_2", l2_args=()):
    import torch
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(16, 32, generator=g).half(), torch.randn(16, 32, generator=g).half()
    exe = emulator.build(source.replace("using namespace AscendC;\n", "using namespace AscendC;\n" + PIPE_WAIT, 1), entry="k", nargs=4, hw=HW,
                         cores=cores, l2_args=l2_args)
    bufs = [emulator.to_bytes(a), emulator.to_bytes(b), bytearray(block_dim * 1024), bytearray(block_dim * 1024)]
    return emulator.run(exe, block_dim, bufs, timeout_s=60), a.float() @ b.float().t(), bufs[3]


def test_a_mixed_kernel_runs_its_cube_and_vector_cores_side_by_side():
    """The AIC's matmul reaches both AIVs of its block through the GM workspace after a mode-2 flag;
    an AIV's GetBlockIdx counts vector cores (block * 2 + sub-block). The workspace, kept in L2, is
    L2 traffic, not HBM traffic."""
    import torch
    report, ref, y = _mix_run(MIX_MATMUL.replace("SET_ID", "0").replace("DONE_ID", "1"), l2_args=(2,))
    assert report.ok, report.errors
    got = torch.frombuffer(y, dtype=torch.float32).reshape(2, 2, 8, 16)
    for block in range(2):
        for sub in range(2):
            torch.testing.assert_close(got[block, sub], ref[8 * sub:8 * sub + 8] * (2 * block + sub + 1), rtol=1e-5, atol=1e-5)
    assert sorted((b.block, b.core) for b in report.blocks) == [(0, "AIC"), (0, "AIV0"), (0, "AIV1"), (1, "AIC"), (1, "AIV0"), (1, "AIV1")]
    aic = next(b for b in report.blocks if b.core == "AIC")
    aiv = next(b for b in report.blocks if b.core == "AIV0")
    assert aic.busy["Cube"] > 0 and aic.ub_used == 0 and aiv.busy["Vector"] > 0
    assert aiv.makespan > aic.busy["FIX"]          # the AIVs start only after the AIC's Fixpipe
    pipes = report.pipe_cycles()
    assert pipes["Cube"] > 0 and pipes["Vector"] > 0 and report.cube_blocks
    # per block: the AIC writes 16 x 16 floats to the workspace and each AIV reads its half
    assert [b.l2_bytes for b in report.blocks] == [1024, 512, 512] * 2
    assert aic.gm_read == 2 * 512 * 2 and aic.gm_written == 0 and aiv.gm_read == 0 and aiv.gm_written == 512


@pytest.mark.parametrize("change,rule", [
    (("DONE_ID", "2"), "hang: CrossCoreWaitFlag(2) of mode 2 on the AIC of block 0"),   # the AIVs set 1, never 2
    (("SET_ID", "11"), "CrossCoreSetFlag: flagId 11"),
    (("KERNEL_TYPE_MIX_AIC_1_2", "KERNEL_TYPE_AIV_ONLY"), "kernel type: declared with 0 AIC and 1 AIV"),
    (("CrossCoreSetFlag<2, PIPE_FIX>(SET_ID);", "for (int i = 0; i < 17; ++i) CrossCoreSetFlag<2, PIPE_FIX>(0);"),
     "counter holds at most 15"),   # the AIVs wait once
    (("CrossCoreSetFlag<2, PIPE_FIX>(SET_ID);", "CrossCoreSetFlag<2, PIPE_FIX>(0); CrossCoreSetFlag<2, PIPE_FIX>(0);"),
     "cross-core flags: CrossCoreSetFlag(0) of mode 2 from the AIC of block 0 set 1 more time(s) than AIV 0 of block 0"),
])
def test_mixed_kernel_rules(change, rule):
    """A wait no set can meet hangs (reported, not waited out); flag IDs 0-10; the declared kernel type
    is the launch; a flag's counter holds 15 sets; a launch ends with every flag's sets waited for (a
    count left in a core's counter would let the next launch's first wait through early)."""
    source = MIX_MATMUL.replace(*change).replace("SET_ID", "0").replace("DONE_ID", "1")
    report, _, _ = _mix_run(source)
    assert not report.ok and rule in report.errors[0], report.errors


def test_each_core_has_only_its_own_memories():
    """On the split A2/A3 cores a vector core has no L1 / L0 and the Cube core no UB."""
    report, _, _ = _mix_run(MIX_MATMUL.replace("SET_ID", "0").replace("DONE_ID", "1"), cores="aiv")
    assert not report.ok and "kernel type" in report.errors[0]
    body = "    TBuf<TPosition::A1> b; pipe.InitBuffer(b, 1024);"
    report, _ = _run_kernel(body, bytearray(256))
    assert not report.ok and "position" in report.errors[0] and "vector core (AIV)" in report.errors[0]


def test_indexer_backward_streams_keys_that_do_not_fit_l1():
    """When the keys do not fit L1 (V4 at long context: 16384 compressed keys) the Cube backward loads
    each key tile per use: the planner picks that there, and the streamed kernel is verified here at a
    small shape with the knob forced (tails in rows and keys, two batch rows)."""
    import tempfile
    spec = OPS["indexer_score"]
    long = ascend.plan(spec, spec.problem("1x65536x64x128x16384", "bf16"), HW, target="ascend910b2", solver="highs", explain=False)
    assert long.knobs["bwd_stream"] == 1
    problem = spec.problem("2x27x64x128x261", "bf16")
    knobs = dict(planned_knobs(spec, problem), bwd_stream=1)
    with tempfile.TemporaryDirectory() as tmp:
        emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, Path(tmp), HW), HW)
        result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
    assert result.passed, result.summary
    assert {c.tensor for c in result.checks} >= {"y", "grad_q", "grad_k", "grad_hidden", "grad_proj"}


def test_causal_indexer_computes_only_the_key_tiles_its_queries_see(tmp_path):
    """indexer_score[causal] on the AI cores (the scores DeepseekV4Indexer takes to its top-k): a query tile
    computes only the key tiles its rows see (their largest limit), writes each row's scores below its limit
    and -inf from there, and takes a row's gradient past its limit as zero. Verified forward and backward over
    two batch rows with the keys in two L1 chunks (the second a single key) and streamed in the backward; at
    the same plan both directions run in fewer emulated cycles than scoring every entry. Each AI core takes
    an early range of tiles (few keys each, so more of them) and a late one, of equal work."""
    import torch
    from aurakernel.targets.ascend.ops.indexer_score import causal_key_tiles, core_parts, tile_bounds
    spec = OPS["indexer_score"]
    knobs = {"cube_rows": 2, "cube_keys": 64, "key_chunk": 64, "bwd_rows": 2, "bwd_keys": 64}
    cycles = {}
    for variant, stream in (("causal", 0), ("causal", 1), ("default", 0)):
        problem = spec.problem("2x260x64x128x65", "bf16", variant)
        plan = planned_knobs(spec, problem) | knobs | {"bwd_stream": stream}
        emu = ascend.Emulated(spec, ascend.render_project(spec, problem, plan, tmp_path / f"{variant}{stream}", HW), HW)
        if variant == "causal":
            result = ascend.verify(spec, [problem], plan, emu, seeds=(0,))
            assert result.passed, result.summary
            y = {c.tensor for c in result.checks}
            assert {"y", "grad_q", "grad_k", "grad_hidden", "grad_proj"} <= y
        if stream == 0:
            cycles[variant] = {phase: r.cycles for phase, r in ascend.emulate(spec, problem, plan, emu).items()}
    assert all(cycles["causal"][phase] < cycles["default"][phase] for phase in ("forward", "backward")), cycles
    bounds = tile_bounds(1, 4096, 2, 1024, 128, 24, True, 27)   # 2048 query tiles of two rows, 24 AI cores
    cost = (16 * causal_key_tiles(1, 4096, 2, 1024, 128)).clamp(min=27)
    cores = core_parts(bounds, True)
    work = [sum(int(cost[a:b].sum()) for a, b in ranges) for ranges in cores]
    assert len(bounds) == 49 and bounds[0] == 0 and bounds[-1] == 2048 and len(cores) == 24
    assert max(work) < 1.05 * min(work)                                    # of equal work
    assert all(early[1] <= bounds[24] <= late[0] for early, late in cores)  # each an early range and a late one
    assert bounds[1] - bounds[0] > 2 * (bounds[-1] - bounds[-2])           # the early tiles cheaper: more of them
    assert core_parts(tile_bounds(1, 4096, 2, 1024, 128, 24, False), False) == [[(86 * c, min(86 * c + 86, 2048))]
                                                                                for c in range(24)]
    # fp32 runs the backward on the vector cores: every key tile, the gradient masked at each row's limit
    problem = spec.problem("1x40x64x128x10", "fp32", "causal")
    plan = planned_knobs(spec, problem)
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, plan, tmp_path / "fp32", HW), HW)
    result = ascend.verify(spec, [problem], plan, emu, seeds=(0,))
    assert result.passed, result.summary
    inputs = spec.make_inputs(problem, 0)
    grad = torch.randn(1, 40, 10, generator=torch.Generator().manual_seed(1))
    out, grads, _ = ascend.kernel_of(spec).run(problem, plan, inputs, {"y": grad}, emu)
    limit = inputs["limit"][0]
    past = torch.arange(10).view(1, -1) >= limit.view(-1, 1)
    assert torch.isneginf(out["y"][0][past]).all() and torch.isfinite(out["y"][0][~past]).all()
    _, masked, _ = ascend.kernel_of(spec).run(problem, plan, inputs, {"y": grad.masked_fill(past, 0.0)}, emu)
    assert all(torch.equal(grads[name], masked[name]) for name in ("q", "k")), "a gradient past a row's limit reached q or k"


def test_the_planner_refuses_a_variant_the_ascend_kernel_does_not_compute(monkeypatch, capsys):
    """A kernel that computes some of its operator's variants (AscendKernel.variants) is planned for those
    only: the CLI names the variant and what the kernels compute, exit 2."""
    from aurakernel.cli import main
    monkeypatch.setattr(type(ascend.kernel_of(OPS["indexer_score"])), "variants", ("default",))
    assert main(["tune", "indexer_score", "--variant", "causal", "--target", "ascend910b2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "indexer_score[causal] has no AscendC kernel: its kernels compute default" in err[0]


def test_indexer_cube_starts_on_the_first_keys_while_the_rest_arrive(monkeypatch):
    """The keys resident in L1 come in parts (up to four), each with its own event: the Cube starts on
    the first part's tiles while the rest is copied. Verified with the planner's splits, whose last
    part is a short last tile, and both kernels then run in fewer emulated cycles than with every key
    in one part (the first tile waiting for the last key). The first part the planner sizes is a
    proper part of the keys, the parts ascending."""
    import tempfile
    spec = OPS["indexer_score"]
    kernel = ascend.kernel_of(spec)
    problem = spec.problem("1x8x64x128x517", "bf16")
    knobs = planned_knobs(spec, problem)
    planned = kernel.profile_params(problem, knobs, HW)
    fwd, bwd = planned["fwd_key_ends"], planned["bwd_key_ends"]
    assert 0 < fwd[0] < min(knobs["key_chunk"], 517) and 0 < bwd[0] < 517
    assert list(fwd) == sorted(fwd) and list(bwd) == sorted(bwd) and fwd[-1] == min(knobs["key_chunk"], 517) and bwd[-1] == 517
    assert fwd.count(fwd[-1]) < len(fwd) - 1 and bwd.count(bwd[-1]) < len(bwd) - 1   # more than two parts here

    def cycles(heads):
        monkeypatch.setattr(type(kernel), "profile_params", lambda self, p, k, hw: heads)
        with tempfile.TemporaryDirectory() as tmp:
            emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, Path(tmp), HW), HW)
            result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
            assert result.passed, result.summary
            return {phase: r.cycles for phase, r in ascend.emulate(spec, problem, knobs, emu).items()}
    split = cycles(planned)
    whole = cycles(planned | {"fwd_key_ends": (knobs["key_chunk"],) * 4, "bwd_key_ends": (528,) * 4})
    assert split["forward"] < whole["forward"] and split["backward"] < whole["backward"], (split, whole)


def test_indexer_backward_copies_the_next_q_in_parts_between_coefficients(monkeypatch, tmp_path):
    """The Cube backward's in-order MTE2 carries each key tile's coefficients and, once per query tile,
    the next tile's q. Copied whole, q sat in front of the next coefficients and the Cube waited at every
    query tile; the planner splits it into parts that each fit beside a coefficient copy under a pair's
    Mmads. Five query tiles per AI core (4 cores, tails in rows and keys): the parts verify and run the
    backward in fewer emulated cycles than the whole copy."""
    spec = OPS["indexer_score"]
    kernel = ascend.kernel_of(spec)
    problem = spec.problem("1x39x64x128x200", "bf16")
    knobs = planned_knobs(spec, problem) | {"cube_blocks": 4, "bwd_rows": 2}
    planned = kernel.profile_params(problem, knobs, HW)
    fractal_rows = 2 * 64 // 16
    assert 1 <= planned["bwd_q_part"] < fractal_rows

    def backward_cycles(part, sub, verify):
        monkeypatch.setattr(type(kernel), "profile_params", lambda self, p, k, hw: planned | {"bwd_q_part": part})
        emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path / sub, HW), HW)
        if verify:   # (timing only for the whole copy: the parts are what the kernel runs)
            result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
            assert result.passed, result.summary
        return ascend.emulate(spec, problem, knobs, emu)["backward"].cycles
    parts, whole = backward_cycles(planned["bwd_q_part"], "parts", True), backward_cycles(fractal_rows, "whole", False)
    assert parts < whole, (parts, whole)


def test_indexer_vector_cores_copy_a_groups_weights_at_once(monkeypatch, tmp_path):
    """Each query tile's head weights came in a copy of their own (256 B and a copy's latency, ~4% of the
    forward's vector-core reads); the weights of up to W_GROUP whole tiles of a batch row now come in
    one strided copy. Five tiles per AI core, the last of a batch row short (39 rows): both directions
    verify with groups, and the forward runs in fewer emulated cycles than with a copy per tile."""
    from aurakernel.targets.ascend.ops import indexer_score as module
    spec = OPS["indexer_score"]
    problem = spec.problem("1x39x64x128x200", "bf16")
    knobs = planned_knobs(spec, problem) | {"cube_blocks": 4, "cube_rows": 2}

    def forward_cycles(group):
        monkeypatch.setattr(module, "W_GROUP", group)
        emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path / str(group), HW), HW)
        if group > 1:   # (timing only for a copy per tile)
            result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
            assert result.passed, result.summary
        return ascend.emulate(spec, problem, knobs, emu)["forward"].cycles
    grouped, alone = forward_cycles(module.W_GROUP), forward_cycles(1)
    assert grouped < alone, (grouped, alone)


@pytest.mark.parametrize("variant,q_buffers,cube_blocks", [("sliding", 2, 24), ("hca", 2, 24), ("csa", 2, 24), ("sliding", 1, 8),
                                                         ("hca", 1, 24)])
def test_sparse_attention_forward_keeps_a_whole_window_tile_in_ring_order(variant, q_buffers, cube_blocks, tmp_path):
    """Where the window is a key tile of its own (window = kv_tile), the forward keeps it in L1 as a
    ring and copies only the kv rows its buffer's earlier window lacks (two key buffers, beside two q
    buffers: sliding the core's position two back; hca the previous one, its entries in the other
    buffer; csa where the previous one had two tiles. Three, beside one q buffer: sliding three back
    (on 8 AI cores: 24 positions), hca none of its positions of two tiles), never across batch rows. Both kernels verify over two
    batch rows; for sliding and hca the forward's Cube side moves exactly the L2 bytes that predicts:
    the rows the planner's window_rows counts, every tile's P in and its S and P V out."""
    import torch
    from aurakernel.targets.ascend.ops.sparse_attention import key_buffers, position_keys, position_split, window_rows
    spec, kernel = OPS["sparse_attention"], ascend.kernel_of(OPS["sparse_attention"])
    problem = spec.problem(f"2x16x200x128x64x{dict(sliding=1, hca=16, csa=8)[variant]}", "bf16", variant)
    knobs = planned_knobs(spec, problem) | {"kv_tile": 64, "d_chunk": 64,
                                                                                          "q_buffers": q_buffers,
                                                                                          "cube_blocks": cube_blocks}
    emu = ascend.Emulated(spec, ascend.render_project(spec, problem, knobs, tmp_path, HW), HW)
    result = ascend.verify(spec, [problem], knobs, emu, seeds=(0,))
    assert result.passed, result.summary
    if variant == "csa":   # its picks are drawn at random: the rows it copies are not counted here
        return
    inputs = spec.make_inputs(problem, 0)
    grad_out = {"y": torch.randn(*spec.reference(problem, inputs)["y"].shape, generator=torch.Generator().manual_seed(1))}
    _, _, reports = kernel.run(problem, knobs, inputs, grad_out, emu)
    batch, heads, seq, dim, window, extra = problem.shape
    keys, _ = position_keys(variant, seq, window, extra)   # each batch row's
    rows = batch * window_rows(keys, window, 64, position_split(batch * seq, knobs["cube_blocks"])[1], key_buffers(knobs["q_buffers"]))
    if variant == "sliding" or q_buffers == 2:   # hca with three key buffers: a window's buffer last held entries
        assert rows < 0.9 * batch * sum(min(s + 1, window) for s in range(seq))
    tiles = batch * [(min(64, int(k) - 64 * j)) for k in keys for j in range(-(-int(k) // 64))]   # each tile's keys
    entries = batch * sum(k - min(s + 1, window) for s, k in enumerate(keys))
    expected = 2 * ((rows + entries) * dim + len(tiles) * heads * 64) + sum(4 * heads * (n + dim) for n in tiles)
    moved = sum(b.l2_bytes for b in reports["forward"].blocks if b.core == "AIC")
    assert moved == expected
