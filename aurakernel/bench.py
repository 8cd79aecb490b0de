"""The benchmark suite behind `aurakernel bench`, and its regression gate.

Every operator at its benchmark shapes (fwd + bwd) is planned, built, verified and timed side by
side with the eager reference and torch.compile of it; then the tiny model's full training step
(eager, torch.compile, every kernel swapped in). The result is JSON (schema below), a markdown
table and PNG plots; against a stored baseline it fails on any kernel that is not verified and on
any speedup that fell by more than the allowed fraction.

Noise control (2-core CI machines are noisy):
  * candidates run in interleaved rounds in rotating order after warm-ups; medians are reported
    (aurakernel.measure.compare); training steps alternate runs every step;
  * the thread count is fixed to the machine's cores for the whole run;
  * the gate compares speedup ratios measured in the same rounds, never absolute times;
  * a kernel over the threshold is measured once more before it is reported (the better run counts).
A baseline recorded on another CPU (model or vector/matrix units differ) is not comparable: ratios
depend on the hardware, so only verification is enforced and the report says why.

JSON: {"schema": 1, "machine": {...}, "versions": {...}, "quick": bool, "subset": bool,
       "kernels": [{"op", "variant", "shape", "dtype", "aurakernel_us", "eager_us", "compiled_us",
                    "aurakernel_compiled_us", "speedup_vs_eager", "speedup_vs_compiled",
                    "compiled_speedup_vs_compiled", "roofline_pct", "intensity",
                    "verified", "verification", "status"}],
       "train_step": {"steps", "median_step_ms": {...}, "tokens_per_s": {...}, "mfu": {...},
                      "speedup_vs_eager", "speedup_vs_compiled", "compiled_speedup_vs_compiled"} | null,
The four columns: eager, torch.compile, AuraKernel alone ("aurakernel"), and AuraKernel inside
torch.compile ("aurakernel_compiled": the patched module compiled, its kernels custom ops in the
graph); compiled_speedup_vs_compiled = compiled_us / aurakernel_compiled_us, what a user who already
compiles gains. The gate compares speedup_vs_eager and speedup_vs_compiled.
       "summary": {"geomean_vs_eager", "geomean_vs_compiled", "min_vs_eager"}}
"""

from __future__ import annotations

import copy
import json
import math
import platform
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .agent import tune_problem
from .db import TuningDB
from .hardware import _cpu_flags, _cpu_model, host_cores, load_calibration, load_profile
from .ops import OPS
from .ops.base import Problem
from .paths import write_text_atomic

SCHEMA = 1
QUICK_OPS = ("rms_norm", "swiglu", "router", "cross_entropy", "adamw")   # one of each kernel shape family
# CPU features the kernels take different paths on: a baseline from a CPU without the same set is
# not comparable
PATH_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
KERNEL_KEYS = ("op", "variant", "shape", "dtype", "aurakernel_us", "eager_us", "compiled_us", "aurakernel_compiled_us",
               "speedup_vs_eager", "speedup_vs_compiled", "compiled_speedup_vs_compiled", "roofline_pct", "intensity",
               "verified", "verification", "status")


def machine_info() -> dict:
    flags = _cpu_flags()
    return {"cpu": _cpu_model(), "cores": host_cores(), "path_flags": sorted(f for f in PATH_FLAGS if f in flags),
            "platform": platform.platform()}


def versions() -> dict:
    import transformers
    return {"aurakernel": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def bench_problems(quick: bool, ops: list[str] | None = None) -> list[Problem]:
    """Every operator variant at its default shape (V4-Flash widths, rows scaled to run in seconds),
    in bf16 where the operator takes it; --quick: the first variant of QUICK_OPS; `ops`: only these."""
    out = []
    for name, spec in OPS.items():
        if (quick and name not in QUICK_OPS) or (ops is not None and name not in ops):
            continue
        dtype = "bf16" if any(d.value == "bf16" for d in spec.dtypes) else spec.dtypes[0].value
        for variant in spec.variants[:1] if quick else spec.variants:
            out.append(spec.problem(None, dtype, variant))
    return out


def kernel_row(problem: Problem, hw, db: TuningDB, with_compiled: bool) -> dict:
    """Plan, build, verify and time one kernel: its row of the report."""
    spec = OPS[problem.op]
    result = tune_problem(spec, problem, hw, target="host", solver="highs", db=db, with_compiled=with_compiled,
                          with_compiled_kernel=with_compiled)
    work = [spec.work(problem, backward=b) for b in (False, True)]
    nbytes, flops = sum(w.bytes_moved for w in work), sum(w.flops for w in work)
    roofline = None
    if result.measured_us:
        roofline = 100.0 * (nbytes / (result.measured_us * 1e-6)) / hw.stream_bandwidth(hw.cores)
    return {"op": problem.op, "variant": problem.variant, "shape": problem.shape_text, "dtype": problem.dtype.value,
            "aurakernel_us": result.measured_us, "eager_us": result.eager_us, "compiled_us": result.compiled_us,
            "aurakernel_compiled_us": result.aurakernel_compiled_us,
            "speedup_vs_eager": result.speedup_vs_eager, "speedup_vs_compiled": result.speedup_vs_compiled,
            "compiled_speedup_vs_compiled": _ratio(result.compiled_us, result.aurakernel_compiled_us),
            "roofline_pct": roofline, "intensity": flops / nbytes if nbytes else None,
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

    def to_json(self) -> dict:
        ms = self.median_step_ms
        return {"steps": self.steps, "median_step_ms": ms, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "final_loss": self.final_loss, "swapped": self.swapped,
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
    from trainer.metrics import flops_per_token, mfu
    from trainer.model import build_model
    from trainer.train import make_run, train_step

    from . import apply

    cfg = load_config(config)
    if plan is None:
        from .agent import autotune
        log("autotune of the training config")
        plan = autotune(cfg).plan
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
    tokens = cfg.data.seq_len * cfg.data.batch_size
    flops_token = flops_per_token(base, cfg.data.seq_len)
    hw = load_profile(cfg.hardware.target)
    peak = hw.peak_tflops.get(cfg.train.dtype, hw.peak_tflops.get("fp32", 0.0))
    med = {n: statistics.median(r.step_s[2:] if len(r.step_s) > 4 else r.step_s) for n, r in runs.items()}
    return TrainStepResult(steps, {n: v * 1e3 for n, v in med.items()}, {n: tokens / v for n, v in med.items()},
                           {n: mfu(tokens / v, flops_token, peak) for n, v in med.items()},
                           {n: r.losses[-1] for n, r in runs.items()}, report.summary())


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
        from .calibrate import calibrate
        calibrate()
    hw = load_profile("host")
    torch.set_num_threads(hw.cores)
    problems = bench_problems(quick, ops)
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
    return len(bench_problems(quick, ops)) + int(with_train)


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


# --- the regression gate --------------------------------------------------------------------------

def kernel_key(row: dict) -> tuple:
    return row["op"], row["variant"], row["shape"], row["dtype"]


def comparable(current: dict, baseline: dict) -> str | None:
    """None when the two runs' ratios can be compared, else why not."""
    a, b = current.get("machine", {}), baseline.get("machine", {})
    if a.get("cpu") != b.get("cpu") or a.get("path_flags") != b.get("path_flags") or a.get("cores") != b.get("cores"):
        return (f"the baseline was recorded on {b.get('cpu')} ({b.get('cores')} cores, {', '.join(b.get('path_flags', []))}), "
                f"this is {a.get('cpu')} ({a.get('cores')} cores, {', '.join(a.get('path_flags', []))})")
    return None


def kernel_name(row: dict) -> str:
    return "{}[{}] {} {}".format(*kernel_key(row))


TRAIN_STEP = "training step"


def unverified(result: dict) -> list[str]:
    """One line per kernel that failed verification: always a failure, baseline or not."""
    return [f"{kernel_name(k)}: not verified ({k['verification']})" for k in result["kernels"] if not k["verified"]]


def slower(current: dict, baseline: dict, max_regression: float) -> list[tuple[str, str]]:
    """(name, why) of every kernel and of the training step whose speedup fell below the baseline's
    by more than `max_regression` (a fraction), and of baseline kernels a full run did not measure."""
    now = {kernel_key(k): k for k in current["kernels"]}
    pairs = [(kernel_name(base), base, now.get(kernel_key(base))) for base in baseline["kernels"]]
    if baseline.get("train_step") and current.get("train_step"):
        pairs.append((TRAIN_STEP, baseline["train_step"], current["train_step"]))
    out = []
    for name, base, row in pairs:
        if row is None:
            if not current.get("subset"):        # a full run must cover every baseline kernel
                out.append((name, "in the baseline but not measured"))
            continue
        for metric in ("speedup_vs_eager", "speedup_vs_compiled"):
            was, got = base.get(metric), row.get(metric)
            if was and got and got < was * (1.0 - max_regression):
                out.append((name, f"{metric} {got:.2f}x, baseline {was:.2f}x (-{1 - got / was:.0%}, "
                                  f"allowed -{max_regression:.0%})"))
    return out


def regressions(current: dict, baseline: dict, max_regression: float) -> list[str]:
    """One line per failure: unverified kernels, and (when the runs are comparable) what is slower."""
    if comparable(current, baseline) is not None:
        return unverified(current)
    return unverified(current) + [f"{name}: {why}" for name, why in slower(current, baseline, max_regression)]


def remeasure_regressed(current: dict, baseline: dict, max_regression: float, *, with_compiled: bool,
                        log=lambda msg: None) -> dict:
    """Measure every kernel (and the training step) over the threshold once more and keep the
    better run (noise control)."""
    flagged = {name for name, _ in slower(current, baseline, max_regression)}
    hw = load_profile("host")
    out = dict(current, kernels=[])
    with tempfile.TemporaryDirectory(prefix="ak-bench-") as tmp:
        db = TuningDB(Path(tmp) / "bench.sqlite")
        for k in current["kernels"]:
            name = kernel_name(k)
            if name in flagged and k["verified"]:
                log(f"re-measuring {name}")
                again = kernel_row(OPS[k["op"]].problem(k["shape"], k["dtype"], k["variant"]), hw, db, with_compiled)
                if (again["speedup_vs_eager"] or 0) > (k["speedup_vs_eager"] or 0):
                    k = again
            out["kernels"].append(k)
    out["summary"] = summarize(out["kernels"])
    t = current.get("train_step")
    if TRAIN_STEP in flagged and t:
        log("re-measuring the training step")
        again = train_step_compare(steps=t["steps"], with_compiled=t.get("speedup_vs_compiled") is not None,
                                   log=log).to_json()
        if again["speedup_vs_eager"] > t["speedup_vs_eager"]:
            out["train_step"] = again
    return out


# --- reports -------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    lines = ["| op | shape | dtype | aurakernel us | eager us | compile us | aurakernel + compile us | vs eager | "
             "vs compile | + compile vs compile | roofline | verified |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"
    for k in result["kernels"]:
        lines.append(f"| {k['op']}[{k['variant']}] | {k['shape']} | {k['dtype']} | {num(k['aurakernel_us'], ',.0f')} | "
                     f"{num(k['eager_us'], ',.0f')} | {num(k['compiled_us'], ',.0f')} | "
                     f"{num(k.get('aurakernel_compiled_us'), ',.0f')} | "
                     f"{num(k['speedup_vs_eager'], '.2f')}x | {num(k['speedup_vs_compiled'], '.2f')}x | "
                     f"{num(k.get('compiled_speedup_vs_compiled'), '.2f')}x | "
                     f"{num(k['roofline_pct'], '.0f')}% | {'yes' if k['verified'] else 'NO'} |")
    s = result["summary"]
    lines.append("")
    lines.append(f"Geomean speedup: {num(s['geomean_vs_eager'], '.2f')}x vs eager, "
                 f"{num(s['geomean_vs_compiled'], '.2f')}x vs torch.compile; AuraKernel inside torch.compile "
                 f"{num(s.get('geomean_compiled_vs_compiled'), '.2f')}x vs torch.compile.")
    t = result.get("train_step")
    if t:
        ms = t["median_step_ms"]
        lines += ["", "| training step (tiny config) | median ms | tokens/s | MFU |", "|---|---|---|---|"]
        for name in ms:
            lines.append(f"| {name} | {ms[name]:.0f} | {t['tokens_per_s'][name]:,.0f} | {100 * t['mfu'][name]:.2f}% |")
        lines.append("")
        lines.append(f"Training step: {t['speedup_vs_eager']:.2f}x vs eager"
                     + (f", {t['speedup_vs_compiled']:.2f}x vs torch.compile" if t.get("speedup_vs_compiled") else "")
                     + (f"; AuraKernel inside torch.compile {t['compiled_speedup_vs_compiled']:.2f}x vs torch.compile."
                        if t.get("compiled_speedup_vs_compiled") else "."))
    m = result["machine"]
    lines += ["", f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['path_flags'])}); "
              + ", ".join(f"{k} {v}" for k, v in result["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def plots(result: dict, out_dir: Path) -> list[Path]:
    """speedup.png (bars per kernel, vs eager and vs torch.compile) and roofline.png (each kernel's
    achieved bandwidth share against its arithmetic intensity)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [k for k in result["kernels"] if k["speedup_vs_eager"]]
    names = [f"{k['op']}[{k['variant']}]\n{k['shape']}" for k in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4.5))
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [k["speedup_vs_eager"] for k in rows], 0.27, label="vs eager")
    ax.bar(list(x), [k["speedup_vs_compiled"] or 0 for k in rows], 0.27, label="vs torch.compile")
    ax.bar([i + 0.27 for i in x], [k.get("compiled_speedup_vs_compiled") or 0 for k in rows], 0.27,
           label="inside torch.compile vs torch.compile")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup (fwd + bwd)")
    ax.set_title("AuraKernel host kernels")
    ax.legend()
    fig.tight_layout()
    speedup = out_dir / "speedup.png"
    fig.savefig(speedup, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for k in rows:
        if k["roofline_pct"] is not None and k["intensity"]:
            ax.scatter(k["intensity"], k["roofline_pct"])
            ax.annotate(k["op"], (k["intensity"], k["roofline_pct"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.axhline(100.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved bandwidth, % of calibrated stream")
    ax.set_title("Roofline placement")
    fig.tight_layout()
    roofline = out_dir / "roofline.png"
    fig.savefig(roofline, dpi=110)
    plt.close(fig)
    return [speedup, roofline]


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "bench.json", json.dumps(result, indent=2))
    write_text_atomic(out_dir / "bench.md", markdown(result))
    return [out_dir / "bench.json", out_dir / "bench.md", *plots(result, out_dir)]


README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"


def update_readme(readme: Path, result: dict, plot_dir: Path) -> None:
    """Replace the README's results block (between the bench markers) with this run's tables and
    plots (plot_dir: where write_outputs put them)."""
    from .errors import UserError
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise UserError(f"{readme} has no {README_START} ... {README_END} block to write the results into")
    rel = plot_dir.resolve().relative_to(readme.resolve().parent)
    block = (f"{README_START}\n" + markdown(result)
             + f"\n![speedup per operator]({rel.as_posix()}/speedup.png)\n"
             + f"![roofline placement]({rel.as_posix()}/roofline.png)\n{README_END}")
    head, rest = text.split(README_START, 1)
    write_text_atomic(readme, head + block + rest.split(README_END, 1)[1])


def load_result(path: Path) -> dict:
    from .errors import UserError
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"baseline {path} does not exist: record one with --update-baseline") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"baseline {path} is not a bench JSON file: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("kernels"), list):
        raise UserError(f"baseline {path} is not a schema-{SCHEMA} bench result (no 'kernels' list)")
    return data
