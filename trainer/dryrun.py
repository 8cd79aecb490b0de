"""Dry run: parameters, FLOPs and per-device training memory of a config, with no weights allocated.

The model is built on the meta device (shapes only, no storage), so DeepSeek-V4-Pro's 1.6T
parameters cost a fraction of a second and no memory. Counts come from trainer.metrics, the same
functions the trainer logs MFU with.

What is counted: the modules transformers' DeepseekV4ForCausalLM builds, i.e. embedding, the
num_hidden_layers decoder layers, the mHC head, final norm and LM head. transformers does not build
the MTP (next-token prediction) layer of the release checkpoints, so it is not in total_params;
`mtp_params_estimate` says roughly what it adds.

Memory per device assumes FSDP full sharding (ZeRO-3) over world_size devices with bf16 mixed
precision, 16 bytes per parameter in all (the ZeRO paper's accounting), each term / world_size:
  bf16 weights 2 + fp32 master weights 4 + AdamW m 4 + AdamW v 4 + bf16 gradients 2
(train.dtype fp32: the fp32 weights are the master copy, no bf16 copy, fp32 gradients 4.) With
world_size > 1 FSDP also holds unsharded buffers: the largest unit's all-gathered weights twice
(current + prefetched) and its unsharded gradient once, before the reduce-scatter.
data.batch_size is the per-device micro-batch: activations do not shrink with world_size.

The activation figures are an ESTIMATE, not a measurement: per token and layer, each intermediate
tensor the forward keeps for backward is counted once (see _layer_activation_bytes), assuming fused
attention and indexer kernels that keep only their inputs, output and softmax statistics.
transformers' eager attention instead materialises [heads, seq, keys] scores and probabilities per
layer; `eager_attention_extra_bytes` is that excess, reported apart and not in the totals.
  no checkpointing:   tokens * (sum over layers of per-layer bytes + embedding output + head)
  per-layer checkpointing: tokens * (num_layers * layer input (hc_mult streams)
                           + the largest layer's bytes (recomputed in backward) + head)
with tokens = seq_len * batch_size and head = mHC head + final norm + bf16 and fp32 logits + log-softmax.
"""

from __future__ import annotations

from collections import Counter

import torch
from rich.table import Table
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from aurakernel.errors import UserError
from aurakernel.hardware import load_profile

from .config import TrainConfig
from .metrics import attention_flops_per_token, flops_per_token, parameter_counts
from .model import model_config

_SHORT = {"sliding_attention": "SWA", "compressed_sparse_attention": "CSA",
          "heavily_compressed_attention": "HCA", "hash_moe": "hash_moe", "moe": "topk_moe"}


def build_meta_model(model_section: dict) -> DeepseekV4ForCausalLM:
    """DeepseekV4ForCausalLM with every parameter on the meta device: shapes, no storage."""
    config = model_config(model_section)
    with torch.device("meta"):
        return DeepseekV4ForCausalLM(config)


def _mean_compressed(seq_len: int, rate: int) -> float:
    """Compressed entries a query sees, averaged over positions 0..seq_len-1."""
    return sum((p + 1) // rate for p in range(seq_len)) / seq_len


def _layer_activation_bytes(c: DeepseekV4Config, layer_type: str, seq_len: int, a: int) -> float:
    """ESTIMATE of the bytes one decoder layer keeps for backward per token (a: bytes per element
    of the compute dtype; fp32 where the module computes in fp32)."""
    D, n, H, d = c.hidden_size, c.hc_mult, c.num_attention_heads, c.head_dim
    k, I = c.num_experts_per_tok, c.moe_intermediate_size
    # mHC, twice a layer (attn_hc, ffn_hc): fp32 flattened streams and their RMS-normed copy (the
    # mix projection's input), the streams (collapse, comb @ streams), the block output (post * out)
    mhc = 2 * (n * D * 8 + n * D * a + D * a)
    # attention: collapsed + normed input, q_a out + normed q residual, q_b out + per-head norm +
    # roped q, kv_proj out + normed + roped kv, attention output + de-roped output, o_a out; fp32 lse
    attn = (2 * D + 2 * c.q_lora_rank + 3 * H * d + 3 * d + 2 * H * d + c.o_groups * c.o_lora_rank) * a + 4 * H
    # compressor (CSA: overlapping windows, 2 * head_dim wide; HCA: head_dim): kv and gate
    # projections, their window copies, fp32 softmax weights; pooled + normed + roped entries per m tokens
    comp = 0.0
    if layer_type != "sliding_attention":
        rate = c.compress_rates[layer_type]
        w = 2 * d if layer_type == "compressed_sparse_attention" else d
        comp = w * (4 * a + 4) + 3 * d * a / rate
        if layer_type == "compressed_sparse_attention":
            # lightning indexer: its own compressor at 2 * index_head_dim, q_b out, head weights,
            # fp32 index scores over the compressed entries, top-k indices (int64)
            wi = 2 * c.index_head_dim
            comp += (wi * (4 * a + 4) + 3 * c.index_head_dim * a / rate + c.index_n_heads * c.index_head_dim * a
                     + c.index_n_heads * a + 4 * _mean_compressed(seq_len, rate) + 8 * c.index_topk)
    # MoE: collapsed + normed input, fp32 router logits; per routed slot gathered input, gate_up
    # out (2I), activation (I), down out; shared expert gate, up, activation, down out
    moe = (2 * D + k * (2 * D + 3 * I) + 3 * I + D) * a + 4 * c.n_routed_experts
    return mhc + attn + comp + moe


def _head_activation_bytes(c: DeepseekV4Config, a: int) -> float:
    """Per token after the last layer: mHC head (fp32 streams + normed), final norm in/out,
    bf16 logits, fp32 logits and log-softmax for the cross-entropy."""
    return c.hc_mult * c.hidden_size * 8 + 2 * c.hidden_size * a + c.vocab_size * (a + 8)


def _eager_attention_bytes(c: DeepseekV4Config, layer_type: str, seq_len: int, a: int) -> float:
    """Per token: transformers' eager attention keeps scores and probabilities over every key
    (all seq_len raw positions, masked, plus the compressed entries) for each head."""
    keys = seq_len + (seq_len // c.compress_rates[layer_type] if layer_type != "sliding_attention" else 0)
    return 2 * c.num_attention_heads * keys * a


def _mtp_params_estimate(model) -> int:
    """One more decoder layer with sliding-window attention (the trailing compress_ratios entry
    is 0) plus its two hidden x hidden input projections; embedding and LM head are shared."""
    c = model.config
    layer = max(model.model.layers, key=lambda m: sum(p.numel() for p in m.parameters()))
    compressor = layer.self_attn.compressor
    per = sum(p.numel() for p in layer.parameters()) - (
        sum(p.numel() for p in compressor.parameters()) if compressor is not None else 0)
    return c.num_nextn_predict_layers * (per + 2 * c.hidden_size * c.hidden_size)


def _device_capacity(target: str) -> tuple[str, int | None]:
    profile = load_profile(target)
    for level in ("HBM", "DRAM"):
        if level in profile.memory:
            return profile.name, int(profile.memory[level].capacity)
    return profile.name, None


def dry_run(cfg: TrainConfig, world_size: int = 1) -> dict:
    """Parameter counts, FLOPs per token and an FSDP memory plan for `cfg`, without allocating
    weights. Byte figures are per device; see the module docstring for what each one assumes."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise UserError(f"world size must be an integer >= 1, got {world_size!r}")
    model = build_meta_model(cfg.model)
    c = model.config
    seq_len, batch = int(cfg.data.seq_len), int(cfg.data.batch_size)
    tokens = seq_len * batch
    total, active = parameter_counts(model)
    n = world_size
    bf16 = cfg.train.dtype == "bf16"
    a = 2 if bf16 else 4

    # FSDP units: each decoder layer, and the embedding / LM head (the rest is negligible)
    largest_unit = max([sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
                       + [model.model.embed_tokens.weight.numel(), model.lm_head.weight.numel()])
    gather = 3 * largest_unit * a if n > 1 else 0

    per_layer = [_layer_activation_bytes(c, t, seq_len, a) for t in c.layer_types]
    layer_input = c.hc_mult * c.hidden_size * a
    head = _head_activation_bytes(c, a)
    act_no_ckpt = tokens * (sum(per_layer) + layer_input + head)
    act_ckpt = tokens * (len(per_layer) * layer_input + max(per_layer) + head)
    eager = [_eager_attention_bytes(c, t, seq_len, a) for t in c.layer_types]

    breakdown = {
        "weights_bf16": 2 * total / n if bf16 else 0.0,
        "master_weights_fp32": 4 * total / n,
        "adamw_m_fp32": 4 * total / n,
        "adamw_v_fp32": 4 * total / n,
        "gradients": a * total / n,
        "fsdp_gather_buffers": float(gather),
        "activations_ckpt": float(act_ckpt),
        "activations_no_ckpt": float(act_no_ckpt),
    }
    states = sum(v for k, v in breakdown.items() if not k.startswith(("activations", "fsdp")))
    memory = states + gather + act_ckpt
    memory_no_ckpt = states + gather + act_no_ckpt

    device, capacity = _device_capacity(cfg.hardware.target)
    min_world = None   # smallest world size whose per-device memory (with checkpointing) fits
    if capacity is not None:
        if 16 * total + act_ckpt <= capacity:
            min_world = 1
        elif 3 * largest_unit * a + act_ckpt < capacity:
            min_world = max(2, -(-16 * total // int(capacity - 3 * largest_unit * a - act_ckpt)))

    counts = Counter(c.layer_types) + Counter(c.mlp_layer_types)
    return {
        "config": cfg.path,
        "world_size": n,
        "seq_len": seq_len,
        "batch_size": batch,
        "dtype": cfg.train.dtype,
        "total_params": int(total),
        "active_params": int(active),
        "embedding_params": int(model.model.embed_tokens.weight.numel()),
        "mtp_params_estimate": int(_mtp_params_estimate(model)),
        "flops_per_token": float(flops_per_token(model, seq_len)),
        "attention_flops_per_token": float(attention_flops_per_token(c, seq_len)),
        "layers": {"total": c.num_hidden_layers, **{short: counts.get(t, 0) for t, short in _SHORT.items()}},
        "memory_per_device_bytes": float(memory),          # with per-layer activation checkpointing
        "memory_per_device_no_ckpt_bytes": float(memory_no_ckpt),
        "breakdown": breakdown,
        "eager_attention_extra_bytes": {"ckpt": float(tokens * max(eager)), "no_ckpt": float(tokens * sum(eager))},
        "device": device,
        "device_memory_bytes": capacity,
        "fits_device": None if capacity is None else memory <= capacity,
        "min_world_size_to_fit": min_world,
        "activations_are_estimate": True,
    }


def _count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:,.2f} GiB"


def format_dry_run(result: dict) -> Table:
    """The dry run as a two-column rich table."""
    r = result
    table = Table(title=f"Dry run: {r['config'] or 'model'} (world size {r['world_size']}, "
                        f"seq {r['seq_len']} x batch {r['batch_size']}, {r['dtype']})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    L = r["layers"]
    table.add_row("layers", f"{L['total']}: {L['SWA']} SWA + {L['CSA']} CSA + {L['HCA']} HCA; "
                            f"{L['hash_moe']} hash + {L['topk_moe']} top-k MoE")
    table.add_row("parameters (total)", _count(r["total_params"]))
    table.add_row("parameters (active per token)", _count(r["active_params"]))
    table.add_row("MTP layer, not built (estimate)", _count(r["mtp_params_estimate"]))
    table.add_row("FLOPs per token (fwd + bwd)", _count(r["flops_per_token"]))
    table.add_row("  of which attention", _count(r["attention_flops_per_token"]))
    table.add_section()
    labels = {"weights_bf16": "bf16 weights", "master_weights_fp32": "fp32 master weights",
              "adamw_m_fp32": "AdamW m (fp32)", "adamw_v_fp32": "AdamW v (fp32)", "gradients": "gradients",
              "fsdp_gather_buffers": "FSDP all-gather buffers",
              "activations_ckpt": "activations, checkpointed (estimate)",
              "activations_no_ckpt": "activations, no checkpointing (estimate)"}
    for key, label in labels.items():
        table.add_row(f"{label} / device", _gib(r["breakdown"][key]))
    table.add_section()
    table.add_row("memory / device (checkpointed)", _gib(r["memory_per_device_bytes"]))
    table.add_row("memory / device (no checkpointing)", _gib(r["memory_per_device_no_ckpt_bytes"]))
    table.add_row("eager attention extra (not counted)", _gib(r["eager_attention_extra_bytes"]["ckpt"]))
    if r["device_memory_bytes"] is not None:
        fits = "fits" if r["fits_device"] else "does not fit"
        table.add_row(f"{r['device']} memory", f"{_gib(r['device_memory_bytes'])} ({fits})")
        table.add_row("min world size to fit", str(r["min_world_size_to_fit"]) if r["min_world_size_to_fit"]
                      else "none: FSDP buffers + activations alone exceed it")
    return table
