"""The sparse_attention kernel in a model: its torch op (custom op with autograd and fake
registrations) and DeepseekV4Attention's patched forward.

The patched forward computes q and kv as transformers does, then hands the attention the pieces
instead of a dense mask: the window's kv, the compressed kv and the indexer's picks (the
compressors, patched too, return their selection instead of the dense block bias). The kernel runs
when the call is one it computes exactly:
  - the model was called without a padding mask, position ids or cache (training on packed
    sequences, as the trainer does): then the mask it would build is its plain sliding-window causal
    mask over positions 0..S-1. A pre-hook on the model says so to every layer's attention call (the
    `aurakernel_plain_window` keyword, handed down with the model's **kwargs) and, when every
    attention of the model is patched, keeps the model from building that dense [B, 1, S, S] mask at
    all; a call with a 2-D attention_mask, even all ones, keeps the reference;
  - no dropout, no attention weights asked for, the eager (or sdpa) attention implementation;
  - a verified kernel for the layer's (heads, head_dim, window, top-k or ratio) and dtype.
Otherwise the module runs the reference lines, with the compressor's selection turned back into
transformers' block bias (and attn_softmax, where patched, in its eager attention).
The kernel returns no attention weights; a module whose caller reads only the probability mass on
the compressed entries (the indexer KL objective sets `aurakernel_wants_compressed_mass`) gets that
from the kernel's logsumexp instead (compressed_mass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
from transformers.models.deepseek_v4.modeling_deepseek_v4 import ALL_ATTENTION_FUNCTIONS, apply_rotary_pos_emb

from ..dtypes import DType
from ..ops.base import Problem
from ..ops.sparse_attention import SPEC, SparseAttention, block_bias, sparse_attention_reference, window_mask
from ..targets.host.library import built_kernel
from ..targets.host.ops.sparse_attention import backward, forward, rows_in_place, sorted_indices
from .base import Patch
from .compressor import _csa_forward, _hca_forward
from .install import copied_from, install, require
from .torch_op import torch_op

VARIANT_OF_LAYER = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                    "heavily_compressed_attention": "hca"}


def _forward(q: torch.Tensor, kv: torch.Tensor, compressed_kv: torch.Tensor | None, indices: torch.Tensor | None,
             sinks: torch.Tensor, scaling: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, H, D], lse [B, H, S]): the backward needs both; lse is not differentiated (it is
    an output for what reads the attention's probabilities: compressed_mass). `indices` come sorted."""
    b, h, s, d = q.shape
    out, lse = q.new_empty(b, s, h, d), q.new_empty(b, h, s, dtype=torch.float32)
    forward(built_kernel(kernel), q, kv.contiguous(),
            compressed_kv.contiguous() if compressed_kv is not None else None, indices, sinks.float().contiguous(),
            out, lse, scaling)
    return out, lse


def _fake_forward(q, kv, compressed_kv, indices, sinks, scaling, kernel):
    b, h, s, d = q.shape
    return q.new_empty(b, s, h, d), q.new_empty(b, h, s, dtype=torch.float32)


def _gradients(q: torch.Tensor, kv: torch.Tensor, compressed_kv: torch.Tensor | None):
    """The backward's operands it allocates gradients like, and those gradients (dq in q's layout, as
    it comes or contiguous: the kernel writes it through q's rows; the rest contiguous): the fake
    backward makes the same, so a compiled graph sees the strides the kernel writes."""
    q, kv = rows_in_place(q)[0], kv.contiguous()
    ckv = compressed_kv.contiguous() if compressed_kv is not None else None
    grads = (torch.empty_like(q), torch.empty_like(kv), torch.empty_like(ckv) if ckv is not None else q.new_empty(0),
             q.new_empty(q.shape[1], dtype=torch.float32))
    return (q, kv, ckv), grads


def _backward(dy: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, compressed_kv: torch.Tensor | None,
              indices: torch.Tensor | None, sinks: torch.Tensor, y: torch.Tensor, lse: torch.Tensor, scaling: float,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    (q, kv, ckv), (dq, dkv, dckv, dsinks) = _gradients(q, kv, compressed_kv)
    backward(built_kernel(kernel), q, kv, ckv, indices, sinks.float().contiguous(), y.contiguous(), lse,
             dy.to(q.dtype), dq, dkv, dckv if ckv is not None else None, dsinks, scaling)
    return dq, dkv, dckv, dsinks.to(sinks.dtype)


def _fake_backward(dy, q, kv, compressed_kv, indices, sinks, y, lse, scaling, kernel):
    dq, dkv, dckv, dsinks = _gradients(q, kv, compressed_kv)[1]
    return dq, dkv, dckv, dsinks.to(sinks.dtype)


OP = torch_op("sparse_attention", _forward, _backward, fake_forward=_fake_forward, fake_backward=_fake_backward,
              outputs=2, differentiable=1, save_outputs=True,
              saved=("q", "kv", "compressed_kv", "indices", "sinks"), consts=("scaling", "kernel"),
              grads=("q", "kv", "compressed_kv", "sinks"))


# the largest [B, H, rows, T] block of scores compressed_mass holds at once (floats: 64 MB)
MASS_BLOCK_FLOATS = 1 << 24


@torch.no_grad()
def compressed_mass(q, compressed_kv, indices, lse, scaling: float, block_floats: int = MASS_BLOCK_FLOATS) -> torch.Tensor:
    """What a reader of the attention probabilities over the compressed entries needs (the indexer
    KL objective: `weights[..., -T:].sum(dim=1)`), without the dense weights: the probability of
    each selected entry, summed over heads, as [B, 1, S, T] (0 where not selected), from the kernel's
    logsumexp. `indices` sorted ascending; a repeated pick counts once, as in the dense mask.
    Every query's scores against all T entries, a block of query rows at a time (a batched GEMM),
    then masked to the picks: gathering each pick's key row first ([B, S, k, D], 4 MB a call at the
    tiny config) made it 3x slower (4.3 -> 1.4 ms a call on an AVX2 EPYC), and the blocks keep its
    memory bounded at any length."""
    batch, heads, seq, _ = q.shape
    entries = compressed_kv.shape[1]
    valid = (indices >= 0) & (indices < entries)
    valid[..., 1:] &= indices[..., 1:] != indices[..., :-1]
    picked = torch.zeros(batch, seq, entries, device=q.device).scatter_add_(
        -1, torch.where(valid, indices, 0), valid.float()) > 0                                  # [B, S, T]
    keys = compressed_kv.float().transpose(-1, -2).unsqueeze(1)                                  # [B, 1, D, T]
    out = torch.empty(batch, seq, entries, device=q.device)
    rows = max(1, block_floats // max(1, batch * heads * entries))
    for s0 in range(0, seq, rows):
        s1 = min(seq, s0 + rows)
        scores = torch.matmul(q[:, :, s0:s1].float(), keys).mul_(scaling)                       # [B, H, rows, T]
        out[:, s0:s1] = scores.sub_(lse[:, :, s0:s1].unsqueeze(-1)).exp_().sum(dim=1)
    # where, not a product: an entry not picked may score above the logsumexp (exp overflows)
    return torch.where(picked, out, 0.0).unsqueeze(1)


# --- what the model was called with -------------------------------------------------------------

PLAIN = "aurakernel_plain_window"   # the keyword the model's pre-hook hands its layers' attention calls


def _mark_plain_calls(model, args, kwargs):
    """DeepseekV4Model forward pre-hook: a call without a padding mask, position ids or cache would
    build the plain sliding-window causal mask over positions 0..S-1, which the kernel computes; the
    flag reaches every layer's attention through the **kwargs the model hands down (checkpoint
    recompute included), and is a static fact torch.compile can guard on."""
    plain = (kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None
             and kwargs.get("cache") is None and not kwargs.get("use_cache"))
    return args, {**kwargs, PLAIN: plain}


def _mark_plain_calls_without_mask(model, args, kwargs):
    """_mark_plain_calls for a model whose every attention runs the patched forward: a plain call
    also skips building the dense [B, 1, S, S] mask (1 GB of fp32 at 16K tokens, 16 GB at 64K). The
    model takes a dict of prebuilt masks as is; the layers get None, and an attention that falls
    back to the reference lines builds the mask itself."""
    args, kwargs = _mark_plain_calls(model, args, kwargs)
    if kwargs[PLAIN]:
        kwargs["attention_mask"] = {"sliding_attention": None}
    return args, kwargs


# --- the patched forward -------------------------------------------------------------------------

def kernel_key(module) -> tuple[int, int, int, int]:
    cfg = module.config
    variant = VARIANT_OF_LAYER[module.layer_type]
    extra = {"csa": cfg.index_topk, "hca": cfg.compress_rates["heavily_compressed_attention"], "sliding": 1}[variant]
    return (module.num_heads, module.head_dim, module.sliding_window, extra)


def _kernel_for(self, q, kv, compressed_kv, cache, kwargs) -> str | None:
    if (cache is not None or not kwargs.get(PLAIN) or q.device.type != "cpu" or (self.training and self.attention_dropout > 0)
            or kwargs.get("output_attentions") or self.config._attn_implementation not in ("eager", "sdpa")
            or (compressed_kv is not None and compressed_kv.dtype != q.dtype) or kv.dtype != q.dtype):
        return None
    return self._ak_lookup(kernel_key(self), q.dtype)


@copied_from(v4.DeepseekV4Attention, "forward", "7e61a222ad0603b7")
def _attention_forward(self, hidden_states, position_embeddings, position_ids, attention_mask, cache=None, **kwargs):
    """DeepseekV4Attention.forward (transformers 5.24): the sparse kernel where it computes the call,
    else the reference lines."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings[self.rope_layer_type]

    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2)
    q = self.q_b_norm(q)
    q = apply_rotary_pos_emb(q, cos, sin)

    kv = self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
    kv = apply_rotary_pos_emb(kv, cos, sin)

    if cache is not None:  # sliding where K==V
        kv = cache.update(kv, kv, self.layer_idx, kwargs=kwargs)[0]

    compressed_kv, selection = None, None
    if self.compressor is not None:   # selection: the csa picks, None (hca's rule), or a dense block bias
        compressed_kv, selection = self.compressor(hidden_states, q_residual, position_ids, cache, self.layer_idx)
    ckv = compressed_kv[:, 0] if compressed_kv is not None and compressed_kv.shape[2] > 0 else None
    dense_bias = selection is not None and selection.is_floating_point()
    kernel = None if dense_bias else _kernel_for(self, q, kv, ckv, cache, kwargs)
    if kernel is None and kwargs.get(PLAIN) and attention_mask is None:   # the model skipped building it
        attention_mask = window_mask(q.shape[2], self.sliding_window, hidden_states.dtype, q.device).expand(
            q.shape[0], 1, q.shape[2], q.shape[2])
    kwargs.pop(PLAIN, None)   # not the attention interface's
    if kernel is not None:
        indices = sorted_indices(selection) if ckv is not None and self.layer_type == "compressed_sparse_attention" else None
        attn_output, lse = OP(q, kv[:, 0], ckv, indices, self.sinks, float(self.scaling), kernel)
        attn_weights = None
        if getattr(self, "aurakernel_wants_compressed_mass", False) and indices is not None:
            attn_weights = compressed_mass(q, ckv, indices, lse, float(self.scaling))
    else:
        block = selection
        if compressed_kv is not None and not dense_bias and compressed_kv.shape[2] > 0 and q.shape[2] > 1:
            block = block_bias("csa" if self.layer_type == "compressed_sparse_attention" else "hca", q.shape[0],
                               q.shape[2], compressed_kv.shape[2], self.compressor.compress_rate, selection,
                               dtype=compressed_kv.dtype, device=q.device, positions=position_ids)
        if compressed_kv is not None:
            kv = torch.cat([kv, compressed_kv], dim=2)
        if isinstance(attention_mask, torch.Tensor) and kv.shape[2] > attention_mask.shape[-1]:
            if block is not None:
                attention_mask = torch.cat([attention_mask, block.to(attention_mask.dtype)], dim=-1)
            else:
                attention_mask = F.pad(attention_mask, (0, kv.shape[2] - attention_mask.shape[-1]), value=0.0)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    v4.eager_attention_forward)
        attn_output, attn_weights = attention_interface(
            self, q, kv, kv, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, s_aux=self.sinks, **kwargs)

    attn_output = apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = attn_output.reshape(*input_shape, self.config.o_groups, -1)
    grouped = self.o_a_proj(grouped).flatten(2)
    output = self.o_b_proj(grouped)
    return output, attn_weights


def _reference_forward(self: SparseAttention, q, kv, compressed_kv=None, indices=None):
    """The timing module (ops.sparse_attention.SparseAttention) through the kernel."""
    kernel = self._ak_lookup((q.shape[1], q.shape[3], self.window, self.extra), q.dtype)
    if kernel is None:
        return sparse_attention_reference(self, q, kv, compressed_kv, indices, q.shape[-1] ** -0.5)
    return OP(q, kv, compressed_kv, sorted_indices(indices), self.sinks, q.shape[-1] ** -0.5, kernel)[0]


class SparseAttentionPatch(Patch):
    def call_problem(self, module, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or not isinstance(module, v4.DeepseekV4Attention):
            return None
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else module.q_b_proj.weight.dtype
        if dtype not in (d.torch for d in self.spec.dtypes):
            return None
        heads, dim, window, extra = kernel_key(module)
        return Problem(self.spec.name, VARIANT_OF_LAYER[module.layer_type], (x.shape[0], heads, x.shape[1], dim,
                                                                              window, extra), DType.from_torch(dtype))

    def patch_model(self, model: torch.nn.Module, patched: list[torch.nn.Module]) -> None:
        for sub in model.modules():
            if isinstance(sub, v4.DeepseekV4Model) and not getattr(sub, "_ak_marks_plain_calls", False):
                every = all(any(a is p for p in patched) for a in sub.modules() if isinstance(a, v4.DeepseekV4Attention))
                sub.register_forward_pre_hook(_mark_plain_calls_without_mask if every else _mark_plain_calls,
                                              with_kwargs=True)
                sub._ak_marks_plain_calls = True

    def patch(self, module: torch.nn.Module, lookup) -> None:
        if isinstance(module, SparseAttention):
            module._ak_lookup = lookup
            install(module, "forward", _reference_forward)
            return
        require(module.layer_type in VARIANT_OF_LAYER, f"layer type {module.layer_type!r} is not one the kernel computes")
        compressor = module.compressor
        if compressor is not None:   # the compressor hands over its selection (its own patch may bind it too)
            fn = _csa_forward if isinstance(compressor, v4.DeepseekV4CSACompressor) else _hca_forward
            if compressor.__dict__.get("_ak_installed", {}).get("forward") is not fn:
                install(compressor, "forward", fn)
            compressor._ak_selection = True
        module._ak_lookup = lookup
        install(module, "forward", _attention_forward)


PARTS = (SparseAttentionPatch(SPEC),)
