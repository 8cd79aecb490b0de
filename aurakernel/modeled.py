"""Modeled profile: one training step of a real config (V4-Flash, V4-Pro) traced on the meta device
(shapes only, no memory), every op timed on a target profile by model, grouped like the measured
profile (profiler.py), before and after AuraKernel's planned kernels.

Trace. The model is built under `torch.device("meta")` in bf16 and runs forward, the loss and
backward inside a TorchDispatchMode that sees every aten op with its shapes. View ops (outputs that
alias an input, per the op's schema) cost nothing. Forward ops belong to the innermost open module
group (the profiler's module hooks). Backward ops are charged to the group whose forward created
their autograd node: each hook reads the autograd sequence counter (a one-element probe op), so a
group owns the sequence numbers allocated while it was innermost, and a backward op's node
(`torch._C._current_autograd_node()`) is looked up by its sequence number.

Time model (per op, on the target; every figure from the profile, estimates marked there):
    matmul ops  max(FLOPs / peak of the dtype, bytes / HBM bandwidth)         -> the "matmul" bucket
    other ops   bytes / HBM bandwidth + one launch (call_overhead_us)          -> their group
    optimizer   one AdamW pass over the device's share of the parameters: 16 B read + 12 B written
                per parameter (fp32 param, grad, m, v in; param, m, v out), one launch per tensor
    experts     expert parallelism over the world (min(world, experts) ranks): each device holds
                its share of the routed experts' weights, so a grouped matmul moves that share of
                the stacked expert weights (and of their gradients) and every routed token row
    comm        world_size > 1: FSDP all-gather of the bf16 non-expert weights (forward and
                backward), reduce-scatter of their fp32 gradients, and the MoE expert-parallel
                all-to-all of the routed tokens (dispatch and combine, forward and backward), at the
                profile's collective bandwidth. Overlap, as FSDP2 schedules it: a layer's gathers
                and reduce-scatter run beside the compute of its neighbours (prefetch), so per layer
                only what exceeds the layer's compute is exposed, plus the first layer's forward
                gather; the all-to-all is exposed in full (it sits between the router and the experts
                on the critical path)
After the planned kernels: a group whose calls pose problems of the operator library runs the
planner's predicted time for each problem (forward + backward; the AscendC plan on an Ascend target
where the operator has an AscendC kernel, the host plan on the host), other ops with an OpSpec run
at the roofline of the operator's Work, and everything else is unchanged. The remainder of a group
(ops no kernel covers) keeps its modeled eager time: a group's kernels replace only the share of
its bytes their problems account for.
MFU = model FLOPs of the step (aurakernel.flops: 6 x active params + attention) / (step time x peak).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4Experts

from .errors import UserError
from .hardware import HardwareProfile
from .ops import OPS
from .profiler import FUSABLE, _Hooks, save_group_chart
from .targets import target_for

GEMM = "gemm"   # the scope the tracer books matmul-class ops under (their group "matmul")
MATMUL_ATEN = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_grouped_mm", "matmul", "linear"}
EXPERT_PARAMS = ".mlp.experts."


@dataclass
class ModeledGroup:
    name: str
    kind: str                  # fusable | matmul | optimizer | comm | other
    time_us: float             # modeled eager time per step
    share: float
    calls: float               # module calls per step
    ops: int                   # aten ops (forward + backward) per step
    bytes: float               # bytes the group's ops read and write
    flops: float
    time_after_us: float       # with the planned kernels
    basis: str                 # planned | roofline | - : what time_after_us rests on
    shapes: list[dict] = field(default_factory=list)
    flops_after: float | None = None   # the matmul bucket: what still runs with the kernels (fused ones out)


@dataclass
class ModeledProfile:
    config: str
    target: str
    seq_len: int
    batch_size: int
    world_size: int
    tokens: int
    model_flops: float          # per step on this device
    peak_tflops: float
    step_us: float
    step_after_us: float
    groups: list[ModeledGroup]

    @property
    def mfu_before(self) -> float:
        return self.model_flops / (self.step_us * 1e-6) / (self.peak_tflops * 1e12)

    @property
    def mfu_after(self) -> float:
        return self.model_flops / (self.step_after_us * 1e-6) / (self.peak_tflops * 1e12)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "groups"}
        d.update(mfu_before=self.mfu_before, mfu_after=self.mfu_after,
                 groups=[asdict(g) for g in self.groups])
        return d

    def save_chart(self, path: str | Path) -> Path:
        groups = [g for g in self.groups if g.time_us > 0][:16]
        return save_group_chart(path, [f"{g.name} ({g.kind})" for g in groups],
                                [("modeled eager", "#9bb7d4", [g.time_us / 1e3 for g in groups]),
                                 ("with planned kernels", "#5cb85c", [g.time_after_us / 1e3 for g in groups])],
                                xlabel="ms per training step (modeled)",
                                title=f"{Path(self.config).stem} on {self.target}, seq {self.seq_len}: "
                                      f"MFU {self.mfu_before:.1%} -> {self.mfu_after:.1%}")


class _GroupTracker(_Hooks):
    """The profiler's module hooks, also tracking the innermost open problem scope (a call whose
    eager ops a kernel of the library replaces) and mapping autograd sequence numbers to
    (group, problem): a piecewise constant map from the sequence number at each boundary."""

    def __init__(self, model, layer_weights: list[int]):
        self.starts: list[int] = []
        self.owner: list[tuple] = []
        self.scopes: list = []   # open problem scopes, innermost last (None: a call that poses none)
        self.weight = 1          # how many layers of the full model the running layer stands for
        self.probing = False     # the tracer ignores the probe's own ops
        self.layer_handles = []
        self.attention_problem = None   # the sparse attention problem of the attention module running
        for layer, w in zip(model.model.layers, layer_weights, strict=True):   # before the group hooks: set first
            self.layer_handles.append(layer.register_forward_pre_hook(lambda m, a, w=w: setattr(self, "weight", w)))
            self.layer_handles.append(layer.register_forward_hook(lambda m, a, o: setattr(self, "weight", 1)))
        super().__init__(model)

    def where(self) -> tuple[tuple[str, object], int]:
        return (self.groups[-1] if self.groups else "other", self.scopes[-1] if self.scopes else None), self.weight

    def _mark(self):
        """Start a new owner at the autograd sequence number the next node will get (a probe op
        takes the current one)."""
        self.probing = True
        probe = torch.ones(1, device="meta", requires_grad=True) * 1
        self.probing = False
        self.starts.append(probe.grad_fn._sequence_nr() + 1)
        self.owner.append(self.where())

    def record(self, problem) -> None:
        self.problems[(self.groups[-1] if self.groups else "other", problem)] += self.weight

    def remove(self):
        super().remove()
        for h in self.layer_handles:
            h.remove()

    def _pre(self, group, op):
        inner = super()._pre(group, op)

        def hook(module, args):
            inner(module, args)
            if group is not None:
                self.calls[group] += self.weight - 1   # the base counted 1
            self._mark()
        return hook

    def _post(self, group, op):
        inner = super()._post(group, op)

        def hook(module, args, output):
            inner(module, args, output)
            self._mark()
        return hook

    def enter_scope(self, module, problem):
        # the experts' swiglu kernel replaces only the gate: its scope opens in _apply_gate; the sparse
        # attention kernel only the attention call between the projections: its scope opens there
        if isinstance(module, DeepseekV4Attention):
            self.attention_problem = problem
        self.scopes.append(None if isinstance(module, DeepseekV4Experts | DeepseekV4Attention) else problem)

    def attention_call_problem(self, module, *args, **kwargs):
        """The problem of an eager attention call: the sparse attention its module poses, else the
        attention softmax between its matmuls."""
        from .patch import attn_softmax
        if isinstance(module, DeepseekV4Attention) and self.attention_problem is not None:
            return self.attention_problem
        return attn_softmax.call_problem(module, *args, **kwargs)

    def record_call(self, problem) -> None:
        """Record a function call's problem; the sparse attention's was recorded by its module."""
        if problem.op != "sparse_attention":
            self.record(problem)

    def exit_scope(self, module):
        self.scopes.pop()

    @contextlib.contextmanager
    def scope(self, problem, group: str | None = None):
        """A problem scope (or a group, for code outside any module: the loss) around a call."""
        if group is not None:
            self.groups.append(group)
        self.scopes.append(problem)
        self._mark()
        try:
            yield
        finally:
            self.scopes.pop()
            if group is not None:
                self.groups.pop()
            self._mark()

    def owner_of_seq(self, seq: int) -> tuple[tuple[str, object], int]:
        i = bisect.bisect_right(self.starts, seq) - 1
        return self.owner[i] if i >= 0 else (("other", None), 1)


@contextlib.contextmanager
def _gate_scopes(tracker: _GroupTracker):
    """Open a swiglu problem scope around every experts' _apply_gate call."""
    original = DeepseekV4Experts._apply_gate
    spec = OPS["swiglu"]

    def scoped(self, gate_up):
        from .dtypes import DType
        from .ops.base import Problem
        problem = None
        if gate_up.dtype in spec_dtypes:
            problem = Problem("swiglu", "default", (gate_up.numel() // gate_up.shape[-1], gate_up.shape[-1] // 2),
                              DType.from_torch(gate_up.dtype))
        with tracker.scope(problem):
            return original(self, gate_up)

    spec_dtypes = {d.torch for d in spec.dtypes}
    DeepseekV4Experts._apply_gate = scoped
    try:
        yield
    finally:
        DeepseekV4Experts._apply_gate = original


@contextlib.contextmanager
def _one_sequence_per_row():
    """transformers checks position ids for packed sequences with a data-dependent .item(), which a
    meta tensor cannot answer; each traced row is one sequence."""
    from unittest import mock

    from transformers import masking_utils
    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _matmul_flops(name: str, args, out) -> float:
    """2 x M x N x K of a matmul-class op: the output's elements times twice the reduced extent."""
    outs = list(_tensors(out))
    if not outs:
        return 0.0
    if name == "_grouped_mm":
        if outs[0].dim() == 3 and args[0].dim() == 2 and args[1].dim() == 2:
            # (M, S) @ (S, N) -> (E, M, N), the weight gradient: each expert reduces over its own rows
            return 2.0 * outs[0].numel() / outs[0].shape[0] * args[0].shape[1]
        return 2.0 * outs[0].numel() * args[0].shape[-1]   # (S, K) @ (E, K, N): each row meets one expert
    a = args[1] if name in ("addmm", "baddbmm", "addbmm") else args[0]
    return 2.0 * outs[0].numel() * a.shape[-1]


class _Tracer(TorchDispatchMode):
    def __init__(self, tracker: _GroupTracker, n_experts: int = 0, expert_share: float = 1.0):
        super().__init__()
        self.tracker = tracker
        self.n_experts, self.expert_share = n_experts, expert_share   # this device's share of the experts
        self.bytes: dict[tuple, float] = defaultdict(float)   # (group, problem or None) -> bytes
        self.ops: dict[tuple, int] = defaultdict(int)
        self.matmuls: list[tuple[float, float, torch.dtype, object]] = []   # (flops, bytes, dtype, problem scope)

    def _where(self) -> tuple[tuple[str, object], int]:
        node = torch._C._current_autograd_node()
        if node is not None:   # backward: where the forward created the node
            return self.tracker.owner_of_seq(node._sequence_nr())
        return self.tracker.where()

    def _nbytes(self, name: str, t: torch.Tensor) -> float:
        """A grouped matmul's stacked expert weights (or their gradient) are this device's share."""
        if name == "_grouped_mm" and t.dim() == 3 and t.shape[0] == self.n_experts:
            return _nbytes(t) * self.expert_share
        return _nbytes(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.tracker.probing:
            return out
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out   # a view: no data moves
        name = func.__name__.split(".")[0]
        moved = sum(self._nbytes(name, t) for t in (*_tensors(args), *_tensors(kwargs or {}), *_tensors(out)))
        where, weight = self._where()
        if name in MATMUL_ATEN:
            flops = _matmul_flops(name, args, out)
            self.matmuls.append((flops * weight, moved * weight, next(_tensors(out)).dtype, where[1]))
            where = ("matmul", GEMM)
        self.bytes[where] += moved * weight
        self.ops[where] += weight
        return out


def _planned_problem_us(problem, hw: HardwareProfile, bw: float) -> tuple[float, str]:
    """A problem's kernel time on the target, forward + backward: the planner's prediction where
    the target has a kernel for it, else the roofline of the operator's Work: its minimum traffic at
    the bandwidth or its arithmetic at the dtype's peak, whichever is slower."""
    spec = OPS[problem.op]
    target = target_for(hw)
    try:
        if target.supported(spec):
            return target.predicted_us(spec, problem, hw), "planned"
    except UserError:
        pass
    works = [spec.work(problem, backward=b) for b in (False, True)]
    peak = (hw.peak_tflops.get(problem.dtype.value) or hw.peak_tflops.get("bf16") or 0.0) * 1e12
    compute_s = sum(w.flops for w in works) / peak if peak else 0.0
    return max(sum(w.bytes_moved for w in works) / bw, compute_s) * 1e6 + 2 * hw.call_overhead_us, "roofline"


STATE_BYTES_PER_PARAM = 16   # bf16 weight + fp32 master + fp32 m and v + bf16 gradient (trainer.dryrun)


def default_world_size(n_params: int, hw: HardwareProfile) -> int:
    """The smallest power of two of devices whose HBM holds the fully sharded training state with a
    fifth left for activations: the per-device view a modeled step takes by default."""
    hbm = hw.memory["HBM"].capacity if "HBM" in hw.memory else 0
    if hbm <= 0:
        return 1
    need = STATE_BYTES_PER_PARAM * n_params / (0.8 * hbm)
    return 1 << max(0, math.ceil(math.log2(max(need, 1.0))))


def _representative_model(config):
    """A bf16 meta model with one decoder layer per distinct (attention type, MoE type) of `config`,
    and how many layers of the full model each stands for: layers of one kind pose the same ops."""
    from collections import Counter

    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    kinds = Counter(zip(config.layer_types, config.mlp_layer_types, strict=True))
    d = config.to_dict()
    d.pop("compress_ratios", None)
    d.update(num_hidden_layers=len(kinds), layer_types=[a for a, _ in kinds], mlp_layer_types=[m for _, m in kinds],
             use_cache=False)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**d))
    return model.to(torch.bfloat16).train(), list(kinds.values())


def modeled_profile(full: torch.nn.Module, target: str, *, seq_len: int, batch_size: int,
                    world_size: int | None = None, config_path: str | None = None) -> ModeledProfile:
    """Trace one training step of `full` (a DeepseekV4ForCausalLM on the meta device: the CLI builds
    it from the config) at (batch_size x seq_len) tokens per device and model it on `target`
    (world_size devices; None: default_world_size); see the module docstring."""
    import torch.nn.functional as F

    from .dtypes import DType
    from .flops import flops_per_token
    from .hardware import load_profile
    from .patch import attn_softmax, rope
    from .ops.base import Problem

    hw = load_profile(target)
    if seq_len < 1 or batch_size < 1 or (world_size is not None and world_size < 1):
        raise UserError(f"seq {seq_len}, batch {batch_size}, world size {world_size}: each must be >= 1")
    peak = hw.peak_tflops.get("bf16") or hw.peak_tflops.get("fp32") or 0.0
    if peak <= 0:
        raise UserError(f"target {target}: its profile has no bf16 or fp32 peak_tflops to model matmuls with")
    if world_size is None:
        world_size = default_world_size(sum(p.numel() for p in full.parameters()), hw)
    comm_gbps = float(hw.extra.get("collective_gbps", 0.0))
    if world_size > 1 and comm_gbps <= 0:
        raise UserError(f"target {target}: its profile has no collective_gbps to model --world-size {world_size} with")
    model, layer_weights = _representative_model(full.config)
    tracker = _GroupTracker(model, layer_weights)
    n_experts = int(getattr(full.config, "n_routed_experts", 0) or 0)
    local_experts = math.ceil(n_experts / min(world_size, n_experts)) if n_experts else 0
    tracer = _Tracer(tracker, n_experts, local_experts / n_experts if n_experts else 1.0)
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    tokens = batch_size * seq_len
    vocab = model.config.vocab_size
    loss_problem = Problem("cross_entropy", "default", (tokens, vocab), DType.bf16)
    try:
        with rope.SWAP.recording(tracker.record, rope.call_problem, tracker.scope), \
                attn_softmax.SWAP.recording(tracker.record_call, tracker.attention_call_problem, tracker.scope), \
                _gate_scopes(tracker), _one_sequence_per_row(), tracer:
            logits = model(input_ids=ids, use_cache=False).logits
            with tracker.scope(loss_problem, group="cross_entropy"):   # the loss over the vocabulary
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), ids.reshape(-1))
            loss.backward()
    finally:
        tracker.remove()
    tracker.problems[("cross_entropy", loss_problem)] += 1

    bw = hw.stream_bandwidth(hw.cores)
    kernel_us: dict = {}
    for (_, problem) in tracker.problems:
        if problem not in kernel_us:
            kernel_us[problem] = _planned_problem_us(problem, hw, bw)

    def eager_us(key) -> float:
        return tracer.bytes[key] / bw * 1e6 + tracer.ops[key] * hw.call_overhead_us

    dtypes = {d.torch: d.value for d in DType}

    def matmul_us(flops: float, bytes_: float, dtype: torch.dtype, scope=None) -> float:
        dtype_peak = hw.peak_tflops.get(dtypes.get(dtype, ""), 0.0) or peak   # no fp32 figure: the bf16 rate
        return max(flops / (dtype_peak * 1e12) * 1e6, bytes_ / bw * 1e6)

    # the matmuls inside the scope of a kernel that fuses them (the dense attention's), per problem
    scope_mm_us: dict = defaultdict(float)
    for m in tracer.matmuls:
        if m[3] is not None and OPS[m[3].op].fuses_matmuls:
            scope_mm_us[m[3]] += matmul_us(*m)
    won: set = set()   # problems whose kernel (fusing its scope's matmuls) beats the eager ops

    groups: list[ModeledGroup] = []
    for name in sorted({g for g, _ in tracer.bytes} - {"matmul"}):
        keys = [k for k in tracer.bytes if k[0] == name]
        eager = sum(eager_us(k) for k in keys)
        problems = sorted(((p, n) for (g, p), n in tracker.problems.items() if g == name), key=lambda pn: pn[0].describe())
        # with the kernels: each problem's scope (its eager ops, forward and backward) runs the kernel
        after = sum(eager_us(k) for k in keys if k[1] is None)
        for k in keys:
            if k[1] is None:
                continue
            eager_k, kernel_k = eager_us(k) + scope_mm_us.get(k[1], 0.0), kernel_us[k[1]][0] * tracker.problems[(name, k[1])]
            after += min(eager_k, kernel_k)
            if kernel_k < eager_k and k[1] in scope_mm_us:
                won.add(k[1])
        bases = sorted({kernel_us[k[1]][1] for k in keys if k[1] is not None})
        shapes = [{"op": p.op, "variant": p.variant, "shape": list(p.shape), "dtype": p.dtype.value, "calls": n}
                  for p, n in problems]
        groups.append(ModeledGroup(name, "fusable" if name in FUSABLE else "other", eager, 0.0,
                                   tracker.calls.get(name, 0), sum(tracer.ops[k] for k in keys),
                                   sum(tracer.bytes[k] for k in keys), 0.0, after, "+".join(bases) or "-", shapes))

    mm_us = sum(matmul_us(*m) for m in tracer.matmuls)
    kept = [m for m in tracer.matmuls if m[3] not in won]   # the fused ones run inside their kernels
    # the other ops of the projections' modules (their input's reshapes, the grouped projection's
    # transposes): eager, before and after
    mm_keys = [k for k in tracer.bytes if k[0] == "matmul"]
    other_us = sum(eager_us(k) for k in mm_keys if k[1] != GEMM)
    groups.append(ModeledGroup("matmul", "matmul", mm_us + other_us, 0.0, 0, sum(tracer.ops[k] for k in mm_keys),
                               sum(tracer.bytes[k] for k in mm_keys),
                               sum(m[0] for m in tracer.matmuls), sum(matmul_us(*m) for m in kept) + other_us,
                               "less the fused attention matmuls" if won else "-",
                               flops_after=sum(m[0] for m in kept)))

    # the optimizer update over this device's share of the parameters
    params = list(full.named_parameters())
    n_params = sum(p.numel() for _, p in params)
    per_device = n_params / world_size
    opt_us = per_device * 28 / bw * 1e6 + len(params) * hw.call_overhead_us
    adamw = Problem("adamw", "default", (max(1, int(per_device)),), DType.fp32)
    opt_after, opt_basis = _planned_problem_us(adamw, hw, bw)
    groups.append(ModeledGroup("adamw", "optimizer", opt_us, 0.0, 1, len(params), per_device * 28, 0.0,
                               min(opt_us, opt_after), opt_basis,
                               [{"op": "adamw", "variant": "default", "shape": [int(per_device)], "dtype": "fp32",
                                 "calls": 1}]))
    if world_size > 1:
        frac = (world_size - 1) / world_size
        dense = n_params - sum(p.numel() for n, p in params if EXPERT_PARAMS in n)
        gather, scatter = dense * 2 * frac, dense * 4 * frac   # bf16 weights gathered (fwd, bwd), fp32 grads
        moe_layers = sum(1 for t in full.config.mlp_layer_types if "moe" in t)
        a2a = 4 * tokens * full.config.num_experts_per_tok * full.config.hidden_size * 2 * frac * moe_layers
        layers = full.config.num_hidden_layers
        us = 1e6 / (comm_gbps * 1e9)

        def exposed_us(compute_us: float) -> float:
            """FSDP traffic beside the compute (per layer only its excess shows), the first gather and
            the last reduce-scatter in the open; the all-to-all in full."""
            fsdp_layer, compute_layer = (2 * gather + scatter) * us / layers, compute_us / layers
            edges = (gather + scatter) * us / layers
            return edges + layers * max(0.0, fsdp_layer - compute_layer) + a2a * us

        compute = sum(g.time_us for g in groups if g.kind != "optimizer")
        compute_after = sum(g.time_after_us for g in groups if g.kind != "optimizer")
        groups.append(ModeledGroup("communication", "comm", exposed_us(compute), 0.0, 0, 0, 2 * gather + scatter + a2a,
                                   0.0, exposed_us(compute_after), "FSDP beside compute, all-to-all exposed"))

    step = sum(g.time_us for g in groups)
    step_after = sum(g.time_after_us for g in groups)
    for g in groups:
        g.share = g.time_us / step if step else 0.0
    groups.sort(key=lambda g: -g.time_us)
    flops = flops_per_token(full, seq_len) * tokens
    return ModeledProfile(config_path, hw.name, seq_len, batch_size, world_size, tokens, flops, peak, step,
                          step_after, groups)


def to_json(result: ModeledProfile) -> str:
    return json.dumps(result.to_dict(), default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
