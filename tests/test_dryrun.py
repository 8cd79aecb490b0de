"""Dry run of the real DeepSeek-V4 configs: counts against the official totals, FSDP memory scaling,
and no weights allocated (the model lives on the meta device)."""

import io
import json
import resource
from functools import lru_cache

import pytest
from rich.console import Console
from rich.table import Table

from aurakernel.errors import UserError
from aurakernel.hardware import load_profile
from trainer.config import load_config
from trainer.dryrun import build_meta_model, dry_run, format_dry_run
from trainer.metrics import flops_per_token, parameter_counts
from trainer.model import build_model, model_config

from conftest import REPO, TINY

CONFIGS = REPO / "trainer" / "configs"


@lru_cache(maxsize=None)
def run(name: str, world_size: int = 1) -> dict:
    return dry_run(load_config(CONFIGS / f"{name}.yaml"), world_size)


@pytest.mark.parametrize("name,hidden,layers,experts,types", [
    ("flash", 4096, 43, 256, {"SWA": 2, "CSA": 21, "HCA": 20}),
    ("pro", 7168, 61, 384, {"SWA": 0, "CSA": 30, "HCA": 31}),
])
def test_v4_configs_load_with_the_official_layout(name, hidden, layers, experts, types):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    c = model_config(cfg.model)
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts) == (hidden, layers, experts)
    assert c.num_experts_per_tok == 6
    assert c.head_dim == 512 and c.qk_rope_head_dim == 64 and c.hc_mult == 4 and c.vocab_size == 129280
    assert c.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    assert c.rope_parameters["compress"]["rope_type"] == "yarn" and c.rope_parameters["main"]["rope_type"] == "default"
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.train.dtype) == (4096, 1, "bf16")
    assert load_profile(cfg.hardware.target).name == "ascend910b2"
    assert run(name)["layers"] == {"total": layers, **types, "hash_moe": 3, "topk_moe": layers - 3}


@pytest.mark.parametrize("name,total,active", [("flash", 284e9, 13e9), ("pro", 1.6e12, 49e9)])
def test_counts_match_the_official_totals(name, total, active):
    r = run(name)
    # transformers builds no MTP layer (Flash: 284.3B without it; Pro: 1.573T, ~1.6T with it)
    assert r["total_params"] == pytest.approx(total, rel=0.03)
    assert r["active_params"] == pytest.approx(active, rel=0.03)
    assert r["mtp_params_estimate"] == pytest.approx(r["total_params"] / r["layers"]["total"], rel=0.1)
    # 6 x active for the matmuls, plus attention over window + compressed keys
    assert r["flops_per_token"] == pytest.approx(6 * r["active_params"] + r["attention_flops_per_token"])
    assert 0 < r["attention_flops_per_token"] < 0.1 * r["flops_per_token"]


def test_memory_per_device_shrinks_with_world_size():
    one, many = run("flash", 1), run("flash", 64)
    states = ("weights_bf16", "master_weights_fp32", "adamw_m_fp32", "adamw_v_fp32", "gradients")
    for key in states:
        assert many["breakdown"][key] * 64 == pytest.approx(one["breakdown"][key])
    assert sum(one["breakdown"][k] for k in states) == pytest.approx(16 * one["total_params"])  # 16 B/param
    # activations are per device (data parallel); only the sharded states shrink
    assert many["breakdown"]["activations_ckpt"] == one["breakdown"]["activations_ckpt"]
    assert one["breakdown"]["activations_ckpt"] < one["breakdown"]["activations_no_ckpt"]
    assert one["breakdown"]["fsdp_gather_buffers"] == 0 < many["breakdown"]["fsdp_gather_buffers"]
    assert many["memory_per_device_bytes"] < one["memory_per_device_bytes"] / 16
    assert one["memory_per_device_bytes"] > one["device_memory_bytes"] and not one["fits_device"]
    assert (many["world_size"], many["seq_len"]) == (64, 4096)
    with pytest.raises(UserError, match="world size"):
        dry_run(load_config(TINY), 0)


def test_dry_run_allocates_no_weights():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    cfg = load_config(CONFIGS / "pro.yaml")
    model = build_meta_model(cfg.model)
    assert all(p.is_meta for p in model.parameters())
    dry_run(cfg, 8)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 1024 * 1024, f"peak RSS grew by {grown / 1024:.0f} MiB"


def test_tiny_dry_run_agrees_with_the_real_model():
    cfg = load_config(TINY)
    r = dry_run(cfg)
    model = build_model(cfg.model, seed=0)
    total, active = parameter_counts(model)
    assert (r["total_params"], r["active_params"]) == (total, active)
    assert r["flops_per_token"] == pytest.approx(flops_per_token(model, cfg.data.seq_len))
    assert r["layers"]["total"] == 4 and r["dtype"] == "fp32" and r["breakdown"]["weights_bf16"] == 0
    json.dumps(r)  # the CLI's --json output


def test_format_dry_run_renders():
    table = format_dry_run(run("flash", 64))
    assert isinstance(table, Table)
    out = io.StringIO()
    Console(file=out, width=120).print(table)
    text = out.getvalue()
    assert "284.33B" in text and "2 SWA + 21 CSA + 20 HCA" in text and "GiB" in text
