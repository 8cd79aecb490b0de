"""Where the operators go in transformers' DeepSeek-V4: the one table of its modules, read by
`apply` (the sites it patches), the profiler (the groups it times, the problems it records) and the
modeled profile; and the built-in operators' patches (patch/<op>.py), registered here.

A row names a transformers class, the profiler group its calls belong to, and the operator whose
kernel replaces it with that kernel's compile-time extents. A module takes the rows of the first
class in the table it is an instance of (DeepseekV4Model has two: rope and the eager attention,
functions its code calls, patched in its namespace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from . import (adamw, attn_softmax, block_linear, compressor, cross_entropy, grouped_linear, indexer_score, linear,
               linear_cross_entropy, mhc, mhc_post, mhc_post_pre, moe_permute, moe_unpermute, rms_norm, rope, router,
               sparse_attention, swiglu)
from ..ops import OPS
from .base import PATCHES

PATCHES.load(rms_norm, mhc, mhc_post, mhc_post_pre, router, swiglu, rope, attn_softmax, compressor, indexer_score,
             sparse_attention, cross_entropy, linear_cross_entropy, linear, grouped_linear, block_linear, moe_permute,
             moe_unpermute, adamw)


patch_of = PATCHES.of


Key = Callable[[str, nn.Module, object], "tuple[int, ...] | None"]


@dataclass(frozen=True)
class Row:
    module: type
    group: str | None             # the profiler's group of its calls; None: part of its parent's group
    op: str | None = None         # the operator whose kernel replaces it; None: profiled only
    variant: str | Callable[[nn.Module], str] = "default"   # or the module -> its variant
    key: Key | None = None        # (name, module, config) -> the kernel's compile-time extents; None: per call
    function: bool = False        # the operator replaces a function the module's code calls (not the module)


def _unweighted_key(name, module, cfg):
    if name.endswith("input_norm"):    # mHC: the flattened streams, hc_mult x hidden
        return (cfg.hc_mult * cfg.hidden_size,)
    if name.endswith("q_b_norm"):      # per-head query norm
        return (cfg.head_dim,)
    return None


def _streams(name, module, cfg):
    return (cfg.hc_mult, cfg.hidden_size)


def _compressor(name, module, cfg):
    return (module.compress_rate, module.head_dim)


def _router(name, module, cfg):
    return (module.num_experts, module.top_k)


TABLE: tuple[Row, ...] = (
    Row(v4.DeepseekV4RMSNorm, "rms_norm", "rms_norm", "weighted", lambda n, m, c: (m.weight.shape[0],)),
    Row(v4.DeepseekV4UnweightedRMSNorm, "rms_norm", "rms_norm", "unweighted", _unweighted_key),
    Row(v4.DeepseekV4HyperConnection, "mhc_pre", "mhc_pre", key=_streams),
    Row(v4.DeepseekV4HyperHead, "mhc_head", "mhc_head", key=_streams),
    Row(v4.DeepseekV4HCACompressor, "compressor", "compressor", "hca", _compressor),
    Row(v4.DeepseekV4CSACompressor, "compressor", "compressor", "csa", _compressor),
    Row(v4.DeepseekV4Indexer, "compressor", "compressor", "csa", _compressor),
    # causal: its one caller, DeepseekV4Indexer, masks each query's entries past its position to -inf
    Row(v4.DeepseekV4IndexerScorer, None, "indexer_score", "causal", key=lambda n, m, c: (c.index_n_heads, c.index_head_dim)),
    Row(v4.DeepseekV4HashRouter, "router", "router", "hash", _router),
    Row(v4.DeepseekV4TopKRouter, "router", "router", "topk", _router),
    Row(v4.DeepseekV4Experts, "moe_experts", "swiglu", key=lambda n, m, c: (m.intermediate_dim,)),
    # and the grouped projections around it, a function its forward calls (gate_up, then down)
    Row(v4.DeepseekV4Experts, None, "grouped_linear", function=True),
    # and the routing around them: the pairs' rows sorted by expert, then weighted and summed per token
    Row(v4.DeepseekV4Experts, "moe_experts", "moe_permute",
        key=lambda n, m, c: (m.num_experts, c.num_experts_per_tok, c.hidden_size)),
    Row(v4.DeepseekV4Experts, "moe_experts", "moe_unpermute", key=lambda n, m, c: (c.num_experts_per_tok, c.hidden_size)),
    Row(v4.DeepseekV4MLP, "shared_expert", "swiglu", key=lambda n, m, c: (m.intermediate_size,)),
    Row(v4.DeepseekV4Attention, "attention", "sparse_attention",
        lambda m: sparse_attention.VARIANT_OF_LAYER.get(m.layer_type, "unknown"),
        lambda n, m, c: sparse_attention.kernel_key(m) if m.layer_type in sparse_attention.VARIANT_OF_LAYER else None),
    # what a layer runs outside its children: the stream mixing
    Row(v4.DeepseekV4DecoderLayer, "mhc_post", "mhc_post", key=_streams),
    # or its first update and the FFN's HyperConnection after it in one kernel
    Row(v4.DeepseekV4DecoderLayer, "mhc_post", "mhc_post_pre", key=_streams),
    Row(nn.Embedding, "embedding"),
    # the projections: matmul work, timed in the matmul bucket with the GEMMs outside modules; the
    # grouped output projection is an nn.Linear whose forward is a batched GEMM of its own
    Row(v4.DeepseekV4GroupedLinear, "matmul", "block_linear", key=lambda n, m, c: block_linear.block_key(m)),
    Row(nn.Linear, "matmul", "linear", key=lambda n, m, c: (m.in_features, m.out_features)),
    Row(v4.DeepseekV4Model, None, "rope", function=True),
    Row(v4.DeepseekV4Model, None, "attn_softmax", key=lambda n, m, c: (), function=True),
)


def rows_of(module: nn.Module) -> list[Row]:
    """The table's rows for `module`: those of the first class it is an instance of."""
    first = next((row.module for row in TABLE if isinstance(module, row.module)), None)
    return [row for row in TABLE if row.module is first] if first is not None else []


def group_of(module: nn.Module) -> str | None:
    """The profiler group a call of `module` belongs to (None: its parent's)."""
    rows = rows_of(module)
    return rows[0].group if rows else None


def ops_of(module: nn.Module) -> list[str]:
    """The operators whose problems a call of `module` poses (not the functions its code calls): a
    decoder layer's mhc_post, and mhc_post_pre, which computes one of its calls with the FFN's mhc_pre."""
    return [row.op for row in rows_of(module) if row.op is not None and not row.function]


@dataclass
class Site:
    """A module the operator library can replace: its op, variant and compile-time extents."""

    name: str
    module: torch.nn.Module
    op: str
    variant: str
    kernel_key: tuple[int, ...] | None   # None: known only per call


def sites(model: torch.nn.Module) -> list[Site]:
    """Every module of a DeepSeek-V4 model the table covers, and those that registered operators'
    patches (Patch.sites) say they patch, in any model."""
    cfg = getattr(model, "config", None)
    found = [Site(name, module, spec.name, variant, tuple(key) if key is not None else None)
             for spec in OPS.values() if spec.name in PATCHES
             for name, module, variant, key in PATCHES[spec.name].sites(model)]
    for name, module in model.named_modules():
        for row in rows_of(module):
            if row.op is not None:
                key = row.key(name, module, cfg) if row.key is not None else None
                variant = row.variant(module) if callable(row.variant) else row.variant
                found.append(Site(name or "model" if row.function else name, module, row.op, variant,
                                  tuple(key) if key is not None else None))
    return found
