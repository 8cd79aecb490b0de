"""trainer.checkpoint: loading (plain and release-quantized), AuraKernel's quantizer, HF export, bad input.

Two tiny models: the tiny.yaml one (hidden 256: every quantized dim is a multiple of, or smaller than, 128, so
transformers' own dequantizer can serve as an independent oracle) and a "tail" variant whose dims leave partial
fp8 blocks (192 = 128 + 64, 80, 96, 160) and a partial fp4 group (K = 80 = 32 + 32 + 16)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from aurakernel.errors import UserError
from conftest import TINY
from trainer import checkpoint as ck
from trainer.config import load_config
from trainer.model import build_model

TAIL = {"hidden_size": 192, "q_lora_rank": 96, "o_lora_rank": 80, "moe_intermediate_size": 80,
        "num_hidden_layers": 2, "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe"]}
IDS = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(7))
E2M1 = torch.tensor(ck.E2M1_VALUES)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Small tensors on 2 shared cores: thread hand-offs cost more than the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _saved(tmp_path_factory, name: str, **overrides) -> SimpleNamespace:
    model = build_model({**load_config(TINY).model, **overrides}, seed=0).eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return SimpleNamespace(model=model, dir=path, logits=_logits(model))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _saved(tmp_path_factory, "tiny")


@pytest.fixture(scope="module")
def tail(tmp_path_factory):
    return _saved(tmp_path_factory, "tail", **TAIL)


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    return ck.quantize_checkpoint(tiny.dir, tmp_path_factory.mktemp("q") / "release", max_shard_size="300KB")


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _headers(root: Path) -> dict[str, tuple[str, list[int], Path]]:
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape(), path) for k in f.keys()})
    return out


def _renamer(config):
    """transformers' own checkpoint-name -> model-name mapping (what from_pretrained applies)."""
    with torch.device("meta"):
        meta = DeepseekV4ForCausalLM(config)
    state = meta.state_dict()
    conv = get_model_conversion_mapping(meta)
    ren = [c for c in conv if isinstance(c, WeightRenaming)]
    cvt = [c for c in conv if isinstance(c, WeightConverter)]
    return state, lambda key: rename_source_key(key, ren, cvt, "model", state)


# Format error bounds, from the formats alone (no code under test): e4m3 keeps 3 mantissa bits (relative error
# <= 2^-4) down to 2^-6 and then steps by 2^-9; a ue8m0 block scale s satisfies amax/448 <= s < 2*amax/448.
# e2m1 steps by 0.5 below 2, 1 below 4 and 2 up to 6 (error <= max(|x|, s)/4) with amax/6 <= s < amax/3.
def _blocks(x: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """Per-element amax of its (bn x bk) block, partial blocks at the ends."""
    n, k = x.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(x.abs(), (0, gk * bk - k, 0, gn * bn - n))
    amax = padded.view(gn, bn, gk, bk).amax(dim=(1, 3))
    return amax.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def fp8_bound(w: torch.Tensor) -> torch.Tensor:
    return 2.0 ** -4 * w.abs() + 2.0 ** -9 * _blocks(w, 128, 128) / 448 + 1e-30


def fp4_bound(w: torch.Tensor) -> torch.Tensor:
    return torch.maximum(w.abs() / 4, _blocks(w, 1, 32) / 12) + 1e-30


def _within(got: torch.Tensor, want: torch.Tensor, bound) -> bool:
    return bool(((got.float() - want.float()).abs() <= bound(want.float())).all())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


# --------------------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------------------

def test_fp8_exactly_representable_values_round_trip_bit_exact():
    g = torch.Generator().manual_seed(0)
    n, k = 200, 300                                       # blocks of 128+72 rows, 128+128+44 columns
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38                  # no NaN patterns (0x38 is 1.0)
    codes[0::128, 0::128] = 0x7E                          # every block's amax is exactly 448 * 2^e
    values = codes.view(torch.float8_e4m3fn).float()
    exps = torch.randint(-20, 10, (2, 3), generator=g)
    w = values * torch.ldexp(torch.ones(n, k), exps.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k])
    q, scale = ck.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 3)
    assert torch.equal(scale.view(torch.uint8).long(), exps + 127)
    assert torch.equal(q.view(torch.uint8), codes)
    assert torch.equal(ck.dequantize_fp8_block(q, scale), w)


def test_fp4_exactly_representable_values_round_trip_bit_exact():
    g = torch.Generator().manual_seed(1)
    n, k = 6, 80                                          # groups of 32, 32 and a partial 16
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[:, [0, 32, 64]] = 7                             # each group's amax is 6 * 2^e
    exps = torch.randint(-10, 10, (n, 3), generator=g)
    w = E2M1[codes.long()] * torch.ldexp(torch.ones(n, k), exps.repeat_interleave(32, 1)[:, :k])
    packed, scale = ck.quantize_fp4_e2m1(w)
    assert packed.dtype == torch.int8 and packed.shape == (n, k // 2)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (n, 3)
    assert torch.equal(scale.view(torch.uint8).long(), exps + 127)
    assert torch.equal(packed.view(torch.uint8), codes[:, 0::2] | (codes[:, 1::2] << 4))   # even index low nibble
    assert torch.equal(ck.dequantize_fp4_e2m1(packed, scale), w)


def test_fp4_rounds_to_nearest_with_ties_to_even():
    row = torch.zeros(1, 32)
    row[0, :11] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 5.01])
    packed, scale = ck.quantize_fp4_e2m1(row)
    assert scale.view(torch.uint8).item() == 127          # amax 6 -> scale 1
    got = ck.dequantize_fp4_e2m1(packed, scale)[0, :11].tolist()
    assert got == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 6.0]


def test_ue8m0_scales_are_the_smallest_power_of_two_that_fits():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(2)) * 3
    q, scale = ck.quantize_fp8_block(w)
    s = ck.ue8m0_decode(scale)
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    assert torch.equal(scale.view(torch.uint8).float(), torch.log2(s) + 127)
    # The block amax lands in (qmax/2, qmax] once scaled: nothing clips and no exponent is wasted.
    ratio = _blocks(w, 128, 128) / s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert bool(((ratio > 224) & (ratio <= 448)).all())
    _, s4 = ck.quantize_fp4_e2m1(w[:, :290])              # 9 full groups and a partial one per row
    ratio4 = _blocks(w[:, :290], 1, 32) / ck.ue8m0_decode(s4).repeat_interleave(32, 1)[:, :290]
    assert torch.equal(torch.log2(ck.ue8m0_decode(s4)), torch.log2(ck.ue8m0_decode(s4)).round())
    assert bool(((ratio4 > 3) & (ratio4 <= 6)).all())


def test_dequantizers_agree_with_transformers_and_wrong_decodings_break_the_bounds():
    g = torch.Generator().manual_seed(3)
    w8 = torch.randn(256, 384, generator=g) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(128)
    w4 = torch.randn(64, 128, generator=g) * torch.tensor([0.05, 2.0, 0.3, 9.0]).repeat_interleave(32)
    q8, s8 = ck.quantize_fp8_block(w8)
    q4, s4 = ck.quantize_fp4_e2m1(w4)
    oracle = Fp8Dequantize(None)
    assert torch.equal(ck.dequantize_fp8_block(q8, s8), oracle._dequantize_one(q8, s8, output_dtype=torch.float32))
    assert torch.equal(ck.dequantize_fp4_e2m1(q4, s4), oracle._dequantize_one(q4, s4, output_dtype=torch.float32))

    assert _within(ck.dequantize_fp8_block(q8, s8), w8, fp8_bound)
    assert _within(ck.dequantize_fp4_e2m1(q4, s4), w4, fp4_bound)
    assert _rel(ck.dequantize_fp8_block(q8, s8), w8) < 0.035
    assert _rel(ck.dequantize_fp4_e2m1(q4, s4), w4) < 0.14
    # The bounds catch each plausible decoding mistake.
    doubled8 = (s8.view(torch.uint8) + 1).view(torch.float8_e8m0fnu)
    assert not _within(ck.dequantize_fp8_block(q8, doubled8), w8, fp8_bound)
    assert not _within(ck.dequantize_fp8_block(q8, s8.view(torch.uint8).flip(-1)), w8, fp8_bound)
    swapped = ((q4.view(torch.uint8) >> 4) | (q4.view(torch.uint8) << 4)).view(torch.int8)
    assert not _within(ck.dequantize_fp4_e2m1(swapped, s4), w4, fp4_bound)
    assert not _within(ck.dequantize_fp4_e2m1(q4, s4.view(torch.uint8).roll(1, dims=-1)), w4, fp4_bound)
    assert not _within(ck.dequantize_fp4_e2m1(q4, s4.view(torch.uint8).view(torch.float8_e8m0fnu).float()
                                              .mul(0.5)), w4, fp4_bound)


# --------------------------------------------------------------------------------------------------------------
# load_pretrained
# --------------------------------------------------------------------------------------------------------------

def test_load_pretrained_matches_transformers_from_pretrained(tiny, tmp_path):
    sharded = tmp_path / "sharded"
    tiny.model.save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / ck.INDEX_NAME).is_file() and len(list(sharded.glob("*.safetensors"))) >= 2
    for root in (tiny.dir, sharded):
        for dtype in (torch.float32, torch.bfloat16):
            ours = ck.load_pretrained(root, dtype=dtype)
            ref = DeepseekV4ForCausalLM.from_pretrained(root, dtype=dtype)
            assert not ours.training
            ref_state = ref.state_dict()
            for name, value in ours.state_dict().items():
                assert value.dtype == ref_state[name].dtype, name
                assert torch.equal(value, ref_state[name]), name
            assert torch.equal(_logits(ours), _logits(ref))
    assert torch.equal(_logits(ck.load_pretrained(tiny.dir, dtype="fp32")), tiny.logits)


# --------------------------------------------------------------------------------------------------------------
# quantize_checkpoint
# --------------------------------------------------------------------------------------------------------------

def test_quantized_checkpoint_has_the_release_layout(tiny, quantized):
    index = json.loads((quantized / ck.INDEX_NAME).read_text())
    shards = sorted(quantized.glob("*.safetensors"))
    assert len(shards) >= 2 and {p.name for p in shards} == set(index["weight_map"].values())
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                                             "expert_dtype": "fp4"}
    headers = _headers(quantized)
    assert set(headers) == set(index["weight_map"])
    # The V4-Flash listing, scaled down to the tiny config.
    expected = {
        "embed.weight": ("BF16", [512, 256]), "head.weight": ("BF16", [512, 256]), "norm.weight": ("BF16", [256]),
        "hc_head_fn": ("F32", [4, 1024]), "hc_head_base": ("F32", [4]), "hc_head_scale": ("F32", [1]),
        "layers.0.hc_attn_fn": ("F32", [24, 1024]), "layers.0.hc_ffn_scale": ("F32", [3]),
        "layers.0.attn_norm.weight": ("BF16", [256]), "layers.0.ffn_norm.weight": ("BF16", [256]),
        "layers.0.attn.attn_sink": ("F32", [4]), "layers.0.attn.q_norm.weight": ("BF16", [128]),
        "layers.0.attn.kv_norm.weight": ("BF16", [64]),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", [128, 256]), "layers.0.attn.wq_a.scale": ("F8_E8M0", [1, 2]),
        "layers.0.attn.wq_b.weight": ("F8_E4M3", [256, 128]), "layers.0.attn.wq_b.scale": ("F8_E8M0", [2, 1]),
        "layers.0.attn.wkv.weight": ("F8_E4M3", [64, 256]), "layers.0.attn.wkv.scale": ("F8_E8M0", [1, 2]),
        "layers.0.attn.wo_a.weight": ("F8_E4M3", [128, 128]), "layers.0.attn.wo_a.scale": ("F8_E8M0", [1, 1]),
        "layers.0.attn.wo_b.weight": ("F8_E4M3", [256, 128]), "layers.0.attn.wo_b.scale": ("F8_E8M0", [2, 1]),
        "layers.0.ffn.gate.weight": ("BF16", [8, 256]), "layers.0.ffn.gate.tid2eid": ("I64", [512, 2]),
        "layers.1.ffn.gate.bias": ("F32", [8]),
        "layers.0.ffn.shared_experts.w1.weight": ("F8_E4M3", [128, 256]),
        "layers.0.ffn.shared_experts.w2.weight": ("F8_E4M3", [256, 128]),
        "layers.0.ffn.shared_experts.w2.scale": ("F8_E8M0", [2, 1]),
        "layers.0.ffn.experts.7.w1.weight": ("I8", [128, 128]),
        "layers.0.ffn.experts.7.w1.scale": ("F8_E8M0", [128, 8]),
        "layers.0.ffn.experts.7.w2.weight": ("I8", [256, 64]),
        "layers.0.ffn.experts.7.w2.scale": ("F8_E8M0", [256, 4]),
        "layers.0.ffn.experts.7.w3.weight": ("I8", [128, 128]),
        "layers.1.attn.compressor.wkv.weight": ("BF16", [128, 256]),
        "layers.1.attn.compressor.wgate.weight": ("BF16", [128, 256]),
        "layers.1.attn.compressor.ape": ("F32", [4, 128]), "layers.1.attn.compressor.norm.weight": ("BF16", [64]),
        "layers.1.attn.indexer.wq_b.weight": ("F8_E4M3", [128, 128]),
        "layers.1.attn.indexer.weights_proj.weight": ("BF16", [4, 256]),
        "layers.1.attn.indexer.compressor.wkv.weight": ("BF16", [64, 256]),
        "layers.1.attn.indexer.compressor.ape": ("F32", [4, 64]),
        "layers.2.attn.compressor.ape": ("F32", [128, 64]),
    }
    for name, (dtype, shape) in expected.items():
        assert headers[name][:2] == (dtype, shape), name
    # Every name is one transformers itself maps onto the model (the writer's names are the release's).
    state, rename = _renamer(tiny.model.config)
    for name, (dtype, _, _) in headers.items():
        assert not name.startswith(("model.", "mtp."))
        if name.endswith(".scale"):
            assert dtype == "F8_E8M0" and name[: -len("scale")] + "weight" in headers
            continue
        target, converter = rename(name)
        assert target in state, name
        assert (converter is not None) == (".ffn.experts." in name), name
        has_scale = name.endswith(".weight") and name[: -len("weight")] + "scale" in headers
        assert (dtype in ("F8_E4M3", "I8")) == has_scale, name
    assert sum(1 for n in headers if n.endswith(".scale")) == 4 * (5 + 3 + 8 * 3) + 2   # + 2 indexer wq_b


def test_quantized_load_equals_transformers_dequantization(tiny, quantized):
    """Independent decode of every stored tensor (transformers' Fp8Dequantize, its renaming, and the expert merge
    its deepseek_v4 converters do), bit-compared with what load_pretrained put in the model."""
    loaded = ck.load_pretrained(quantized, dtype=torch.float32).state_dict()
    state, rename = _renamer(tiny.model.config)
    tensors = {}
    for path in quantized.glob("*.safetensors"):
        tensors.update(load_file(path))
    oracle = Fp8Dequantize(None)
    expected: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, value in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name[: -len("weight")] + "scale")
        value = oracle._dequantize_one(value, scale, output_dtype=torch.float32) if scale is not None else value
        target, converter = rename(name)
        if converter is None:
            expected[target] = value
        else:
            index, proj = name.split(".")[-3:-1]
            experts.setdefault(target, {}).setdefault(int(index), {})[proj] = value
    for target, per_expert in experts.items():
        order = [per_expert[e] for e in sorted(per_expert)]
        expected[target] = torch.stack([torch.cat([p["w1"], p["w3"]]) if "w1" in p else p["w2"] for p in order])
    assert set(expected) == set(state) == set(loaded)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value.to(loaded[name].dtype)), name


def test_quantized_weights_and_logits_stay_within_format_error(tail, tmp_path):
    release = ck.quantize_checkpoint(tail.dir, tmp_path / "release", max_shard_size=200_000)
    assert len(list(release.glob("*.safetensors"))) >= 2
    loaded = ck.load_pretrained(release, dtype=torch.float32)
    got, original = loaded.state_dict(), tail.model.state_dict()
    kinds = {"fp8": 0, "fp4": 0, "bf16": 0, "fp32": 0}
    for name, want in original.items():
        if not want.is_floating_point():
            assert torch.equal(got[name], want), name
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for e in range(want.shape[0]):
                assert _within(got[name][e], want[e], fp4_bound), f"{name}[{e}]"
                assert _rel(got[name][e], want[e]) < 0.14, f"{name}[{e}]"
            kinds["fp4"] += 1
        elif ck._RELEASE_FP8_RE.search(ck.release_name(name)):
            assert _within(got[name], want, fp8_bound), name
            assert _rel(got[name], want) < 0.035, name
            kinds["fp8"] += 1
        elif ck._RELEASE_FP32_RE.search(ck.release_name(name)):
            assert torch.equal(got[name], want), name
            kinds["fp32"] += 1
        else:                                            # bf16 keeps 8 significant bits: relative error <= 2^-8
            assert bool(((got[name] - want).abs() <= want.abs() * 2.0 ** -8).all()), name
            kinds["bf16"] += 1
    # fp8: 5 attention + 3 shared-expert projections per layer + the CSA layer's indexer wq_b; fp4: fused experts;
    # bf16: embed/head/norm + 4 norms and the router per layer + the CSA compressor and indexer (7) and the HCA
    # compressor (3); fp32: hc_head (3) + mHC and sinks per layer (7) + 3 position biases + the top-k router bias.
    assert kinds == {"fp8": 17, "fp4": 4, "bf16": 3 + 2 * 5 + 7 + 3, "fp32": 3 + 2 * 7 + 3 + 1}
    # Quantization noise (fp4 experts dominate) moves the logits, but they stay the same model's logits.
    logits = _logits(loaded)
    assert _rel(logits, tail.logits) < 0.2
    assert torch.nn.functional.cosine_similarity(logits.flatten(), tail.logits.flatten(), dim=0) > 0.98
    # A bf16 load of the same checkpoint: the dequantized values rounded once more.
    bf16 = ck.load_pretrained(release)
    assert bf16.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].attn_hc.fn.dtype == torch.float32
    assert torch.equal(bf16.model.layers[0].self_attn.q_a_proj.weight,
                       loaded.model.layers[0].self_attn.q_a_proj.weight.to(torch.bfloat16))


# --------------------------------------------------------------------------------------------------------------
# export_hf
# --------------------------------------------------------------------------------------------------------------

def test_export_hf_round_trips_through_from_pretrained(tiny, tmp_path):
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (tokenizer / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    out = ck.export_hf(tiny.model, tmp_path / "fp32", tokenizer_dir=tokenizer)
    assert (out / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").is_file()
    assert torch.equal(_logits(DeepseekV4ForCausalLM.from_pretrained(out)), tiny.logits)
    assert torch.equal(_logits(ck.load_pretrained(out, dtype=torch.float32)), tiny.logits)

    out16 = ck.export_hf(tiny.model, tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size="2MB")
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out16 / ck.INDEX_NAME).is_file()
    dtypes = {name: dtype for name, (dtype, _, _) in _headers(out16).items()}
    assert dtypes["model.layers.0.attn.wq_a.weight"] == "BF16" and dtypes["model.layers.0.hc_attn_fn"] == "F32"
    reloaded = DeepseekV4ForCausalLM.from_pretrained(out16)
    assert reloaded.dtype == torch.bfloat16
    assert torch.equal(_logits(reloaded), _logits(DeepseekV4ForCausalLM.from_pretrained(tiny.dir,
                                                                                         dtype=torch.bfloat16)))


def test_export_hf_is_atomic(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous export")
    with pytest.raises(UserError, match="not empty"):
        ck.export_hf(tiny.model, out)

    def crash_mid_write(self, save_directory, **kwargs):
        (Path(save_directory) / "model.safetensors").write_bytes(b"half a shard")
        raise OSError("No space left on device")

    monkeypatch.setattr(DeepseekV4ForCausalLM, "save_pretrained", crash_mid_write)
    with pytest.raises(OSError, match="No space"):
        ck.export_hf(tiny.model, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "previous export"
    with pytest.raises(OSError, match="No space"):
        ck.export_hf(tiny.model, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]     # no half-written dir, no temp left over

    monkeypatch.undo()
    ck.export_hf(tiny.model, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert torch.equal(_logits(DeepseekV4ForCausalLM.from_pretrained(out)), tiny.logits)


# --------------------------------------------------------------------------------------------------------------
# Bad input: one UserError line naming the file and what is wrong
# --------------------------------------------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(root: Path, edit) -> Path:
    config = json.loads((root / "config.json").read_text())
    edit(config)
    (root / "config.json").write_text(json.dumps(config))
    return root / "config.json"


def _error(root) -> str:
    with pytest.raises(UserError) as info:
        ck.load_pretrained(root)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_directories_and_files(tiny, quantized, tmp_path):
    missing = tmp_path / "nowhere"
    assert str(missing) in _error(missing) and "no such directory" in _error(missing)

    no_config = _copy(tiny.dir, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    assert str(no_config) in _error(no_config) and "config.json" in _error(no_config)

    bad_json = _copy(tiny.dir, tmp_path / "bad_json")
    (bad_json / "config.json").write_text("{ not json")
    assert str(bad_json / "config.json") in _error(bad_json) and "not valid JSON" in _error(bad_json)

    no_weights = _copy(tiny.dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    message = _error(no_weights)
    assert str(no_weights) in message and "model.safetensors.index.json" in message

    truncated = _copy(tiny.dir, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 100])
    message = _error(truncated)
    assert str(truncated / "model.safetensors") in message and "corrupt or truncated" in message

    no_shard = _copy(quantized, tmp_path / "no_shard")
    shard = sorted(set(json.loads((no_shard / ck.INDEX_NAME).read_text())["weight_map"].values()))[1]
    (no_shard / shard).unlink()
    message = _error(no_shard)
    assert message.startswith(f"{no_shard / ck.INDEX_NAME}: shard {shard} is listed")


def test_bad_tensors(tiny, tmp_path):
    mismatch = _copy(tiny.dir, tmp_path / "mismatch")
    weights = mismatch / "model.safetensors"
    _edit_tensors(weights, lambda t: t.update({"model.layers.2.attn.wkv.weight": torch.zeros(64, 255)}))
    message = _error(mismatch)
    assert message.startswith(f"{weights}: config/weights mismatch")
    assert "model.layers.2.attn.wkv.weight" in message and "[64, 255]" in message and "[64, 256]" in message

    config_edit = _copy(tiny.dir, tmp_path / "config_edit")
    _edit_config(config_edit, lambda c: c.update(q_lora_rank=96))
    message = _error(config_edit)
    assert "config/weights mismatch" in message and "implies" in message and str(config_edit / "config.json") in message

    missing = _copy(tiny.dir, tmp_path / "missing")
    _edit_tensors(missing / "model.safetensors", lambda t: (t.pop("model.layers.1.attn.attn_sink"),
                                                            t.pop("model.layers.0.ffn.experts.3.w3.weight")))
    message = _error(missing)
    assert str(missing / "model.safetensors") in message and "missing 2 tensor(s)" in message
    assert "model.layers.1.self_attn.sinks" in message and "expert 3 w3" in message

    unexpected = _copy(tiny.dir, tmp_path / "unexpected")
    _edit_tensors(unexpected / "model.safetensors",
                  lambda t: t.update({"model.layers.0.attn.bogus.weight": torch.zeros(2, 2)}))
    message = _error(unexpected)
    assert message.startswith(f"{unexpected / 'model.safetensors'}: unexpected tensor model.layers.0.attn.bogus")

    too_many_experts = _copy(tiny.dir, tmp_path / "experts")
    _edit_tensors(too_many_experts / "model.safetensors",
                  lambda t: t.update({"model.layers.0.ffn.experts.8.w1.weight": torch.zeros(128, 256)}))
    assert "unexpected tensor model.layers.0.ffn.experts.8.w1.weight" in _error(too_many_experts)

    routing = _copy(tiny.dir, tmp_path / "routing")
    _edit_tensors(routing / "model.safetensors",
                  lambda t: t["model.layers.0.ffn.gate.tid2eid"].__setitem__((5, 1), 8))
    message = _error(routing)
    assert message.startswith(f"{routing / 'model.safetensors'}: tensor model.layers.0.ffn.gate.tid2eid routes")

    packed_without_scale = _copy(tiny.dir, tmp_path / "packed")
    packed = torch.zeros(256, 64, dtype=torch.int8)
    _edit_tensors(packed_without_scale / "model.safetensors",
                  lambda t: t.update({"model.layers.0.ffn.experts.2.w2.weight": packed}))
    assert "has dtype I8, expected a floating-point tensor (a packed fp4 weight needs its .scale)" in \
        _error(packed_without_scale)


def test_bad_quantized_checkpoints(quantized, tmp_path):
    unsupported = _copy(quantized, tmp_path / "awq")
    config = _edit_config(unsupported, lambda c: c["quantization_config"].update(quant_method="awq"))
    message = _error(unsupported)
    assert message.startswith(f"{config}: unsupported quantization_config (quant_method 'awq')")
    assert "accepted is quant_method 'fp8'" in message

    expert_dtype = _copy(quantized, tmp_path / "int4")
    _edit_config(expert_dtype, lambda c: c["quantization_config"].update(expert_dtype="int4"))
    assert "expert_dtype 'int4'" in _error(expert_dtype)

    block = _copy(quantized, tmp_path / "block64")
    _edit_config(block, lambda c: c["quantization_config"].update(weight_block_size=[64, 64]))
    message = _error(block)
    assert "config/weights mismatch: scale" in message and "fp8 blocks 64x64" in message and ".safetensors" in message

    unquantized = _copy(quantized, tmp_path / "no_qc")
    config = _edit_config(unquantized, lambda c: c.pop("quantization_config"))
    message = _error(unquantized)
    assert "is quantized" in message and f"{config} has no quantization_config" in message

    no_scale = _copy(quantized, tmp_path / "no_scale")
    index = json.loads((no_scale / ck.INDEX_NAME).read_text())
    shard = no_scale / index["weight_map"]["layers.0.attn.wq_a.scale"]
    _edit_tensors(shard, lambda t: t.pop("layers.0.attn.wq_a.scale"))
    message = _error(no_scale)
    assert str(shard) in message and "layers.0.attn.wq_a.scale" in message     # listed by the index, not in the file
    index["weight_map"].pop("layers.0.attn.wq_a.scale")
    (no_scale / ck.INDEX_NAME).write_text(json.dumps(index))
    message = _error(no_scale)
    assert message.startswith(f"{shard}: tensor layers.0.attn.wq_a.weight is F8_E4M3 but has no scale tensor")
