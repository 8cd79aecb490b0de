"""The LM head and the loss at V4's vocabulary: eager (transformers' lm_head, fp32-upcast logits,
F.cross_entropy), the fused linear_cross_entropy kernel (planned for this machine) and, with
--compiled, torch.compile of the eager module. Forward + backward of each, timed side by side in
interleaved rounds; peak memory is the allocator's high-water mark of one forward + backward above
what was allocated before it (torch.profiler's CPU allocation events; the resident set would not
tell, with freed blocks kept mapped for reuse).

    python -m benchmarks.linear_cross_entropy [--tokens 4096] [--hidden 4096] [--vocab 129280]
                                              [--dtype bf16] [--compiled] [--json]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
from aurakernel.hostmem import retain_freed_memory  # noqa: E402

retain_freed_memory()

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from aurakernel.hardware import load_profile  # noqa: E402
from aurakernel.measure import compare, peak_allocated_bytes  # noqa: E402
from aurakernel.ops import get_op  # noqa: E402
from aurakernel.patch.deepseek_v4 import patch_of  # noqa: E402
from aurakernel.planner import solve_tiling  # noqa: E402
from aurakernel.targets.host.build import build_kernel  # noqa: E402
from aurakernel.targets.host.ops import kernel_of  # noqa: E402


def run(tokens: int, hidden: int, vocab: int, dtype: str, compiled: bool) -> dict:
    hw = load_profile("host")
    torch.set_num_threads(hw.cores)
    spec = get_op("linear_cross_entropy")
    problem = spec.problem(f"{tokens}x{hidden}x{vocab}", dtype)
    plan = solve_tiling(kernel_of(spec).tiling_problem(problem, hw), op=problem.op, variant=problem.variant,
                        shape=problem.shape, dtype=dtype, target="host")
    kernel = build_kernel(spec, problem, plan.knobs)
    candidates, notes = patch_of(spec).timing_candidates(problem, kernel.source_hash, compiled)
    peaks = {}
    for name, step in candidates.items():
        step()   # warm (and, for torch.compile, compiled) outside the measurements
        peaks[name] = peak_allocated_bytes(step)
    times = compare(candidates, warmup=0, min_rounds=3, max_rounds=3, budget_s=0.0, threads=hw.cores)
    us = {name: t.us for name, t in times.items()}
    return {"shape": problem.shape_text, "dtype": dtype, "plan": plan.knobs, "notes": notes, "us": us,
            "peak_mib": {n: b / 2**20 for n, b in peaks.items()},
            "speedup_vs_eager": us["eager"] / us["aurakernel"],
            "peak_vs_eager": peaks["aurakernel"] / peaks["eager"],
            **({"speedup_vs_compiled": us["compiled"] / us["aurakernel"],
                "peak_vs_compiled": peaks["aurakernel"] / peaks["compiled"]} if "compiled" in us else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--compiled", action="store_true", help="also torch.compile of the eager module")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args.tokens, args.hidden, args.vocab, args.dtype, args.compiled)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    t = Table(title=f"LM head + loss, {r['shape']} {r['dtype']} (plan {r['plan']}), forward + backward")
    for col in ("candidate", "median ms", "peak MiB (allocator)"):
        t.add_column(col)
    for name, us in r["us"].items():
        t.add_row(name, f"{us / 1e3:,.0f}", f"{r['peak_mib'][name]:,.0f}")
    console = Console()
    console.print(t)
    console.print(f"fused vs eager: {r['speedup_vs_eager']:.2f}x the speed, {r['peak_vs_eager']:.3f}x the peak memory"
                  + (f"; vs torch.compile: {r['speedup_vs_compiled']:.2f}x, {r['peak_vs_compiled']:.3f}x"
                     if "speedup_vs_compiled" in r else ""))
    for name, note in r["notes"].items():
        console.print(f"[yellow]{name}[/]: {note}")


if __name__ == "__main__":
    main()
