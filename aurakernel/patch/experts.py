"""The routed experts' forward that the swiglu and grouped_linear patches install (either or both):
transformers' grouped_mm experts forward with cheaper row gathers, calling the gate and the grouped
projections by the names the two patches replace."""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_linear, grouped_mm_experts_forward
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts


def experts_forward(self: DeepseekV4Experts, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts forward (integrations/moe.py) with its three row gathers as
    index_select instead of advanced indexing: the same values, but their backward is an
    index_add_ instead of an index_put_ with accumulation, which sorts its indices and took about
    8% of the tiny model's training step. Both of its parts may run kernels: the gate in between
    (`self._apply_gate`, the swiglu patch's) and the two projections (`_grouped_linear`, swapped by the
    grouped_linear patch in the module's globals).
    Any other experts implementation (eager, batched_mm, a grouped_mm a user registered in place of
    transformers' own) and expert parallelism keep transformers' dispatching forward."""
    impl = self.config._experts_implementation
    if (impl != "grouped_mm" or ALL_EXPERTS_FUNCTIONS[impl] is not grouped_mm_experts_forward
            or self._is_expert_parallel or self.has_bias):
        return DeepseekV4Experts.forward(self, hidden_states, top_k_index, top_k_weights)
    num_top_k, num_tokens, hidden_dim = top_k_index.size(-1), hidden_states.size(0), hidden_states.size(-1)
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    selected = hidden_states.index_select(0, perm // num_top_k)
    sample_weights_g = top_k_weights.reshape(-1).index_select(0, perm)
    histc_input = expert_ids_g.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    proj = _grouped_linear(selected, self.gate_up_proj, offsets, is_transposed=self.is_transposed)
    proj = self._apply_gate(proj)
    proj = _grouped_linear(proj, self.down_proj, offsets, is_transposed=self.is_transposed)
    weighted = proj * sample_weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    out = weighted.index_select(0, inv_perm).view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return out.to(hidden_states.dtype)
