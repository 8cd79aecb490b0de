"""Checkpoint I/O for the trainer: load a DeepSeek-V4 checkpoint for full-parameter training, write
AuraKernel's own release-layout quantized checkpoint, and export a trained model in HF format.

API
---
``load_pretrained(model_dir, dtype=torch.bfloat16)``
    A ``DeepseekV4ForCausalLM`` from a checkpoint directory (config.json + ``model.safetensors`` or shards
    listed in ``model.safetensors.index.json``). Quantized checkpoints are dequantized to ``dtype``.
    Every tensor is checked against the config before any data is read; the model is built the way
    ``from_pretrained`` builds it (same per-parameter dtypes, eval mode), so logits match
    ``DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=dtype)`` on an unquantized checkpoint.
``quantize_checkpoint(src_dir, dst_dir, max_shard_size="5GB")``
    Writes ``src_dir`` (any checkpoint ``load_pretrained`` reads) in the DeepSeek-V4 release layout below.
``export_hf(model, out_dir, tokenizer_dir=None, dtype=None, overwrite=False)``
    ``save_pretrained`` into a temporary sibling directory, renamed onto ``out_dir`` only when complete.

Names read
----------
Both spellings transformers' own ``from_pretrained`` reads: the DeepSeek release names (``embed.weight``,
``layers.3.attn.wq_a.weight``, ``layers.3.ffn.experts.7.w1.weight``, ...) and the names transformers writes
(``model.layers.3.attn.wq_a.weight``, ``model.embed_tokens.weight``, fused ``...mlp.experts.gate_up_proj``).
Names are mapped with transformers' own rules (``conversion_mapping.py``, entry ``deepseek_v4``, applied with
``core_model_loading.rename_source_key``), so both loaders agree by construction. Per-expert tensors are merged
as that entry's converters do: ``gate_up_proj[e] = cat(w1_e, w3_e, dim=0)``, ``down_proj[e] = w2_e``.
``mtp.*`` tensors (the multi-token-prediction module) are skipped: the transformers model has no MTP module
and its ``_keys_to_ignore_on_load_unexpected`` drops them too.

Release quantization layout (read and written)
----------------------------------------------
config.json ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"scale_fmt": "ue8m0", "weight_block_size": [128, 128], "expert_dtype": "fp4"}`` (V4-Flash ships
``expert_dtype`` at top level; transformers' ``DeepseekV4Config`` folds it into ``quantization_config``).

* FP8 linears: ``<m>.weight`` float8_e4m3fn ``[N, K]`` + ``<m>.scale`` float8_e8m0fnu
  ``[ceil(N/128), ceil(K/128)]``; ``w = float(q) * scale[i // 128, j // 128]`` (the last block of a row or
  column may be partial). Modules: ``attn.{wq_a, wq_b, wkv, wo_a, wo_b}``, ``attn.indexer.wq_b``,
  ``ffn.shared_experts.{w1, w2, w3}``.
* FP4 routed experts: ``ffn.experts.<e>.{w1,w2,w3}.weight`` int8 ``[N, K/2]``, two e2m1 codes per byte, the
  even element in the low nibble (codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign) + ``.scale``
  float8_e8m0fnu ``[N, ceil(K/32)]``: one power-of-two scale per 32 consecutive elements along K (MXFP4 style).
* ue8m0 = a biased exponent byte, value ``2**(byte - 127)``; 255 is NaN. The quantizer picks
  ``scale = 2**ceil(log2(amax / qmax))`` per block (qmax 448 for e4m3, 6 for e2m1; amax floored at 1e-4), which
  is DeepSeek's ``fast_round_scale``, so every block's largest element lands in (qmax/2, qmax] and nothing clips.
* Kept unquantized, in the release dtypes: bf16 for ``embed``, ``head``, every RMSNorm weight, the compressors'
  ``wkv``/``wgate``, ``indexer.weights_proj`` and ``ffn.gate.weight``; fp32 for ``hc_*`` (mHC), ``attn_sink``,
  ``ape`` and ``ffn.gate.bias``; int64 for ``ffn.gate.tid2eid``.
* The reader also accepts FP8 scales stored as raw exponent bytes (uint8), as float32 multipliers (V3-style
  ``scale_fmt`` absent), under the ``weight_scale_inv`` spelling, and any ``weight_block_size``.

Sources: the published V4-Flash tensor listing (dtypes and shapes, e.g. ``layers.0.attn.wq_a.weight`` F8_E4M3
[1024, 4096] with ``.scale`` F8_E8M0 [8, 32]; ``layers.0.ffn.experts.0.w1.weight`` I8 [2048, 2048] with
``.scale`` F8_E8M0 [2048, 128]); DeepSeek's reference ``inference/model.py`` (``Linear``: fp8 scale grid
``ceil(out/128) x ceil(in/128)``, fp4 weight ``[out, in/2]`` with scale ``[out, in/32]``, ``fp4_block_size = 32``)
and ``inference/kernel.py`` (``fast_round_scale``); transformers 5.24 ``integrations/finegrained_fp8.py``
(``FP8Experts`` fp4 storage: int8, K halved, scale granularity 1 x 32; ``Fp8Dequantize``: the e2m1 table and
nibble order) and ``quantizers/quantizer_finegrained_fp8.py`` (``.scale`` is the V4-Flash spelling of
``weight_scale_inv``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.initialization import no_init_weights
from transformers.utils.hub import convert_file_size_to_int

from aurakernel.errors import UserError
from aurakernel.paths import read_json_object

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json")

FP8_MAX = 448.0        # largest finite float8_e4m3fn
FP4_MAX = 6.0          # largest e2m1
FP4_GROUP = 32         # e2m1 elements per ue8m0 scale, along K
RELEASE_BLOCK = (128, 128)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
RELEASE_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                        "scale_fmt": "ue8m0", "weight_block_size": list(RELEASE_BLOCK), "expert_dtype": "fp4"}

_ACCEPTED_QUANT = ("quant_method 'fp8' with fmt 'e4m3', activation_scheme 'dynamic', weight_block_size [n, k] "
                   "(positive ints), scale_fmt 'ue8m0' or 'float', expert_dtype 'fp4' or 'fp8'")
_FP8_DTYPES = {"F8_E4M3"}
_FP4_DTYPES = {"I8", "U8"}             # the release stores packed e2m1 pairs as int8 bytes
_SCALE_DTYPES = {"F8_E8M0", "U8", "F32", "BF16", "F16"}
_EXPERT_RE = re.compile(r"experts\.(\d+)\.(w[123])\.weight$")
_RELEASE_FP8_RE = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123])"
                             r"\.weight$")
_RELEASE_FP4_RE = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_RELEASE_FP32_RE = re.compile(r"(^|\.)(hc_(head|attn|ffn)_(fn|base|scale)|attn\.attn_sink|ape|ffn\.gate\.bias)$")

# transformers names -> release names inside a layer: the inverse of conversion_mapping's deepseek_v4 renames
# (the tests check that transformers' own renaming maps every written name back onto the model).
_TO_RELEASE_LAYER = dict((
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
))
_TO_RELEASE_TOP = {
    "model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


# ----------------------------------------------------------------------------------------------------------------
# Quantization formats (pure tensor functions)
# ----------------------------------------------------------------------------------------------------------------

def ue8m0_exponent(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for positive normal float32 x, from the bits as DeepSeek's ``fast_log2_ceil`` does
    (exact: no log rounding)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def ue8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales 2**exponent as float8_e8m0fnu (the byte is exponent + 127)."""
    return (exponent.clamp(-127, 127) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def ue8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: float8_e8m0fnu and raw exponent bytes (uint8) are 2**(byte - 127); float scales pass."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.to(torch.float32)


def _round_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    # DeepSeek's fast_round_scale: the smallest power of two with amax / scale <= qmax (amax floored at 1e-4).
    return ue8m0_exponent(amax.clamp(min=1e-4) * (1.0 / qmax))


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[-1], 0, rows - x.shape[-2]))


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = RELEASE_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (float8_e4m3fn ``[N, K]``, float8_e8m0fnu ``[ceil(N/bn), ceil(K/bk)]``)."""
    bn, bk = block
    n, k = weight.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    w = _pad_to(weight.to(torch.float32), gn * bn, gk * bk).view(gn, bn, gk, bk)
    exponent = _round_scale(w.abs().amax(dim=(1, 3)), FP8_MAX)
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    q = (w / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), ue8m0_encode(exponent)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = RELEASE_BLOCK
                         ) -> torch.Tensor:
    """float8_e4m3fn ``[..., N, K]`` with block scales ``[..., ceil(N/bn), ceil(K/bk)]`` -> float32."""
    bn, bk = block
    n, k = q.shape[-2:]
    s = ue8m0_decode(scale).repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return q.to(torch.float32) * s


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values (|v| <= 6) to e2m1 codes, to nearest with ties to the even code (as cvt.rn does).
    The grid spacing is 0.5 below 2, 1 below 4 and 2 up to 6; torch.round rounds half to even, and each
    shifted/scaled operand below is exact in float32."""
    a = v.abs()
    code = torch.where(a < 2, torch.round(a * 2),
                       torch.where(a < 4, 4 + torch.round(a - 2), 6 + torch.round((a - 4) / 2)))
    return (code.clamp(max=7) + 8 * torch.signbit(v)).to(torch.uint8)


def quantize_fp4_e2m1(weight: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` (K even) -> (int8 ``[N, K/2]`` packed e2m1 pairs, float8_e8m0fnu ``[N, ceil(K/group)]``)."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"fp4 packing needs an even K, got {k}")
    g = math.ceil(k / group)
    w = _pad_to(weight.to(torch.float32), n, g * group).view(n, g, group)
    exponent = _round_scale(w.abs().amax(dim=-1), FP4_MAX)
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    codes = _e2m1_codes((w / scale[..., None]).clamp(-FP4_MAX, FP4_MAX)).view(n, g * group)[:, :k]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)     # element 2j in the low nibble
    return packed.contiguous().view(torch.int8), ue8m0_encode(exponent)


def dequantize_fp4_e2m1(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """int8/uint8 ``[..., N, K/2]`` packed e2m1 with scales ``[..., N, ceil(K/group)]`` -> float32 ``[..., N, K]``."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).flatten(-2)
    k = values.shape[-1]
    return values * ue8m0_decode(scale).repeat_interleave(group, dim=-1)[..., :k]


# ----------------------------------------------------------------------------------------------------------------
# Reading a checkpoint directory
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Quant:
    block: tuple[int, int]
    expert_dtype: str | None


@dataclass
class _Entry:
    """One checkpoint tensor (with its scale, when quantized), from the safetensors headers."""
    key: str
    file: Path
    dtype: str
    shape: list[int]
    target: str = ""                 # model state-dict key
    expert: int | None = None        # routed expert index when the tensor is one expert's projection
    proj: str | None = None          # w1 / w2 / w3
    scale_key: str | None = None
    scale_file: Path | None = None
    scale_dtype: str | None = None
    scale_shape: list[int] | None = None

    @property
    def kind(self) -> str:
        if self.dtype in _FP8_DTYPES:
            return "fp8"
        if self.dtype in _FP4_DTYPES and self.scale_key is not None:
            return "fp4"
        return "plain"

    @property
    def logical_shape(self) -> list[int]:
        return self.shape[:-1] + [2 * self.shape[-1]] if self.kind == "fp4" else list(self.shape)


@dataclass
class _Checkpoint:
    root: Path
    raw_config: dict
    config: DeepseekV4Config
    quant: _Quant | None
    entries: list[_Entry]


def _read_config(model_dir: Path) -> tuple[Path, dict]:
    if not model_dir.is_dir():
        raise UserError(f"checkpoint {model_dir}: no such directory")
    path = model_dir / CONFIG_NAME
    if not path.is_file():
        raise UserError(f"checkpoint {model_dir}: no {CONFIG_NAME}")
    raw = read_json_object(path, "checkpoint config")
    if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise UserError(f"{path}: model_type {raw['model_type']!r}: accepted is 'deepseek_v4'")
    return path, raw


def _check_quantization(raw: dict, path: Path) -> _Quant | None:
    qc = raw.get("quantization_config")
    if qc is None:
        return None

    def bad(what: str) -> UserError:
        return UserError(f"{path}: unsupported quantization_config ({what}): accepted is {_ACCEPTED_QUANT}")

    if not isinstance(qc, dict):
        raise bad("not an object")
    if qc.get("quant_method") != "fp8":
        raise bad(f"quant_method {qc.get('quant_method')!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise bad(f"fmt {qc.get('fmt')!r}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise bad(f"activation_scheme {qc.get('activation_scheme')!r}")
    if qc.get("scale_fmt") not in (None, "ue8m0", "float"):
        raise bad(f"scale_fmt {qc.get('scale_fmt')!r}")
    block = qc.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise bad(f"weight_block_size {block!r}")
    expert_dtype = qc.get("expert_dtype", raw.get("expert_dtype"))
    if expert_dtype not in (None, "fp4", "fp8"):
        raise bad(f"expert_dtype {expert_dtype!r}")
    return _Quant(block=(block[0], block[1]), expert_dtype=expert_dtype)


def _build_config(raw: dict, path: Path) -> DeepseekV4Config:
    # The model is trained dequantized: the quantization keys describe the files, not the model.
    plain = {k: v for k, v in raw.items() if k not in ("quantization_config", "expert_dtype")}
    try:
        return DeepseekV4Config.from_dict(plain)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise several types
        raise UserError(f"{path}: config rejected by transformers: {str(exc).splitlines()[0]}") from None


def _weight_files(model_dir: Path) -> tuple[Path, dict[Path, set[str] | None]]:
    """The file that lists the weights (single file or index), and each safetensors file with the keys the
    index assigns it (None for a single unindexed file)."""
    single, index = model_dir / SINGLE_FILE, model_dir / INDEX_NAME
    if single.is_file():              # transformers prefers the single file too
        return single, {single: None}
    if not index.is_file():
        raise UserError(f"checkpoint {model_dir}: no {SINGLE_FILE} or {INDEX_NAME} (only safetensors is read)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"{index}: not a safetensors index (need a JSON object with 'weight_map'): {exc}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file")
    files: dict[Path, set[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name:
            raise UserError(f"{index}: tensor {key} maps to {name!r}, expected a file name in {model_dir}")
        files.setdefault(model_dir / name, set()).add(key)
    for path in files:
        if not path.is_file():
            raise UserError(f"{index}: shard {path.name} is listed but {path} does not exist")
    return index, files


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise UserError(f"{path}: corrupt or truncated safetensors file ({exc})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _header(path: Path) -> dict[str, tuple[str, list[int]]]:
    with _open(path) as f:
        try:
            return {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
        except SafetensorError as exc:
            raise UserError(f"{path}: corrupt safetensors header ({exc})") from None


def _meta_model(config: DeepseekV4Config) -> DeepseekV4ForCausalLM:
    with no_init_weights(), torch.device("meta"):
        return DeepseekV4ForCausalLM(copy.deepcopy(config))


def _scale_owner(key: str) -> str | None:
    """The weight a scale tensor belongs to, by name: release ``<m>.scale``, transformers ``<w>_scale_inv``."""
    if key.endswith(".scale"):
        return key[: -len(".scale")] + ".weight"
    if key.endswith("_scale_inv"):
        return key[: -len("_scale_inv")]
    return None


def _shape_str(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _few(names: list[str]) -> str:
    more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more


def _scan(model_dir: str | Path) -> _Checkpoint:
    """Read config and headers and check every tensor against the config; no tensor data is read."""
    root = Path(model_dir)
    config_path, raw = _read_config(root)
    quant = _check_quantization(raw, config_path)
    config = _build_config(raw, config_path)
    listing, files = _weight_files(root)

    headers: dict[str, tuple[Path, str, list[int]]] = {}
    for path, listed in files.items():
        header = _header(path)
        if listed is not None and (absent := sorted(listed - header.keys())):
            raise UserError(f"{path}: the index lists {_few(absent)} in this shard but the file does not hold it")
        for key, (dtype, shape) in header.items():
            if key in headers:
                raise UserError(f"{path}: tensor {key} is also in {headers[key][0].name}")
            headers[key] = (path, dtype, shape)

    meta = _meta_model(config)
    state = meta.state_dict()
    shapes = {k: v.shape for k, v in state.items()}
    dtypes = {k: v.dtype for k, v in state.items()}
    conversions = get_model_conversion_mapping(meta)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    n_experts = config.n_routed_experts

    scales = {k for k in headers if (owner := _scale_owner(k)) is not None and owner in headers}
    entries: list[_Entry] = []
    covered: dict[str, set] = {}
    for key, (path, dtype, shape) in headers.items():
        if key in scales or key.startswith("mtp.") or ".mtp." in key:
            continue
        entry = _Entry(key=key, file=path, dtype=dtype, shape=shape)
        for scale_key in (key[: -len(".weight")] + ".scale" if key.endswith(".weight") else None, key + "_scale_inv"):
            if scale_key in headers:
                entry.scale_key = scale_key
                entry.scale_file, entry.scale_dtype, entry.scale_shape = headers[scale_key]
        target, converter = rename_source_key(key, renamings, converters, meta.base_model_prefix, state)
        if target not in shapes and key in shapes:
            # As from_pretrained: a key that already is a model name is taken as is (e.g. model.norm.weight).
            target, converter = rename_source_key(key, [], [], meta.base_model_prefix, state)
        if converter is not None:
            match = _EXPERT_RE.search(key)
            if match is None or target not in shapes or int(match.group(1)) >= n_experts:
                raise UserError(f"{path}: unexpected tensor {key} (no routed expert of that name with "
                                f"n_routed_experts={n_experts} in {config_path})")
            entry.expert, entry.proj = int(match.group(1)), match.group(2)
            full = shapes[target]
            expected = [full[1] // 2, full[2]] if entry.proj != "w2" else [full[1], full[2]]
            part = (entry.expert, entry.proj)
        elif target in shapes:
            expected, part = list(shapes[target]), None
        else:
            raise UserError(f"{path}: unexpected tensor {key} (no such parameter in DeepseekV4ForCausalLM "
                            f"for {config_path})")
        entry.target = target
        _check_quantized(entry, quant, config_path)
        stored_float = entry.kind != "plain" or dtype in ("F64", "F32", "BF16", "F16")
        if dtypes[target].is_floating_point != stored_float:
            want = "a floating-point" if dtypes[target].is_floating_point else "an integer"
            raise UserError(f"{path}: tensor {key} has dtype {dtype}, expected {want} tensor"
                            + (" (a packed fp4 weight needs its .scale)" if dtype in _FP4_DTYPES else ""))
        if entry.logical_shape != expected:
            raise UserError(f"{path}: config/weights mismatch: tensor {key} has shape {_shape_str(entry.logical_shape)}"
                            f" but {config_path} implies {_shape_str(expected)}")
        done = covered.setdefault(target, set())
        if part in done or (part is None and done) or (part is not None and None in done):
            raise UserError(f"{path}: tensor {key} loads {target}, which another tensor already supplies")
        done.add(part)
        entries.append(entry)

    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    expert_parts = {(e, p) for e in range(n_experts) for p in ("w1", "w3")}
    missing = []
    for target in shapes:
        done = covered.get(target, set())
        if target in tied or None in done:
            continue
        if target.endswith("experts.gate_up_proj"):
            missing += [f"{target}[expert {e} {p}]" for e, p in sorted(expert_parts - done)]
        elif target.endswith("experts.down_proj"):
            missing += [f"{target}[expert {e} w2]" for e in range(n_experts) if (e, "w2") not in done]
        else:
            missing.append(target)
    if missing:
        raise UserError(f"{listing}: missing {len(missing)} tensor(s) that {config_path.name} needs: {_few(missing)}")
    return _Checkpoint(root, raw, config, quant, entries)


def _check_quantized(entry: _Entry, quant: _Quant | None, config_path: Path) -> None:
    where = f"{entry.file}: tensor {entry.key}"
    if entry.dtype not in _FP8_DTYPES | _FP4_DTYPES and entry.dtype.startswith(("F8", "F4", "F6")):
        raise UserError(f"{where} has dtype {entry.dtype}: accepted quantized dtypes are F8_E4M3 (fp8 block) "
                        f"and I8/U8 (packed fp4 e2m1)")
    if entry.scale_key is None:
        if entry.dtype in _FP8_DTYPES:
            raise UserError(f"{where} is {entry.dtype} but has no scale tensor (.scale or _scale_inv)")
        return
    if entry.dtype not in _FP8_DTYPES | _FP4_DTYPES:
        raise UserError(f"{entry.scale_file}: tensor {entry.scale_key} scales {entry.key}, which is not "
                        f"quantized ({entry.dtype})")
    if quant is None:
        raise UserError(f"{where} is quantized ({entry.dtype} with {entry.scale_key}) but {config_path} "
                        f"has no quantization_config")
    if entry.scale_dtype not in _SCALE_DTYPES:
        raise UserError(f"{entry.scale_file}: scale {entry.scale_key} has dtype {entry.scale_dtype}: "
                        f"accepted are {', '.join(sorted(_SCALE_DTYPES))}")
    n, k = entry.logical_shape[-2:] if len(entry.shape) >= 2 else (None, None)
    if n is None:
        raise UserError(f"{where}: a quantized tensor must have at least 2 dimensions, got {_shape_str(entry.shape)}")
    if entry.kind == "fp8":
        bn, bk = quant.block
        grid = [math.ceil(n / bn), math.ceil(k / bk)]
        layout = f"fp8 blocks {bn}x{bk}"
    else:
        grid = [n, math.ceil(k / FP4_GROUP)]
        layout = f"fp4 groups of {FP4_GROUP} along K"
    expected = entry.shape[:-2] + grid
    if entry.scale_shape != expected:
        raise UserError(f"{entry.scale_file}: config/weights mismatch: scale {entry.scale_key} has shape "
                        f"{_shape_str(entry.scale_shape)} but {entry.key} {_shape_str(entry.logical_shape)} with "
                        f"{layout} implies {_shape_str(expected)}")


@contextlib.contextmanager
def _readers() -> Iterator[dict]:
    """Open safetensors files on first use, all closed at the end (a scale may sit in another shard)."""
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def get(path: Path, key: str) -> torch.Tensor:
            if path not in handles:
                handles[path] = stack.enter_context(_open(path))
            try:
                return handles[path].get_tensor(key)
            except SafetensorError as exc:
                raise UserError(f"{path}: cannot read tensor {key}, the file is corrupt ({exc})") from None

        yield get


def _materialize(entry: _Entry, ckpt: _Checkpoint, get) -> torch.Tensor:
    """The tensor as the model wants it: dequantized to float32 when quantized, else as stored."""
    value = get(entry.file, entry.key)
    if entry.kind == "plain":
        return value
    scale = get(entry.scale_file, entry.scale_key)
    if not torch.isfinite(ue8m0_decode(scale)).all():
        raise UserError(f"{entry.scale_file}: scale {entry.scale_key} holds NaN/inf (ue8m0 byte 255?)")
    if entry.kind == "fp8":
        return dequantize_fp8_block(value, scale, ckpt.quant.block)
    return dequantize_fp4_e2m1(value, scale)


def _iter_tensors(ckpt: _Checkpoint) -> Iterator[tuple[_Entry, torch.Tensor]]:
    with _readers() as get:
        for entry in sorted(ckpt.entries, key=lambda e: (str(e.file), e.key)):
            yield entry, _materialize(entry, ckpt, get)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if isinstance(dtype, torch.dtype) and dtype in names.values():
        return dtype
    if isinstance(dtype, str) and dtype in names:
        return names[dtype]
    raise UserError(f"dtype {dtype!r}: accepted are {', '.join(names)}")


def load_pretrained(model_dir: str | Path, dtype: torch.dtype | str = torch.bfloat16) -> DeepseekV4ForCausalLM:
    """Load a DeepSeek-V4 checkpoint directory for full-parameter training (see the module docstring)."""
    dtype = _resolve_dtype(dtype)
    ckpt = _scan(model_dir)
    # Built as from_pretrained builds it: same constructor path and dtype context, so the modules transformers
    # keeps in fp32 (mHC, norms, sinks, ...) stay fp32; no random init, every tensor comes from the checkpoint.
    with no_init_weights():
        model = DeepseekV4ForCausalLM._from_config(copy.deepcopy(ckpt.config), dtype=dtype)
    state = model.state_dict()
    n_experts = ckpt.config.n_routed_experts
    with torch.no_grad():
        for entry, value in _iter_tensors(ckpt):
            if entry.target.endswith("tid2eid") and value.numel() and not 0 <= value.min() <= value.max() < n_experts:
                raise UserError(f"{entry.file}: tensor {entry.key} routes tokens to experts outside "
                                f"0..{n_experts - 1} (n_routed_experts in config.json)")
            dest = state[entry.target]
            if entry.proj == "w2":
                dest = dest[entry.expert]
            elif entry.proj is not None:                 # gate_up_proj[e] = cat(w1_e, w3_e)
                half = dest.shape[1] // 2
                dest = dest[entry.expert, :half] if entry.proj == "w1" else dest[entry.expert, half:]
            dest.copy_(value)
        if ckpt.config.tie_word_embeddings:
            model.tie_weights()
    model.eval()
    return model


# ----------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------

def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


@contextlib.contextmanager
def _atomic_dir(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A fresh sibling directory to write into; it replaces ``out_dir`` only when the block completes."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir}: exists and is not empty (pass overwrite=True to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if out_dir.is_dir() and any(out_dir.iterdir()):
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)
            except BaseException:
                os.rename(old, out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)             # rename(2) replaces an empty directory atomically
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _shard_bytes(max_shard_size: int | str) -> int:
    try:
        size = convert_file_size_to_int(max_shard_size)
    except (ValueError, TypeError):
        size = -1
    if not isinstance(size, int) or size <= 0:
        raise UserError(f"max_shard_size {max_shard_size!r}: accepted is a positive byte count or a size like '5GB'")
    return size


class _ShardWriter:
    """Fills shards up to a byte budget (a weight and its scale stay together) and writes the index."""

    def __init__(self, root: Path, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending.update({k: v.contiguous() for k, v in tensors.items()})
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        if self.pending:
            save_file(self.pending, str(self.root / f"shard-{len(self.shards):05d}.tmp"), metadata={"format": "pt"})
            self.shards.append(list(self.pending))
            self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        if len(self.shards) == 1:
            os.rename(self.root / "shard-00000.tmp", self.root / SINGLE_FILE)
            return
        weight_map = {}
        for i, keys in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.rename(self.root / f"shard-{i:05d}.tmp", self.root / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.root / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def release_name(model_key: str, expert: int | None = None, proj: str | None = None) -> str:
    """The release checkpoint name of a model state-dict key (one routed expert's projection when given)."""
    if model_key in _TO_RELEASE_TOP:
        return _TO_RELEASE_TOP[model_key]
    match = _LAYER_RE.match(model_key)
    if match:
        layer, rest = match.groups()
        if expert is not None and rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            return f"layers.{layer}.ffn.experts.{expert}.{proj}.weight"
        if rest in _TO_RELEASE_LAYER:
            return f"layers.{layer}.{_TO_RELEASE_LAYER[rest]}"
    raise ValueError(f"no release name for {model_key}")


def _release_tensors(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One release tensor, quantized (with its scale) or cast to the dtype the release stores it in."""
    if not value.is_floating_point():
        return {name: value.to(torch.int64)}
    if not torch.isfinite(value).all():
        raise UserError(f"tensor {name} holds NaN/inf values; refusing to quantize")
    base = name[: -len(".weight")]
    if _RELEASE_FP4_RE.search(name):
        if value.shape[-1] % 2:
            raise UserError(f"tensor {name} has {value.shape[-1]} input features; fp4 packing needs an even number")
        q, s = quantize_fp4_e2m1(value)
        return {name: q, base + ".scale": s}
    if _RELEASE_FP8_RE.search(name):
        q, s = quantize_fp8_block(value)
        return {name: q, base + ".scale": s}
    return {name: value.to(torch.float32 if _RELEASE_FP32_RE.search(name) else torch.bfloat16)}


def _copy_side_files(src: Path, dst: Path, names=TOKENIZER_FILES + ("generation_config.json",)) -> None:
    for name in names:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def quantize_checkpoint(src_dir: str | Path, dst_dir: str | Path, max_shard_size: int | str = "5GB",
                        overwrite: bool = False) -> Path:
    """Write ``src_dir`` in the DeepSeek-V4 release layout (fp8 e4m3 + ue8m0 128x128 block scales, routed experts
    fp4 e2m1 + ue8m0 per 32, the rest in the release dtypes) with the matching ``quantization_config``.
    One tensor at a time, so memory stays near one shard; the output appears only when complete."""
    ckpt = _scan(src_dir)
    dst = Path(dst_dir)
    max_bytes = _shard_bytes(max_shard_size)
    raw = {k: v for k, v in ckpt.raw_config.items() if k not in ("expert_dtype", "torch_dtype")}
    raw["quantization_config"] = copy.deepcopy(RELEASE_QUANTIZATION)
    raw["dtype"] = "bfloat16"
    with _atomic_dir(dst, overwrite) as tmp:
        writer = _ShardWriter(tmp, max_bytes)
        for entry, value in _iter_tensors(ckpt):
            if entry.expert is not None:
                writer.add(_release_tensors(release_name(entry.target, entry.expert, entry.proj), value))
            elif entry.target.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # A fused (transformers-layout) expert tensor: one release tensor per expert and projection.
                gate_up = entry.target.endswith("gate_up_proj")
                half = value.shape[1] // 2
                for e in range(value.shape[0]):
                    parts = {"w1": value[e, :half], "w3": value[e, half:]} if gate_up else {"w2": value[e]}
                    for proj, part in parts.items():
                        writer.add(_release_tensors(release_name(entry.target, e, proj), part))
            else:
                writer.add(_release_tensors(release_name(entry.target), value))
        writer.close()
        (tmp / CONFIG_NAME).write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        _copy_side_files(ckpt.root, tmp)
    return dst


def _tokenizer_files(tokenizer_dir: str | Path) -> list[Path]:
    root = Path(tokenizer_dir)
    if not root.is_dir():
        raise UserError(f"tokenizer {root}: no such directory")
    found = [root / name for name in TOKENIZER_FILES if (root / name).is_file()]
    if not found:
        raise UserError(f"tokenizer {root}: none of {', '.join(TOKENIZER_FILES)}")
    return found


def export_hf(model: DeepseekV4ForCausalLM, out_dir: str | Path, tokenizer_dir: str | Path | None = None, *,
              dtype: torch.dtype | str | None = None, overwrite: bool = False,
              max_shard_size: int | str = "5GB") -> Path:
    """Save ``model`` as an HF checkpoint that ``DeepseekV4ForCausalLM.from_pretrained(out_dir)`` loads back.

    ``dtype=None`` keeps the model's tensors as they are; ``dtype=torch.bfloat16`` stores each tensor in the dtype
    ``from_pretrained(..., dtype=torch.bfloat16)`` would hold it in (the fp32-kept modules stay fp32). Written into
    a temporary sibling of ``out_dir`` and renamed at the end: a failure leaves ``out_dir`` as it was."""
    out = Path(out_dir)
    tokenizer = _tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []
    _shard_bytes(max_shard_size)
    state_dict = None
    target = model.dtype
    if dtype is not None:
        target = _resolve_dtype(dtype)
        with no_init_weights(), torch.device("meta"):
            reference = DeepseekV4ForCausalLM._from_config(copy.deepcopy(model.config), dtype=target)
        wanted = {k: v.dtype for k, v in reference.state_dict().items()}
        state_dict = {k: v.detach().to(wanted.get(k, target)) if v.is_floating_point() else v.detach()
                      for k, v in model.state_dict().items()}
    with _atomic_dir(out, overwrite) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict, max_shard_size=max_shard_size)
        config_path = tmp / CONFIG_NAME
        config = json.loads(config_path.read_text())
        config.pop("quantization_config", None)     # the export is plain floating point
        config.pop("torch_dtype", None)
        config["dtype"] = str(target).removeprefix("torch.")
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for path in tokenizer:
            shutil.copy2(path, tmp / path.name)
    return out
