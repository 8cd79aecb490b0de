import json

import pytest

from aurakernel.agent import problems_from_profile
from aurakernel.profiler import profile_training
from trainer.config import load_config
from trainer.train import workload

from conftest import TINY


@pytest.fixture(scope="module")
def report():
    cfg = load_config(TINY)
    cfg.data.seq_len, cfg.data.batch_size = 160, 2
    return cfg, profile_training(workload(cfg), steps=1, warmup=1)


def test_groups_cover_the_step(report):
    cfg, rep = report
    names = {g.name for g in rep.groups}
    assert {"rms_norm", "mhc_pre", "mhc_post", "attention", "router", "moe_experts", "matmul", "adamw",
            "cross_entropy"} <= names
    assert sum(g.share for g in rep.groups) == pytest.approx(1.0, abs=1e-6)
    assert all(g.time_us >= 0 for g in rep.groups)
    norm = next(g for g in rep.groups if g.name == "rms_norm")
    # 4 layers x (input, post-attention, q_a, kv, q_b per-head, 2 mHC input norms) + compressor/indexer norms
    # + the final norm and hc_head input norm
    assert norm.calls >= 4 * 7 + 2 and norm.tunable and norm.saving_basis == "planned"


def test_ranked_by_estimated_saving(report):
    _, rep = report
    savings = [g.saving_us for g in rep.groups if g.saving_us is not None]
    assert savings == sorted(savings, reverse=True)


def test_norm_shapes_match_the_config(report):
    cfg, rep = report
    m = cfg.model
    tokens = cfg.data.seq_len * cfg.data.batch_size
    problems = {(p.variant, p.shape[1]): p.shape[0] for p in problems_from_profile(rep) if p.op == "rms_norm"}
    assert problems[("weighted", m["hidden_size"])] == tokens
    assert problems[("weighted", m["q_lora_rank"])] == tokens
    assert problems[("unweighted", m["hc_mult"] * m["hidden_size"])] == tokens
    assert problems[("unweighted", m["head_dim"])] == tokens * m["num_attention_heads"]


def test_json_and_chart(report, tmp_path):
    _, rep = report
    data = json.loads(rep.save_json(tmp_path / "p.json").read_text())
    assert data["groups"][0]["name"] and data["step_us"] > 0
    png = rep.save_chart(tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_every_operator_of_the_library_is_found(report):
    """Autotune can only tune what the profile records: every op appears as a problem."""
    from aurakernel.ops import OPS

    _, rep = report
    assert {p.op for p in problems_from_profile(rep)} == set(OPS)


def test_a_fused_kernel_is_listed_beside_the_ops_it_fuses_and_not_counted_twice(report):
    """mhc_post_pre computes a layer's first stream update with the FFN's mhc_pre: the profile lists its
    problem in the mhc_post group (so autotune tunes it), once per layer call, but the group's planned
    time is mhc_post's alone (mhc_pre's part is planned in its own group)."""
    from aurakernel.dtypes import DType
    from aurakernel.hardware import load_profile
    from aurakernel.ops.base import Problem
    from aurakernel.profiler import _planned_us

    cfg, rep = report
    group = next(g for g in rep.groups if g.name == "mhc_post")
    calls = {s["op"]: s["calls"] for s in group.shapes}
    assert calls == {"mhc_post": cfg.model["num_hidden_layers"], "mhc_post_pre": cfg.model["num_hidden_layers"]}
    post = next(s for s in group.shapes if s["op"] == "mhc_post")
    planned = _planned_us(Problem("mhc_post", "default", tuple(post["shape"]), DType.parse(post["dtype"])),
                          load_profile("host")) * post["calls"]
    assert group.saving_basis == "planned"
    assert group.saving_us == pytest.approx(max(0.0, group.time_us - planned))


@pytest.mark.parametrize("fused_us,kept", [(3000.0, True), (3200.0, False)])
def test_autotune_keeps_a_fused_kernel_only_where_it_beats_its_parts_apart(fused_us, kept):
    """mhc_post_pre against mhc_post + mhc_pre tuned at the same shape, timed side by side (3100 us
    apart): slower or no faster, it leaves the plan with the reason; the parts' entries stay either
    way. The tuned results' own times (from separate runs) decide nothing."""
    from aurakernel.agent import _drop_fusions_not_faster_than_apart, plan_entry
    from aurakernel.dtypes import DType
    from aurakernel.ops.base import Problem
    from aurakernel.planfile import KernelPlan
    from aurakernel.planner.tiling import Plan
    from aurakernel.targets.result import TuneResult

    def result(op, us):
        problem = Problem(op, "default", (1024, 4, 256), DType.fp32)
        plan = Plan(op, "default", problem.shape, "fp32", "host", {"threads": 2}, us, {}, "-", "highs", 0.0, "ok")
        return TuneResult(problem, "host", plan, f"hash-{op}", None, measured_us=us, eager_us=10 * us)

    # measured apart, the fused kernel would look slower (or faster) than it is
    tuned = [result("mhc_post", 500.0), result("mhc_pre", 1000.0), result("mhc_post_pre", 4000.0 if kept else 100.0)]
    asked = []

    def time_apart(r, parts):
        asked.append((r.source_hash, {op: p.source_hash for op, p in parts.items()}))
        return {"fused": fused_us, "apart": 3100.0}

    plan, skipped = KernelPlan(target="host", kernels=[plan_entry(r) for r in tuned]), []
    _drop_fusions_not_faster_than_apart(plan, tuned, skipped, time_apart)
    assert asked == [("hash-mhc_post_pre", {"mhc_post": "hash-mhc_post", "mhc_pre": "hash-mhc_pre"})]
    assert tuned[2].against_apart == {"fused": fused_us, "apart": 3100.0}   # what autotune prints beside the plan
    assert {e.op for e in plan.kernels} == ({"mhc_post", "mhc_pre"} | ({"mhc_post_pre"} if kept else set()))
    if kept:
        assert skipped == []
    else:
        assert [s["op"] for s in skipped] == ["mhc_post_pre"]
        assert "not faster than mhc_post + mhc_pre apart (3200.0 us vs 3100.0 us, timed side by side)" in skipped[0]["reason"]
    # a target that times nothing here (Ascend) keeps the fused kernel: nothing to compare
    plan, skipped = KernelPlan(target="host", kernels=[plan_entry(r) for r in tuned]), []
    _drop_fusions_not_faster_than_apart(plan, tuned, skipped, lambda r, parts: None)
    assert skipped == [] and len(plan.kernels) == 3
