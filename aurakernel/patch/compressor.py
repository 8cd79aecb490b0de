"""The compressor kernel in a model: its torch ops (custom ops with autograd and fake registrations) and the patched forwards."""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from ..dtypes import DType
from ..ops.base import Problem, Tensors
from ..ops.compressor import CompressorPool, SPEC, pool_reference
from ..targets.host.library import built_kernel
from .base import Patch, bind
from .indexer_score import causal_scores
from .install import copied_from
from .rms_norm import norm_eps
from .torch_op import torch_op


_SAVED = ("rstd", "p", "pooled", "exact")   # what the forward keeps for the backward


def _inputs(kv, gate, position_bias, weight) -> Tensors:
    return {"kv": kv.contiguous(), "gate": gate.contiguous(), "position_bias": position_bias.float().contiguous(),
            "weight": weight.float().contiguous()}


def _forward(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, weight: torch.Tensor, eps: float,
             kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, rstd, p, pooled, exact): all but y are residuals for the backward; eps is kv_norm's."""
    inputs = {**_inputs(kv, gate, position_bias, weight), "eps": eps}
    outputs = built_kernel(kernel).empty_outputs(None, inputs)
    built_kernel(kernel).run_forward(inputs, outputs)
    return outputs["y"], *(outputs[n] for n in _SAVED)


def _fake_forward(kv, gate, position_bias, weight, eps, kernel):
    outputs = built_kernel(kernel).empty_outputs(None, {"kv": kv, "position_bias": position_bias, "weight": weight})
    return outputs["y"], *(outputs[n] for n in _SAVED)


def _backward(dy: torch.Tensor, kv: torch.Tensor, position_bias: torch.Tensor, weight: torch.Tensor,
              rstd: torch.Tensor, p: torch.Tensor, pooled: torch.Tensor, exact: torch.Tensor,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    kv, w32 = kv.contiguous(), weight.float().contiguous()
    grads = {"kv": torch.empty_like(kv), "gate": torch.empty_like(kv),
             "position_bias": kv.new_empty(position_bias.shape, dtype=torch.float32), "weight": torch.empty_like(w32)}
    built_kernel(kernel).run_backward({"kv": kv, "weight": w32},
                      {"rstd": rstd, "p": p, "pooled": pooled, "exact": exact}, {"y": dy.to(kv.dtype)}, grads)
    return grads["kv"], grads["gate"], grads["position_bias"].to(position_bias.dtype), grads["weight"].to(weight.dtype)


def _fake_backward(dy, kv, position_bias, weight, rstd, p, pooled, exact, kernel):
    return kv.new_empty(kv.shape), kv.new_empty(kv.shape), position_bias.new_empty(position_bias.shape), \
        weight.new_empty(weight.shape)


POOL_OP = torch_op("compressor", _forward, _backward, fake_forward=_fake_forward, fake_backward=_fake_backward,
                   outputs=1, saved=("kv", "position_bias", "weight"), consts=("kernel",),
                   grads=("kv", "gate", "position_bias", "weight"))


def _pool_op(kv, gate, position_bias, kv_norm: torch.nn.Module, kernel: str) -> torch.Tensor:
    """kv_norm(pooling) through the kernel, with that norm's weight and epsilon."""
    return POOL_OP(kv, gate, position_bias, kv_norm.weight, norm_eps(kv_norm), kernel)


def _pooled(module, kv, gate, ratio: int, head_dim: int, overlap: bool):
    """kv_norm(pooling) through the kernel when one fits, else the reference lines."""
    kernel = None
    if kv.device.type == "cpu" and kv.dtype == gate.dtype:
        lookup = getattr(module, "_ak_lookup", None)   # None: installed by sparse_attention alone
        kernel = lookup((ratio, head_dim), kv.dtype) if lookup is not None else None
    if kernel is None:
        return module.kv_norm(pool_reference(kv, gate, module.position_bias, ratio, head_dim, overlap))
    return _pool_op(kv, gate, module.position_bias, module.kv_norm, kernel)


def _pool_forward(self: CompressorPool, kv, gate, position_bias):
    kernel = self._ak_lookup((self.ratio, self.head_dim), kv.dtype)
    return _pool_op(kv, gate, position_bias, self.kv_norm, kernel)


def _rope_at_windows(module, compressed, n_windows: int, batch: int, rope):
    """The pooled keys rotated at their windows' first positions; `rope` is the caller's
    apply_rotary_pos_emb (the kernel's dispatcher where rope is patched too)."""
    positions = torch.arange(n_windows, device=compressed.device)
    positions = (positions * module.compress_rate).unsqueeze(0).expand(batch, -1)
    cos, sin = module.rotary_emb(compressed, position_ids=positions, layer_type=module.rope_layer_type)
    return rope(compressed.unsqueeze(1), cos, sin).squeeze(1)


@copied_from(v4.DeepseekV4HCACompressor, "forward", "3fb94114cb4ed493")
def _hca_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
    """DeepseekV4HCACompressor.forward (transformers 5.24), training path through the kernel."""
    if cache is not None:
        return v4.DeepseekV4HCACompressor.forward(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    batch = hidden_states.shape[0]
    kv, gate = self.kv_proj(hidden_states), self.gate_proj(hidden_states)
    n_windows = kv.shape[1] // self.compress_rate
    if n_windows > 0:
        compressed = _pooled(self, kv, gate, self.compress_rate, self.head_dim, overlap=False)
        compressed = _rope_at_windows(self, compressed, n_windows, batch, apply_rotary_pos_emb)
    else:
        compressed = kv.new_zeros((batch, 0, self.head_dim))
    compressed_kv = compressed.unsqueeze(1)
    compressed_len, seq_len = compressed_kv.shape[2], position_ids.shape[1]
    if seq_len == 1 or compressed_len == 0 or getattr(self, "_ak_selection", False):
        return compressed_kv, None   # the sparse attention applies the causal rule itself
    entry_indices = torch.arange(compressed_len, device=compressed_kv.device)
    causal_threshold = (position_ids + 1) // self.compress_rate
    block_bias = compressed_kv.new_zeros((batch, 1, seq_len, compressed_len))
    block_bias = block_bias.masked_fill(entry_indices.view(1, 1, 1, -1) >= causal_threshold.unsqueeze(1).unsqueeze(-1),
                                        float("-inf"))
    return compressed_kv, block_bias


@copied_from(v4.DeepseekV4CSACompressor, "forward", "3644b0ea966e20d2")
def _csa_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
    """DeepseekV4CSACompressor.forward (transformers 5.24), training path through the kernel."""
    if cache is not None:
        return v4.DeepseekV4CSACompressor.forward(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    batch, seq_len, _ = hidden_states.shape
    kv, gate = self.kv_proj(hidden_states), self.gate_proj(hidden_states)
    n_windows = kv.shape[1] // self.compress_rate
    if n_windows > 0:
        compressed = _pooled(self, kv, gate, self.compress_rate, self.head_dim, overlap=True)
        compressed = _rope_at_windows(self, compressed, n_windows, batch, apply_rotary_pos_emb)
    else:
        compressed = kv.new_zeros((batch, 0, self.head_dim))
    compressed_kv = compressed.unsqueeze(1)
    top_k_indices = self.indexer(hidden_states, q_residual, position_ids, cache, layer_idx)
    if getattr(self, "_ak_selection", False):
        return compressed_kv, top_k_indices   # the sparse attention takes the picks, not a dense bias
    compressed_len = compressed_kv.shape[2]
    valid = top_k_indices >= 0
    safe_indices = torch.where(valid, top_k_indices, torch.full_like(top_k_indices, compressed_len))
    block_bias = compressed_kv.new_full((batch, 1, seq_len, compressed_len + 1), float("-inf"))
    block_bias.scatter_(-1, safe_indices.unsqueeze(1), 0.0)
    return compressed_kv, block_bias[..., :compressed_len]


@copied_from(v4.DeepseekV4Indexer, "forward", "428c5223ef907ac9")
def _indexer_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
    """DeepseekV4Indexer.forward (transformers 5.24), training path with its pooling through the kernel."""
    if cache is not None:
        return v4.DeepseekV4Indexer.forward(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    batch, seq_len, _ = hidden_states.shape
    kv, gate = self.kv_proj(hidden_states), self.gate_proj(hidden_states)
    n_windows = kv.shape[1] // self.compress_rate
    if n_windows > 0:
        compressed = _pooled(self, kv, gate, self.compress_rate, self.head_dim, overlap=True)
        compressed_kv = _rope_at_windows(self, compressed, n_windows, batch, apply_rotary_pos_emb)
    else:
        compressed_kv = kv.new_zeros((batch, 0, self.head_dim))
    cos_q, sin_q = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type=self.rope_layer_type)
    q = self.q_b_proj(q_residual).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)
    compressed_len = compressed_kv.shape[1]
    top_k = min(self.index_topk, compressed_len)
    if compressed_len > 0:
        causal_threshold = (position_ids + 1) // self.compress_rate
        # the scores with the future entries at -inf (through the scorer's kernel: never computed)
        index_scores = causal_scores(self.scorer, q, compressed_kv, hidden_states, causal_threshold)
        top_k_indices = index_scores.topk(top_k, dim=-1).indices
        invalid = top_k_indices >= causal_threshold.unsqueeze(-1)
        return torch.where(invalid, torch.full_like(top_k_indices, -1), top_k_indices)
    return self.scorer(q, compressed_kv, hidden_states).topk(top_k, dim=-1).indices


class CompressorPatch(Patch):
    def call_problem(self, module, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None:
            return None
        ratio, d = module.compress_rate, module.head_dim
        variant = "hca" if isinstance(module, v4.DeepseekV4HCACompressor) else "csa"
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else module.kv_proj.weight.dtype
        if dtype not in (dt.torch for dt in self.spec.dtypes) or x.shape[1] < ratio:
            return None
        return Problem(self.spec.name, variant, (x.shape[0], x.shape[1] // ratio, ratio, d), DType.from_torch(dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        bind(module, lookup, self.spec.name, [(v4.DeepseekV4HCACompressor, "forward", _hca_forward),
                                         (v4.DeepseekV4CSACompressor, "forward", _csa_forward),
                                         (v4.DeepseekV4Indexer, "forward", _indexer_forward),
                                         (CompressorPool, "forward", _pool_forward)])


PARTS = (CompressorPatch(SPEC),)
