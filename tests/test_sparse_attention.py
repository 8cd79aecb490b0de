"""sparse_attention: V4's attention over the window and the selected (csa) or ready (hca) compressed
entries, forward and backward, against transformers' own dense attention; and in the model, where it
replaces the dense attention of every layer without changing the loss or any gradient."""

import copy

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from aurakernel import apply
from aurakernel.dtypes import DType
from aurakernel.hardware import host_profile
from aurakernel.ops import get_op
from aurakernel.ops.base import Problem
from aurakernel.planfile import KernelPlan, PlanEntry
from aurakernel.planner import solve_tiling
from aurakernel.swap import deepseek_v4_sites
from aurakernel.targets.host.build import build_kernel
from aurakernel.targets.host.library import Kernel
from aurakernel.targets.host.ops import kernel_of
from aurakernel.targets.host.target import verify
from trainer.config import load_config
from trainer.model import build_model

from conftest import TINY

SPEC = get_op("sparse_attention")
TEMPLATE = "host/sparse_attention.c.j2"


# --- the kernel --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["csa", "hca", "sliding"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("knobs", [{"tile_rows": 1, "key_chunk": 16, "threads": 2, "pack_rows": 2},
                                   {"tile_rows": 4, "key_chunk": 32, "threads": 2, "pack_rows": 0},
                                   {"tile_rows": 16, "key_chunk": 256, "threads": 1, "pack_rows": 10 ** 6}],
                         ids=["t1k16", "t4k32-own", "t16k256-union"])
def test_kernel_matches_dense_attention_at_tails(variant, dtype, knobs):
    """Sequences not a multiple of the task, windows longer than the sequence and shorter, keys in
    several chunks (the online softmax rescales), csa rows whose picks are all -1 (the first
    positions) or repeated, hca sequences ending inside a compression window, D off the SIMD grid.
    csa tasks take both ways to their picks: with packing priced at nothing (pack_rows 0) each position
    gathers its own unless all a task's positions picked the same, priced at everything every task
    gathers its positions' union, each row masked to its own picks."""
    vec = max(host_profile().simd_bytes // 4, 4)
    shapes = ["2x4x45x64x64x16", "1x3x83x40x8x8"]   # BxHxSxDxWINDOWxEXTRA
    for shape in shapes:
        problem = SPEC.problem(shape, dtype, variant)
        kernel = build_kernel(SPEC, problem, {**knobs, "vec": vec})
        result = verify(SPEC, [(problem, kernel)], seeds=(0, 1))
        assert result.passed, f"{shape}: {result.summary}"
        assert {c.tensor for c in result.checks} >= {"y", "grad_q", "grad_kv", "grad_sinks"}


def test_bf16_runs_on_the_tile_unit_where_the_cpu_has_one():
    """The bf16 build holds the AMX path (tile GEMMs) exactly where the CPU has AMX-BF16: the tails test
    above verifies that path here, tests/test_portable.py the AVX2 one."""
    import subprocess
    from aurakernel.hardware import _cpu_flags
    vec = max(host_profile().simd_bytes // 4, 4)
    problem = SPEC.problem("1x4x40x64x16x8", "bf16", "hca")
    kernel = build_kernel(SPEC, problem, {"tile_rows": 2, "key_chunk": 32, "threads": 1, "vec": vec, "pack_rows": 8})
    code = subprocess.run(["objdump", "-d", str(kernel.artifact)], capture_output=True, text=True, check=True).stdout
    assert ("tdpbf16ps" in code) == ("amx_bf16" in _cpu_flags())


def test_the_inputs_have_what_the_tails_need():
    """The csa inputs the tests verify on: early rows with no valid pick, rows with a repeated pick."""
    problem = SPEC.problem("1x2x83x16x8x8", "fp32", "csa")
    idx = SPEC.make_inputs(problem, seed=0)["indices"]
    assert (idx[0, :3] == -1).all()                                   # positions 0-2: nothing ready
    assert any(len(set(r.tolist()) - {-1}) < (r >= 0).sum() for r in idx[0])   # some row repeats a pick


def test_backward_is_deterministic_and_keeps_no_dense_scores():
    problem = SPEC.problem("2x4x300x64x64x16", "fp32", "csa")
    knobs = solve_tiling(kernel_of(SPEC).tiling_problem(problem, host_profile()), op=problem.op, variant="csa",
                         shape=problem.shape, dtype="fp32", target="host").knobs
    kernel = build_kernel(SPEC, problem, knobs)
    inputs = SPEC.make_inputs(problem, seed=3)
    impl = kernel_of(SPEC)
    outputs = impl.empty_outputs(problem, inputs)
    impl.run_forward(kernel, inputs, outputs)
    # what the forward keeps for the backward: the output and one logsumexp per row
    assert outputs["lse"].shape == (2, 4, 300) and set(outputs) == {"y", "lse"}
    g = {"y": torch.randn(outputs["y"].shape, generator=torch.Generator().manual_seed(0))}
    runs = []
    for _ in range(2):
        grads = {k: torch.empty_like(inputs[k]) for k in SPEC.differentiable(problem)}
        impl.run_backward(kernel, inputs, outputs, g, grads)
        runs.append(grads)
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_q_and_do_are_read_in_the_layout_they_come_in(dtype):
    """q arrives as rope's output of the attention's transposed view (rows stored [B][S][H]) and dO as
    the attention output's (rows stored [B][H][S]); the kernels read both there, uncopied, dq is written
    in q's layout, and every output and gradient is the same bit for bit as from contiguous copies; a
    layout that is neither is copied."""
    from aurakernel.targets.host.ops.sparse_attention import _args, backward, forward, rows_in_place

    problem = SPEC.problem("2x4x45x64x64x16", dtype, "csa")
    knobs = solve_tiling(kernel_of(SPEC).tiling_problem(problem, host_profile()), op=problem.op, variant="csa",
                         shape=problem.shape, dtype=dtype, target="host").knobs
    kernel = build_kernel(SPEC, problem, knobs)
    inputs = SPEC.make_inputs(problem, seed=1)
    impl = kernel_of(SPEC)
    outputs = impl.empty_outputs(problem, inputs)
    impl.run_forward(kernel, inputs, outputs)
    b, h, s, d = inputs["q"].shape
    g_bhsd = torch.randn(b, h, s, d, generator=torch.Generator().manual_seed(2)).to(problem.dtype.torch)
    transposed = g_bhsd.transpose(1, 2)                   # [B, S, H, D], stored [B][H][S]
    assert rows_in_place(transposed) == (transposed, 1)     # read in place
    assert rows_in_place(transposed.contiguous())[1] == 0
    odd = torch.randn(s, b, h, d).to(problem.dtype.torch).permute(1, 0, 2, 3)
    assert rows_in_place(odd)[0].is_contiguous()            # neither layout: copied

    def grads_from(dout):
        q, kv, ckv, idx = _args(inputs)
        out = {"q": torch.empty_like(q), "kv": torch.empty_like(kv), "ckv": torch.empty_like(ckv),
               "sinks": torch.empty(h)}
        backward(kernel, q, kv, ckv, idx, inputs["sinks"].float().contiguous(), outputs["y"], outputs["lse"],
                 dout, out["q"], out["kv"], out["ckv"], out["sinks"], d ** -0.5)
        return out

    in_place, copied = grads_from(transposed), grads_from(transposed.contiguous())
    for k in in_place:
        assert torch.equal(in_place[k], copied[k]), k

    # q stored [B][S][H]: forward and backward against the contiguous q's, dq in q's layout
    q, kv, ckv, idx = _args(inputs)
    q_bsh = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert rows_in_place(q_bsh) == (q_bsh, 1)
    sinks = inputs["sinks"].float().contiguous()
    results = []
    for qx in (q, q_bsh):
        out, lse = torch.empty_like(outputs["y"]), torch.empty_like(outputs["lse"])
        forward(kernel, qx, kv, ckv, idx, sinks, out, lse, d ** -0.5)
        dq, dkv, dckv = torch.empty_like(qx), torch.empty_like(kv), torch.empty_like(ckv)
        backward(kernel, qx, kv, ckv, idx, sinks, out, lse, transposed, dq, dkv, dckv, torch.empty(h), d ** -0.5)
        assert dq.stride() == qx.stride()
        results.append((out, lse, dq, dkv, dckv))
    for a, b_ in zip(*results):
        assert torch.equal(a, b_)


def test_the_planner_sizes_tasks_to_the_cache_and_the_window():
    """A wide head (V4-Flash: 64 heads of 512) leaves no room for big tasks; the tiny model's heads
    do; the plan always fits the cache it was planned for."""
    hw = host_profile()
    for shape in ("1x64x4096x512x128x512", "1x4x4096x64x64x16"):
        problem = SPEC.problem(shape, "bf16", "csa")
        model = kernel_of(SPEC).tiling_problem(problem, hw)
        plan = solve_tiling(model, op=problem.op, variant="csa", shape=problem.shape, dtype="bf16", target="host")
        assert model.feasible(plan.knobs)
        for c in model.constraints:
            assert c.usage.value(plan.knobs) <= c.limit


# --- in the model ------------------------------------------------------------------------------------------

def _cfg(seq: int):
    cfg = load_config(TINY)
    cfg.data.seq_len, cfg.data.batch_size = seq, 1
    return cfg


def sparse_plan(model, seq: int, dtypes=("fp32",)) -> KernelPlan:
    """A plan with a planned sparse_attention kernel for every attention layer of `model`."""
    hw = host_profile()
    entries, seen = [], set()
    for site in deepseek_v4_sites(model):
        if site.op != "sparse_attention":
            continue
        for dt in dtypes:
            if (site.variant, site.kernel_key, dt) in seen:
                continue
            seen.add((site.variant, site.kernel_key, dt))
            heads, dim, window, extra = site.kernel_key
            problem = Problem("sparse_attention", site.variant, (1, heads, seq, dim, window, extra), DType.parse(dt))
            knobs = solve_tiling(kernel_of(SPEC).tiling_problem(problem, hw), op=problem.op, variant=site.variant,
                                 shape=problem.shape, dtype=dt, target="host").knobs
            entries.append(PlanEntry("sparse_attention", site.variant, list(site.kernel_key), dt, problem.shape_text,
                                     knobs, build_kernel(SPEC, problem, knobs).source_hash))
    return KernelPlan(target="host", kernels=entries)


def _kernel_calls(monkeypatch) -> list[str]:
    calls = []
    call = Kernel.call

    def counting(kernel, name, *args):
        if kernel.source.template == TEMPLATE:
            calls.append(name)
        return call(kernel, name, *args)
    monkeypatch.setattr(Kernel, "call", counting)
    return calls


@pytest.mark.parametrize("seq", [256, 1024])
def test_swapped_model_matches_the_dense_one_over_three_optimizer_steps(seq, monkeypatch):
    cfg = _cfg(seq)
    ref = build_model(cfg.model, seed=0)
    ours = copy.deepcopy(ref)
    report = apply(ours, sparse_plan(ours, seq))
    assert {s["module"] for s in report.swapped if s["op"] == "sparse_attention"} == {
        f"model.layers.{i}.self_attn" for i in range(len(cfg.model["layer_types"]))}
    calls = _kernel_calls(monkeypatch)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, ours)]
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, cfg.model["vocab_size"], (1, seq), generator=g)
        losses = []
        for model, opt in zip((ref, ours), opts):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss)
        assert float(losses[1]) == pytest.approx(float(losses[0]), rel=1e-5), step
        for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
            if a.grad is not None:
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        ours.load_state_dict(ref.state_dict())   # the same weights at every step: compare the step itself
    layers = len(cfg.model["layer_types"])
    assert calls.count("fwd") == 3 * layers and calls.count("bwd") == 3 * layers


def test_nothing_of_size_s_by_s_is_kept_for_the_backward():
    """Under the kernel the attention saves q, kv, the compressed kv, the picks, the output and one
    logsumexp per row; the dense path keeps [B, H, S, S + T] probabilities. No tensor saved for the
    backward of the patched model has two extents of at least S (the vocabulary, 512, and the mHC
    streams, 4 x 256, are below it)."""
    seq = 1536
    cfg = _cfg(seq)
    model = build_model(cfg.model, seed=0)
    dense = copy.deepcopy(model)
    apply(model, sparse_plan(model, seq))
    ids = torch.randint(0, cfg.model["vocab_size"], (1, seq))

    def square_saves(m) -> list[tuple[int, ...]]:
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            m(input_ids=ids, labels=ids).loss.backward()
        return [s for s in shapes if sum(e >= seq for e in s) >= 2]

    assert square_saves(dense)   # the dense attention's scores and probabilities
    assert square_saves(model) == []
    # nor is the model's dense [B, 1, S, S] window mask built: its layers get none
    masks = []
    for m in model.modules():
        if isinstance(m, v4.DeepseekV4Attention):
            m.register_forward_pre_hook(lambda mod, a, k: masks.append(k.get("attention_mask")), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)
    assert masks == [None] * len(cfg.model["layer_types"])


def test_what_the_kernel_does_not_compute_stays_on_the_reference(monkeypatch):
    """A padding mask, a cache (generation) or a dtype without a kernel: the dense reference lines run
    (with the compressor's picks turned back into its block bias), and the outputs are the
    unpatched model's."""
    seq = 160
    cfg = _cfg(seq)
    ref = build_model(cfg.model, seed=0)
    ours = copy.deepcopy(ref)
    apply(ours, sparse_plan(ours, seq))
    calls = _kernel_calls(monkeypatch)
    ids = torch.randint(0, cfg.model["vocab_size"], (2, seq))
    padding = torch.ones(2, seq, dtype=torch.long)
    padding[1, :7] = 0
    with torch.no_grad():
        for kwargs in ({"attention_mask": padding}, {"use_cache": True}):
            torch.testing.assert_close(ours(input_ids=ids, **kwargs).logits, ref(input_ids=ids, **kwargs).logits)
        assert calls == []
        with torch.autocast("cpu", dtype=torch.bfloat16):   # bf16 calls: the plan has fp32 kernels only
            torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits)
        assert calls == []
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        assert calls.count("fwd") == len(cfg.model["layer_types"])


def test_the_indexer_kl_objective_reads_its_attention_mass_from_the_kernel(monkeypatch):
    """The indexer's KL alignment needs the main attention's probability on the compressed entries:
    under the kernel it comes from the kernel's logsumexp, not from dense weights, and the KL loss
    and the indexer's gradients are the dense model's."""
    from trainer.objectives import IndexerAlignment

    seq = 160
    cfg = _cfg(seq)
    ref = build_model(cfg.model, seed=0)
    ours = copy.deepcopy(ref)
    apply(ours, sparse_plan(ours, seq))
    ids = torch.randint(0, cfg.model["vocab_size"], (2, seq))
    losses, grads = [], []
    for model in (ref, ours):
        aligner = IndexerAlignment(model, 1.0)
        calls = _kernel_calls(monkeypatch)
        model(input_ids=ids)
        loss = aligner.loss()
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and ".indexer." in n})
        aligner.remove()
        monkeypatch.undo()
    assert calls.count("fwd") == len(cfg.model["layer_types"])   # every layer ran the kernel, the csa ones too
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert grads[0] and grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert not any("aurakernel_wants_compressed_mass" in m.__dict__ for m in ours.modules())   # removed with it


def test_the_attention_mass_on_the_picks_matches_the_picked_rows_scores_in_any_block_of_rows():
    """compressed_mass scores every entry a block of query rows at a time and keeps the picks: the
    same mass as scoring each picked key row (a repeat and a -1 count nothing), whatever the block, and
    an entry that is not picked adds nothing even where its score is far above the logsumexp."""
    from aurakernel.patch.sparse_attention import compressed_mass

    gen = torch.Generator().manual_seed(3)
    batch, heads, seq, dim, entries, k = 2, 3, 11, 8, 9, 4
    q = torch.randn(batch, heads, seq, dim, generator=gen)
    ckv = torch.randn(batch, entries, dim, generator=gen)
    ckv[:, -1] = 400 * q[:, 0].mean(dim=(0, 1))[None]   # scores of e^100 and more where it is not picked
    indices = torch.randint(0, entries - 1, (batch, seq, k), generator=gen).sort(-1).values
    indices[0, 2, 0] = -1
    indices[1, 5, :2] = indices[1, 5, 2]                  # one entry picked three times
    lse = torch.randn(batch, heads, seq, generator=gen) + 3
    valid = (indices >= 0) & torch.cat([torch.ones_like(indices[..., :1], dtype=torch.bool),
                                        indices[..., 1:] != indices[..., :-1]], -1)
    safe = indices.clamp_min(0)
    rows = torch.gather(ckv.unsqueeze(1).expand(-1, seq, -1, -1), 2, safe.unsqueeze(-1).expand(-1, -1, -1, dim))
    mass = (torch.einsum("bhsd,bskd->bhsk", q, rows) * 0.3 - lse.unsqueeze(-1)).exp().sum(1) * valid
    expected = torch.zeros(batch, seq, entries).scatter_add_(-1, safe, mass).unsqueeze(1)
    for block in (1, 2 * heads * entries * 3, 1 << 24):
        got = compressed_mass(q, ckv, indices, lse, 0.3, block_floats=block)
        assert got.shape == (batch, 1, seq, entries) and torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_4096_token_sequence_trains_on_the_kernel(tmp_path, monkeypatch):
    """Two optimizer steps of the tiny model on 4096-token sequences with the sparse attention
    swapped in: the dense attention's [1, 4, 4096, 5120] scores never exist; the loss is finite and
    every layer's attention ran the kernel, forward and backward."""
    from trainer.train import train

    seq = 4096
    cfg = _cfg(seq)
    plan = sparse_plan(build_model(cfg.model, seed=0), seq)
    apply(build_model(cfg.model, seed=0), plan)   # admitted (rebuilt, re-verified) now: not counted below
    calls = _kernel_calls(monkeypatch)
    result = train(cfg, kernels=plan, steps=2, show_progress=False, log_path=str(tmp_path / "log.jsonl"))
    run = result["runs"]["aurakernel"]
    assert len(run["losses"]) == 2 and all(torch.isfinite(torch.tensor(run["losses"])))
    layers = len(cfg.model["layer_types"])
    assert calls.count("fwd") == 2 * layers and calls.count("bwd") == 2 * layers, " ".join(calls)
