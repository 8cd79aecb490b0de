"""Profile training steps and attribute their time to op groups AuraKernel can fuse.

torch.profiler records every op. Module hooks open a range `ak.group.<name>` around each module
the groups are defined by (innermost wins), so a forward op belongs to the group of its innermost
range. Backward ops are linked to their forward op by the autograd sequence number, so the
backward of a group is charged to the same group. Matmuls form their own bucket (they are not the
fusion target). Python time inside a module (the range's self time) is charged to its group: it is
part of what eager execution costs and a fused kernel removes.

Estimated saving per group = its measured time minus what a fused kernel would take: the
planner's predicted time where the group has an OpSpec, else a roofline bound (the bytes the
module reads and writes, forward and twice for backward, at streaming bandwidth).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.profiler import record_function

from .dtypes import DType
from .hardware import HardwareProfile
from .measure import cpu_profile
from .ops import OPS
from .ops.base import Problem
from .patch.deepseek_v4 import group_of, ops_of, patch_of
from .targets.host.ops import kernel_of as host_kernel

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
              "aten::linear", "aten::_grouped_mm"}
PREFIX = "ak.group."


@dataclass
class GroupStat:
    name: str
    kind: str                 # fusable | matmul | other
    time_us: float            # per step
    share: float
    calls: float              # module calls per step
    ops: float                # eager ops (profiler events) per step: the fragmentation
    saving_us: float | None
    saving_basis: str         # planned | roofline | -
    tunable: bool             # an OpSpec exists for it
    shapes: list[dict] = field(default_factory=list)


@dataclass
class ProfileReport:
    steps: int
    step_us: float
    groups: list[GroupStat]

    def to_dict(self) -> dict:
        return {"steps": self.steps, "step_us": self.step_us, "groups": [asdict(g) for g in self.groups]}

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    def save_chart(self, path: str | Path) -> Path:
        groups = [g for g in self.groups if g.time_us > 0][:16]
        return save_group_chart(path, [f"{g.name} ({g.kind})" for g in groups],
                                [("measured", "#9bb7d4", [g.time_us / 1e3 for g in groups]),
                                 ("est. saving", "#d9534f", [(g.saving_us or 0) / 1e3 for g in groups])],
                                xlabel="ms per training step", title="Training step time by op group")


def save_group_chart(path: str | Path, labels: list[str], series: list[tuple[str, str, list[float]]], *,
                     xlabel: str, title: str) -> Path:
    """Horizontal bars per op group (first label on top), one bar per (name, color, values) series
    side by side: the profile's and the modeled profile's PNG chart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 0.42 * len(labels) + 1.8))
    y = list(range(len(labels)))[::-1]
    height = 0.8 / len(series)
    for i, (name, color, values) in enumerate(series):
        offset = height * ((len(series) - 1) / 2 - i)
        ax.barh([v + offset for v in y], values, height=height, color=color, label=name)
    ax.set_yticks(y, labels)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


class _Hooks:
    """Opens a profiler range per grouped module call and records shapes and bytes. Subclasses may
    follow the problems' extents: enter_scope(module, problem) / exit_scope(module) bracket every
    call of a module that poses a problem of the library (problem None when it poses none)."""

    def __init__(self, model: nn.Module):
        self.handles = []
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.problems: dict = defaultdict(int)   # (group, Problem) -> calls, for ops of the library
        self.stack = []
        self.groups: list[str] = []   # the open ranges' group names, innermost last
        for name, module in model.named_modules():
            group = "cross_entropy" if name == "lm_head" else group_of(module)
            ops = ops_of(module)
            if group is not None or ops:   # ops alone: part of its parent's group (the indexer's scorer)
                self.handles.append(module.register_forward_pre_hook(self._pre(group, ops)))
                self.handles.append(module.register_forward_hook(self._post(group, ops)))

    def _pre(self, group, ops):
        def hook(module, args):
            if group is not None:
                self.stack.append(torch.ops.profiler._record_function_enter_new(PREFIX + group, None))
                self.groups.append(group)
                self.calls[group] += 1
            problems = [patch_of(OPS[op]).call_problem(module, args) for op in ops]
            for problem in problems:
                if problem is not None:
                    self.record(problem)
            if ops:   # the scope follows the module's own operator (the first)
                self.enter_scope(module, problems[0])
        return hook

    def _post(self, group, ops):
        def hook(module, args, output):
            if ops:
                self.exit_scope(module)
            if group is None:
                return
            torch.ops.profiler._record_function_exit._RecordFunction(self.stack.pop())
            self.groups.pop()
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            outs = output if isinstance(output, tuple | list) else [output]
            tensors += [o for o in outs if isinstance(o, torch.Tensor)]
            self.bytes[group] += sum(t.numel() * t.element_size() for t in tensors)
        return hook

    def enter_scope(self, module: nn.Module, problem) -> None:
        pass

    def exit_scope(self, module: nn.Module) -> None:
        pass

    def record(self, problem, group: str | None = None) -> None:
        """A problem posed by a function call (not a module), in `group` or else the innermost open one."""
        self.problems[(group or (self.groups[-1] if self.groups else "other"), problem)] += 1

    def remove(self):
        for h in self.handles:
            h.remove()


FUSABLE = {"rms_norm", "mhc_pre", "mhc_post", "mhc_head", "router", "moe_experts", "shared_expert", "compressor",
           "attention", "cross_entropy", "adamw", "embedding"}


def _attribute(events) -> tuple[dict[str, float], dict[str, int], float]:
    """Self time (us) and op count per group over all events, and the total time."""
    seq_group: dict[int, str] = {}
    group_of_event: dict[int, str | None] = {}

    def enclosing(evt):
        node = evt
        while node is not None:
            key = id(node)
            if key in group_of_event:
                return group_of_event[key]
            if node.name.startswith(PREFIX):
                return node.name[len(PREFIX):]
            if node.name.startswith("autograd::engine::evaluate_function"):
                return seq_group.get(node.sequence_nr)
            node = node.cpu_parent
        return None

    ordered = sorted(events, key=lambda e: e.time_range.start)
    for evt in ordered:  # forward events come first: learn sequence number -> group
        if not evt.name.startswith("autograd::engine") and evt.sequence_nr >= 0:
            g = enclosing(evt)
            if g is not None:
                seq_group.setdefault(evt.sequence_nr, g)
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    total = 0.0
    for evt in ordered:
        self_us = evt.self_cpu_time_total
        total += self_us
        if evt.name in MATMUL_OPS:
            g = "matmul"
        else:
            g = enclosing(evt)
            group_of_event[id(evt)] = g
            g = g or "other"
        times[g] += self_us
        if evt.name.startswith("aten::"):
            counts[g] += 1
    return times, counts, total


@dataclass
class Workload:
    """What the profiler (and autotune) measure, handed in by the caller (the CLI builds it from the
    trainer: trainer.train.workload): the model, one training step on it (forward, backward and
    the optimizer update; it draws its own batch), and the loss it computes outside any module."""

    model: nn.Module
    step: Callable[[], object]
    loss_rows: int            # rows of the logits the loss reads per step (tokens)
    loss_dtype: DType         # the logits' dtype
    config_path: str | None = None   # recorded in the plan autotune writes


def profile_training(workload: Workload, steps: int = 3, warmup: int = 1,
                     hw: HardwareProfile | None = None) -> ProfileReport:
    """Profile `steps` training steps of the workload (after `warmup` unprofiled ones)."""
    from .hardware import load_profile

    hw = hw or load_profile("host")
    model = workload.model
    for _ in range(warmup):
        workload.step()
    hooks = _Hooks(model)
    try:
        with _recording_functions(hooks), cpu_profile(record_shapes=False) as prof:
            for _ in range(steps):
                with record_function("ak.step"):
                    workload.step()
    finally:
        hooks.remove()
    times, counts, total = _attribute(prof.events())
    # the optimizer update is one problem per step: the largest fp32 parameter sets its size
    largest = max((p.numel() for p in model.parameters() if p.dtype == torch.float32), default=0)
    if largest:
        hooks.problems[("adamw", Problem("adamw", "default", (largest,), DType.fp32))] += steps
    # the loss: one row per token over the vocabulary, in the dtype the LM head produces
    hooks.problems[("cross_entropy", Problem("cross_entropy", "default", (workload.loss_rows, model.config.vocab_size),
                                             workload.loss_dtype))] += steps
    # or the LM head and the loss fused (the trainer takes it over cross_entropy when the plan has both)
    hooks.problems[("cross_entropy", Problem("linear_cross_entropy", "default", (
        workload.loss_rows, model.config.hidden_size, model.config.vocab_size), workload.loss_dtype))] += steps
    return _report(times, counts, total, steps, hooks, hw)


@contextlib.contextmanager
def _recording_functions(hooks):
    """The problems of the operators that replace functions the model's code calls (rope, the eager
    attention, the experts' grouped projections), recorded into `hooks` meanwhile: in the group of the
    module that calls them, but the grouped projections in the matmul bucket, where their GEMMs' time
    is (as the plain projections')."""
    from .patch import attn_softmax, grouped_linear, rope

    with contextlib.ExitStack() as stack:
        for part, record in ((rope, hooks.record), (attn_softmax, hooks.record),
                             (grouped_linear, functools.partial(hooks.record, group="matmul"))):
            stack.enter_context(part.SWAP.recording(record, part.call_problem))
        yield


def problems_of_forward(model: nn.Module, input_ids: torch.Tensor) -> list[Problem]:
    """The problems one forward of `model` on `input_ids` poses (no gradients, nothing timed): what a
    plan must cover for this model to run on kernels."""
    hooks = _Hooks(model)
    try:
        with torch.no_grad(), _recording_functions(hooks):
            model(input_ids=input_ids)
    finally:
        hooks.remove()
    return [problem for _, problem in hooks.problems]


def _planned_us(problem, hw: HardwareProfile) -> float | None:
    from .errors import UserError
    from .planner import solve_tiling

    spec = OPS[problem.op]
    try:
        plan = solve_tiling(host_kernel(spec).tiling_problem(problem, hw), op=problem.op, variant=problem.variant,
                            shape=problem.shape, dtype=problem.dtype.value, target=hw.name)
    except UserError:
        return None
    return plan.predicted_us


def _report(times: dict[str, float], counts: dict[str, int], total: float, steps: int, hooks: _Hooks,
            hw: HardwareProfile) -> ProfileReport:
    bw = hw.stream_bandwidth(hw.cores)
    groups = []
    for name, t in times.items():
        per_step = t / steps
        kind = "matmul" if name == "matmul" else ("fusable" if name in FUSABLE else "other")
        saving, basis, shapes = None, "-", []
        problems = sorted(((p, n) for (g, p), n in hooks.problems.items() if g == name),
                          key=lambda pn: pn[0].describe())
        if problems:
            shapes = [{"op": p.op, "variant": p.variant, "shape": list(p.shape), "dtype": p.dtype.value,
                       "calls": n / steps} for p, n in problems]
            if kind != "matmul":   # the matmul bucket's GEMMs (torch's, and the projections' kernels
                # where autotune keeps them): no planned time to compare with
                whole = [(p, n) for p, n in problems if OPS[p.op].covers_group]
                planned = 0.0
                for problem, n in problems:
                    if whole and (problem, n) not in whole or OPS[problem.op].fuses:   # another way to compute
                        continue                                                        # the group: not added
                    p = _planned_us(problem, hw)
                    planned += (p if p is not None else 0.0) * n / steps
                saving, basis = max(0.0, per_step - planned), "planned"
        elif kind == "fusable" and name in hooks.bytes:
            bound_us = 3 * hooks.bytes[name] / steps / bw * 1e6
            saving, basis = max(0.0, per_step - bound_us), "roofline"
        groups.append(GroupStat(name, kind, per_step, t / total if total else 0.0, hooks.calls.get(name, 0) / steps,
                                counts.get(name, 0) / steps, saving, basis, bool(problems), shapes))
    groups.sort(key=lambda g: (g.saving_us is None, -(g.saving_us or 0), -g.time_us))
    return ProfileReport(steps, total / steps, groups)
