"""Model FLOPs and MFU of a DeepseekV4ForCausalLM: what the trainer's metrics, the bench and the
modeled profile report.

FLOPs per token = 6 * active parameters (matmul weights a token passes through: everything but the
embedding table, with routed experts counted top_k / n_experts) + attention: 2 matmuls of
head_dim per head over the keys a query actually uses (the sliding window plus the compressed
entries it may see), x3 for forward + backward. MFU = achieved model FLOP/s / the profile's peak.
"""

from __future__ import annotations

import math

from transformers import DeepseekV4Config


def parameter_counts(model) -> tuple[int, int]:
    """(total, active) parameters of a DeepseekV4ForCausalLM. Reads only shapes, so a model built
    on the meta device (no storage) works too."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    embed = model.model.embed_tokens.weight.numel()
    active = total - embed - routed + routed * cfg.num_experts_per_tok / cfg.n_routed_experts
    return total, int(active)


def attention_flops_per_token(cfg: DeepseekV4Config, seq_len: int) -> float:
    """Forward + backward attention FLOPs per token, averaged over positions 0..seq_len-1."""
    rates = cfg.compress_rates
    per_type: dict[str, float] = {}   # layers of one type cost the same: walk the positions once per type
    total = 0.0
    for layer_type in cfg.layer_types:
        if layer_type not in per_type:
            keys = 0.0
            for p in range(seq_len):
                k = min(cfg.sliding_window, p + 1)
                if layer_type == "compressed_sparse_attention":
                    k += min(cfg.index_topk, (p + 1) // rates[layer_type])
                elif layer_type == "heavily_compressed_attention":
                    k += (p + 1) // rates[layer_type]
                keys += k
            per_type[layer_type] = 3 * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * (keys / seq_len)
        total += per_type[layer_type]
    return total


def flops_per_token(model, seq_len: int) -> float:
    _, active = parameter_counts(model)
    return 6 * active + attention_flops_per_token(model.config, seq_len)


def mfu(tokens_per_s: float, flops_token: float, peak_tflops: float) -> float:
    return tokens_per_s * flops_token / (peak_tflops * 1e12) if peak_tflops > 0 else math.nan
