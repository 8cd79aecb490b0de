"""The `aurakernel` command: the only module that talks to the terminal.

Errors a user can cause print one line on stderr and exit with code 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

# Large CPU tensors on transparent huge pages: page faults on fresh multi-MB buffers cost more than
# many kernels. Applies to every candidate AuraKernel measures alike; set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from .errors import UserError  # noqa: E402

try:  # typer >= 0.25 vendors click
    from typer._click import exceptions as click_exceptions  # noqa: E402
except ImportError:  # pragma: no cover
    from click import exceptions as click_exceptions  # noqa: E402

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="AuraKernel: profile, plan, render, build, verify, measure, record and swap "
                       "fused kernels for DeepSeek-V4 training.")
# piped output gets wide tables instead of rich's 80-column default
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _op_name(op: str, variant: str) -> str:
    """op[variant] for rich output (escaped: rich would read [variant] as markup)."""
    return escape(f"{op}[{variant}]")


def _fmt(v, digits=1, suffix=""):
    return "-" if v is None else f"{v:,.{digits}f}{suffix}"


def _ensure_calibrated(target: str) -> None:
    from .hardware import load_calibration
    if target == "host" and load_calibration() is None:
        from .calibrate import calibrate
        with err.status("calibrating this machine (first run only)..."):
            calibrate()


@app.command()
def tune(
    op: Annotated[str, typer.Argument(help="operator name (see `aurakernel ops`)")],
    shape: Annotated[str | None, typer.Option(help="e.g. 4096x4096; default: the operator's default shape")] = None,
    dtype: Annotated[str, typer.Option(help="fp32/float32, bf16/bfloat16, fp16/float16")] = "bf16",
    variant: Annotated[str | None, typer.Option(help="operator variant, e.g. weighted/unweighted")] = None,
    target: Annotated[str, typer.Option(help="hardware target")] = "host",
    solver: Annotated[str, typer.Option(help="highs, cpsat or scip")] = "highs",
    db: Annotated[str | None, typer.Option(help="tuning DB path (SQLite)")] = None,
    compiled: Annotated[bool, typer.Option("--compiled/--no-compiled", help="also time torch.compile")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    out_dir: Annotated[str | None, typer.Option("--out", help="AscendC targets: write the op project here")] = None,
):
    """Solve the tiling model, build, verify, measure and record one kernel (AscendC targets:
    render the op project, verify it in the emulator and estimate its cycles)."""
    from .agent import tune as run_tune
    from .ops import get_op
    from .planner.model import SOLVERS

    spec = get_op(op)
    spec.problem(shape, dtype, variant)  # validate everything before any slow step
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}: accepted are {', '.join(SOLVERS)}")
    _ensure_calibrated(target)
    with err.status(f"tuning {op}..."):
        result = run_tune(op, shape, dtype, variant=variant, target=target, solver=solver, db_path=db,
                          with_compiled=compiled, out_dir=out_dir)
    if as_json:
        print(json.dumps(result.to_json(), default=str))
        return
    d = result.to_json()
    if "est_cycles" in d:
        _print_ascend(d)
        return
    t = Table(title=_op_name(d["op"], d["variant"]) + f" {d['shape']} {d['dtype']} on {d['target']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("plan", ", ".join(f"{k}={v}" for k, v in d["plan"].items()))
    t.add_row("binding constraint", d["binding_constraint"])
    t.add_row("solver", f"{d['solver']} ({d['solve_s'] * 1e3:.0f} ms)")
    t.add_row("predicted fwd+bwd", _fmt(d["predicted_us"], suffix=" us"))
    t.add_row("measured fwd+bwd", _fmt(d["measured_us"], suffix=" us"))
    t.add_row("eager", _fmt(d["eager_us"], suffix=" us"))
    t.add_row("torch.compile", _fmt(d["compiled_us"], suffix=" us"))
    t.add_row("speedup vs eager", _fmt(d["speedup_vs_eager"], 2, "x"))
    t.add_row("speedup vs compile", _fmt(d["speedup_vs_compiled"], 2, "x"))
    t.add_row("verified", ("[green]yes[/] " if d["verified"] else "[red]no[/] ") + (d["verification"] or ""))
    t.add_row("status", d["status"] + (": " + "; ".join(d["reasons"]) if d["reasons"] else ""))
    out.print(t)


def _print_ascend(d: dict) -> None:
    t = Table(title=_op_name(d["op"], d["variant"]) + f" {d['shape']} {d['dtype']} on {d['target']} (AscendC, emulated)",
              show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("plan", ", ".join(f"{k}={v}" for k, v in d["plan"].items()))
    t.add_row("binding constraint", d["binding_constraint"])
    t.add_row("predicted fwd+bwd", _fmt(d["predicted_us"], suffix=" us"))
    t.add_row("emulator estimate", _fmt(d["est_us"], suffix=" us") + f" ({d['est_cycles']:,.0f} cycles)")
    t.add_row("roofline bound", _fmt(d["roofline_us"], suffix=" us") + f"  (ratio {_fmt(d['roofline_ratio'], 2, 'x')})")
    t.add_row("verified", ("[green]yes[/] " if d["verified"] else "[red]no[/] ") + (d["verification"] or ""))
    if d["project_dir"]:
        t.add_row("op project", d["project_dir"])
    out.print(t)
    for phase, ph in d["phases"].items():
        pt = Table(title=f"{phase}: {ph['est_us']:.2f} us estimated, {ph['roofline_us']:.2f} us at the HBM bound")
        pt.add_column("pipe")
        pt.add_column("busy cycles (slowest core)", justify="right")
        for pipe, cyc in ph["pipes_cycles"].items():
            pt.add_row(pipe, f"{cyc:,.0f}")
        out.print(pt)
        ub = Table(title=f"{phase}: UB {ph['ub_bytes']:,} B")
        ub.add_column("buffer")
        ub.add_column("bytes", justify="right")
        for name, size in ph["buffers"]:
            ub.add_row(name, f"{size:,}")
        out.print(ub)


@app.command()
def autotune(
    config: Annotated[str, typer.Option(help="trainer YAML config")] = "trainer/configs/tiny.yaml",
    out_path: Annotated[str, typer.Option("--out", help="kernel plan file to write")] = "plan.json",
    target: Annotated[str, typer.Option(help="hardware target")] = "host",
    solver: Annotated[str, typer.Option(help="highs or cpsat")] = "highs",
    db: Annotated[str | None, typer.Option(help="tuning DB path (SQLite)")] = None,
    compiled: Annotated[bool, typer.Option("--compiled/--no-compiled", help="also time torch.compile")] = False,
    chart: Annotated[str | None, typer.Option(help="write the profile's PNG bar chart here")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
):
    """Profile a few training steps, rank op groups, tune what can be tuned, write a kernel plan.
    For an Ascend target (--target ascend910b2 ...): --out is a directory that receives one
    verified AscendC op project per group that has an AscendC kernel, and summary.json."""
    from trainer.config import load_config

    from .agent import autotune as run_autotune
    from .hardware import load_profile

    cfg = load_config(config)
    if load_profile(target).kind == "ascend":
        _autotune_ascend(cfg, target, "ascend_projects" if out_path == "plan.json" else out_path, solver, as_json)
        return
    _ensure_calibrated(target)
    with err.status("autotune...") as status:
        result = run_autotune(cfg, target=target, solver=solver, db_path=db, with_compiled=compiled,
                              progress=lambda msg: status.update(f"autotune: {msg}"))
    path = result.plan.save(out_path)
    if chart:
        result.profile.save_chart(chart)
    if as_json:
        print(json.dumps(result.plan.to_dict()))
        return
    _print_profile(result.profile)
    t = Table(title=f"kernel plan -> {path}")
    for col in ("op", "extents", "dtype", "knobs", "measured us", "eager us", "speedup"):
        t.add_column(col)
    for k in result.plan.kernels:
        t.add_row(_op_name(k.op, k.variant), "x".join(map(str, k.kernel_key)), k.dtype,
                  ", ".join(f"{n}={v}" for n, v in k.knobs.items()), _fmt(k.measured_us), _fmt(k.eager_us),
                  _fmt(k.speedup_vs_eager, 2, "x"))
    out.print(t)
    for s in result.plan.skipped:
        where = " ".join(str(s[k]) for k in ("variant", "shape", "dtype") if k in s)
        out.print(f"[yellow]not tuned[/] {s['op']} {where}: {s['reason']}")


def _autotune_ascend(cfg, target: str, out_dir: str, solver: str, as_json: bool) -> None:
    from .agent import autotune_ascend

    _ensure_calibrated("host")   # the profile runs on the host
    with err.status("autotune...") as status:
        result = autotune_ascend(cfg, target=target, out_dir=out_dir, solver=solver,
                                 progress=lambda msg: status.update(f"autotune: {escape(msg)}"))
    if as_json:
        print(json.dumps(result.to_json(), default=str))
        return
    t = Table(title=f"AscendC projects on {target} -> {out_dir}/ (emulated)")
    for col in ("op", "shape", "dtype", "plan", "verified", "est us", "vs roofline", "project"):
        t.add_column(col)
    for r in result.projects:
        d = r.to_json()
        t.add_row(_op_name(d["op"], d["variant"]), d["shape"], d["dtype"],
                  ", ".join(f"{k}={v}" for k, v in d["plan"].items()), "yes" if d["verified"] else "[red]NO[/]",
                  _fmt(d["est_us"]), _fmt(d["roofline_ratio"], 2, "x"), d["project_dir"] or "-")
    out.print(t)
    for s in result.skipped:
        out.print(f"[yellow]no project[/] {_op_name(s['op'], s['variant'])} {s['shape']} {s['dtype']}: "
                  f"{escape(s['reason'])}")
    if any(not r.verified for r in result.projects):
        raise typer.Exit(1)


def _print_profile(report) -> None:
    t = Table(title=f"op groups per training step ({report.step_us / 1e3:.1f} ms profiled)")
    for col in ("group", "kind", "time ms", "share", "calls", "eager ops", "est. saving ms", "basis", "tunable"):
        t.add_column(col)
    for g in report.groups:
        t.add_row(g.name, g.kind, _fmt(g.time_us / 1e3, 2), f"{g.share * 100:.1f}%", _fmt(g.calls, 0), _fmt(g.ops, 0),
                  _fmt(None if g.saving_us is None else g.saving_us / 1e3, 2), g.saving_basis,
                  "yes" if g.tunable else "")
    out.print(t)


@app.command()
def profile(
    config: Annotated[str, typer.Option(help="trainer YAML config")] = "trainer/configs/tiny.yaml",
    steps: Annotated[int, typer.Option(min=1, help="profiled steps")] = 3,
    kernels: Annotated[str | None, typer.Option(help="kernel plan to apply first")] = None,
    chart: Annotated[str | None, typer.Option(help="write a PNG bar chart here")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
):
    """Profile training steps and rank op groups by what fusing them could save."""
    from trainer.config import load_config

    from .profiler import profile_training

    cfg = load_config(config)
    _ensure_calibrated(cfg.hardware.target)
    with err.status("profiling..."):
        report = profile_training(cfg, steps=steps, kernels=kernels)
    if chart:
        report.save_chart(chart)
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        _print_profile(report)


@app.command()
def train(
    config: Annotated[str, typer.Option(help="trainer YAML config")] = "trainer/configs/tiny.yaml",
    kernels: Annotated[str | None, typer.Option(help="kernel plan from `aurakernel autotune`")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="optimizer steps in all (default: from the config)")] = None,
    compare: Annotated[bool, typer.Option("--compare", help="also train the reference, alternating steps")] = False,
    log: Annotated[str | None, typer.Option(help="JSONL log path (default: from the config)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary (or the dry run) as JSON")] = False,
    model_dir: Annotated[str | None, typer.Option(help="start from this Hugging Face checkpoint directory "
                                                        "(its config.json replaces the model section)")] = None,
    checkpoint_dir: Annotated[str | None, typer.Option(help="write DCP checkpoints here (default: "
                                                             "train.checkpoint_dir)")] = None,
    resume: Annotated[bool | None, typer.Option("--resume/--no-resume", help="resume from the checkpoint dir's "
                                                "latest checkpoint (default: when there is one)")] = None,
    export: Annotated[str | None, typer.Option(help="after training, write a Hugging Face model directory here")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print parameters, FLOPs and per-device memory; "
                                                            "train nothing")] = False,
    world_size: Annotated[int | None, typer.Option(min=1, help="devices the --dry-run plans for")] = None,
):
    """Full-parameter training of the config's DeepSeek-V4 model, optionally with tuned kernels.
    Under torchrun it trains data-parallel with FSDP2; rank 0 logs and prints. Put `--` before the
    program (torchrun --nproc-per-node 2 -- aurakernel train ...): torchrun would take --log as its own."""
    from trainer.config import load_config, use_model_dir
    from trainer.train import TrainingDiverged, optional_module
    from trainer.train import train as run_train

    cfg = load_config(config)
    if model_dir:
        use_model_dir(cfg, model_dir)
    if checkpoint_dir:
        cfg.train.checkpoint_dir = checkpoint_dir
    if world_size is not None and not dry_run:
        raise UserError("--world-size sizes a --dry-run; a training run takes its world size from torchrun")
    if dry_run:
        dryrun = optional_module("dryrun", "--dry-run")
        result = dryrun.dry_run(cfg, world_size or 1)
        if as_json:
            print(json.dumps(result))
        else:
            out.print(dryrun.format_dry_run(result))
        return
    if compare and kernels is None:
        raise UserError("--compare needs --kernels PLAN: it trains with and without the plan's kernels")
    _ensure_calibrated(cfg.hardware.target)
    try:
        result = run_train(cfg, kernels=kernels, steps=steps, compare=compare, log_path=log, console=err,
                           show_progress=not as_json, resume=resume, export_dir=export)
    except TrainingDiverged as exc:   # the run failed, the input was fine: exit 1, not 2
        print(f"aurakernel: error: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if as_json:
        print(json.dumps(result))
        return
    if "apply" in result:
        a = result["apply"]
        out.print(f"kernels: {len(a['swapped'])} modules swapped, {len(a['reference'])} on the reference, "
                  f"{len(a['rejected'])} plan entries rejected")
        for r in a["rejected"]:
            out.print(f"  [yellow]rejected[/] {_op_name(r['op'], r['variant'])} {r['kernel_key']} {r['dtype']}: {r['reason']}")
    t = Table(title=f"{result['steps']} steps, {result['tokens_per_step']} tokens/step, {result['dtype']}, "
                    f"{result['world_size']} process(es), peak {result['peak_tflops']:.3f} TFLOP/s per device "
                    f"({result['peak_source']})")
    for col in ("run", "median step ms", "tokens/s", "MFU", "final loss", "skipped steps"):
        t.add_column(col)
    for label, r in result["runs"].items():
        t.add_row(label, _fmt(r["median_step_s"] * 1e3), _fmt(r["tokens_per_s"], 0), f"{r['mfu'] * 100:.2f}%",
                  f"{r['final_loss']:.4f}", str(r["skipped_steps"]))
    out.print(t)
    if "speedup" in result:
        out.print(f"step time with AuraKernel kernels: [bold]{result['speedup']:.3f}x[/] faster than without "
                  f"(same run, alternating steps)")
    if result["checkpoint"]:
        out.print(f"checkpoint: {result['checkpoint']}" + (f" (resumed at step {result['start_step']})"
                                                           if result["start_step"] else ""))
    if result["export"]:
        out.print(f"exported to {result['export']}")


@app.command()
def show(
    db: Annotated[str | None, typer.Option(help="tuning DB path (SQLite)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
):
    """List the tuning DB."""
    from .db import TuningDB
    from .paths import default_db_path

    path = db or default_db_path()
    frame = TuningDB(path).frame()
    if as_json:
        print(frame.to_json(orient="records"))
        return
    t = Table(title=f"tuning DB {path} ({len(frame)} records)")
    for col in ("op", "shape", "dtype", "target", "knobs", "pred us", "meas us", "eager us", "compile us",
                "verified", "status"):
        t.add_column(col)
    for _, r in frame.iterrows():
        knobs = json.loads(r["plan"]).get("knobs", {})
        t.add_row(_op_name(r["op"], r["variant"]), r["shape"], r["dtype"], r["target"],
                  ", ".join(f"{k}={v}" for k, v in knobs.items()), _fmt(r["predicted_us"]),
                  _fmt(r["measured_us"]), _fmt(r["eager_us"]), _fmt(r["compiled_us"]),
                  "yes" if r["verified"] else "no", r["status"])
    out.print(t)


@app.command()
def calibrate(as_json: Annotated[bool, typer.Option("--json")] = False):
    """Measure this machine: streaming bandwidth, call/fork overheads, matmul peak."""
    from .calibrate import calibrate as run_calibrate

    with err.status("calibrating...") as status:
        cal = run_calibrate(progress=lambda msg: status.update(f"calibrating: {msg}"))
    if as_json:
        print(json.dumps(cal))
        return
    t = Table(title=f"host calibration ({cal['path']})", show_header=False)
    for k, v in cal["stream_gbps"].items():
        t.add_row(f"stream bandwidth, {k} thread(s)", f"{v:.2f} GB/s")
    t.add_row("call overhead", f"{cal['call_overhead_us']:.2f} us")
    t.add_row("fork/join overhead", f"{cal['fork_overhead_us']:.2f} us")
    for k, v in cal["peak_tflops"].items():
        t.add_row(f"matmul peak {k}", f"{v:.3f} TFLOP/s")
    out.print(t)


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="a subset that fits in a few minutes on 2 cores")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the result JSON to stdout")] = False,
    out_dir: Annotated[str | None, typer.Option("--out", help="write bench.json, bench.md and PNG plots here")] = None,
    baseline: Annotated[str | None, typer.Option(help="a stored bench JSON to compare speedup ratios against")] = None,
    max_regression: Annotated[float, typer.Option(help="allowed fall of a speedup ratio, as a fraction")] = 0.15,
    update_baseline: Annotated[bool, typer.Option("--update-baseline", help="rewrite --baseline with this run")] = False,
    compiled: Annotated[bool, typer.Option("--compiled/--no-compiled", help="also time torch.compile")] = True,
    readme: Annotated[str | None, typer.Option(help="with --out: rewrite this README's results block")] = None,
    repeat: Annotated[int, typer.Option(help="run the suite N times: medians (a baseline keeps the lowest)")] = 1,
    ops: Annotated[str | None, typer.Option(help="only these operators, comma-separated")] = None,
    train: Annotated[bool, typer.Option("--train/--no-train", help="also the tiny model's training step")] = True,
):
    """Run the benchmark suite: every operator (fwd + bwd) against eager and torch.compile, and the
    tiny model's training step. With --baseline, exit 1 naming each regression or unverified kernel."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import bench as suite
    from .paths import write_text_atomic

    if not 0.0 < max_regression < 1.0:
        raise UserError(f"--max-regression {max_regression}: accepted is a fraction between 0 and 1, e.g. 0.15")
    if not 1 <= repeat <= 10:
        raise UserError(f"--repeat {repeat}: accepted is 1 to 10")
    from .ops import OPS
    names = None if ops is None else [n.strip() for n in ops.split(",") if n.strip()]
    unknown = sorted(set(names or []) - set(OPS))
    if unknown or names == []:
        raise UserError(f"--ops {ops}: unknown operator(s) {', '.join(unknown) or '(none given)'}; "
                        f"accepted are {', '.join(OPS)}")
    if update_baseline and baseline is None:
        raise UserError("--update-baseline needs --baseline FILE: the file to rewrite")
    if readme is not None:
        if out_dir is None or not Path(readme).is_file():
            raise UserError(f"--readme {readme}: needs an existing README file and --out DIR for the plots")
        if suite.README_START not in Path(readme).read_text():
            raise UserError(f"--readme {readme}: no {suite.README_START} ... {suite.README_END} block to write into")
    base = suite.load_result(Path(baseline)) if baseline is not None and not update_baseline else None
    _ensure_calibrated("host")
    progress = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=err, transient=True)
    with progress:
        task = progress.add_task("", total=repeat * suite.total_steps(quick, names, train))
        runs = [suite.run_suite(quick=quick, with_compiled=compiled, ops=names, with_train=train,
                                progress=lambda n, desc: progress.update(task, advance=n, description=escape(desc)))
                for _ in range(repeat)]
    result = suite.combine(runs)
    failures: list[str] = []
    if base is not None:
        why = suite.comparable(result, base)
        if why:
            err.print(f"[yellow]speedups not compared:[/] {escape(why)}; verification is still enforced")
        elif suite.slower(result, base, max_regression):
            result = suite.remeasure_regressed(result, base, max_regression, with_compiled=compiled,
                                               log=lambda m: err.print(escape(m)))
        failures = suite.regressions(result, base, max_regression)
    else:
        failures = suite.unverified(result)
    if out_dir is not None:
        for path in suite.write_outputs(result, Path(out_dir)):
            err.print(f"wrote {path}")
    if readme is not None:
        suite.update_readme(Path(readme), result, Path(out_dir))
        err.print(f"results written into {readme}")
    if update_baseline:
        write_text_atomic(Path(baseline), json.dumps(suite.combine(runs, envelope=True), indent=2))
        err.print(f"baseline {baseline} updated")
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        out.print(suite.markdown(result), markup=False, highlight=False)
    if failures:
        for line in failures:
            err.print(f"[red]REGRESSION[/] {escape(line)}")
        raise typer.Exit(1)


@app.command()
def ops(as_json: Annotated[bool, typer.Option("--json")] = False):
    """List the operators with the meaning of --shape, default shape, variants and dtypes."""
    from .dtypes import shape_text
    from .ops import OPS

    rows = [{"op": s.name, "summary": s.summary, "shape": s.shape_meaning, "default_shape": shape_text(s.default_shape),
             "variants": list(s.variants), "dtypes": [d.value for d in s.dtypes]} for s in OPS.values()]
    if as_json:
        print(json.dumps(rows))
        return
    t = Table(title="operators")
    for col in ("op", "--shape", "default", "variants", "dtypes", "what"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["op"], r["shape"], r["default_shape"], ", ".join(r["variants"]), ", ".join(r["dtypes"]), r["summary"])
    out.print(t)


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, standalone_mode=False, prog_name="aurakernel")
    except UserError as exc:
        print(f"aurakernel: error: {exc}", file=sys.stderr)
        return 2
    except click_exceptions.NoArgsIsHelpError:
        return 0
    except click_exceptions.UsageError as exc:
        print(f"aurakernel: error: {exc.format_message()}", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        print("aurakernel: aborted", file=sys.stderr)
        return 130
    except typer.Exit as exc:
        return exc.exit_code
    return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
