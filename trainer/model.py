"""Build transformers' DeepseekV4ForCausalLM from the config's model section."""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from aurakernel.errors import UserError


def model_config(model_section: dict) -> DeepseekV4Config:
    try:
        return DeepseekV4Config(**model_section)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise several types
        raise UserError(f"model config rejected by transformers: {str(exc).splitlines()[0]}") from None


def build_model(model_section: dict, seed: int) -> DeepseekV4ForCausalLM:
    """A freshly initialised model. The hash-routing tables get a fixed random expert assignment
    (distinct experts per token), as a released checkpoint has; transformers initialises them to 0."""
    config = model_config(model_section)
    # training never reads a KV cache; with one (the config's default) every forward builds a
    # DynamicCache and the compressors take their generation path, which no kernel replaces
    config.use_cache = False
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    g = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if hasattr(module, "tid2eid"):
            table = torch.stack([torch.randperm(config.n_routed_experts, generator=g)[: config.num_experts_per_tok]
                                 for _ in range(config.vocab_size)])
            module.tid2eid.copy_(table)
    return model
