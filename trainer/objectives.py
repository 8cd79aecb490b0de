"""The two training objectives that reach the parameters the LM loss cannot (DeepSeek-V3/V3.2/V4).

* `ExpertBalancer`: aux-loss-free load balancing (`topk_method: noaux_tc`). Each top-k router's
  `e_score_correction_bias` only chooses experts, so no gradient ever moves it; after every
  optimizer step it moves by gamma toward balance: bias_e += gamma * sign(mean_load - load_e).
* `IndexerAlignment`: the lightning indexer of a CSA layer only hands integer top-k indices to the
  attention, so the LM loss gives its parameters no gradient. It is trained by
  KL(main attention's distribution over the selected compressed entries || softmax(index scores)).

Both read module outputs through forward hooks, never the modules' code, so they work unchanged
when aurakernel has patched a module's `forward` (the module object and its outputs stay the
reference's). What the hooks read, in transformers 5.24's modeling_deepseek_v4:

* DeepseekV4TopKRouter.forward -> (logits, weights, indices [tokens, top_k]): the selected experts.
  DeepseekV4HashRouter is skipped: it selects from the frozen tid2eid table and has no bias.
* DeepseekV4Indexer(hidden_states, q_residual, position_ids, cache, layer_idx) -> top-k indices
  [B, S, k], -1 where a pick is not causally visible. Its child DeepseekV4IndexerScorer returns the
  index scores [B, S, T] over all T compressed entries (before the causal mask), as a
  differentiable function of the indexer's parameters and of its two inputs.
* DeepseekV4Attention.forward -> (output, attn_weights [B, H, S, K]): the eager attention's
  probabilities with the sink column dropped. The compressor's T entries are concatenated last on
  the KV axis, so attn_weights[..., -T:] is the main attention over the compressed entries; it is
  exactly 0 outside the indexer's selection (block bias -inf there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4Indexer,
    DeepseekV4TopKRouter,
)


def _recording() -> bool:
    """Hooks record only in a training forward: grad enabled (not an eval/no_grad pass) and not
    inside backward (a gradient-checkpointing recompute would count the same tokens twice).
    torch has no public call for the latter; the graph task id is -1 outside backward. Under
    torch.compile a forward is traced once, outside backward (a compiled graph's recompute does not
    run the hooks again), and the call would break the graph at every hook: it is not asked there."""
    if torch.compiler.is_compiling():
        return torch.is_grad_enabled()
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class ExpertBalancer:
    """Aux-loss-free balancing of every DeepseekV4TopKRouter of `model`.

    Per micro-batch nothing is to be called (the hooks count the experts each router selects);
    after each optimizer step call `update()` once."""

    def __init__(self, model: torch.nn.Module, gamma: float = 1e-3):
        self.gamma = float(gamma)
        self.routers: dict[str, DeepseekV4TopKRouter] = {
            name: m for name, m in model.named_modules() if isinstance(m, DeepseekV4TopKRouter)}
        self._counts = {name: torch.zeros(r.num_experts, dtype=torch.long, device=r.e_score_correction_bias.device)
                        for name, r in self.routers.items()}
        self._handles = [r.register_forward_hook(self._hook(name)) for name, r in self.routers.items()]

    def _hook(self, name: str):
        def count(module, args, output):
            if not _recording():
                return
            indices = output[2]   # the selection, as the (possibly patched) router returned it
            with torch.no_grad():   # a count of fixed length (bincount's output length depends on the
                counts = self._counts[name]   # data, which breaks a compiled graph)
                picks = indices.reshape(-1).to(device=counts.device, dtype=torch.long)
                counts.index_add_(0, picks, torch.ones_like(picks))
        return count

    def counts(self) -> dict[str, torch.Tensor]:
        """Tokens routed to each expert since the last update(), per router (this rank only)."""
        return {name: c.clone() for name, c in self._counts.items()}

    @staticmethod
    def _imbalance(counts: torch.Tensor) -> float | None:
        load = counts.double()
        mean = load.mean()
        return float(load.max() / mean) if mean > 0 else None

    def loads(self) -> dict[str, float]:
        """max load / mean load per router since the last update() (1.0 = perfectly balanced),
        this rank's counts; routers that saw no token are left out."""
        out = {name: self._imbalance(c) for name, c in self._counts.items()}
        return {k: v for k, v in out.items() if v is not None}

    @torch.no_grad()
    def update(self) -> dict[str, float]:
        """The bias step for the optimizer step just taken, from the loads counted since the last
        call (all-reduced across data-parallel ranks), then reset the counts. Returns the step's
        max/mean load per router (over all ranks), for metrics."""
        if not self.routers:
            return {}
        names = list(self.routers)
        counts = torch.stack([self._counts[n] for n in names])   # [routers, experts]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)   # every rank must apply the same step
        load = counts.to(torch.float32)
        step = self.gamma * torch.sign(load.mean(dim=-1, keepdim=True) - load)
        metrics = {}
        for i, name in enumerate(names):
            bias = self.routers[name].e_score_correction_bias
            bias.add_(step[i].to(device=bias.device, dtype=bias.dtype))
            imbalance = self._imbalance(counts[i])
            if imbalance is not None:
                metrics[name] = imbalance
            self._counts[name].zero_()
        return metrics

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def selection_mask(top_k_indices: torch.Tensor, entries: int) -> torch.Tensor:
    """[B, S, k] indexer picks (-1 = not visible) -> [B, S, entries] bool of the selected entries."""
    safe = torch.where(top_k_indices >= 0, top_k_indices, torch.full_like(top_k_indices, entries))
    mask = torch.zeros(*top_k_indices.shape[:-1], entries + 1, dtype=torch.bool, device=top_k_indices.device)
    return mask.scatter_(-1, safe, True)[..., :entries]


def indexer_kl(index_scores: torch.Tensor, selected: torch.Tensor, attn_mass: torch.Tensor) -> torch.Tensor:
    """KL(p || q) averaged over queries, both distributions over each query's selected entries.

    p: `attn_mass` (main attention probability per compressed entry, summed over heads) restricted
    to the selection and L1-normalised, treated as a constant. q: softmax of `index_scores` over the
    selection (V3.2's sparse-stage indexer loss). Queries that select nothing (the first m-1
    positions see no complete window) or whose attention mass there is 0 are left out; with no
    query left the result is a graph-connected 0."""
    selected = selected.bool()
    p_mass = torch.where(selected, attn_mass.detach().float(), 0.0)
    total = p_mass.sum(-1, keepdim=True)
    rows = selected.any(-1) & (total.squeeze(-1) > 0)
    p = p_mass / total.clamp_min(torch.finfo(torch.float32).tiny)
    logits = index_scores.float().masked_fill(~selected, float("-inf"))
    logits = torch.where(rows.unsqueeze(-1), logits, 0.0)   # rows without a selection: finite, unused
    log_q = F.log_softmax(logits, dim=-1)
    # p * (log p - log q) with 0 log 0 = 0; the where keeps -inf (unselected) out of the products
    terms = torch.where(p > 0, p * (torch.log(p.clamp_min(torch.finfo(torch.float32).tiny)) - log_q), 0.0)
    kl_rows = terms.sum(-1)
    if not bool(rows.any()):   # (the selected scores: a causal scorer leaves the future entries at -inf)
        return torch.where(selected, index_scores.float(), 0.0).sum() * 0.0
    return kl_rows[rows].mean()


class IndexerAlignment:
    """KL alignment of every lightning indexer of `model` to its layer's main attention.

    Hooks (installed here, removed by `remove()`):
    * a forward pre-hook on each DeepseekV4Indexer that detaches its inputs (hidden_states,
      q_residual). The indexer's output is integer indices, so the LM loss is unchanged; the KL loss
      then reaches exactly the indexer's own parameters (kv_proj, gate_proj, position_bias, kv_norm,
      q_b_proj, scorer.weights_proj), as DeepSeek-V3.2 trains it ("we detach the indexer input from
      the computational graph").
    * forward hooks on its scorer (index scores, differentiable), on the indexer (its top-k
      selection) and on the attention that owns it (the attention probabilities, detached at once so
      only a [B, S, T] target is kept).
    Per micro-batch: run the forward, then add `loss()` to the LM loss before backward. The scores of
    each captured forward stay alive (with their graph) until `loss()` consumes them.
    Requires attention weights from the attention call (eager attention, which is all
    DeepseekV4 supports, reference or aurakernel's swapped one) and a forward with grad enabled
    (reentrant gradient checkpointing runs it under no_grad: nothing is captured and loss() raises;
    non-reentrant checkpointing is untested)."""

    def __init__(self, model: torch.nn.Module, weight: float = 1.0):
        self.weight = float(weight)
        self.last: dict[str, float] = {}   # per-layer KL of the last loss(), for metrics
        # captures since the last loss(): (attention module name, index scores [B,S,T] with their
        # graph, selected [B,S,T] bool, detached heads-summed attention probability [B,S,T])
        self.records: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._pending: dict[int, dict] = {}   # id(attention) -> the indexer's scores/selection
        self._handles = []
        self.layers: dict[str, DeepseekV4Indexer] = {}
        self._weights_of: list[DeepseekV4Attention] = []
        for name, attn in model.named_modules():
            if not isinstance(attn, DeepseekV4Attention):
                continue
            indexer = getattr(attn.compressor, "indexer", None)
            if not isinstance(indexer, DeepseekV4Indexer):
                continue   # sliding / HCA layers: no indexer
            self.layers[name] = indexer
            # only the compressed entries' mass, heads summed, is read: aurakernel's sparse attention gives
            # that ([B, 1, S, T]) instead of the dense weights
            attn.aurakernel_wants_compressed_mass = True
            self._weights_of.append(attn)
            key = id(attn)
            self._handles += [
                indexer.register_forward_pre_hook(_detach_inputs, with_kwargs=True),
                indexer.scorer.register_forward_hook(self._on_scores(key)),
                indexer.register_forward_hook(self._on_selection(key)),
                attn.register_forward_hook(self._on_attention(key, name)),
            ]

    def _on_scores(self, key: int):
        def hook(module, args, output):
            if _recording():
                self._pending[key] = {"scores": output}
        return hook

    def _on_selection(self, key: int):
        def hook(module, args, output):
            if _recording() and key in self._pending:
                self._pending[key]["indices"] = output
        return hook

    def _on_attention(self, key: int, name: str):
        def hook(module, args, output):
            pending = self._pending.pop(key, None)
            if pending is None or "indices" not in pending or not _recording():
                return
            probs = output[1]
            if probs is None:
                raise RuntimeError(f"{name}: the attention returned no weights; IndexerAlignment needs the "
                                   f"eager attention (config._attn_implementation='eager')")
            scores = pending["scores"]
            entries = scores.shape[-1]
            with torch.no_grad():
                mass = probs[..., probs.shape[-1] - entries:].float().sum(dim=1)   # [B, S, T], heads summed
                selected = selection_mask(pending["indices"], entries)
            self.records.append((name, scores, selected, mass))
        return hook

    def loss(self) -> torch.Tensor:
        """weight * sum over CSA layers (and forwards captured since the last call) of the
        query-averaged KL; consumes the captures. Differentiable w.r.t. the indexer parameters only."""
        if not self.layers:
            return torch.zeros(())
        if not self.records:
            raise RuntimeError("IndexerAlignment.loss(): no forward with grad enabled was captured since the last call")
        self.last = {}
        total = None
        for name, scores, selected, mass in self.records:
            kl = indexer_kl(scores, selected, mass)
            self.last[name] = self.last.get(name, 0.0) + float(kl.detach())
            total = kl if total is None else total + kl
        self.records = []
        return total * self.weight

    def reset(self) -> None:
        """Drop captures (e.g. after a forward whose loss is not taken)."""
        self.records, self._pending = [], {}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in self._weights_of:
            module.__dict__.pop("aurakernel_wants_compressed_mass", None)
        self._weights_of = []
        self.reset()


def _detach_inputs(module, args, kwargs):
    """DeepseekV4Indexer(hidden_states, q_residual, ...) with both inputs cut from the main graph."""
    args = list(args)
    for i, key in enumerate(("hidden_states", "q_residual")):
        if i < len(args) and isinstance(args[i], torch.Tensor):
            args[i] = args[i].detach()
        elif isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = kwargs[key].detach()
    return tuple(args), kwargs


def params_without_grad(model: torch.nn.Module) -> list[str]:
    """Names of trainable parameters that the last backward left without a gradient (None or all 0)."""
    return [name for name, p in model.named_parameters()
            if p.requires_grad and (p.grad is None or not bool(p.grad.detach().ne(0).any()))]
