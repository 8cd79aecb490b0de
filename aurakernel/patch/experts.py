"""The routed experts' forward that the swiglu, grouped_linear, moe_permute and moe_unpermute patches
install (any of them): transformers' grouped_mm experts forward as four calls by the names the
patches replace, its row gathers cheaper."""

from __future__ import annotations

from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_linear, grouped_mm_experts_forward
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

from ..ops.moe_permute import moe_permute
from ..ops.moe_unpermute import moe_unpermute
from .install import install, swap_globals


def experts_forward(self: DeepseekV4Experts, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts forward (integrations/moe.py) in four calls, each of which a
    patch may swap for a kernel in the module's namespace (patch.install.swap_globals): the dispatch
    (`moe_permute`: the pairs' rows sorted by expert and gathered with index_select, whose
    backward is an index_add_ where advanced indexing's index_put_ sorted its indices), the two
    grouped projections (`_grouped_linear`) with the gate between them (`self._apply_gate`, the
    swiglu patch's), and the combine (`moe_unpermute`).
    Any other experts implementation (eager, batched_mm, a grouped_mm a user registered in place of
    transformers' own), expert parallelism, biases and a post-expert norm keep transformers' forward."""
    impl = self.config._experts_implementation
    if (impl != "grouped_mm" or ALL_EXPERTS_FUNCTIONS[impl] is not grouped_mm_experts_forward
            or self._is_expert_parallel or self.has_bias or getattr(self, "has_post_expert_norm", False)):
        return DeepseekV4Experts.forward(self, hidden_states, top_k_index, top_k_weights)
    selected, offsets, rows = moe_permute(hidden_states, top_k_index, self.num_experts)
    proj = _grouped_linear(selected, self.gate_up_proj, offsets, is_transposed=self.is_transposed)
    proj = self._apply_gate(proj)
    proj = _grouped_linear(proj, self.down_proj, offsets, is_transposed=self.is_transposed)
    return moe_unpermute(proj, top_k_weights, rows).to(hidden_states.dtype)


def swap_into_experts(module, op: str, reference: type, **functions) -> None:
    """Patch `module`, the experts or `op`'s reference module, so that its code calls `functions` in
    place of the module-level functions of those names; the experts get the forward above first (the
    one that calls them), unless another of the four operators' patches installed it already."""
    if isinstance(module, DeepseekV4Experts):
        if module.__dict__.get("_ak_installed", {}).get("forward") is not experts_forward:
            install(module, "forward", experts_forward)
    elif not isinstance(module, reference):
        raise TypeError(f"{op} cannot patch {type(module).__name__}")
    swap_globals(module, **functions)
