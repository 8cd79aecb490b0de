"""Swap tuned kernels into a DeepseekV4ForCausalLM, the way Liger-Kernel patches models.

Every kernel of the plan is rebuilt from its knobs; it is used only if the rebuilt source has the
hash it was verified with and it passes a quick re-verification here. Each module the plan covers
then dispatches per call on (compile-time extents, dtype): a verified kernel when one matches,
the reference otherwise. The report says what was swapped, and what stayed on the reference and why.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .dtypes import DType, parse_shape
from .errors import BuildError, UserError
from .hardware import load_profile
from .ops import get_op
from .ops.base import Problem
from .patch.deepseek_v4 import patch_of
from .patch.deepseek_v4 import sites as deepseek_v4_sites
from .patch.install import Refused
from .planfile import KernelPlan, PlanEntry
from .targets.host.build import build_kernel
from .targets.host.ops import kernel_of as host_kernel
from .targets.host.target import verify


@dataclass
class ApplyReport:
    swapped: list[dict] = field(default_factory=list)     # {"module", "op", "variant", "kernel_key", "dtypes"}
    reference: list[dict] = field(default_factory=list)   # {"module", "op", "reason"}
    rejected: list[dict] = field(default_factory=list)    # plan entries not used: {"op", ..., "reason"}
    tuned: list[dict] = field(default_factory=list)       # kernels tuned on demand (tune_missing): {"op", ..., "status"}
    plan: KernelPlan | None = None                         # the plan applied, with the kernels tuned on demand
    optimizer_kernel: str | None = None                    # the verified adamw kernel, for FusedAdamW
    loss_kernels: dict = field(default_factory=dict)       # (op, kernel_key, torch dtype) -> loss kernel

    def loss_kernel(self, vocab: int, dtype: torch.dtype) -> str | None:
        """The verified cross_entropy kernel for logits of this width and dtype, if the plan has one."""
        return self.loss_kernels.get(("cross_entropy", (vocab,), dtype))

    def linear_loss_kernel(self, hidden: int, vocab: int, dtype: torch.dtype) -> str | None:
        """The verified linear_cross_entropy kernel (LM head + loss) for these widths and dtype, if any."""
        return self.loss_kernels.get(("linear_cross_entropy", (hidden, vocab), dtype))

    def to_dict(self) -> dict:
        return {"swapped": self.swapped, "reference": self.reference, "rejected": self.rejected, "tuned": self.tuned,
                "optimizer": "FusedAdamW (adamw kernel)" if self.optimizer_kernel else "torch AdamW",
                "loss": [f"{op} {'x'.join(map(str, key))} {str(d).removeprefix('torch.')}"
                         for op, key, d in self.loss_kernels]}

    def summary(self) -> str:
        tuned = f", {len(self.tuned)} kernels tuned on demand" if self.tuned else ""
        return (f"{len(self.swapped)} modules swapped, {len(self.reference)} on the reference, "
                f"{len(self.rejected)} plan entries rejected{tuned}")


_ADMISSIONS: dict[tuple, tuple[str | None, str | None]] = {}


def _admit(entry: PlanEntry, hw) -> tuple[str | None, str | None]:
    """Rebuild and re-verify one plan entry; (source hash, None) or (None, reason). Done once per
    process for an entry (rebuilding and re-verifying costs about a second per model otherwise), on
    the CPU whatever the default device (a model built under `torch.device("meta")` included)."""
    key = (entry.op, entry.variant, tuple(entry.kernel_key), entry.dtype, entry.shape,
           tuple(sorted(entry.knobs.items())), entry.source_hash, hw.fingerprint())
    if key not in _ADMISSIONS:
        with torch.device("cpu"):
            _ADMISSIONS[key] = _rebuild_and_verify(entry, hw)
    return _ADMISSIONS[key]


def _knobs_refused(spec, problem: Problem, knobs: dict, hw) -> str | None:
    """Why a plan entry's knobs cannot be built here, or None. A plan file is untrusted input: every
    knob must be one of the operator's tiling model on this machine (its domain, its capacity rules)
    before anything is rendered, built or run (a thread count of 0 would otherwise crash the process)."""
    model = host_kernel(spec).tiling_problem(problem, hw)
    if set(knobs) != set(model.domains):
        return f"knobs {sorted(knobs)} are not {spec.name}'s {sorted(model.domains)}"
    for name, value in knobs.items():
        domain = model.domains[name]
        if value not in domain:
            return (f"knob {name}={value} is outside {spec.name}'s domain on this machine "
                    f"({len(domain)} values in {min(domain)}..{max(domain)})")
    if not model.feasible(knobs):
        return f"knobs {knobs} break a capacity rule of {spec.name} on this machine"
    return None


def _rebuild_and_verify(entry: PlanEntry, hw) -> tuple[str | None, str | None]:
    try:
        spec = get_op(entry.op)
        dtype = DType.parse(entry.dtype, spec.dtypes)
        problem = Problem(entry.op, entry.variant, parse_shape(entry.shape, spec.shape_rank), dtype)
        spec.check_shape(problem.shape)
        if tuple(spec.kernel_key(problem)) != tuple(entry.kernel_key):
            return None, f"shape {entry.shape} does not have the entry's extents {entry.kernel_key}"
        refused = _knobs_refused(spec, problem, entry.knobs, hw)
        if refused is not None:
            return None, refused
        kernel = build_kernel(spec, problem, entry.knobs)
    except BuildError as exc:
        return None, f"build failed: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - any unusable entry is rejected with its reason
        return None, f"unusable entry: {exc}"
    if kernel.source_hash != entry.source_hash:
        return None, (f"the kernel its knobs render hashes to {kernel.source_hash}, not the verified {entry.source_hash}: "
                      f"the entry's knobs do not match its hash (edited after tuning), or the templates changed "
                      f"since: re-run autotune")
    # quick re-verification on this machine, on the tail shapes only (cheap)
    simd_elems = max(hw.simd_bytes // 4, 1)
    cases = [(p, build_kernel(spec, p, entry.knobs)) for p in host_kernel(spec).verification_problems(problem, entry.knobs, simd_elems)[1:]]
    result = verify(spec, cases, seeds=(7,))
    if not result.passed:
        return None, f"re-verification failed: {result.summary}"
    return kernel.source_hash, None


def _plan_of(plan: KernelPlan | dict | str | Path) -> KernelPlan:
    if isinstance(plan, dict):
        return KernelPlan.from_dict(plan)
    if isinstance(plan, str | Path):
        return KernelPlan.load(plan)
    if not isinstance(plan, KernelPlan):
        raise UserError(f"apply takes a kernel plan (a KernelPlan, its dict or a plan file path), "
                        f"got {type(plan).__name__}")
    return plan


def _tune_missing(model: torch.nn.Module, plan: KernelPlan, hw, target: str, ops: set[str] | None, tokens: int,
                  db_path, report: ApplyReport) -> KernelPlan:
    """`plan` plus a kernel, tuned here, for every problem one forward of `model` poses that no usable
    entry covers (restricted to `ops` when given): a plan tuned on one model's widths serves another."""
    from .agent import check_fits_in_memory, distinct_problems, kernel_identity, plan_entry, tune_problem
    from .db import TuningDB
    from .paths import default_db_path
    from .profiler import problems_of_forward
    from .targets import target_for

    if target != "host":
        raise UserError(f"tune_missing tunes kernels on this machine: target {target!r} is not accepted (use 'host')")
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        raise UserError("tune_missing runs one forward of the model to find the problems it poses, and this model "
                        "has no weights (meta device): materialise it first, or tune its checkpoint with "
                        "`aurakernel autotune --model-dir`")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise UserError(f"tokens={tokens!r}: expected a positive number of tokens for the forward that finds the problems")
    covered = {(e.op, e.variant, tuple(e.kernel_key), DType.parse(e.dtype)) for e in plan.kernels
               if _admit(e, hw)[1] is None}
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=param.device)
    tgt, db, added = target_for(hw), TuningDB(db_path or default_db_path()), []
    for problem in distinct_problems(problems_of_forward(model, ids)):
        spec = get_op(problem.op)
        if kernel_identity(problem) in covered or (ops is not None and problem.op not in ops) \
                or not tgt.supported(spec):
            continue
        where = {"op": problem.op, "variant": problem.variant, "shape": problem.shape_text,
                 "dtype": problem.dtype.value}
        try:
            check_fits_in_memory(spec, problem)
            r = tune_problem(spec, problem, hw, target=target, solver="highs", db=db, with_compiled=False)
        except (UserError, BuildError) as exc:   # PlanInfeasible is a UserError: this problem stays on the reference
            report.tuned.append(where | {"status": "not tuned", "reason": str(exc).splitlines()[0]})
            continue
        report.tuned.append(where | {"status": r.status, "reason": "; ".join(r.reasons)})
        if r.usable:
            added.append(plan_entry(r))
    return dataclasses.replace(plan, kernels=[*plan.kernels, *added])


def apply(model: torch.nn.Module, plan: KernelPlan | dict | str | Path, target: str = "host", *,
          tune_missing: bool | Iterable[str] = False, tokens: int = 256, db_path=None) -> ApplyReport:
    """Patch `model` with the verified kernels of `plan`: a KernelPlan, its dict (as json.load gives
    it) or a plan file's path.

    tune_missing: tune here (and record in the tuning DB at `db_path`) a kernel for every problem the
    model poses that the plan does not cover, e.g. the widths of a model the plan was not tuned on
    (True: every operator; or a collection of operator names). The problems are those of one forward
    on `tokens` random tokens, in the dtypes it runs in (call apply inside `torch.autocast` to find
    the autocast ones). `report.plan` is the plan with the new kernels, to save for the next run."""
    plan = _plan_of(plan)
    report = ApplyReport()
    hw = load_profile(target)
    if tune_missing:
        ops = None if tune_missing is True else {tune_missing} if isinstance(tune_missing, str) else set(tune_missing)
        for name in ops or ():
            get_op(name)   # an unknown name: one line naming the known operators
        plan = _tune_missing(model, plan, hw, target, ops, tokens, db_path, report)
    report.plan = plan

    # (op, variant, kernel_key) -> {torch dtype: source hash}
    table: dict[tuple, dict[torch.dtype, str]] = defaultdict(dict)
    for entry in plan.kernels:
        source_hash, reason = _admit(entry, hw)
        if reason is not None:
            report.rejected.append({"op": entry.op, "variant": entry.variant, "kernel_key": entry.kernel_key,
                                    "dtype": entry.dtype, "reason": reason})
            continue
        if entry.op == "adamw":   # not a module: the trainer builds its optimizer with it
            report.optimizer_kernel = source_hash
            continue
        if entry.op in ("cross_entropy", "linear_cross_entropy"):   # not a module: the trainer's loss calls it
            report.loss_kernels[(entry.op, tuple(entry.kernel_key), DType.parse(entry.dtype).torch)] = source_hash
            continue
        table[(entry.op, entry.variant, tuple(entry.kernel_key))][DType.parse(entry.dtype).torch] = source_hash

    patched: dict[str, list[torch.nn.Module]] = defaultdict(list)
    for site in deepseek_v4_sites(model):
        keyed = {k[2]: v for k, v in table.items() if k[0] == site.op and k[1] == site.variant}
        if site.kernel_key is not None and site.kernel_key not in keyed:
            have = sorted(keyed) or "none"
            report.reference.append({"module": site.name, "op": site.op,
                                     "reason": f"no verified {site.op}[{site.variant}] kernel for extents "
                                               f"{list(site.kernel_key)} in the plan (plan has {have})"})
            continue
        if not keyed:
            report.reference.append({"module": site.name, "op": site.op,
                                     "reason": f"the plan has no verified {site.op}[{site.variant}] kernel"})
            continue

        def lookup(key, dtype, keyed=keyed):
            return keyed.get(tuple(key), {}).get(dtype)

        try:
            patch_of(get_op(site.op)).patch(site.module, lookup)
        except Refused as exc:   # a precondition of the kernel's math does not hold for this module
            report.reference.append({"module": site.name, "op": site.op, "reason": str(exc)})
            continue
        patched[site.op].append(site.module)
        dtypes = sorted({str(d).removeprefix("torch.") for k, v in keyed.items()
                         if site.kernel_key in (None, k) for d in v})
        report.swapped.append({"module": site.name, "op": site.op, "variant": site.variant,
                               "kernel_key": list(site.kernel_key) if site.kernel_key else "per call",
                               "dtypes": dtypes})
    for op, modules in patched.items():
        patch_of(get_op(op)).patch_model(model, modules)
    return report


class ClassPatch:
    """While active, every DeepSeek-V4 model built (DeepseekV4ForCausalLM, DeepseekV4Model, from
    their constructors or from_pretrained) is patched with the plan once its outermost constructor
    returns; `reports` holds one ApplyReport per model. A context manager; `undo()` ends it."""

    def __init__(self, plan: KernelPlan, target: str, **options):
        self.plan, self.target, self.options = plan, target, options   # options: apply's keywords
        self.reports: list[ApplyReport] = []
        self._saved: dict[type, object] = {}
        self._depth = threading.local()
        for cls in _deepseek_v4_model_classes():
            self._saved[cls] = cls.__dict__.get("__init__")
            cls.__init__ = self._wrapped(cls.__init__)

    def _wrapped(self, init):
        patch = self

        @functools.wraps(init)
        def __init__(model, *args, **kwargs):
            depth = getattr(patch._depth, "n", 0)
            patch._depth.n = depth + 1
            try:
                init(model, *args, **kwargs)
            finally:
                patch._depth.n = depth
            if depth == 0:   # the outermost model: its submodels are patched with it, once
                report = apply(model, patch.plan, patch.target, **patch.options)
                patch.plan = report.plan   # kernels tuned on demand serve the next model too
                patch.reports.append(report)
        return __init__

    def undo(self) -> None:
        for cls, init in self._saved.items():
            if init is None:
                del cls.__init__
            else:
                cls.__init__ = init
        self._saved.clear()

    def __enter__(self) -> ClassPatch:
        return self

    def __exit__(self, *exc) -> bool:
        self.undo()
        return False


def _deepseek_v4_model_classes() -> list[type]:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    found, todo = [], [v4.DeepseekV4PreTrainedModel]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def patch_deepseek_v4(plan: KernelPlan | dict | str | Path, target: str = "host", **options) -> ClassPatch:
    """Liger's `apply_liger_kernel_to_<model>()`: patch every DeepSeek-V4 model built from now on
    with `plan` (checked now: a bad plan is an error here, not at the first model). `options` are
    apply's (tune_missing, tokens, db_path)."""
    unknown = set(options) - {"tune_missing", "tokens", "db_path"}
    if unknown:
        raise UserError(f"patch_deepseek_v4: unknown option(s) {sorted(unknown)}; accepted are tune_missing, tokens, db_path")
    return ClassPatch(_plan_of(plan), target, **options)
