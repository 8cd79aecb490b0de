"""RMSNorm fwd+bwd at DeepSeek-V4 widths: AuraKernel vs eager and torch.compile, and the MILP's pick
vs a measured sweep of the knob space. Ratios come from candidates timed in the same interleaved
rounds (aurakernel.measure), so machine noise hits every candidate alike.

    python -m benchmarks.rms_norm [--quick] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
from aurakernel.hostmem import retain_freed_memory  # noqa: E402

retain_freed_memory()

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from aurakernel.targets.host.target import measure_problem  # noqa: E402
from aurakernel.targets.host.build import build_kernel  # noqa: E402
from aurakernel.hardware import load_calibration, load_profile  # noqa: E402
from aurakernel.measure import compare  # noqa: E402
from aurakernel.ops import get_op  # noqa: E402
from aurakernel.ops.rms_norm import rms_norm  # noqa: E402
from aurakernel.planner import solve_tiling  # noqa: E402
from aurakernel.targets.host.ops import kernel_of as host_kernel

# V4-Flash hidden, V4-Pro hidden, the flattened mHC width of Flash; rows sized to run in seconds here
SHAPES = [("4096x4096", "bf16"), ("2048x7168", "bf16"), ("1024x16384", "fp32"), ("4096x4096", "fp32")]
QUICK = [("4096x4096", "bf16")]


def sweep(spec, problem, hw, plan_knobs):
    """Time the plan's pick against a grid of other knob values, side by side."""
    model = host_kernel(spec).tiling_problem(problem, hw)
    grid = {
        "tile_rows": [v for v in (1, 4, 16, 64) if v in model.domains["tile_rows"]],
        "col_chunk": [v for v in model.domains["col_chunk"] if v in (64, 256, 1024, 4096)],
        "threads": model.domains["threads"],
    }
    configs = [dict(zip(grid, vals)) for vals in itertools.product(*grid.values())]
    if plan_knobs not in configs:
        configs.append(dict(plan_knobs))
    inputs = spec.make_inputs(problem, seed=3)
    x = inputs["x"].requires_grad_(True)
    w = torch.nn.Parameter(inputs["weight"]) if "weight" in inputs else None
    dy = torch.randn_like(x)
    wrt = [x] + ([w] if w is not None else [])
    candidates = {}
    for knobs in configs:
        h = build_kernel(spec, problem, knobs).source_hash
        candidates[tuple(sorted(knobs.items()))] = (
            lambda h=h: torch.autograd.grad(rms_norm(x, w, 1e-6, h), wrt, dy))
    timings = compare(candidates, budget_s=2.0 * len(candidates) ** 0.5, threads=hw.cores)
    best_key = min(timings, key=lambda k: timings[k].median_s)
    pick = timings[tuple(sorted(plan_knobs.items()))].median_s
    return {"configs": len(configs), "best": dict(best_key), "best_us": timings[best_key].us, "pick_us": pick * 1e6,
            "pick_over_best": pick / timings[best_key].median_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape only")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--no-sweep", action="store_true", help="skip the knob sweep")
    args = ap.parse_args(argv)
    console = Console(stderr=args.json)
    if load_calibration() is None:
        from aurakernel.calibrate import calibrate
        calibrate()
    hw = load_profile("host")
    spec = get_op("rms_norm")
    rows = []
    for shape, dtype in (QUICK if args.quick else SHAPES):
        problem = spec.problem(shape, dtype, "weighted")
        console.log(f"{problem.describe()}: planning, building, measuring")
        plan = solve_tiling(host_kernel(spec).tiling_problem(problem, hw), op="rms_norm", variant="weighted",
                            shape=problem.shape, dtype=dtype, target="host")
        kernel = build_kernel(spec, problem, plan.knobs)
        times, _, _ = measure_problem(spec, problem, kernel.source_hash, with_compiled=True, threads=hw.cores)
        row = {"shape": shape, "dtype": dtype, "plan": plan.knobs, "predicted_us": plan.predicted_us,
               "aurakernel_us": times["aurakernel"], "eager_us": times["eager"], "compiled_us": times.get("compiled"),
               "speedup_vs_eager": times["eager"] / times["aurakernel"],
               "speedup_vs_compiled": (times["compiled"] / times["aurakernel"]) if "compiled" in times else None}
        if not args.no_sweep:
            console.log(f"{problem.describe()}: sweeping the knob space")
            row["sweep"] = sweep(spec, problem, hw, plan.knobs)
        rows.append(row)
    if args.json:
        print(json.dumps({"benchmark": "rms_norm fwd+bwd", "threads": hw.cores, "rows": rows}, indent=2))
        return 0
    t = Table(title=f"RMSNorm (weighted) forward + backward, {hw.cores} threads; medians of interleaved rounds")
    for col in ("shape", "dtype", "plan", "aurakernel us", "eager us", "compile us", "vs eager", "vs compile",
                "MILP pick / best of sweep"):
        t.add_column(col)
    for r in rows:
        sw = r.get("sweep")
        t.add_row(r["shape"], r["dtype"], ", ".join(f"{k}={v}" for k, v in r["plan"].items()),
                  f"{r['aurakernel_us']:,.0f}", f"{r['eager_us']:,.0f}",
                  f"{r['compiled_us']:,.0f}" if r["compiled_us"] else "-", f"{r['speedup_vs_eager']:.2f}x",
                  f"{r['speedup_vs_compiled']:.2f}x" if r["speedup_vs_compiled"] else "-",
                  f"{sw['pick_over_best']:.3f} ({sw['configs']} configs)" if sw else "-")
    console.print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
