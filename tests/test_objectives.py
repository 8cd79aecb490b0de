"""The objectives that train what the LM loss cannot: aux-loss-free expert balancing (router
correction bias) and the lightning indexer's KL alignment; on the plain model and with kernels."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

from aurakernel import apply
from aurakernel.targets.host.build import build_kernel
from aurakernel.dtypes import DType
from aurakernel.hardware import host_profile
from aurakernel.ops import get_op
from aurakernel.ops.base import Problem
from aurakernel.planfile import KernelPlan, PlanEntry
from aurakernel.planner import solve_tiling
from aurakernel.swap import deepseek_v4_sites
from trainer.config import load_config
from trainer.model import build_model
from trainer.objectives import ExpertBalancer, IndexerAlignment, indexer_kl, params_without_grad, selection_mask

from conftest import TINY
from aurakernel.targets.host.ops import kernel_of as host_kernel

SEQ, BATCH = 128, 1   # 128: one HCA window (ratio 128), so every parameter can get a gradient
GAMMA = 1e-3


@pytest.fixture(scope="module")
def base():
    cfg = load_config(TINY)
    model = build_model(cfg.model, 0)
    model.train()
    c = model.config
    entries = SEQ // c.compress_rates["compressed_sparse_attention"]
    assert c.index_topk < entries, "the CSA indexer must actually drop entries at this length"
    return model


def batch(seed: int, vocab: int = 512):
    """SEQ inputs and their SEQ next tokens (the last position is the one that sees the HCA entry)."""
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, ids, **kwargs):
    logits = model(input_ids=ids[:, :-1], **kwargs).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def indexer_param_names(model):
    return {n for n, _ in model.named_parameters() if ".indexer." in n}


def plan_for(model, ops, only=lambda site: True):
    """A plan with a buildable fp32 kernel for each site of `ops` that `only` keeps (planner knobs,
    no timing)."""
    hw = host_profile()
    entries, seen = [], set()
    for site in deepseek_v4_sites(model):
        key = (site.op, site.variant, site.kernel_key)
        if site.op not in ops or site.kernel_key is None or key in seen or not only(site):
            continue
        seen.add(key)
        spec = get_op(site.op)
        lead = {"compressor": (1, 16), "indexer_score": (1, 16), "attn_softmax": (1, 4, 16, 20)}.get(site.op, (64,))
        tail = (8,) if site.op == "indexer_score" else ()
        problem = Problem(site.op, site.variant, (*lead, *site.kernel_key, *tail), DType.fp32)
        knobs = solve_tiling(host_kernel(spec).tiling_problem(problem, hw), op=site.op, variant=site.variant,
                             shape=problem.shape, dtype="fp32", target="host").knobs
        kernel = build_kernel(spec, problem, knobs)
        entries.append(PlanEntry(site.op, site.variant, list(site.kernel_key), "fp32", problem.shape_text,
                                 knobs, kernel.source_hash))
    return KernelPlan(target="host", kernels=entries)


def capture_router_inputs(model):
    """Router inputs per top-k router, to recount the selection by hand."""
    seen, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, DeepseekV4TopKRouter):
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: seen.setdefault(name, []).append(args[0].detach())))
    return seen, handles


def manual_counts(router, inputs):
    """The reference router's top-k selection, recomputed from its inputs, as per-expert counts."""
    total = torch.zeros(router.num_experts, dtype=torch.long)
    for x in inputs:
        scores = ACT2FN["sqrtsoftplus"](F.linear(x.reshape(-1, router.hidden_dim), router.weight.detach()))
        idx = torch.topk(scores + router.e_score_correction_bias, router.top_k, dim=-1).indices
        total += torch.bincount(idx.reshape(-1), minlength=router.num_experts)
    return total


def randomize_bias(model, seed):
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, DeepseekV4TopKRouter):
            m.e_score_correction_bias.copy_(torch.randn(m.num_experts, generator=g) * 0.01)


def check_balancer_step(model, balancer, seeds):
    """Run training forwards (the counting happens there), check the counts against a hand count,
    apply update(), check the bias step."""
    inputs, handles = capture_router_inputs(model)
    for seed in seeds:
        model(input_ids=batch(seed)[:, :-1])
    for h in handles:
        h.remove()
    counts = balancer.counts()
    assert set(counts) == set(inputs)
    for name, c in counts.items():
        router = balancer.routers[name]
        assert torch.equal(c, manual_counts(router, inputs[name]))
        assert int(c.sum()) == len(seeds) * BATCH * SEQ * router.top_k
    loads = balancer.loads()
    old = {n: r.e_score_correction_bias.clone() for n, r in balancer.routers.items()}
    metrics = balancer.update()
    assert metrics == loads   # one rank: the all-reduced loads are this rank's
    for name, c in counts.items():
        load, mean = c.double(), c.double().mean()
        over, under = load > mean, load < mean
        assert over.any() and under.any()
        expected = old[name] + torch.where(over, torch.tensor(-GAMMA), torch.where(under, torch.tensor(GAMMA), 0.0))
        assert torch.equal(balancer.routers[name].e_score_correction_bias, expected)
        assert metrics[name] == pytest.approx(float(load.max() / mean)) and metrics[name] > 1.0
    assert all(int(c.sum()) == 0 for c in balancer.counts().values()) and balancer.loads() == {}   # reset
    return counts


def test_balancer_counts_and_bias_step_plain_model(base):
    model = copy.deepcopy(base)
    randomize_bias(model, 1)   # a nonzero bias, so the hand count must take it into account
    hash_tables = {n: m.tid2eid.clone() for n, m in model.named_modules() if isinstance(m, DeepseekV4HashRouter)}
    assert hash_tables
    balancer = ExpertBalancer(model, gamma=GAMMA)
    assert set(balancer.routers) == {f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)}   # layer 0 is hash-routed

    with torch.no_grad():   # an evaluation forward is not a training step's load
        model(input_ids=batch(9)[:, :-1])
    assert all(int(c.sum()) == 0 for c in balancer.counts().values())

    check_balancer_step(model, balancer, seeds=(1, 2))   # two micro-batches summed
    check_balancer_step(model, balancer, seeds=(3,))     # the next step selects with the moved bias
    for name, m in model.named_modules():
        if isinstance(m, DeepseekV4HashRouter):
            assert torch.equal(m.tid2eid, hash_tables[name]) and not hasattr(m, "e_score_correction_bias")
    balancer.remove()


def test_balancer_with_router_kernels_swapped_in(base, monkeypatch):
    """aurakernel patches the routers' forward; the hooks read the outputs, so counts and bias steps
    are the plain model's exactly."""
    import aurakernel.patch.router as router_op

    plain = copy.deepcopy(base)
    randomize_bias(plain, 2)
    ours = copy.deepcopy(plain)
    report = apply(ours, plan_for(ours, ops=("router",)))
    routers = {n for n, m in ours.named_modules() if isinstance(m, DeepseekV4TopKRouter | DeepseekV4HashRouter)}
    assert {s["module"] for s in report.swapped} == routers and not report.rejected
    assert all("forward" in m.__dict__ for n, m in ours.named_modules() if n in routers)   # patched in place
    calls = []
    real_route = router_op.route
    monkeypatch.setattr(router_op, "route", lambda *a, **k: calls.append(1) or real_route(*a, **k))

    b_plain, b_ours = ExpertBalancer(plain, gamma=GAMMA), ExpertBalancer(ours, gamma=GAMMA)
    counts_plain = check_balancer_step(plain, b_plain, seeds=(5,))
    counts_ours = check_balancer_step(ours, b_ours, seeds=(5,))
    assert len(calls) == 4   # every router call went through the kernel (4 routers)
    assert all(torch.equal(counts_plain[n], counts_ours[n]) for n in counts_plain)
    for n in b_plain.routers:
        assert torch.equal(b_plain.routers[n].e_score_correction_bias, b_ours.routers[n].e_score_correction_bias)


def test_alignment_trains_exactly_the_indexer(base):
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    ids = batch(0)
    lm_plain = lm_loss(plain, ids)
    lm_plain.backward()
    # first, without the alignment: the LM loss leaves exactly the indexers' parameters untrained
    names = indexer_param_names(plain)
    assert len(names) == 12   # 6 per CSA layer, 2 CSA layers
    assert set(params_without_grad(plain)) == names

    align = IndexerAlignment(ours)
    assert set(align.layers) == {"model.layers.1.self_attn", "model.layers.3.self_attn"}
    lm = lm_loss(ours, ids)
    assert torch.equal(lm, lm_plain)   # detaching the indexer's inputs changes nothing for the LM loss
    kl = align.loss()
    assert kl.requires_grad and float(kl.detach()) > 0 and set(align.last) == set(align.layers)
    assert not align.records   # consumed

    kl.backward()   # the KL alone: gradients on exactly the indexer's parameters
    touched = {n for n, p in ours.named_parameters() if p.grad is not None}
    assert touched == names
    assert all(bool(p.grad.ne(0).any()) for n, p in ours.named_parameters() if n in names)
    kl_grads = {n: p.grad.clone() for n, p in ours.named_parameters() if n in names}

    lm.backward()   # then the LM loss: every other gradient is the plain model's, bit for bit
    plain_params = dict(plain.named_parameters())
    for n, p in ours.named_parameters():
        if n in names:
            assert torch.equal(p.grad, kl_grads[n]) and plain_params[n].grad is None
        else:
            assert torch.equal(p.grad, plain_params[n].grad), n
    assert params_without_grad(ours) == []   # LM loss + KL: every parameter is trained
    align.remove()


def test_kl_is_zero_iff_indexer_matches_the_attention(base):
    # by hand: p = [3, 1] / 4 on the selection, q = softmax([0, 0]); the unselected entry is ignored
    scores = torch.tensor([[[0.0, 0.0, 9.0]]])
    selected = torch.tensor([[[True, True, False]]])
    mass = torch.tensor([[[3.0, 1.0, 5.0]]])
    assert float(indexer_kl(scores, selected, mass)) == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    picks = torch.tensor([[[2, -1, 0]]])   # the indexer's -1: a pick that is not causally visible
    assert selection_mask(picks, 4).tolist() == [[[True, False, True, False]]]

    model = copy.deepcopy(base)
    align = IndexerAlignment(model)
    model(input_ids=batch(3)[:, :-1])
    records = list(align.records)
    assert [r[0] for r in records] == list(align.layers)
    total, g = 0.0, torch.Generator().manual_seed(0)
    for _, scores, selected, mass in records:
        b, s, t = scores.shape
        assert selected.shape == mass.shape == (b, s, t) and t == SEQ // 4
        assert int(selected.sum(-1).max()) == model.config.index_topk
        # the slice is the attention over compressed entries: no mass outside the indexer's selection
        assert float(mass.masked_fill(selected, 0).abs().max()) == 0.0
        assert bool((mass.sum(-1)[selected.any(-1)] > 0).all())
        p = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
        # an indexer whose scores are log p (+ any per-query shift, + anything off the selection)
        matched = torch.where(selected, torch.log(p.clamp_min(1e-30)) + torch.randn(b, s, 1, generator=g),
                              torch.randn(b, s, t, generator=g))
        assert abs(float(indexer_kl(matched, selected, mass))) < 1e-5
        kl = float(indexer_kl(scores, selected, mass).detach())
        assert kl > 1e-4
        total += kl
    assert float(align.loss().detach()) == pytest.approx(total, rel=1e-6)
    with pytest.raises(RuntimeError, match="no forward"):
        align.loss()   # consumed; a missing forward is an error, not a silent 0
    with torch.no_grad():
        model(input_ids=batch(4)[:, :-1])
    assert not align.records   # no_grad forwards are not captured
    align.remove()


def test_alignment_with_indexer_and_attention_kernels(base, monkeypatch):
    """With the indexer (pooling and scorer) and the attention softmax swapped in, the captured
    KL and its indexer gradients are the plain model's."""
    import aurakernel.patch.indexer_score as score_op

    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    # the compressor kernel only for the indexer's pooling (the CSA/HCA compressors stay reference: less to build)
    report = apply(ours, plan_for(ours, ops=("indexer_score", "attn_softmax", "compressor"),
                                  only=lambda site: site.op != "compressor" or site.name.endswith(".indexer")))
    swapped = {(s["module"], s["op"]) for s in report.swapped}
    assert not report.rejected
    assert {("model.layers.1.self_attn.compressor.indexer.scorer", "indexer_score"),
            ("model.layers.1.self_attn.compressor.indexer", "compressor"), ("model", "attn_softmax")} <= swapped
    calls = []
    real_fwd = score_op._fwd
    monkeypatch.setattr(score_op, "_fwd", lambda *a: calls.append(1) or real_fwd(*a))

    ids, results = batch(7), []
    for model in (plain, ours):
        align = IndexerAlignment(model)
        # use_cache=False: the training path aurakernel's compressor kernels take
        loss = lm_loss(model, ids, use_cache=False) + align.loss()
        loss.backward()
        assert params_without_grad(model) == []
        results.append((float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if ".indexer." in n}))
        align.remove()
    assert len(calls) == 2   # both CSA layers' scores came from the kernel
    (loss_plain, g_plain), (loss_ours, g_ours) = results
    assert loss_ours == pytest.approx(loss_plain, rel=1e-4)
    for n in g_plain:
        rel = float((g_ours[n] - g_plain[n]).norm() / g_plain[n].norm())
        assert rel < 1e-3, n


def test_the_objectives_hooks_compile_into_one_graph_and_record_what_eager_records(base):
    """A user compiles the model with both objectives attached: their hooks trace (fullgraph: a
    graph break fails), and the compiled forward counts the same experts and captures the same KL as
    the eager one; under no_grad the compiled forward records nothing."""
    ids = batch(4)[:, :-1]
    results = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        balancer, align = ExpertBalancer(model, gamma=GAMMA), IndexerAlignment(model)
        torch._dynamo.reset()
        run = torch.compile(model, fullgraph=True, backend="eager") if compiled else model
        with torch.no_grad():
            run(input_ids=ids)
        assert all(int(c.sum()) == 0 for c in balancer.counts().values()) and not align.records
        run(input_ids=ids)
        results.append((balancer.counts(), float(align.loss().detach())))
        balancer.remove()
        align.remove()
    (eager_counts, eager_kl), (compiled_counts, compiled_kl) = results
    assert eager_counts.keys() == compiled_counts.keys() and eager_counts
    for name, c in eager_counts.items():
        assert int(c.sum()) > 0 and torch.equal(compiled_counts[name], c), name
    assert compiled_kl == pytest.approx(eager_kl, rel=1e-5) and eager_kl > 0
