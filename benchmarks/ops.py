"""Every operator of the library at its default shape (V4-Flash widths, rows scaled to run in
seconds), forward + backward: AuraKernel vs eager and torch.compile of the reference, timed side by
side in interleaved rounds (aurakernel.measure). Prints a table, or JSON with --json.

    python -m benchmarks.ops [--dtype bf16] [--ops rms_norm,mhc_pre] [--no-compiled] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from rich.console import Console  # noqa: E402
from rich.markup import escape
from rich.table import Table  # noqa: E402

from aurakernel.agent import measure_problem  # noqa: E402
from aurakernel.build import build_kernel  # noqa: E402
from aurakernel.hardware import load_calibration, load_profile  # noqa: E402
from aurakernel.ops import OPS  # noqa: E402
from aurakernel.planner import solve_tiling  # noqa: E402


def run(ops: list[str], dtype: str, with_compiled: bool, log) -> list[dict]:
    if load_calibration() is None:
        from aurakernel.calibrate import calibrate
        calibrate()
    hw = load_profile("host")
    rows = []
    for name in ops:
        spec = OPS[name]
        dt = dtype if dtype in {d.value for d in spec.dtypes} else spec.dtypes[0].value
        for variant in spec.variants:
            problem = spec.problem(None, dt, variant)
            log(f"{problem.describe()}")
            plan = solve_tiling(spec.tiling_problem(problem, hw), op=name, variant=variant, shape=problem.shape,
                                dtype=dt, target="host")
            kernel = build_kernel(spec, problem, plan.knobs)
            times, notes = measure_problem(spec, problem, kernel.source_hash, with_compiled=with_compiled,
                                           threads=hw.cores)
            rows.append({"op": name, "variant": variant, "shape": problem.shape_text, "dtype": dt,
                         "plan": plan.knobs, "aurakernel_us": times["aurakernel"], "eager_us": times["eager"],
                         "compiled_us": times.get("compiled"),
                         "speedup_vs_eager": times["eager"] / times["aurakernel"],
                         "speedup_vs_compiled": times["compiled"] / times["aurakernel"] if "compiled" in times else None,
                         "notes": notes})
    return rows


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", help="bf16 (default) or fp32; ops without it use their own")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated operator names")
    ap.add_argument("--no-compiled", action="store_true", help="skip torch.compile (faster)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    console = Console(stderr=args.json, width=160)
    rows = run(args.ops.split(","), args.dtype, not args.no_compiled, lambda m: console.log(m))
    summary = {"geomean_vs_eager": geomean(r["speedup_vs_eager"] for r in rows),
               "geomean_vs_compiled": geomean(r["speedup_vs_compiled"] for r in rows),
               "min_vs_eager": min(r["speedup_vs_eager"] for r in rows)}
    if args.json:
        print(json.dumps({"rows": rows, **summary}, indent=2))
        return 0
    t = Table(title="operators, forward + backward at default shapes (medians of interleaved rounds)")
    for col in ("op", "shape", "dtype", "aurakernel us", "eager us", "compile us", "vs eager", "vs compile"):
        t.add_column(col)
    for r in rows:
        t.add_row(escape(f"{r['op']}[{r['variant']}]"), r["shape"], r["dtype"], f"{r['aurakernel_us']:,.0f}",
                  f"{r['eager_us']:,.0f}", f"{r['compiled_us']:,.0f}" if r["compiled_us"] else "-",
                  f"{r['speedup_vs_eager']:.2f}x",
                  f"{r['speedup_vs_compiled']:.2f}x" if r["speedup_vs_compiled"] else "-")
    console.print(t)
    console.print(f"geomean vs eager {summary['geomean_vs_eager']:.2f}x, vs torch.compile "
                  + (f"{summary['geomean_vs_compiled']:.2f}x" if summary["geomean_vs_compiled"] else "-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
