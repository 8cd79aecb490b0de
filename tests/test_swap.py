"""Swapping kernels into DeepseekV4ForCausalLM: same training as the reference, honest reports."""

import collections
import copy
import json

import pytest
import torch

from aurakernel import apply
from aurakernel.targets.host.build import build_kernel
from aurakernel.dtypes import DType
from aurakernel.ops import get_op
from aurakernel.ops.base import Problem
from aurakernel.planfile import KernelPlan, PlanEntry
from aurakernel.swap import deepseek_v4_sites
from trainer.config import load_config
from trainer.data import TokenBatches
from trainer.model import build_model
from trainer.train import loss_fn, make_run, train_step

from conftest import TINY
from aurakernel.targets.host.ops import kernel_of as host_kernel
from aurakernel.patch.deepseek_v4 import patch_of

def plan_for(model, dtypes=("fp32",), skip_cols=(), ops=None):
    """A plan with a buildable kernel for every site of the model (knobs from the planner, no timing)."""
    from aurakernel.hardware import host_profile
    from aurakernel.planner import solve_tiling

    hw = host_profile()
    c = model.config
    per_call = {"rope": [(c.head_dim, c.qk_rope_head_dim), (c.index_head_dim, c.qk_rope_head_dim)],
                # the experts' two grouped projections: gate_up, then down
                "grouped_linear": [(c.hidden_size, 2 * c.moe_intermediate_size), (c.moe_intermediate_size, c.hidden_size)]}
    wanted = []
    for site in deepseek_v4_sites(model):
        keys = per_call.get(site.op, [site.kernel_key])
        wanted += [(site, k) for k in keys]
    entries, seen = [], set()
    for site, kernel_key in wanted:
        if ops is not None and site.op not in ops:
            continue
        for dt in dtypes:
            key = (site.op, site.variant, kernel_key, dt)
            if kernel_key is None or key in seen or (kernel_key and kernel_key[-1] in skip_cols):
                continue
            seen.add(key)
            spec = get_op(site.op)
            lead = {"rope": (64, 2), "compressor": (1, 16), "indexer_score": (1, 16),
                    "attn_softmax": (1, 4, 16, 20), "grouped_linear": (64, c.n_routed_experts)}.get(site.op, (64,))
            shape_tail = (8,) if site.op == "indexer_score" else ()
            shape = (*lead, *kernel_key, *shape_tail)
            if site.op == "sparse_attention":   # heads, head_dim, window, extra around the batch and sequence
                shape = (1, kernel_key[0], 160, *kernel_key[1:])
            problem = Problem(site.op, site.variant, shape, DType.parse(dt))
            knobs = solve_tiling(host_kernel(spec).tiling_problem(problem, hw), op=site.op, variant=site.variant,
                                 shape=problem.shape, dtype=dt, target="host").knobs
            kernel = build_kernel(spec, problem, knobs)
            entries.append(PlanEntry(site.op, site.variant, list(kernel_key), dt, problem.shape_text,
                                     knobs, kernel.source_hash))
    return KernelPlan(target="host", kernels=entries)


@pytest.fixture(scope="module")
def cfg():
    c = load_config(TINY)
    c.data.seq_len, c.data.batch_size = 160, 2   # long enough for one HCA window (128)
    return c


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_fp32_loss_and_gradients_match_reference_over_three_steps(cfg):
    """Along the reference's 3-step AdamW trajectory, the swapped model (given the same weights at
    each step) computes the same loss and the same gradient for every parameter."""
    ref_model = build_model(cfg.model, seed=0)
    ours = copy.deepcopy(ref_model)
    report = apply(ours, plan_for(ours))
    assert len(report.swapped) == len(deepseek_v4_sites(ours)) and not report.rejected
    run = make_run("ref", ref_model, cfg)
    batches = TokenBatches("synthetic", None, cfg.data.seq_len, cfg.data.batch_size, 512, seed=0)
    for step in range(3):
        ours.load_state_dict(ref_model.state_dict())
        input_ids, labels = next(batches)
        losses = []
        for model in (ref_model, ours):
            loss = loss_fn(model, input_ids, labels)
            loss.backward()
            losses.append(float(loss.detach()))
        assert losses[1] == pytest.approx(losses[0], rel=1e-5), step
        for (name, a), (_, b) in zip(ref_model.named_parameters(), ours.named_parameters()):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                assert relative_error(b.grad, a.grad) < 1e-3, (step, name)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)


def test_free_running_training_tracks_the_reference(cfg):
    """Trained side by side, the two runs' losses stay together. (Their weights drift apart at the
    rounding level: AdamW's normalised update turns any difference on a near-zero gradient, e.g.
    1e-9 vs -1e-9, into a full step either way; the reference does the same between thread counts.)"""
    ref_model = build_model(cfg.model, seed=0)
    ours = copy.deepcopy(ref_model)
    apply(ours, plan_for(ours))
    runs = [make_run("ref", ref_model, cfg), make_run("ours", ours, cfg)]
    batches = TokenBatches("synthetic", None, cfg.data.seq_len, cfg.data.batch_size, 512, seed=0)
    for _ in range(3):
        batch = next(batches)
        losses = [train_step(run, batch, cfg)[0] for run in runs]
        assert losses[1] == pytest.approx(losses[0], rel=1e-3)


def test_bf16_autocast_training_is_as_accurate_as_the_reference(cfg):
    """Under bf16 autocast the reference itself is off from fp32 math by up to tens of percent on
    some gradients, so ours is held to the reference's own accuracy: per step, the loss agrees and
    the gradients are no further from an fp32 computation (at the same weights) than the reference's."""
    cfg.train.dtype = "bf16"
    ref_model = build_model(cfg.model, seed=0)
    ours = copy.deepcopy(ref_model)
    apply(ours, plan_for(ours, dtypes=("fp32", "bf16")))
    runs = [make_run("ref", ref_model, cfg), make_run("ours", ours, cfg)]
    batches = TokenBatches("synthetic", None, cfg.data.seq_len, cfg.data.batch_size, 512, seed=0)
    for _ in range(3):
        input_ids, labels = next(batches)
        golds = []   # fp32 math at each run's own current weights
        for run in runs:
            golds.append(copy.deepcopy(run.model))
            loss_fn(golds[-1], input_ids, labels).backward()
        losses = []
        for run in runs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(run.model, input_ids, labels)
            loss.backward()
            losses.append(float(loss.detach()))
        assert losses[1] == pytest.approx(losses[0], rel=1e-2)
        pairs = [(a.grad, b.grad, ga.grad, gb.grad) for a, b, ga, gb in zip(
            ref_model.parameters(), ours.parameters(), golds[0].parameters(), golds[1].parameters())
            if ga.grad is not None]
        flat = [torch.cat([p[i].flatten().double() for p in pairs]) for i in range(4)]
        ref_err, our_err = relative_error(flat[0], flat[2]), relative_error(flat[1], flat[3])
        assert our_err <= 1.5 * ref_err + 0.01, (our_err, ref_err)
        # tensor by tensor (tiny gradients are chaotic in bf16): ours is typically no worse
        ratios = sorted((relative_error(b, gb) + 1e-3) / (relative_error(a, ga) + 1e-3) for a, b, ga, gb in pairs)
        assert ratios[len(ratios) // 2] <= 1.5, ratios
        for run in runs:
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)


def test_report_names_what_stays_on_the_reference(cfg):
    model = build_model(cfg.model, seed=0)
    plan = plan_for(model, skip_cols=(cfg.model["hidden_size"],))
    report = apply(model, plan)
    left = [r for r in report.reference if "extents [256]" in r["reason"]]
    assert left, report.reference
    assert all(r["op"] == "rms_norm" for r in left)
    # every site is either swapped or on the reference with a reason, never silently dropped
    assert len(report.swapped) + len(report.reference) == len(deepseek_v4_sites(model))


def test_tampered_or_broken_plan_entries_are_rejected(cfg, tmp_path):
    model = build_model(cfg.model, seed=0)
    plan = plan_for(model)
    plan.kernels[0].source_hash = "0" * 20            # not the source that was verified
    plan.kernels[1].knobs["tile_rows"] = -3           # not a valid kernel (rendered, but another source)
    path = plan.save(tmp_path / "plan.json")
    report = apply(model, str(path))
    reasons = " | ".join(r["reason"] for r in report.rejected)
    assert len(report.rejected) == 2
    assert "the entry's knobs do not match its hash" in reasons
    # the modules whose kernel was rejected run the reference
    rejected_keys = {tuple(r["kernel_key"]) for r in report.rejected}
    for r in report.reference:
        assert "no verified" in r["reason"]
    assert rejected_keys


def test_dispatch_falls_back_for_unverified_dtype(cfg):
    """A bf16 input reaching a module whose plan has only fp32 kernels runs the reference."""
    model = build_model(cfg.model, seed=0)
    apply(model, plan_for(model, dtypes=("fp32",)))
    norm = model.model.norm
    x = torch.randn(3, cfg.model["hidden_size"], dtype=torch.bfloat16)
    calls = []
    original = norm._ak_reference_forward
    norm._ak_reference_forward = lambda t: calls.append(t) or original(t)
    norm(x)
    assert len(calls) == 1
    norm(x.float())
    assert len(calls) == 1


def test_plan_file_errors_are_clear(tmp_path):
    from aurakernel.errors import UserError

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        KernelPlan.load(bad)
    bad.write_text(json.dumps({"format": 99, "kernels": []}))
    with pytest.raises(UserError, match="not an AuraKernel plan"):
        KernelPlan.load(bad)
    entry = {"op": "rms_norm", "variant": "weighted", "kernel_key": [64], "dtype": "bf16", "shape": "8x64",
             "knobs": {"tile_rows": 8}, "source_hash": "x"}
    for plan, fragment in [
        ({"kernels": [], "typo": 1}, "unknown key(s) typo: a plan has"),
        ({"kernels": {}}, "'kernels' must be a list of entries"),
        ({"kernels": [3]}, "kernels[0]: expected an object"),
        ({"kernels": [{**entry, "knobs": []}]}, "kernels[0]: knobs must map knob names to integers, got []"),
        ({"kernels": [{**entry, "knobs": {"tile_rows": "8"}}]}, "kernels[0]: expected an integer, got '8'"),
        ({"kernels": [{**entry, "kernel_key": 64}]}, "kernels[0]: kernel_key must be a list of integers"),
        ({"kernels": [{**entry, "extra": 1}]}, "kernels[0]: unknown key(s) extra"),
        ({"kernels": [{k: v for k, v in entry.items() if k != "dtype"}]}, "kernels[0]: missing dtype"),
    ]:
        bad.write_text(json.dumps({"format": 1, "target": "host", **plan}))
        with pytest.raises(UserError) as exc:
            KernelPlan.load(bad)
        assert fragment in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    bad.write_text(json.dumps({"format": 1, "target": "host", "kernels": [entry]}))
    assert KernelPlan.load(bad).kernels[0].knobs == {"tile_rows": 8}


def test_fused_adamw_matches_torch_adamw_over_steps(cfg, host):
    """The trainer's optimizer through the adamw kernel: same weights and states as torch's AdamW
    after several steps on every parameter of the tiny model, and a compatible state_dict."""
    from aurakernel.patch.adamw import FusedAdamW
    from aurakernel.planner import solve_tiling

    spec = get_op("adamw")
    problem = Problem("adamw", "default", (65536,), DType.fp32)
    knobs = solve_tiling(host_kernel(spec).tiling_problem(problem, host), op="adamw", variant="default", shape=problem.shape,
                         dtype="fp32", target="host").knobs
    kernel = build_kernel(spec, problem, knobs)
    ref_model = build_model(cfg.model, seed=0)
    ours = copy.deepcopy(ref_model)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), foreach=False, **hyper)
    our_opt = FusedAdamW(ours.parameters(), kernel=kernel.source_hash, **hyper)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        for a, b in zip(ref_model.parameters(), ours.parameters()):
            grad = torch.randn(a.shape, generator=g) * 0.01
            a.grad, b.grad = grad.clone(), grad.clone()
        ref_opt.step()
        our_opt.step()
    for (name, a), (_, b) in zip(ref_model.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    ref_state, our_state = ref_opt.state_dict()["state"], our_opt.state_dict()["state"]
    assert ref_state.keys() == our_state.keys()
    for k in ref_state:
        torch.testing.assert_close(our_state[k]["exp_avg_sq"], ref_state[k]["exp_avg_sq"], atol=1e-9, rtol=1e-5)
        assert float(our_state[k]["step"]) == float(ref_state[k]["step"]) == 4


def test_fused_adamw_batches_its_tensors_and_leaves_the_rest_to_torch(monkeypatch):
    """One kernel call per group and step count for the fp32 tensors (tiny ones share the threads'
    blocks with large ones), torch's AdamW for a bf16 parameter and a non-contiguous one, nothing for a
    parameter without a gradient (its step count falls behind, as torch's does): weights, states and
    step counts all as torch's AdamW, over 4 steps with a group added after 2."""
    from aurakernel.patch.adamw import FusedAdamW
    from aurakernel.targets.host.library import Kernel

    kernel = build_kernel(get_op("adamw"), Problem("adamw", "default", (4096,), DType.fp32), {"tile_rows": 1, "threads": 2})
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (1025,), (64, 33), (7, 5)]
    base = [torch.randn(s, generator=g) for s in shapes] + [torch.randn(16, generator=g).bfloat16(),
                                                            torch.randn(6, 4, generator=g).t(), torch.randn(5, generator=g)]
    ours, ref = ([torch.nn.Parameter(t.clone()) for t in base] for _ in range(2))
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    our_opt = FusedAdamW(ours[:-1], kernel=kernel.source_hash, **hyper)
    ref_opt = torch.optim.AdamW(ref[:-1], foreach=False, **hyper)
    calls = []
    call = Kernel.call
    monkeypatch.setattr(Kernel, "call", lambda k, name, *a: (calls.append((name, a[0][:, 4].tolist())), call(k, name, *a))[1])
    for step in range(4):
        if step == 2:   # a parameter joins the group late: its steps count from here
            our_opt.add_param_group({"params": [ours[-1]]}), ref_opt.add_param_group({"params": [ref[-1]]})
        for i, (a, b) in enumerate(zip(ours, ref)):
            grad = None if i == 3 and step == 1 else torch.randn(a.shape, generator=g).to(a.dtype) * 0.01
            a.grad = None if grad is None else grad.clone()
            b.grad = None if grad is None else grad.clone()
        our_opt.step(), ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(our_opt.state.values(), ref_opt.state.values()):
        assert float(a["step"]) == float(b["step"])
    # a call per group, step and step count: (7, 5) has no gradient at step 1, so it counts a step less
    # from then on; the late group's parameter joins at step 2
    big, late, behind = [3, 1025, 64 * 33], [5], [35]
    assert {c[0] for c in calls} == {"update_many"}
    assert [c[1] for c in calls] == [big + behind, big, big, behind, late, big, behind, late]


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_fused_adamw_clips_gradients_as_torch_does_inside_its_step(monkeypatch, max_norm):
    """FusedAdamW.clip_grad_norm_ + step against torch's clip_grad_norm_ + AdamW over 3 steps, clipping
    (max_norm below the norm) or not: the same norms, weights and states. The clip is one kernel call
    for the norm and no pass for the scaling (the step reads each gradient times the coefficient):
    per step the kernel is called for the norm and the update and nothing else, and p.grad is left
    as backward wrote it. A gradient changed between the clip and the step is refused (it would be
    scaled by another gradient's norm); zero_grad drops a pending clip."""
    from aurakernel.patch.adamw import FusedAdamW
    from aurakernel.targets.host.library import Kernel

    kernel = build_kernel(get_op("adamw"), Problem("adamw", "default", (4096,), DType.fp32), {"tile_rows": 1, "threads": 2})
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=g) for s in [(3,), (1025,), (64, 33), (4096, 3)]]
    ours, ref = ([torch.nn.Parameter(t.clone()) for t in base] for _ in range(2))
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    our_opt = FusedAdamW(ours, kernel=kernel.source_hash, **hyper)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **hyper)
    calls = []
    call = Kernel.call
    monkeypatch.setattr(Kernel, "call", lambda k, name, *a: (calls.append(name), call(k, name, *a))[1])
    for _ in range(3):
        grads = [torch.randn(t.shape, generator=g) * 0.01 for t in base]
        for a, b, grad in zip(ours, ref, grads):
            a.grad, b.grad = grad.clone(), grad.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        our_norm = our_opt.clip_grad_norm_(max_norm)
        torch.testing.assert_close(our_norm, ref_norm, rtol=1e-6, atol=0)
        assert all(torch.equal(a.grad, grad) for a, grad in zip(ours, grads))   # scaled only as the step reads them
        our_opt.step(), ref_opt.step()
    assert (float(ref_norm) > max_norm) == (max_norm < 1)   # the small max_norm clips, the large one does not
    assert calls == ["grad_sumsq", "update_many"] * 3
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(our_opt.state.values(), ref_opt.state.values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], atol=1e-9, rtol=1e-5)
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], atol=1e-12, rtol=1e-5)

    our_opt.clip_grad_norm_(max_norm)
    ours[1].grad.add_(1.0)   # another backward's accumulation after the clip
    before = [t.detach().clone() for t in ours]
    with pytest.raises(RuntimeError, match="gradients changed between clip_grad_norm_ and step"):
        our_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, before))   # nothing updated
    our_opt.zero_grad()
    for a in ours:
        a.grad = torch.ones_like(a)
    our_opt.step()   # no error: zero_grad dropped the clip (a pending one would refuse these new gradients)

    ours[0].grad = torch.full_like(ours[0], float("nan"))   # a non-finite norm: torch's error where asked for
    with pytest.raises(RuntimeError, match="non-finite"):
        our_opt.clip_grad_norm_(max_norm, error_if_nonfinite=True)
    assert torch.isnan(our_opt.clip_grad_norm_(max_norm))


def test_fused_adamw_clip_is_torchs_own_where_a_gradient_is_not_the_kernels():
    """A bf16 parameter's gradient (or any the kernel does not read as it is) makes clip_grad_norm_
    torch's own call, which scales the gradients in place; the step then scales nothing more."""
    from aurakernel.patch.adamw import FusedAdamW

    kernel = build_kernel(get_op("adamw"), Problem("adamw", "default", (4096,), DType.fp32), {"tile_rows": 1, "threads": 2})
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(300, generator=g), torch.randn(16, generator=g).bfloat16()]
    ours, ref = ([torch.nn.Parameter(t.clone()) for t in base] for _ in range(2))
    our_opt = FusedAdamW(ours, kernel=kernel.source_hash, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref, foreach=False, lr=1e-2)
    for a, b in zip(ours, ref):
        grad = torch.randn(a.shape, generator=g).to(a.dtype)
        a.grad, b.grad = grad.clone(), grad.clone()
    torch.testing.assert_close(our_opt.clip_grad_norm_(0.1), torch.nn.utils.clip_grad_norm_(ref, 0.1))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours, ref))   # scaled in place, as torch does
    our_opt.step(), ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_experts_dispatch_is_bitwise_the_reference(dtype):
    """The swiglu patch also installs the experts' forward of four swappable calls, whose torch code
    gathers rows by index_select (its backward an index_add_ rather than a sorting index_put_) and
    weights the rows after gathering them: outputs and every gradient stay bitwise equal."""
    model = build_model(load_config(TINY).model, seed=0)
    experts = model.model.layers[1].mlp.experts
    ours = copy.deepcopy(experts)
    patch_of(get_op("swiglu")).patch(ours, lambda key, dt: None)   # no gate kernel: only the dispatch differs
    assert "forward" in vars(ours)
    g = torch.Generator().manual_seed(0)
    tokens, e, k = 300, experts.num_experts, 2
    x = torch.randn(tokens, experts.hidden_dim, generator=g).to(dtype).requires_grad_(True)
    idx = torch.rand(tokens, e, generator=g).topk(k, dim=-1).indices
    w = torch.rand(tokens, k, generator=g).requires_grad_(True)
    dy = torch.randn(tokens, experts.hidden_dim, generator=g).to(dtype)
    results = []
    for mod in (experts, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = mod(x, idx, w)
        results.append([y, *torch.autograd.grad(y, [x, w, mod.gate_up_proj, mod.down_proj], dy)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)



def _kernels_match_the_reference(model, ops: set, ids, monkeypatch) -> collections.Counter:
    """A copy of `model` with the kernels of `ops` applied (every one swapped in): its loss and every
    gradient match the model's; returns the kernel entries the copy called, by (template, entry)."""
    from aurakernel.targets.host.library import Kernel

    ours = copy.deepcopy(model)
    report = apply(ours, plan_for(ours, ops=ops))
    assert {s["op"] for s in report.swapped} == ops and not report.rejected
    calls = collections.Counter()
    call = Kernel.call
    monkeypatch.setattr(Kernel, "call", lambda k, name, *a: calls.update([(k.source.template, name)]) or call(k, name, *a))
    results = []
    for m in (model, ours):
        loss = m(input_ids=ids, labels=ids).loss
        results.append([loss, *torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)])
    for a, b in zip(*results, strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    return calls


@pytest.mark.parametrize("ops", [{"grouped_linear"}, {"grouped_linear", "swiglu"}, {"moe_permute"}, {"moe_unpermute"},
                                 {"moe_permute", "grouped_linear", "swiglu", "moe_unpermute"}])
def test_the_routed_experts_run_their_kernels_alone_or_together(ops, monkeypatch):
    """The experts' forward is four calls a kernel may take: the dispatch (moe_permute), the two
    grouped projections (transformers' _grouped_linear), the gate between them (swiglu) and the
    combine (moe_unpermute); any of them alone or all together, loss and every gradient match the
    reference's, and the profiler sees the problems of all of them."""
    from aurakernel.profiler import problems_of_forward

    model = build_model(load_config(TINY).model, seed=0)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    tokens, k = 2 * 64, c.num_experts_per_tok
    seen = collections.defaultdict(set)
    for p in problems_of_forward(model, ids):
        seen[p.op].add(p.shape)
    assert seen["grouped_linear"] == {(tokens * k, c.n_routed_experts, c.hidden_size, 2 * c.moe_intermediate_size),
                                      (tokens * k, c.n_routed_experts, c.moe_intermediate_size, c.hidden_size)}
    assert seen["moe_permute"] == {(tokens, c.n_routed_experts, k, c.hidden_size)}
    assert seen["moe_unpermute"] == {(tokens, k, c.hidden_size)}
    calls = _kernels_match_the_reference(model, ops, ids, monkeypatch)
    moe_layers = len(c.mlp_layer_types)   # every FFN is an MoE (hash-routed or top-k)
    per_layer = {"grouped_linear": 2, "moe_permute": 1, "moe_unpermute": 1}
    for op in ops & set(per_layer):
        assert calls[(f"host/{op}.c.j2", "fwd")] == calls[(f"host/{op}.c.j2", "bwd")] == per_layer[op] * moe_layers, op


def test_the_grouped_output_projection_runs_the_block_linear_kernel(monkeypatch):
    """Every attention's grouped output projection (DeepseekV4GroupedLinear, a batched GEMM of its
    own, which linear leaves alone) takes the block_linear kernel: the profiler sees its problem, a
    call each way per layer, loss and every gradient match the reference's."""
    from aurakernel.profiler import problems_of_forward

    model = build_model(load_config(TINY).model, seed=0)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    group_in = c.num_attention_heads * c.head_dim // c.o_groups
    assert {p.shape for p in problems_of_forward(model, ids) if p.op == "block_linear"} == {
        (2 * 64, c.o_groups, group_in, c.o_lora_rank)}
    calls = _kernels_match_the_reference(model, {"block_linear"}, ids, monkeypatch)
    layers = c.num_hidden_layers
    assert calls[("host/block_linear.c.j2", "fwd")] == calls[("host/block_linear.c.j2", "bwd")] == layers


def test_an_input_read_by_two_patched_projections_gets_its_gradients_summed_in_place():
    """Several projections read one input (a layer's normalised hidden states): their kernels hand
    autograd dx as tensors of their own, not views, so it adds the second to the first in place
    (aten::add_) instead of allocating the sum (aten::add: one more tensor and pass a consumer)."""
    from torch.profiler import profile

    from aurakernel.patch.linear import OP

    spec = get_op("linear")
    problem = Problem("linear", "default", (4 * 64, 32, 48), DType.fp32)
    kernel = build_kernel(spec, problem, planned_knobs(problem))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 32, generator=g, requires_grad=True)
    w1, w2 = (torch.randn(48, 32, generator=g) for _ in range(2))
    loss = OP(x, w1, kernel.source_hash).square().sum() + OP(x, w2, kernel.source_hash).sum()
    with profile(record_shapes=True) as prof:
        loss.backward()
    adds = {e.key for e in prof.key_averages(group_by_input_shape=True)
            if e.key in ("aten::add", "aten::add_") and e.input_shapes[:1] == [[4, 64, 32]]}
    assert adds == {"aten::add_"}
    torch.testing.assert_close(x.grad, (2 * (x @ w1.T)) @ w1 + torch.ones(4, 64, 48) @ w2, rtol=1e-4, atol=1e-4)

def planned_knobs(problem: Problem, **fixed) -> dict:
    """The host planner's knobs for `problem` with `fixed` ones set (linear_cross_entropy's fp32 builds
    add their GEMMs' blocking to the chunk, sweep and thread knobs)."""
    from aurakernel.hardware import host_profile
    from aurakernel.targets.host.target import TARGET

    return {**TARGET.plan(get_op(problem.op), problem, host_profile(), target="host").knobs, **fixed}


def _linear_loss_plan(model, tokens: int, dtype: str = "fp32") -> KernelPlan:
    c = model.config
    spec = get_op("linear_cross_entropy")
    problem = Problem("linear_cross_entropy", "default", (tokens, c.hidden_size, c.vocab_size), DType.parse(dtype))
    knobs = planned_knobs(problem, chunk_rows=64, col_chunk=256, threads=2)   # several chunks a step
    kernel = build_kernel(spec, problem, knobs)
    return KernelPlan(target="host", kernels=[PlanEntry("linear_cross_entropy", "default", [c.hidden_size, c.vocab_size],
                                                        dtype, problem.shape_text, knobs, kernel.source_hash)])


def test_fused_linear_loss_matches_the_lm_head_and_loss_in_loss_and_gradients(cfg):
    """The LM head and the loss fused (chunks of 64 tokens, the logits never whole): along the
    reference's 3-step AdamW trajectory the same loss, the same gradient of the hidden states (the
    LM head's input) and of the LM head weight, and of every other parameter."""
    from aurakernel.patch import linear_cross_entropy as lce

    ref_model = build_model(cfg.model, seed=0)
    ours = copy.deepcopy(ref_model)
    report = apply(ours, _linear_loss_plan(ours, cfg.data.seq_len * cfg.data.batch_size))
    assert report.linear_loss_kernel(ours.config.hidden_size, ours.config.vocab_size, torch.float32) is not None
    run = make_run("ref", ref_model, cfg)
    batches = TokenBatches("synthetic", None, cfg.data.seq_len, cfg.data.batch_size, 512, seed=0)
    hidden = {}
    for model in (ref_model, ours):
        model.model.register_forward_hook(
            lambda mod, args, out, model=model: hidden.__setitem__(id(model), out.last_hidden_state) or
            out.last_hidden_state.retain_grad())
    calls = []
    real = lce.linear_cross_entropy
    for step in range(3):
        ours.load_state_dict(ref_model.state_dict())
        input_ids, labels = next(batches)
        losses = []
        for model in (ref_model, ours):
            try:
                lce.linear_cross_entropy = lambda *a: calls.append(1) or real(*a)
                loss = loss_fn(model, input_ids, labels, report if model is ours else None)
            finally:
                lce.linear_cross_entropy = real
            loss.backward()
            losses.append(float(loss.detach()))
        assert losses[1] == pytest.approx(losses[0], rel=1e-5), step
        assert relative_error(hidden[id(ours)].grad, hidden[id(ref_model)].grad) < 1e-4, step
        assert relative_error(ours.lm_head.weight.grad, ref_model.lm_head.weight.grad) < 1e-4, step
        for (name, a), (_, b) in zip(ref_model.named_parameters(), ours.named_parameters()):
            if a.grad is not None:
                assert relative_error(b.grad, a.grad) < 1e-3, (step, name)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
    assert len(calls) == 3   # the fused kernel ran, once a step


def test_the_tiny_model_trains_with_the_fused_linear_loss_like_without(cfg, tmp_path):
    from trainer.train import train

    c = copy.deepcopy(cfg)
    c.data.seq_len, c.data.batch_size, c.train.log = 64, 2, None
    plan = _linear_loss_plan(build_model(c.model, seed=0), c.data.seq_len * c.data.batch_size)
    path = plan.save(tmp_path / "plan.json")
    result = train(c, kernels=str(path), steps=3, compare=True, show_progress=False)
    assert any(s.startswith("linear_cross_entropy") for s in result["apply"]["loss"])
    ref, ours = result["runs"]["reference"]["losses"], result["runs"]["aurakernel"]["losses"]
    assert len(ours) == 3 and ours == pytest.approx(ref, rel=1e-4)


def test_fused_linear_loss_reuses_its_residuals_and_refuses_a_second_backward():
    """Eager calls scale the saved gradients in place (the weight gradient exists once at the peak):
    the gradients are the reference's for any loss gradient, and a second backward through the same
    graph is an error, never a gradient scaled twice."""
    from aurakernel.patch.linear_cross_entropy import linear_cross_entropy

    spec = get_op("linear_cross_entropy")
    problem = Problem("linear_cross_entropy", "default", (50, 32, 300), DType.fp32)
    kernel = build_kernel(spec, problem, planned_knobs(problem, chunk_rows=16, col_chunk=128, threads=2)).source_hash
    inputs = spec.make_inputs(problem, 0)
    ours = {k: inputs[k].clone().requires_grad_() for k in ("hidden", "weight")}
    ref = {k: inputs[k].clone().requires_grad_() for k in ("hidden", "weight")}
    loss = linear_cross_entropy(ours["hidden"], ours["weight"], inputs["labels"], kernel)
    (loss * 0.375).backward(retain_graph=True)
    (spec.reference(problem, {**ref, "labels": inputs["labels"]})["loss"] * 0.375).backward()
    for k in ours:
        torch.testing.assert_close(ours[k].grad, ref[k].grad, rtol=1e-4, atol=1e-7)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss * 0.375).backward()


def _count_backward_calls(monkeypatch) -> collections.Counter:
    """Calls of each kernel's backward entry from now on, by symbol (a backward runs once per call,
    where a checkpointed forward runs twice)."""
    from aurakernel.targets.host.library import Kernel

    backward = collections.Counter()
    call = Kernel.call
    monkeypatch.setattr(Kernel, "call", lambda k, name, *a: backward.update([k.entries[name].symbol] * (name == "bwd"))
                        or call(k, name, *a))
    return backward


@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_layers_last_update_runs_fused_with_the_next_layers_hyperconnection(checkpointing, monkeypatch):
    """mhc_post of one decoder layer with mhc_pre of the next: where both layers run the fused update,
    the first's last stream update runs on the mhc_post_pre kernel together with the next layer's
    attention HyperConnection, and the model's forward hands the result across. A forward of L layers
    then runs the fused kernel 2L - 1 times, mhc_post's alone once (the last layer's) and mhc_pre's
    once (the first layer's attention, besides the head's); loss and every gradient match the
    reference. Under transformers' checkpointing switch (which may be reentrant: a tensor handed
    across layers would get no gradient) the layers stay apart (L fused calls) and still match."""
    model = build_model(load_config(TINY).model, seed=0)
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    ours = copy.deepcopy(model)
    assert not apply(ours, plan_for(ours, ops={"mhc_post", "mhc_pre", "mhc_post_pre"})).rejected
    backward = _count_backward_calls(monkeypatch)
    results = []
    for m in (model, ours):
        loss = m(input_ids=ids, labels=ids).loss
        results.append([loss, *torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)])
    for a, b in zip(*results, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    apart = layers if checkpointing else 1
    assert backward["ak_mhc_post_pre_bwd"] == 2 * layers - apart
    assert backward["ak_mhc_post_bwd"] == backward["ak_mhc_bwd"] == apart


def test_sharded_layers_make_their_own_hyperconnection(tmp_path, monkeypatch):
    """Under FSDP2 a layer's parameters are gathered only for its own forward, so a layer whose last
    update ran fused with the next layer's HyperConnection would read that layer's shards: with the
    layers sharded (one rank, gloo) each makes its own (L fused calls, not 2L - 1), and the loss is the
    unsharded patched model's."""
    import torch.distributed as dist
    from trainer.train import shard

    model = build_model(load_config(TINY).model, seed=0)
    assert not apply(model, plan_for(model, ops={"mhc_post", "mhc_pre", "mhc_post_pre"})).rejected
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    expected = float(model(input_ids=ids, labels=ids).loss)
    backward = _count_backward_calls(monkeypatch)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        shard(model)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        dist.destroy_process_group()
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert backward["ak_mhc_post_pre_bwd"] == model.config.num_hidden_layers
