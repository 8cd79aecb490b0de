"""The kernel suite behind `aurakernel bench`: every operator at its benchmark shape (fwd + bwd)
planned, built, verified and timed side by side with the eager reference, torch.compile of it, the
patched module and the patched module under torch.compile; then the tiny model's full training step
the same four ways. The package docstring (aurakernel/bench/__init__.py) has the JSON schema and the
noise control."""

from __future__ import annotations

import copy
import math
import platform
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__
from ..agent import tune_problem
from ..calibrate import slow_dtypes
from ..db import TuningDB
from ..dtypes import DType
from ..hardware import _cpu_flags, _cpu_model, host_cores, load_calibration, load_profile
from ..measure import peak_allocated_bytes
from ..ops import OPS
from ..ops.base import Problem

SCHEMA = 1
QUICK_OPS = ("rms_norm", "swiglu", "router", "cross_entropy", "adamw")   # one of each kernel shape family
# CPU features the kernels take different paths on: a baseline from a CPU without the same set is
# not comparable
PATH_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
KERNEL_KEYS = ("op", "variant", "shape", "dtype", "aurakernel_us", "eager_us", "compiled_us", "aurakernel_compiled_us",
               "speedup_vs_eager", "speedup_vs_compiled", "compiled_speedup_vs_compiled", "roofline_pct", "attained_gbps",
               "intensity", "peak_mib", "verified", "verification", "status")


def machine_info() -> dict:
    """The CPU, its fast paths, and the calibrated roofs (stream bandwidth with every core, a copy's and
    an update in place's, matmul peaks, the fp32 FMA roof where the calibration measured it)."""
    from ..hardware import load_calibration

    flags = _cpu_flags()
    hw = load_profile("host")
    return {"cpu": _cpu_model(), "cores": host_cores(), "path_flags": sorted(f for f in PATH_FLAGS if f in flags),
            "platform": platform.platform(), "stream_gbps": hw.stream_bandwidth(hw.cores) / 1e9,
            "inplace_gbps": hw.inplace_bandwidth(hw.cores) / 1e9, "peak_tflops": dict(hw.peak_tflops),
            "fma_tflops": dict((load_calibration() or {}).get("fma_tflops", {}))}


def versions() -> dict:
    import transformers
    return {"aurakernel": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


COMPUTE_BOUND = 32.0   # FLOP per byte of minimum traffic: an operator above this is matmul work


def bench_problems(quick: bool, ops: list[str] | None = None, hw=None) -> list[Problem]:
    """Every operator variant at its default shape (V4-Flash widths, rows scaled to run in seconds),
    in bf16 where the operator takes it; --quick: the first variant of QUICK_OPS; `ops`: only these.
    On a CPU without a fast bf16 matmul path (`hw`'s calibrated peaks: an AVX2-only one runs torch's
    bf16 matmuls ~100x below fp32), the matmul-class operators run in fp32: eager bf16 attention
    would take minutes a call there, and no one trains bf16 matmuls on such a machine."""
    slow16 = hw is not None and "bf16" in slow_dtypes(hw.peak_tflops)
    out = []
    for name, spec in OPS.items():
        if (quick and name not in QUICK_OPS) or (ops is not None and name not in ops):
            continue
        for variant in spec.variants[:1] if quick else spec.variants:
            problem = spec.problem(None, None, variant)
            matmul_work = _intensity(spec, problem) > COMPUTE_BOUND
            if slow16 and problem.dtype.itemsize == 2 and DType.fp32 in spec.dtypes and matmul_work:
                problem = spec.problem(None, DType.fp32.value, variant)
            out.append(problem)
    return out


def _intensity(spec, problem: Problem) -> float:
    work = [spec.work(problem, backward=b) for b in (False, True)]
    return sum(w.flops for w in work) / max(1, sum(w.bytes_moved for w in work))


def kernel_row(problem: Problem, hw, db: TuningDB, with_compiled: bool) -> dict:
    """Plan, build, verify and time one kernel: its row of the report."""
    spec = OPS[problem.op]
    result = tune_problem(spec, problem, hw, target="host", solver="highs", db=db, with_compiled=with_compiled,
                          with_compiled_kernel=with_compiled, with_memory=True)
    work = [spec.work(problem, backward=b) for b in (False, True)]
    nbytes, flops = sum(w.bytes_moved for w in work), sum(w.flops for w in work)
    roofline = attained = None
    if result.measured_us:   # the minimum traffic's time at the calibrated rates, as a share of the measured
        roofline = 100.0 * sum(w.floor_seconds(hw) for w in work) / (result.measured_us * 1e-6)
        attained = nbytes / (result.measured_us * 1e-6) / 1e9
    return {"op": problem.op, "variant": problem.variant, "shape": problem.shape_text, "dtype": problem.dtype.value,
            "aurakernel_us": result.measured_us, "eager_us": result.eager_us, "compiled_us": result.compiled_us,
            "aurakernel_compiled_us": result.aurakernel_compiled_us,
            "speedup_vs_eager": result.speedup_vs_eager, "speedup_vs_compiled": result.speedup_vs_compiled,
            "compiled_speedup_vs_compiled": _ratio(result.compiled_us, result.aurakernel_compiled_us),
            "roofline_pct": roofline, "attained_gbps": attained, "intensity": flops / nbytes if nbytes else None,
            # allocator high-water mark of one fwd+bwd, per candidate (MiB)
            "peak_mib": {name: b / 2**20 for name, b in result.peak_bytes.items()},
            "verified": result.verified, "verification": result.verification.summary if result.verification else
            "; ".join(result.reasons), "status": result.status}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


@dataclass
class TrainStepResult:
    steps: int
    median_step_ms: dict
    tokens_per_s: dict
    mfu: dict
    final_loss: dict
    swapped: dict
    peak_mib: dict   # run -> allocator high-water mark of one training step above the state it starts from

    def to_json(self) -> dict:
        ms = self.median_step_ms
        return {"steps": self.steps, "median_step_ms": ms, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "final_loss": self.final_loss, "swapped": self.swapped, "peak_mib": self.peak_mib,
                "speedup_vs_eager": ms["eager"] / ms["aurakernel"],
                "speedup_vs_compiled": _ratio(ms.get("compiled"), ms["aurakernel"]),
                "compiled_speedup_vs_compiled": _ratio(ms.get("compiled"), ms.get("aurakernel_compiled"))}


def train_step_compare(config: str = "trainer/configs/tiny.yaml", plan=None, steps: int = 20,
                       with_compiled: bool = True, log=lambda msg: None) -> TrainStepResult:
    """The tiny model's full training step from the same weights on the same batches, alternating
    every step: eager transformers, every kernel of `plan` (an autotune plan; autotuned here when
    None) swapped in and, with `with_compiled`, torch.compile of each of the two."""
    from trainer.config import load_config
    from trainer.data import TokenBatches
    from trainer.model import build_model
    from trainer.train import make_run, train_step, workload

    from .. import apply
    from ..flops import flops_per_token, mfu

    cfg = load_config(config)
    if plan is None:
        from ..agent import autotune
        log("autotune of the training config")
        plan = autotune(workload(cfg)).plan
    base = build_model(cfg.model, cfg.train.seed)
    runs = {"eager": make_run("eager", copy.deepcopy(base), cfg)}
    if with_compiled:
        compiled = copy.deepcopy(base)
        runs["compiled"] = make_run("compiled", compiled, cfg)
        runs["compiled"].model = torch.compile(compiled)
    tuned = copy.deepcopy(base)
    report = apply(tuned, plan)
    runs["aurakernel"] = make_run("aurakernel", tuned, cfg, adamw_kernel=report.optimizer_kernel)
    runs["aurakernel"].apply_report = report   # the loss through the plan's cross_entropy kernel too
    if with_compiled:   # the applied model compiled: its kernels are custom ops in the graph
        both = copy.deepcopy(tuned)
        runs["aurakernel_compiled"] = make_run("aurakernel_compiled", both, cfg, adamw_kernel=report.optimizer_kernel)
        runs["aurakernel_compiled"].apply_report = report
        runs["aurakernel_compiled"].model = torch.compile(both)
    batches = TokenBatches(cfg.data.source, cfg.data.path, cfg.data.seq_len, cfg.data.batch_size,
                           base.config.vocab_size, cfg.train.seed)
    if with_compiled:
        log("torch.compile of the model and of the applied model (their first steps)")
        warmup = next(batches)
        for name in ("compiled", "aurakernel_compiled"):
            train_step(runs[name], warmup, cfg)
    names = list(runs)
    for step in range(steps):
        batch = next(batches)
        for name in names[step % len(names):] + names[: step % len(names)]:
            loss, _, dt = train_step(runs[name], batch, cfg)
            runs[name].step_s.append(dt)
            runs[name].losses.append(loss)
        log(f"step {step}: " + "  ".join(f"{n} {runs[n].step_s[-1] * 1e3:.0f} ms" for n in names))
    batch = next(batches)   # one more step each, under the allocator's watch (not timed)
    peaks = {name: peak_allocated_bytes(lambda run=run: train_step(run, batch, cfg)) / 2**20 for name, run in runs.items()}
    tokens = cfg.data.seq_len * cfg.data.batch_size
    flops_token = flops_per_token(base, cfg.data.seq_len)
    hw = load_profile(cfg.hardware.target)
    peak = hw.peak_tflops.get(cfg.train.dtype, hw.peak_tflops.get("fp32", 0.0))
    med = {n: statistics.median(r.step_s[2:] if len(r.step_s) > 4 else r.step_s) for n, r in runs.items()}
    return TrainStepResult(steps, {n: v * 1e3 for n, v in med.items()}, {n: tokens / v for n, v in med.items()},
                           {n: mfu(tokens / v, flops_token, peak) for n, v in med.items()},
                           {n: r.losses[-1] for n, r in runs.items()}, report.summary(), peaks)


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summarize(kernels: list[dict]) -> dict:
    return {"geomean_vs_eager": geomean(k["speedup_vs_eager"] for k in kernels),
            "geomean_vs_compiled": geomean(k["speedup_vs_compiled"] for k in kernels),
            "geomean_compiled_vs_compiled": geomean(k.get("compiled_speedup_vs_compiled") for k in kernels),
            "min_vs_eager": min((k["speedup_vs_eager"] for k in kernels if k["speedup_vs_eager"]), default=None)}


def run_suite(*, quick: bool, with_compiled: bool = True, train_steps: int | None = None, progress=None,
              ops: list[str] | None = None, with_train: bool = True, log=lambda msg: None) -> dict:
    """The whole suite; `progress(advance_by, description)` is called as it goes."""
    progress = progress or (lambda n, desc: None)
    if load_calibration() is None:
        from ..calibrate import calibrate
        calibrate()
    hw = load_profile("host")
    torch.set_num_threads(hw.cores)
    problems = bench_problems(quick, ops, hw)
    kernels = []
    with tempfile.TemporaryDirectory(prefix="ak-bench-") as tmp:
        db = TuningDB(Path(tmp) / "bench.sqlite")   # bench runs leave the user's tuning DB alone
        for problem in problems:
            progress(0, problem.describe())
            kernels.append(kernel_row(problem, hw, db, with_compiled))
            progress(1, problem.describe())
    train = None
    if with_train:
        progress(0, "training step")
        steps = train_steps or (10 if quick else 20)
        train = train_step_compare(steps=steps, with_compiled=with_compiled and not quick, log=log).to_json()
        progress(1, "training step")
    return {"schema": SCHEMA, "machine": machine_info(), "versions": versions(), "quick": quick,
            "subset": quick or ops is not None,
            "kernels": kernels, "train_step": train, "summary": summarize(kernels)}


def total_steps(quick: bool, ops: list[str] | None = None, with_train: bool = True) -> int:
    return len(bench_problems(quick, ops)) + int(with_train)   # the same count in any dtype


def combine(results: list[dict], envelope: bool = False) -> dict:
    """Several runs of the suite as one: each speedup's median (envelope=True: its minimum, the
    lower envelope a baseline keeps, so that noise between healthy runs is not a regression);
    times are medians; a kernel is verified only if every run verified it."""
    pick = min if envelope else statistics.median

    def merged(rows: list[dict]) -> dict:
        row = dict(rows[0])
        for key in ("aurakernel_us", "eager_us", "compiled_us", "aurakernel_compiled_us", "roofline_pct"):
            vals = [r[key] for r in rows if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        for key in ("speedup_vs_eager", "speedup_vs_compiled", "compiled_speedup_vs_compiled"):
            vals = [r[key] for r in rows if r.get(key) is not None]
            row[key] = pick(vals) if vals else None
        row["verified"] = all(r["verified"] for r in rows)
        row["verification"] = next((r["verification"] for r in rows if not r["verified"]), rows[0]["verification"])
        return row

    first = results[0]
    kernels = [merged([next(k for k in r["kernels"] if kernel_key(k) == kernel_key(k0)) for r in results])
               for k0 in first["kernels"]]
    out = dict(first, kernels=kernels, summary=summarize(kernels), runs=len(results))
    trains = [r["train_step"] for r in results if r.get("train_step")]
    if trains:
        out["train_step"] = dict(trains[0])
        for key in ("speedup_vs_eager", "speedup_vs_compiled", "compiled_speedup_vs_compiled"):
            vals = [t[key] for t in trains if t.get(key) is not None]
            out["train_step"][key] = pick(vals) if vals else None
    return out



def kernel_key(row: dict) -> tuple:
    return row["op"], row["variant"], row["shape"], row["dtype"]


