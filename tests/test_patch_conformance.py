"""A patched model keeps the promises the unpatched one makes: a module whose configuration a
kernel's math does not cover stays on the reference (and the report says why), and activation
checkpointing still recomputes every layer, through the kernels, with the same loss and gradients."""

import collections
import copy
import json

import pytest
import torch

from aurakernel import apply
from aurakernel.targets.host.library import Kernel
from aurakernel.errors import UserError
from trainer import train as tt
from trainer.config import load_config
from trainer.data import TokenBatches
from trainer.model import build_model

from conftest import TINY
from test_swap import plan_for
from aurakernel.targets.host.ops import kernel_of as host_kernel


def _cfg():
    cfg = load_config(TINY)
    cfg.data.seq_len, cfg.data.batch_size = 160, 2   # one HCA window (128): every kernel runs
    return cfg


@pytest.mark.parametrize("override,op,fragment", [
    ({"hidden_act": "gelu"}, "swiglu", "hidden_act is GELUActivation"),
    ({"scoring_func": "sigmoid"}, "router", "scoring_func is Sigmoid"),
    ({"hc_sinkhorn_iters": 7}, "mhc_pre", "hc_sinkhorn_iters 7"),
    ({"hc_sinkhorn_iters": 7}, "mhc_post_pre", "hc_sinkhorn_iters 7"),   # the layer's fused update + FFN mhc_pre
    # the norms' epsilon, under either of its transformers names (the unweighted norm's `eps` became
    # `variance_epsilon` in 5.25): large enough that the rms_norm kernels computing with another would
    # miss the reference's logits
    ({"rms_norm_eps": 0.5}, "mhc_pre", "rms_norm_eps 0.5"),
])
def test_a_config_the_kernel_does_not_compute_stays_on_the_reference(override, op, fragment):
    cfg = _cfg()
    plan = plan_for(build_model(cfg.model, 0))   # kernels for the tiny config's widths
    model = build_model({**cfg.model, **override}, 0)
    reference = copy.deepcopy(model)
    report = apply(model, plan)
    refused = [r for r in report.reference if r["op"] == op]
    assert refused and all(fragment in r["reason"] for r in refused), report.reference
    assert {s["op"] for s in report.swapped} >= {"rms_norm", "rope", "attn_softmax"}   # the rest still swapped
    ids = torch.randint(0, cfg.model["vocab_size"], (2, 160), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_a_norms_epsilon_is_read_under_the_name_of_the_installed_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4UnweightedRMSNorm

    from aurakernel.patch.rms_norm import norm_eps

    assert norm_eps(DeepseekV4UnweightedRMSNorm(eps=0.25)) == 0.25
    legacy = torch.nn.Module()   # transformers 5.24's unweighted norm: the epsilon is `eps`
    legacy.eps = 0.125
    assert norm_eps(legacy) == 0.125


def test_a_changed_transformers_forward_is_not_replaced_by_a_stale_copy(monkeypatch):
    """The compressors' and the decoder layer's patched forwards re-implement transformers' code:
    when the installed transformers' source of one differs from the one copied, that module runs
    the reference (its kernels still run inside it where they can) and the report says why."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    from aurakernel.patch import install

    cfg = _cfg()
    plan = plan_for(build_model(cfg.model, 0), ops=("compressor", "mhc_post", "rms_norm"))
    upstream = v4.DeepseekV4HCACompressor.forward

    def forward(self, *args, **kwargs):   # an upstream change: the same behaviour, another source
        return upstream(self, *args, **kwargs)

    monkeypatch.setattr(v4.DeepseekV4HCACompressor, "forward", forward)
    install.source_hash.cache_clear()
    try:
        model = build_model(cfg.model, 0)
        reference = copy.deepcopy(model)
        report = apply(model, plan)
    finally:
        install.source_hash.cache_clear()
    hca = {n for n, m in model.named_modules() if isinstance(m, v4.DeepseekV4HCACompressor)}
    refused = [r for r in report.reference if r["module"] in hca]
    assert hca and len(refused) == len(hca)
    assert all("DeepseekV4HCACompressor.forward is not the source this patch re-implements" in r["reason"]
               for r in refused)
    assert all("forward" not in model.get_submodule(n).__dict__ for n in hca)   # the class's own forward runs
    swapped = {s["module"] for s in report.swapped if s["op"] == "compressor"}
    assert swapped and not swapped & hca   # the CSA compressor and the indexer keep their kernels
    ids = torch.randint(0, cfg.model["vocab_size"], (2, 160), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_patch_deepseek_v4_patches_every_model_built_while_active_and_survives_save_load(tmp_path):
    """The class-level entry point (Liger's apply_liger_kernel_to_<model>): every model built while
    it is active, by its constructor or from_pretrained, is patched once (the outermost model); a
    patched model saves and loads back to the same logits; models built after undo are not patched."""
    import aurakernel
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4RMSNorm

    cfg = _cfg()
    plan = plan_for(build_model(cfg.model, 0))
    reference = build_model(cfg.model, 0)
    ids = torch.randint(0, cfg.model["vocab_size"], (2, 160), generator=torch.Generator().manual_seed(0))
    expected = reference(input_ids=ids).logits
    with pytest.raises(UserError, match="apply takes a kernel plan"):
        aurakernel.patch_deepseek_v4(42)
    with aurakernel.patch_deepseek_v4(plan) as patched:
        model = build_model(cfg.model, 0)
        assert len(patched.reports) == 1 and not patched.reports[0].rejected
        assert {s["op"] for s in patched.reports[0].swapped} >= {"rms_norm", "mhc_pre", "mhc_post", "swiglu", "rope"}
        model.save_pretrained(tmp_path / "saved")
        loaded = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
        assert len(patched.reports) == 2
    norms = [m for m in loaded.modules() if isinstance(m, DeepseekV4RMSNorm)]
    assert norms and all("forward" in m.__dict__ for m in norms)   # patched on the instance
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    after = build_model(cfg.model, 0)
    assert len(patched.reports) == 2
    assert not any("forward" in m.__dict__ for m in after.modules() if isinstance(m, DeepseekV4RMSNorm))


@pytest.mark.parametrize("how", ["transformers", "torch.utils.checkpoint"])
def test_activation_checkpointing_recomputes_patched_layers_through_the_kernels(how, monkeypatch):
    cfg = _cfg()
    input_ids, labels = next(TokenBatches.from_config(cfg.data, cfg.model["vocab_size"], seed=0))
    plan = plan_for(build_model(cfg.model, 0))
    calls = collections.Counter()
    call = Kernel.call

    def counting(kernel, name, *args):
        calls[(kernel.source.template, name)] += 1
        return call(kernel, name, *args)

    monkeypatch.setattr(Kernel, "call", counting)
    results = []
    for checkpointed in (False, True):
        model = build_model(cfg.model, 0).train()
        report = apply(model, plan)
        assert not report.reference and not report.rejected
        if checkpointed:
            if how != "transformers":
                model.supports_gradient_checkpointing = False   # the trainer's fallback for models without the switch
            tt.enable_activation_checkpointing(model)
        calls.clear()
        layer_calls = []
        model.model.layers[0].mlp.register_forward_hook(lambda *_: layer_calls.append(1))
        loss = tt.loss_fn(model, input_ids, labels)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads, len(layer_calls), dict(calls)))
    (plain_loss, plain_grads, plain_layer, plain_calls), (ckpt_loss, ckpt_grads, ckpt_layer, ckpt_calls) = results
    assert (plain_layer, ckpt_layer) == (1, 2)   # the patched layer was recomputed in backward
    # the recompute ran the layers' kernels again (rope is a module-level function the patched attention
    # calls, the sparse attention its own), none fell back
    for template in ("host/rope.c.j2", "host/sparse_attention.c.j2", "host/swiglu.c.j2"):
        assert ckpt_calls[(template, "fwd")] == 2 * plain_calls[(template, "fwd")], template
        assert ckpt_calls[(template, "bwd")] == plain_calls[(template, "bwd")], template
    # mhc_post, the decoder layer's own forward, recomputed once a call: only the last layer's update runs
    # apart, the others fused with the next layer's mhc_pre; under transformers' switch (which may be
    # reentrant, where a tensor handed across layers gets no gradient) every layer's runs apart
    apart = cfg.model["num_hidden_layers"] if how == "transformers" else 1
    mhc_post = "host/mhc_post.c.j2"
    assert ckpt_calls[(mhc_post, "fwd")] == 2 * ckpt_calls[(mhc_post, "bwd")] == 2 * apart
    assert plain_calls[(mhc_post, "fwd")] == plain_calls[(mhc_post, "bwd")] == 1
    assert ckpt_loss == pytest.approx(plain_loss, rel=1e-6)
    assert plain_grads.keys() == ckpt_grads.keys()
    for name, g in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, rtol=1e-5, atol=1e-6)


def test_apply_takes_a_plan_dict_and_refuses_anything_else():
    cfg = _cfg()
    plan = plan_for(build_model(cfg.model, 0))
    report = apply(build_model(cfg.model, 0), json.loads(json.dumps(plan.to_dict())))   # as json.load gives it
    assert report.swapped and not report.rejected and not report.reference
    with pytest.raises(UserError, match="a KernelPlan, its dict or a plan file path"):
        apply(build_model(cfg.model, 0), 42)


def test_apply_to_a_model_initialised_on_the_meta_device_and_admissions_are_cached(monkeypatch):
    from transformers import DeepseekV4ForCausalLM

    from aurakernel import swap
    from trainer.model import model_config

    cfg = _cfg()
    plan = plan_for(build_model(cfg.model, 0))
    monkeypatch.setattr(swap, "_ADMISSIONS", {})   # re-verify here, with meta as the default device
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(model_config(cfg.model))
        report = apply(model, plan)   # re-verification runs its kernels on CPU tensors
    assert report.swapped and not report.rejected and not report.reference
    assert next(model.parameters()).device.type == "meta"
    verified = []
    monkeypatch.setattr(swap, "verify", lambda *a, **k: verified.append(a))
    again = apply(build_model(cfg.model, 0), plan)   # another model, same plan: nothing rebuilt or re-verified
    assert not verified and len(again.swapped) == len(report.swapped)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "a user's grouped_mm"])
def test_the_models_experts_implementation_is_kept(implementation, monkeypatch):
    """The swiglu patch replaces the gate inside whatever experts implementation the model uses
    (transformers' eager / batched_mm, or a grouped_mm a user registered), never the implementation."""
    from transformers.integrations import moe

    cfg = _cfg()
    plan = plan_for(build_model(cfg.model, 0))
    model = build_model(cfg.model, 0)
    used = []
    if implementation == "a user's grouped_mm":
        def users_grouped_mm(self, *args, **kwargs):
            used.append(implementation)
            return moe.grouped_mm_experts_forward(self, *args, **kwargs)
        monkeypatch.setitem(moe.ExpertsInterface._global_mapping, "grouped_mm", users_grouped_mm)
    else:
        model.set_experts_implementation(implementation)
        original = moe.ExpertsInterface._global_mapping.get(implementation)
        if original is not None:   # eager is the class's own forward, not in the mapping
            monkeypatch.setitem(moe.ExpertsInterface._global_mapping, implementation,
                                lambda self, *a, **k: used.append(implementation) or original(self, *a, **k))
    reference = copy.deepcopy(model)
    report = apply(model, plan)
    assert any(s["op"] == "swiglu" for s in report.swapped)
    gates = []
    experts = next(m for m in model.modules() if type(m).__name__ == "DeepseekV4Experts")
    gate = experts._apply_gate
    experts._apply_gate = lambda gate_up: gates.append(1) or gate(gate_up)   # the kernel's gate, spied on
    ids = torch.randint(0, cfg.model["vocab_size"], (2, 160), generator=torch.Generator().manual_seed(0))
    used.clear()
    out = model(input_ids=ids).logits
    assert gates, "the swiglu kernel ran inside the experts"
    if implementation != "eager":
        assert used, f"{implementation} was bypassed"
    torch.testing.assert_close(out, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("knob,value", [("threads", 0), ("col_chunk", 0), ("tile_rows", 10**9)])
def test_a_plan_with_a_knob_outside_its_domain_is_refused_before_anything_is_built(knob, value):
    """A plan file is untrusted input: an edited knob with its source hash recomputed to match is
    refused with a line naming the knob, and nothing is built or run with it."""
    from aurakernel.codegen import render
    from aurakernel.dtypes import DType, parse_shape
    from aurakernel.ops import get_op
    from aurakernel.ops.base import Problem

    cfg = _cfg()
    plan = plan_for(build_model(cfg.model, 0), ops={"rms_norm"})
    entry = plan.kernels[0]
    spec = get_op(entry.op)
    entry.knobs[knob] = value
    problem = Problem(entry.op, entry.variant, parse_shape(entry.shape), DType.parse(entry.dtype))
    entry.source_hash = render(host_kernel(spec).template(), host_kernel(spec).render_params(problem, entry.knobs)).hash
    report = apply(build_model(cfg.model, 0), plan)
    rejected = [r for r in report.rejected if r["kernel_key"] == entry.kernel_key]
    assert len(rejected) == 1 and f"knob {knob}={value} is outside rms_norm's domain" in rejected[0]["reason"]


def test_tune_missing_tunes_the_widths_a_plan_lacks_and_the_model_still_computes_the_same(tmp_path, monkeypatch):
    """A plan tuned on one model's widths, applied to a wider model: without tune_missing the new
    widths stay on the reference (and the report says which extents are missing); with it they are
    tuned here, recorded in the DB, swapped in, and the extended plan serves the next model as is.
    Whether a kernel is swapped in is the measurement's call (one slower than eager is not), and at
    these tiny widths a noisy machine can go either way: the timing is held fixed here, so what is
    checked is the plan's extension, not the machine's load."""
    from aurakernel.db import TuningDB
    from aurakernel.swap import deepseek_v4_sites
    from aurakernel.targets.host import target as host_target

    monkeypatch.setattr(host_target, "measure_problem", lambda *a, **k: ({"aurakernel": 1.0, "eager": 2.0}, {}, {}))

    cfg = _cfg()
    plan = plan_for(build_model(cfg.model, 0), ops={"rms_norm"})
    wider = {**cfg.model, "hidden_size": 192}
    reference = build_model(wider, 0)
    before = apply(build_model(wider, 0), plan)
    missing = [r for r in before.reference if r["op"] == "rms_norm"]
    assert missing and all("extents" in r["reason"] for r in missing) and not before.tuned

    model = build_model(wider, 0)
    db = tmp_path / "tuning.sqlite"
    report = apply(model, plan, tune_missing={"rms_norm"}, db_path=db)
    assert {(t["op"], t["shape"].split("x")[-1]) for t in report.tuned} == {("rms_norm", "192"), ("rms_norm", "768")}
    assert all(t["status"] == "ok" for t in report.tuned), report.tuned
    assert not [r for r in report.reference if r["op"] == "rms_norm"]
    assert len(report.plan.kernels) == len(plan.kernels) + 2 and len(TuningDB(db).frame()) == 2
    ids = torch.randint(0, cfg.model["vocab_size"], (2, 160))
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)

    again = apply(build_model(wider, 0), report.plan, tune_missing=True, db_path=db)
    assert [t for t in again.tuned if t["op"] == "rms_norm"] == []   # covered now: nothing tuned again
    assert len([s for s in again.swapped if s["op"] == "rms_norm"]) == \
        len([s for s in deepseek_v4_sites(model) if s.op == "rms_norm"])
    with pytest.raises(UserError, match="accepted are"):
        apply(build_model(wider, 0), plan, tune_missing={"layer_norm"})
    with torch.device("meta"):
        from transformers import DeepseekV4ForCausalLM
        from trainer.model import model_config
        on_meta = DeepseekV4ForCausalLM(model_config(wider))
    with pytest.raises(UserError, match="meta device"):
        apply(on_meta, plan, tune_missing=True)


def test_a_layers_stream_update_and_ffn_hyperconnection_run_as_one_fused_kernel(monkeypatch):
    """With mhc_post_pre in the plan, each decoder layer's first stream update and its FFN's
    HyperConnection run as one kernel call forward and one backward, and so do each layer's last
    update and the next layer's attention HyperConnection (2L - 1 calls); the loss and every gradient
    are the unpatched model's, and the state dict keeps its keys (the fused modules hold the layers'
    HyperConnections outside the module tree, so checkpoints load either way)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    cfg = _cfg()
    model = build_model(cfg.model, 0).train()
    reference = copy.deepcopy(model)
    report = apply(model, plan_for(model, ops=("mhc_post_pre",)))
    layers = sorted(n for n, m in model.named_modules() if isinstance(m, DeepseekV4DecoderLayer))
    assert sorted(s["module"] for s in report.swapped if s["op"] == "mhc_post_pre") == layers
    assert not report.rejected
    assert model.state_dict().keys() == reference.state_dict().keys()

    calls = collections.Counter()
    call = Kernel.call

    def counting(kernel, name, *args):
        calls[(kernel.meta.get("fused_post", False), name)] += 1
        return call(kernel, name, *args)

    monkeypatch.setattr(Kernel, "call", counting)
    ids = torch.randint(0, cfg.model["vocab_size"], (2, 160), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (model, reference):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    assert calls[(True, "fwd")] == calls[(True, "bwd")] == 2 * len(layers) - 1
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_linear_takes_the_plain_projections_not_the_grouped_one():
    """linear patches every bias-free torch.nn.Linear that computes x W^T, and never V4's grouped
    output projection (an nn.Linear subclass whose forward is a batched GEMM over head groups: run
    as x W^T it returns the wrong shape); a bias or autocast keeps a call on torch's GEMM."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

    from aurakernel.ops import get_op
    from aurakernel.patch.deepseek_v4 import patch_of, sites

    model = build_model(_cfg().model, 0)
    linear = {s.name for s in sites(model) if s.op == "linear"}
    grouped = [n for n, m in model.named_modules() if isinstance(m, DeepseekV4GroupedLinear)]
    assert grouped and not linear & set(grouped)
    assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.o_b_proj", "lm_head"} <= linear
    patch = patch_of(get_op("linear"))
    with pytest.raises(TypeError, match="not a plain torch.nn.Linear"):
        patch.patch(model.get_submodule(grouped[0]), lambda key, dtype: "0" * 20)
    x = torch.randn(3, 8)
    assert patch.call_problem(torch.nn.Linear(8, 4, bias=False), (x,)).shape == (3, 8, 4)
    assert patch.call_problem(torch.nn.Linear(8, 4), (x,)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert patch.call_problem(torch.nn.Linear(8, 4, bias=False), (x,)) is None
