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
from .hostmem import retain_freed_memory  # noqa: E402

retain_freed_memory()   # fresh outputs reuse pages already faulted in (hostmem.py); AURAKERNEL_RETAIN_FREED_MEMORY=0: off

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


def _print_calibration() -> None:
    """Which calibration the MFU and the cost model used, when it was taken, what to distrust in it."""
    from .calibrate import describe
    from .hardware import load_calibration
    cal = load_calibration()
    out.print(("[yellow]" if cal and cal.get("warnings") else "") + escape(describe(cal)))


def _calibrate(progress=None) -> dict:
    from .calibrate import calibrate
    from .errors import BuildError
    try:
        return calibrate(progress=progress)
    except BuildError as exc:   # the machine's compiler, not a template: the user's to fix
        raise UserError(f"calibration needs a working C compiler: {str(exc).splitlines()[0]} "
                        "(set CC to gcc or clang)") from None


def _ensure_calibrated(target: str) -> None:
    from .hardware import load_calibration
    if target == "host" and load_calibration() is None:
        with err.status("calibrating this machine (first run only)..."):
            _calibrate()


CANDIDATES_HELP = ("time the planner's N best tilings against each other and keep the fastest verified one "
                   "(Ascend targets: estimated side by side in the emulator; 1: its pick)")


def _check_solver(solver: str) -> None:
    from .planner.model import SOLVERS
    if solver not in SOLVERS:
        raise UserError(f"unknown solver {solver!r}: accepted are {', '.join(SOLVERS)}")


@app.command()
def tune(
    op: Annotated[str, typer.Argument(help="operator name (see `aurakernel ops`)")],
    shape: Annotated[str | None, typer.Option(help="e.g. 4096x4096; default: the operator's default shape")] = None,
    dtype: Annotated[str | None, typer.Option(help="fp32/float32, bf16/bfloat16, fp16/float16; default: bf16 "
                                                   "where the operator takes it, else its first dtype")] = None,
    variant: Annotated[str | None, typer.Option(help="operator variant, e.g. weighted/unweighted")] = None,
    target: Annotated[str, typer.Option(help="hardware target")] = "host",
    solver: Annotated[str, typer.Option(help="highs, cpsat or scip")] = "highs",
    db: Annotated[str | None, typer.Option(help="tuning DB path (SQLite)")] = None,
    compiled: Annotated[bool, typer.Option("--compiled/--no-compiled", help="also time torch.compile")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    out_dir: Annotated[str | None, typer.Option("--out", help="AscendC targets: write the op project here")] = None,
    candidates: Annotated[int, typer.Option(help=CANDIDATES_HELP)] = 1,
):
    """Solve the tiling model, build, verify, measure and record one kernel (AscendC targets:
    render the op project, verify it in the emulator and estimate its cycles)."""
    from .agent import check_candidates, check_fits_in_memory, tune_problem
    from .db import TuningDB
    from .hardware import load_profile
    from .ops import get_op
    from .paths import check_writable, default_db_path
    from .targets import target_for

    spec = get_op(op)
    problem = spec.problem(shape, dtype, variant)   # parsed once; validate everything before any slow step
    check_fits_in_memory(spec, problem)
    _check_solver(solver)
    hw = load_profile(target)
    check_candidates(candidates)
    if out_dir is not None and not target_for(hw).writes_projects:
        raise UserError(f"--out writes an AscendC op project: target {target!r} has none to write "
                        "(host kernels are built into the cache; `aurakernel show` lists them)")
    if out_dir is not None:
        check_writable(out_dir, "--out", directory=True)   # the op project is a directory
    tuning_db = TuningDB(db or default_db_path())   # a DB that cannot be written fails now, not after the tuning
    _ensure_calibrated(target)
    hw = load_profile(target)   # with the calibration just taken, if this was the first run
    with err.status(f"tuning {op}..."):
        result = tune_problem(spec, problem, hw, target=target, solver=solver, db=tuning_db,
                              with_compiled=compiled, out_dir=Path(out_dir) if out_dir is not None else None,
                              candidates=candidates)
    if as_json:
        print(json.dumps(result.to_json(), default=str))
    else:
        _print_tune(result)
    if result.status in ("build_failed", "verify_failed"):   # no kernel came of it: a failure for scripts and CI
        raise typer.Exit(1)


def _print_tune(result) -> None:
    d = result.to_json()
    if result.estimate is not None:   # a target that estimates instead of running (the emulator)
        _print_estimate(d)
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


def _print_estimate(d: dict) -> None:
    t = Table(title=_op_name(d["op"], d["variant"]) + f" {d['shape']} {d['dtype']} on {d['target']} (AscendC, emulated)",
              show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("plan", ", ".join(f"{k}={v}" for k, v in d["plan"].items()))
    t.add_row("binding constraint", d["binding_constraint"])
    t.add_row("predicted fwd+bwd", _fmt(d["predicted_us"], suffix=" us"))
    t.add_row("emulator estimate", _fmt(d["est_us"], suffix=" us") + f" ({d['est_cycles']:,.0f} cycles)")
    t.add_row("roofline bound", _fmt(d["roofline_us"], suffix=" us") + f" ({d['bound']}; ratio {_fmt(d['roofline_ratio'], 2, 'x')})")
    if d.get("traffic_us") is not None:   # the same time against the traffic the kernels make themselves
        t.add_row("bound at its own traffic", _fmt(d["traffic_us"], suffix=" us") + f" (ratio {_fmt(d['traffic_ratio'], 2, 'x')})")
    t.add_row("verified", ("[green]yes[/] " if d["verified"] else "[red]no[/] ") + (d["verification"] or ""))
    if d["project_dir"]:
        name = d["project_name"]
        t.add_row("op project", f"{d['project_dir']} (builds libak_{name}_ops.so: torch.ops.aurakernel.{name}_*)")
    out.print(t)
    for phase, ph in d["phases"].items():
        pt = Table(title=f"{phase}: {ph['est_us']:.2f} us estimated, {ph['roofline_us']:.2f} us at the {ph['bound']} bound")
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
    model_dir: Annotated[str | None, typer.Option(help="tune for this Hugging Face checkpoint directory's widths "
                                                        "(its config.json replaces the model section)")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", min=1, help="tokens per sequence of the profiled "
                                                                          "steps (default: data.seq_len)")] = None,
    candidates: Annotated[int, typer.Option(help=CANDIDATES_HELP)] = 1,
):
    """Profile a few training steps, rank op groups, tune what can be tuned, write a kernel plan.
    For an Ascend target (--target ascend910b2 ...): --out is a directory that receives one
    verified AscendC op project per group that has an AscendC kernel, and summary.json."""
    from trainer.config import load_config, use_model_dir
    from trainer.train import workload

    from .agent import autotune as run_autotune
    from .agent import check_candidates
    from .db import TuningDB
    from .hardware import load_profile
    from .paths import check_writable, default_db_path
    from .targets import target_for

    cfg = load_config(config)
    if model_dir:
        use_model_dir(cfg, model_dir)
    if seq_len is not None:
        cfg.data.seq_len = seq_len
    tgt = target_for(load_profile(target))   # unknown targets: one line naming the accepted ones
    check_candidates(candidates)
    if tgt.writes_projects:   # a folder of op projects (AscendC), not a plan file
        out_path = "ascend_projects" if out_path == "plan.json" else out_path
    _check_solver(solver)   # every option and output path before the profile and the tuning, not after
    check_writable(out_path, "--out", directory=tgt.writes_projects)
    if chart:
        check_writable(chart, "--chart")
    tuning_db = TuningDB(db or default_db_path())   # a foreign or unwritable DB: refused before the profile
    _ensure_calibrated("host")   # the profile runs on this machine
    with err.status("autotune...") as status:
        result = run_autotune(workload(cfg), target=target, solver=solver, db=tuning_db, with_compiled=compiled,
                              out_dir=out_path if tgt.writes_projects else None, candidates=candidates,
                              progress=lambda msg: status.update(f"autotune: {escape(msg)}"))
    if chart:
        result.profile.save_chart(chart)
    if tgt.writes_projects:
        _print_projects(result, target, out_path, as_json)
        return
    path = result.plan.save(out_path)
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
    from .ops import OPS
    kept = {k.source_hash for k in result.plan.kernels}
    for r in result.tuned:
        if r.against_apart is not None and r.source_hash in kept:
            out.print(f"[green]fused[/] {r.problem.describe()}: {r.against_apart['fused']:,.1f} us against "
                      f"{' + '.join(OPS[r.problem.op].fuses)} apart {r.against_apart['apart']:,.1f} us (side by side)")
    for s in result.plan.skipped:
        where = " ".join(str(s[k]) for k in ("variant", "shape", "dtype") if k in s)
        out.print(f"[yellow]not tuned[/] {s['op']} {where}: {escape(s['reason'])}")


def _print_projects(result, target: str, out_dir: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_json(), default=str))
        return
    t = Table(title=f"op projects on {target} -> {out_dir}/ (emulated)")
    for col in ("op", "shape", "dtype", "plan", "verified", "est us", "vs roofline", "project"):
        t.add_column(col)
    for r in result.tuned:
        d = r.to_json()
        t.add_row(_op_name(d["op"], d["variant"]), d["shape"], d["dtype"],
                  ", ".join(f"{k}={v}" for k, v in d["plan"].items()), "yes" if d["verified"] else "[red]NO[/]",
                  _fmt(d["est_us"]), _fmt(d["roofline_ratio"], 2, "x"), d["project_dir"] or "-")
    out.print(t)
    for s in result.skipped:
        where = " ".join(str(s[k]) for k in ("variant", "shape", "dtype") if k in s)
        out.print(f"[yellow]no project[/] {_op_name(s['op'], s.get('variant', 'default'))} {where}: "
                  f"{escape(s['reason'])}")


def _print_profile(report) -> None:
    t = Table(title=f"op groups per training step ({report.step_us / 1e3:.1f} ms profiled)")
    for col in ("group", "kind", "time ms", "share", "calls", "eager ops", "est. saving ms", "basis", "tunable"):
        t.add_column(col)
    for g in report.groups:
        t.add_row(g.name, g.kind, _fmt(g.time_us / 1e3, 2), f"{g.share * 100:.1f}%", _fmt(g.calls, 0), _fmt(g.ops, 0),
                  _fmt(None if g.saving_us is None else g.saving_us / 1e3, 2), g.saving_basis,
                  "yes" if g.tunable else "")
    out.print(t)


def _print_modeled(result) -> None:
    t = Table(title=f"{result.config}: one training step on {result.target}, modeled "
                    f"(seq {result.seq_len} x batch {result.batch_size} per device, {result.world_size} devices)")
    for col in ("group", "kind", "modeled ms", "share", "with kernels ms", "basis", "calls", "ops"):
        t.add_column(col)
    for g in result.groups:
        t.add_row(g.name, g.kind, _fmt(g.time_us / 1e3, 2), f"{g.share * 100:.1f}%", _fmt(g.time_after_us / 1e3, 2),
                  g.basis, _fmt(g.calls, 0), _fmt(g.ops, 0))
    out.print(t)
    mm = next((g for g in result.groups if g.kind == "matmul"), None)
    if mm is not None and mm.flops_after is not None and mm.flops_after < mm.flops:
        out.print(f"matmuls execute {mm.flops / 1e12:,.1f} TFLOP -> {mm.flops_after / 1e12:,.1f} TFLOP with the kernels "
                  f"(the dense attention's scores and weighted sums run inside the sparse attention kernel) for "
                  f"{result.model_flops / 1e12:,.1f} TFLOP of model FLOPs")
    out.print(f"step {result.step_us / 1e3:.1f} ms -> {result.step_after_us / 1e3:.1f} ms with the planned kernels; "
              f"MFU {result.mfu_before:.1%} -> {result.mfu_after:.1%} (of {result.peak_tflops:g} TFLOP/s)")


@app.command()
def profile(
    config: Annotated[str, typer.Option(help="trainer YAML config")] = "trainer/configs/tiny.yaml",
    steps: Annotated[int, typer.Option(min=1, help="profiled steps")] = 3,
    kernels: Annotated[str | None, typer.Option(help="kernel plan to apply first")] = None,
    chart: Annotated[str | None, typer.Option(help="write a PNG bar chart here")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    target: Annotated[str | None, typer.Option(help="model the step on this hardware profile instead of measuring "
                                                     "it: the config's model traced on the meta device (no memory)")] = None,
    seq: Annotated[int | None, typer.Option(min=1, help="--target: tokens per sequence (default: data.seq_len)")] = None,
    batch: Annotated[int | None, typer.Option(min=1, help="--target: sequences per device (default: data.batch_size)")] = None,
    world_size: Annotated[int | None, typer.Option(min=1, help="--target: devices (default: the fewest whose memory "
                                                               "holds the sharded training state)")] = None,
):
    """Profile training steps and rank op groups by what fusing them could save; with --target, model
    one step of the config (e.g. V4-Flash) on that hardware instead, before and after the planned kernels."""
    from trainer.config import load_config

    cfg = load_config(config)
    if chart:
        from .paths import check_writable
        check_writable(chart, "--chart")
    if target is None:
        if seq is not None or batch is not None or world_size is not None:
            raise UserError("--seq, --batch and --world-size shape a modeled profile: add --target PROFILE")
        from trainer.train import workload

        from .hardware import load_profile
        from .profiler import profile_training

        _ensure_calibrated(cfg.hardware.target)
        with err.status("profiling..."):
            report = profile_training(workload(cfg, kernels), steps=steps, hw=load_profile(cfg.hardware.target))
        if chart:
            report.save_chart(chart)
        if as_json:
            print(json.dumps(report.to_dict()))
        else:
            _print_profile(report)
        return
    if kernels is not None:
        raise UserError("--kernels applies to a measured profile; a modeled one (--target) plans its own kernels")
    from trainer.dryrun import build_meta_model

    from .modeled import modeled_profile

    _ensure_calibrated(target)
    with err.status(f"tracing one training step on the meta device and modeling it on {target}..."):
        result = modeled_profile(build_meta_model(cfg.model), target, seq_len=seq or cfg.data.seq_len,
                                 batch_size=batch or cfg.data.batch_size, world_size=world_size, config_path=cfg.path)
    if chart:
        result.save_chart(chart)
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        _print_modeled(result)


@app.command()
def train(
    config: Annotated[str, typer.Option(help="trainer YAML config")] = "trainer/configs/tiny.yaml",
    kernels: Annotated[str | None, typer.Option(help="kernel plan from `aurakernel autotune`")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="optimizer steps in all (default: from the config)")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", min=1, help="tokens per sequence (default: "
                                                                          "data.seq_len)")] = None,
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
    if seq_len is not None:
        cfg.data.seq_len = seq_len
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
    isa = result.get("isa_peak_tflops")
    t = Table(title=f"{result['steps']} steps, {result['tokens_per_step']} tokens/step, {result['dtype']}, "
                    f"{result['world_size']} process(es), peak {result['peak_tflops']:.3f} TFLOP/s per device "
                    f"({result['peak_source']})" + (f", compute roof {isa:.2f} TFLOP/s (calibrate's FMA probe; bf16's derived from it)" if isa else ""))
    mem = "peak GiB (resident set)" if result.get("device", "cpu") == "cpu" else "peak GiB (allocator)"
    for col in ("run", "median step ms", "tokens/s", "MFU", *(("MFU of compute roof",) if isa else ()), "final loss",
                "skipped steps", mem):
        t.add_column(col)
    for label, r in result["runs"].items():
        of_isa = (f"{r['mfu_of_isa_peak'] * 100:.2f}%",) if isa else ()
        t.add_row(label, _fmt(r["median_step_s"] * 1e3), _fmt(r["tokens_per_s"], 0), f"{r['mfu'] * 100:.2f}%",
                  *of_isa, f"{r['final_loss']:.4f}", str(r["skipped_steps"]), _fmt(r["peak_mem_gib"], 2))
    out.print(t)
    if "speedup" in result:
        out.print(f"step time with AuraKernel kernels: [bold]{result['speedup']:.3f}x[/] faster than without "
                  f"(same run, alternating steps)")
    if result["checkpoint"]:
        out.print(f"checkpoint: {result['checkpoint']}" + (f" (resumed at step {result['start_step']})"
                                                           if result["start_step"] else ""))
    _print_calibration()
    if result["export"]:
        out.print(f"exported to {result['export']}")


@app.command()
def show(
    db: Annotated[str | None, typer.Option(help="tuning DB path (SQLite)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
):
    """List the tuning DB."""
    from .db import TuningDB, plan_knobs
    from .paths import default_db_path

    path = Path(db) if db else default_db_path()
    if not path.exists() and not db:   # (a --db typo is an error: the read-only DB refuses a missing file)
        if as_json:
            print("[]")
        else:
            out.print(f"no tuning DB yet at {path}: tune or autotune records into it")
        return
    frame = TuningDB(path, readonly=True).frame()
    if as_json:
        print(frame.to_json(orient="records"))
        return
    t = Table(title=f"tuning DB {path} ({len(frame)} records)")
    for col in ("op", "shape", "dtype", "target", "knobs", "pred us", "meas us", "eager us", "compile us",
                "verified", "status"):
        t.add_column(col)
    for _, r in frame.iterrows():
        knobs = plan_knobs(r["plan"])
        t.add_row(_op_name(r["op"], r["variant"]), r["shape"], r["dtype"], r["target"],
                  "[red](plan not readable)[/]" if knobs is None else escape(", ".join(f"{k}={v}" for k, v in knobs.items())), _fmt(r["predicted_us"]),
                  _fmt(r["measured_us"]), _fmt(r["eager_us"]), _fmt(r["compiled_us"]),
                  "yes" if r["verified"] else "no", r["status"])
    out.print(t)
    _print_calibration()


@app.command()
def calibrate(
    as_json: Annotated[bool, typer.Option("--json")] = False,
    fit: Annotated[bool, typer.Option("--fit", help="fit the cost model's coefficients to measurements instead: "
                                                    "host: the tuning DB's records; Ascend: emulator runs")] = False,
    target: Annotated[str, typer.Option(help="--fit: host or an Ascend profile (e.g. ascend910b2)")] = "host",
    db: Annotated[str | None, typer.Option(help="--fit --target host: tuning DB path (SQLite)")] = None,
    samples: Annotated[int | None, typer.Option(help="--fit --target ascend*: emulator runs to fit to, ~15 s "
                                                     "each (default 15)")] = None,
):
    """Measure this machine: streaming bandwidth, call/fork overheads, matmul peak. With --fit, fit
    the planner's cost-model coefficients by least squares and report the rank correlation of
    predicted vs measured time before and after (exit 2 when there are too few records)."""
    if fit:
        _calibrate_fit(target, db, samples, as_json)
        return
    if target != "host" or db is not None or samples is not None:
        raise UserError("--target, --db and --samples apply to --fit; plain `calibrate` measures this machine")
    with err.status("calibrating...") as status:
        cal = _calibrate(progress=lambda msg: status.update(f"calibrating: {msg}"))
    if as_json:
        print(json.dumps(cal))
        return
    t = Table(title=f"host calibration ({cal['path']})", show_header=False)
    for k, v in cal["stream_gbps"].items():
        t.add_row(f"stream bandwidth, {k} thread(s)", f"{v:.2f} GB/s")
    for k, v in cal["inplace_gbps"].items():
        t.add_row(f"in-place update bandwidth, {k} thread(s)", f"{v:.2f} GB/s")
    t.add_row("call overhead", f"{cal['call_overhead_us']:.2f} us")
    t.add_row("fork/join overhead", f"{cal['fork_overhead_us']:.2f} us")
    from .hardware import _cpu_flags

    amx = "amx_bf16" in _cpu_flags()
    for k, v in cal["peak_tflops"].items():
        ideal = cal["theoretical_tflops"].get(k)
        roof = ("the FMA probe's" if k == "fp32" else "derived from fp32's FMA roof" if not amx
                else f"AMX tiles at the reported {cal['theoretical_clock_ghz']} GHz: an estimate")
        t.add_row(f"matmul peak {k}", f"{v:.3f} TFLOP/s" + (f" (compute roof {ideal:.2f}: {roof})" if ideal else "")
                  + (" (no fast path on this CPU)" if k in cal["no_fast_path"] else ""))
    for k, v in cal.get("own_gemm_tflops", {}).items():
        t.add_row(f"AuraKernel's blocked GEMM {k}", f"{v:.3f} TFLOP/s (where a kernel may run either, the faster is planned)")
    out.print(t)
    for w in cal["warnings"]:
        out.print(f"[yellow]implausible after 3 attempts[/] {escape(w)}: the machine looks busy; re-run on an idle one")


def _calibrate_fit(target: str, db: str | None, samples: int | None, as_json: bool) -> None:
    from .hardware import load_profile
    from .paths import default_db_path
    from .planner import fit as fitting

    kind = load_profile(target).kind   # unknown targets: one line naming the accepted ones
    if kind == "host":
        if samples is not None:
            raise UserError("--samples applies to an Ascend target; the host fit reads the tuning DB (--db)")
        _ensure_calibrated("host")   # the fit is stored in this machine's calibration
        with err.status("fitting the host cost model to the tuning DB..."):
            report = fitting.fit_host(Path(db) if db else default_db_path())
    elif kind == "ascend":
        if db is not None:
            raise UserError("--db applies to --target host; an Ascend fit runs the emulator (--samples)")
        samples = 15 if samples is None else samples
        if not fitting.ascend_min_samples() <= samples <= 200:
            raise UserError(f"--samples {samples}: accepted is {fitting.ascend_min_samples()} to 200 emulator runs")
        with err.status(f"emulating {samples} sampled tilings on {target}...") as status:
            found, failed = fitting.ascend_samples(target, samples,
                                                   progress=lambda m: status.update(f"emulating {escape(m)}"))
            report = fitting.fit_ascend(target, found, skipped=failed)
    else:
        raise UserError(f"target {target!r} is a {kind} profile: --fit takes host or an Ascend profile")
    if as_json:
        print(json.dumps(report.to_json()))
        return
    t = Table(title=f"cost model fit, {report.target}: {report.records} records ({report.source})")
    for col in ("coefficient", "before", "after"):
        t.add_column(col)
    for name, before in report.before.items():
        t.add_row(name, f"{before:.4g}", f"{report.after[name]:.4g}")
    out.print(t)
    rho = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    out.print(f"Spearman rank correlation, predicted vs measured: {rho(report.spearman_before)} -> "
              f"{rho(report.spearman_after)} (cross-validated {rho(report.spearman_cv)}); within a problem "
              f"({report.problems_ranked} with 3+ records): {rho(report.spearman_within_before)} -> "
              f"{rho(report.spearman_within_after)}; median relative error "
              f"{report.median_rel_err_before:.1%} -> {report.median_rel_err_after:.1%}")
    for reason, n in report.skipped.items():
        out.print(f"[yellow]left out[/] {n} record(s): {escape(reason)}")
    if report.kept_because is not None:
        out.print(f"[yellow]kept the current coefficients[/]: {escape(report.kept_because)}; add records "
                  f"(`aurakernel bench search-quality --db ...` measures every candidate of a space) and fit again")
    else:
        out.print(f"coefficients written to {report.path}")


@app.command()
def bench(
    suite_name: Annotated[str, typer.Argument(metavar="SUITE", help="kernels: the regression suite (default); "
                                              "search-quality: the MILP's pick against every candidate of its space",
                                              show_default=False)] = "kernels",
    quick: Annotated[bool, typer.Option("--quick", help="a subset that fits in a few minutes on 2 cores")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the result JSON to stdout")] = False,
    out_dir: Annotated[str | None, typer.Option("--out", help="write bench.json, bench.md and PNG plots here")] = None,
    baseline: Annotated[str | None, typer.Option(help="a stored bench JSON to compare speedup ratios against, or a "
                                                      "directory of them, one per machine (this machine's is used)")] = None,
    max_regression: Annotated[float, typer.Option(help="allowed fall of a speedup ratio, as a fraction")] = 0.15,
    update_baseline: Annotated[bool, typer.Option("--update-baseline", help="rewrite --baseline with this run (a "
                                                                          "directory: this machine's file in it)")] = False,
    compiled: Annotated[bool, typer.Option("--compiled/--no-compiled", help="also time torch.compile")] = True,
    readme: Annotated[str | None, typer.Option(help="with --out: rewrite this README's results block")] = None,
    repeat: Annotated[int, typer.Option(help="run the suite N times: medians (a baseline keeps the lowest)")] = 1,
    ops: Annotated[str | None, typer.Option(help="only these operators, comma-separated")] = None,
    train: Annotated[bool, typer.Option("--train/--no-train", help="also the tiny model's training step")] = True,
    shapes_per_op: Annotated[int | None, typer.Option(help="search-quality: shapes per operator, 1 to 3 "
                                                           "(default 3)")] = None,
    max_candidates: Annotated[int | None, typer.Option(help="search-quality: candidates timed per shape, a seeded "
                                                            "sample with the pick when the space is larger "
                                                            "(default 16)")] = None,
    db: Annotated[str | None, typer.Option(help="search-quality: record every measured candidate in this tuning "
                                                "DB (for calibrate --fit)")] = None,
):
    """Run a benchmark suite. kernels (default): every operator (fwd + bwd) against eager and
    torch.compile, and the tiny model's training step; with --baseline, exit 1 naming each regression
    or unverified kernel. search-quality: per operator and shape, the planner's pick timed against
    the other candidates of its tiling space (aurakernel/bench/search_quality.py)."""
    if suite_name not in ("kernels", "search-quality"):
        raise UserError(f"unknown benchmark suite {suite_name!r}: accepted are kernels, search-quality")
    kernels_only = [flag for flag, given in (("--quick", quick), ("--baseline", baseline is not None),
                                             ("--update-baseline", update_baseline),
                                             ("--readme", readme is not None), ("--repeat", repeat != 1)) if given]
    search_only = [flag for flag, value in (("--shapes-per-op", shapes_per_op), ("--max-candidates", max_candidates),
                                            ("--db", db)) if value is not None]
    if suite_name == "search-quality" and kernels_only:
        raise UserError(f"{', '.join(kernels_only)}: option(s) of the kernels suite, not of search-quality")
    if suite_name == "kernels" and search_only:
        raise UserError(f"{', '.join(search_only)}: option(s) of `aurakernel bench search-quality`")
    from .ops import OPS
    names = None if ops is None else [n.strip() for n in ops.split(",") if n.strip()]
    unknown = sorted(set(names or []) - set(OPS))
    if unknown or names == []:
        raise UserError(f"--ops {ops}: unknown operator(s) {', '.join(unknown) or '(none given)'}; "
                        f"accepted are {', '.join(OPS)}")
    from .paths import check_writable
    if out_dir is not None:   # written after a run of many minutes: checked before it
        check_writable(out_dir, "--out", directory=True)
    if suite_name == "search-quality":
        _bench_search_quality(names, shapes_per_op, max_candidates, db, out_dir, as_json)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import bench as suite
    from .paths import write_text_atomic

    if not 0.0 < max_regression < 1.0:
        raise UserError(f"--max-regression {max_regression}: accepted is a fraction between 0 and 1, e.g. 0.15")
    if not 1 <= repeat <= 10:
        raise UserError(f"--repeat {repeat}: accepted is 1 to 10")
    if update_baseline and baseline is None:
        raise UserError("--update-baseline needs --baseline FILE: the file to rewrite")
    if update_baseline and not Path(baseline).is_dir():
        check_writable(baseline, "--baseline")
    if readme is not None:
        if out_dir is None or not Path(readme).is_file():
            raise UserError(f"--readme {readme}: needs an existing README file and --out DIR for the plots")
        if suite.README_START not in Path(readme).read_text():
            raise UserError(f"--readme {readme}: no {suite.README_START} ... {suite.README_END} block to write into")
    _ensure_calibrated("host")
    machine = suite.machine_info()
    if update_baseline and Path(baseline).is_dir():
        check_writable(str(suite.baseline_path(Path(baseline), machine)), "--baseline")
    base, no_base = (suite.load_baseline(Path(baseline), machine) if baseline is not None and not update_baseline
                     else (None, None))
    progress = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=err, transient=True)
    with progress:
        task = progress.add_task("", total=repeat * suite.total_steps(quick, names, train))
        runs = [suite.run_suite(quick=quick, with_compiled=compiled, ops=names, with_train=train,
                                progress=lambda n, desc: progress.update(task, advance=n, description=escape(desc)))
                for _ in range(repeat)]
    result = suite.combine(runs)
    failures: list[str] = []
    if no_base:
        err.print(f"[yellow]speedups not compared:[/] {escape(no_base)}; verification is still enforced")
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
        target = suite.baseline_path(Path(baseline), result["machine"])
        write_text_atomic(target, json.dumps(suite.combine(runs, envelope=True), indent=2))
        err.print(f"baseline {target} updated")
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        out.print(suite.markdown(result), markup=False, highlight=False)
    if failures:
        for line in failures:
            err.print(f"[red]REGRESSION[/] {escape(line)}")
        raise typer.Exit(1)


def _bench_search_quality(names: list[str] | None, shapes_per_op: int | None, max_candidates: int | None,
                          db: str | None, out_dir: str | None, as_json: bool) -> None:
    from .bench import search_quality

    from .db import TuningDB
    from .paths import write_text_atomic

    shapes_per_op = search_quality.SHAPES_PER_OP if shapes_per_op is None else shapes_per_op
    max_candidates = search_quality.MAX_CANDIDATES if max_candidates is None else max_candidates
    search_quality.check_options(shapes_per_op, max_candidates)
    tuning_db = TuningDB(db) if db is not None else None
    _ensure_calibrated("host")
    with err.status("search quality...") as status:
        result = search_quality.run(names, shapes_per_op, max_candidates, db=tuning_db,
                                    progress=lambda m: status.update(f"search quality: {escape(m)}"))
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for name, text in (("search_quality.json", json.dumps(result, indent=2)),
                           ("search_quality.md", search_quality.markdown(result) + "\n")):
            err.print(f"wrote {write_text_atomic(Path(out_dir) / name, text)}")
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        out.print(search_quality.markdown(result), markup=False, highlight=False)


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
        # without standalone mode click hands back a command's typer.Exit code instead of exiting
        rc = app(args=argv, standalone_mode=False, prog_name="aurakernel")
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
    return rc if isinstance(rc, int) else 0


def entry() -> None:
    rc = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun worker ends here without the interpreter's finalization. FSDP2's device mesh
        # keeps the gloo process group alive after destroy_process_group, and its worker threads
        # could be torn down during finalization still joinable: "terminate called without an active
        # exception", SIGABRT after a run that completed (1 in ~10 two-rank runs on a loaded 2-core
        # machine), which torchrun reports as the run's failure. Everything a run writes (log,
        # checkpoints, export) is closed by the time train returns; only stdio is left to flush.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
