"""A decoder layer's attention stream update and its FFN's HyperConnection, fused (one mhc_post_pre
kernel) against apart (the mhc_post and mhc_pre kernels, each planned for this machine, with
autograd adding the streams' two gradients between them) and eager. Forward + backward of the same
module (gradients to every input and parameter, all four outputs), timed side by side in
interleaved rounds.

    python -m benchmarks.mhc_post_pre [--shape 4096x4x4096] [--dtype bf16] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
from aurakernel.hostmem import retain_freed_memory  # noqa: E402

retain_freed_memory()

import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from aurakernel.hardware import load_profile  # noqa: E402
from aurakernel.measure import compare  # noqa: E402
from aurakernel.ops import get_op  # noqa: E402
from aurakernel.patch.deepseek_v4 import patch_of  # noqa: E402
from aurakernel.planner import solve_tiling  # noqa: E402
from aurakernel.targets.host.build import build_kernel  # noqa: E402
from aurakernel.targets.host.ops import kernel_of  # noqa: E402


def planned_kernel(op: str, shape: str, dtype: str, hw):
    spec = get_op(op)
    problem = spec.problem(shape, dtype)
    plan = solve_tiling(kernel_of(spec).tiling_problem(problem, hw), op=op, variant=problem.variant,
                        shape=problem.shape, dtype=dtype, target="host")
    return build_kernel(spec, problem, plan.knobs).source_hash, plan.knobs


def run(shape: str, dtype: str) -> dict:
    hw = load_profile("host")
    torch.set_num_threads(hw.cores)
    spec = get_op("mhc_post_pre")
    problem = spec.problem(shape, dtype)
    module, step_of = spec.module_steps(problem)
    hashes, knobs = {}, {}
    for op in ("mhc_post_pre", "mhc_post", "mhc_pre"):
        hashes[op], knobs[op] = planned_kernel(op, shape, dtype, hw)
    fused = copy.deepcopy(module)
    patch_of(spec).patch(fused, lambda key, dt: hashes["mhc_post_pre"])
    apart = copy.deepcopy(module)
    patch_of(spec).patch_parts(apart, {op: (lambda key, dt, h=hashes[op]: h) for op in spec.fuses})
    candidates = {"eager": step_of(module), "apart": step_of(apart), "fused": step_of(fused)}
    times = compare(candidates, min_rounds=5, max_rounds=9, budget_s=10.0, threads=hw.cores)
    us = {name: t.us for name, t in times.items()}
    return {"shape": problem.shape_text, "dtype": dtype, "plans": knobs, "us": us,
            "fused_vs_apart": us["apart"] / us["fused"], "fused_vs_eager": us["eager"] / us["fused"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4x4096", help="ROWSxHCxD")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp16"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args.shape, args.dtype)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    ms = ", ".join(f"{name} {us / 1e3:,.2f} ms" for name, us in r["us"].items())
    Console().print(f"mhc_post + mhc_pre {r['shape']} {r['dtype']}, forward + backward: {ms}; "
                    f"fused {r['fused_vs_apart']:.2f}x apart, {r['fused_vs_eager']:.2f}x eager")


if __name__ == "__main__":
    main()
