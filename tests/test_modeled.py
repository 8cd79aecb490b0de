"""The modeled profile: a real config's training step traced on the meta device, timed by model."""

import json
import resource
import pytest
import torch

from aurakernel.hardware import load_profile
from aurakernel.modeled import _matmul_flops, default_world_size, modeled_profile
from trainer.config import load_config
from trainer.dryrun import build_meta_model

from conftest import REPO, TINY

FLASH = str(REPO / "trainer" / "configs" / "flash.yaml")


@pytest.fixture(scope="module")
def flash():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cfg = load_config(FLASH)
    result = modeled_profile(build_meta_model(cfg.model), "ascend910b2", seq_len=256, batch_size=1, config_path=cfg.path)
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return result, grown_kb


def _shapes(result, group, op, variant=None):
    g = next(g for g in result.groups if g.name == group)
    return [s for s in g.shapes if s["op"] == op and (variant is None or s["variant"] == variant)]


def test_flash_groups_have_the_configs_shapes(flash):
    r, _ = flash
    tokens = 256
    # mHC: 4 streams of hidden 4096, pre-mixing twice per layer (attention and FFN) over 43 layers
    (pre,) = _shapes(r, "mhc_pre", "mhc_pre")
    assert pre["shape"] == [tokens, 4, 4096] and pre["calls"] == 2 * 43
    (post,) = _shapes(r, "mhc_post", "mhc_post")
    assert post["calls"] == 43
    # the mHC input norm runs over the flattened streams: width 4 x 4096 = 16384, in fp32
    widths = {tuple(s["shape"][1:]) for s in _shapes(r, "rms_norm", "rms_norm", "unweighted")}
    assert (16384,) in widths
    # routers: 256 experts, top-6; the first 3 MoE layers are hash-routed
    routers = {s["variant"]: s for s in _shapes(r, "router", "router")}
    assert routers["hash"]["shape"] == [tokens, 256, 6] and routers["hash"]["calls"] == 3
    assert routers["topk"]["calls"] == 40
    # routed experts: tokens x top-6 rows through the clamped SwiGLU of width 2048
    (gate,) = _shapes(r, "moe_experts", "swiglu")
    assert gate["shape"] == [tokens * 6, 2048] and gate["calls"] == 43
    # 21 CSA layers (compressor + indexer pooling) and 20 HCA layers
    comp = _shapes(r, "compressor", "compressor")
    assert sum(s["calls"] for s in comp if s["variant"] == "hca") == 20
    assert sum(s["calls"] for s in comp if s["variant"] == "csa") == 2 * 21
    (loss,) = _shapes(r, "cross_entropy", "cross_entropy")
    assert loss["shape"] == [tokens, 129280]


def test_flash_times_and_mfu_are_consistent(flash):
    r, grown_kb = flash
    assert grown_kb < 1024 * 1024   # meta device: the 284B-parameter model allocates nothing
    assert sum(g.share for g in r.groups) == pytest.approx(1.0)
    assert r.step_us == pytest.approx(sum(g.time_us for g in r.groups))
    assert all(g.time_after_us <= g.time_us + 1e-9 for g in r.groups if g.kind != "comm")
    # FSDP traffic hides behind compute only as far as there is compute: faster kernels expose more of it,
    # never more than all of it at the collective bandwidth
    (comm,) = [g for g in r.groups if g.kind == "comm"]
    gbps = load_profile("ascend910b2").extra["collective_gbps"]
    assert 0 < comm.time_us <= comm.time_after_us <= comm.bytes / (gbps * 1e9) * 1e6
    assert 0 < r.mfu_before < r.mfu_after < 1
    # backward ops are charged to the group whose forward made them, not left over
    other = sum(g.time_us for g in r.groups if g.name == "other")
    assert other < 0.01 * r.step_us
    # the world size defaults to the fewest devices holding 16 B/parameter of training state
    assert r.world_size == default_world_size(284_332_230_231, load_profile("ascend910b2")) == 128
    assert any(g.kind == "comm" and g.time_us > 0 for g in r.groups)
    # model FLOPs = 6 x active (13.3B) + attention, per token
    assert r.model_flops / r.tokens == pytest.approx(6 * 13.27e9, rel=0.1)


def test_expert_weights_are_the_devices_share():
    # expert parallelism: a grouped matmul moves this device's experts' stacked weights, every routed row
    from aurakernel.modeled import _Tracer
    tracer = _Tracer(tracker=None, n_experts=256, expert_share=2 / 256)
    w, rows = torch.empty(256, 64, 32, device="meta"), torch.empty(256, 64, device="meta")
    assert tracer._nbytes("_grouped_mm", w) == w.numel() * 4 * 2 / 256
    assert tracer._nbytes("_grouped_mm", rows) == rows.numel() * 4
    assert tracer._nbytes("mm", w) == w.numel() * 4


def test_grouped_matmul_flops():
    # forward: (S, K) @ (E, K, N): every row meets one expert
    x, w = torch.empty(12, 8, device="meta"), torch.empty(3, 8, 5, device="meta")
    assert _matmul_flops("_grouped_mm", (x, w), torch.empty(12, 5, device="meta")) == 2 * 12 * 8 * 5
    # weight gradient: (K, S) @ (S, N) -> (E, K, N): each expert reduces over its own rows only
    xt, g = torch.empty(8, 12, device="meta"), torch.empty(12, 5, device="meta")
    assert _matmul_flops("_grouped_mm", (xt, g), torch.empty(3, 8, 5, device="meta")) == 2 * 8 * 12 * 5
    a, b = torch.empty(4, 6, device="meta"), torch.empty(6, 7, device="meta")
    assert _matmul_flops("mm", (a, b), torch.empty(4, 7, device="meta")) == 2 * 4 * 6 * 7


def test_cli_modeled_profile_json_and_errors(tmp_path, capsys):
    from aurakernel.cli import main
    chart = tmp_path / "profile.png"
    assert main(["profile", "--config", TINY, "--target", "ascend910b2", "--seq", "64", "--world-size", "1",
                 "--json", "--chart", str(chart)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"groups", "mfu_before", "mfu_after", "step_us"} <= set(d)
    assert all({"name", "kind", "time_us", "share", "calls"} <= set(g) for g in d["groups"])
    assert not any(g["kind"] == "comm" for g in d["groups"])   # one device: nothing to communicate
    assert chart.stat().st_size > 0
    for args, fragment in ((["--seq", "64"], "add --target"), (["--target", "tpu9"], "unknown target"),
                           (["--target", "host", "--kernels", "plan.json"], "--kernels applies")):
        assert main(["profile", "--config", FLASH] + args) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err


def test_every_profile_loads():
    from aurakernel.hardware import available_targets
    for target in available_targets():
        hw = load_profile(target)
        assert hw.name == target and hw.cores > 0
