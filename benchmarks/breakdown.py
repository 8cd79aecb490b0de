"""Where a host kernel's time goes, forward and backward apart: the C kernel alone on buffers it has
written before (no page faults, no dispatch), the same call on fresh outputs (what a training step
allocates), and the whole forward + backward through the patched module (custom op, autograd,
the torch ops around the kernel), each against the minimum traffic at the calibrated stream
bandwidth (the operator's Work, i.e. one pass over every tensor).

    python -m benchmarks.breakdown [--ops rms_norm,swiglu] [--json]

Reading it: kernel-alone far below the bound is the kernel's own code (passes over memory, the
vector code gcc emitted, thread imbalance); fresh far above alone is first-touch page faults;
module far above fresh + fresh is the dispatch and the torch ops around the kernel. The "in cache"
columns run the same kernel (same knobs) on fewer rows, few enough that a forward's and a
backward's minimum traffic fit in three quarters of the last-level cache (the L2 would leave too
few rows: a call's fixed costs would weigh), side by side with the full shape, and give its time per
row as a share of the full shape's: near 1, DRAM is not what the kernel waits on (arithmetic or
issue is), so no change to its passes over memory can bring it to the bandwidth bound; well under
1, it waits on memory. Left out ("-") where the rows that fit make fewer than two tiles a thread
(the threads' imbalance and the call's fixed costs would be what it measures), and where the whole
shape fits already (then nothing but its arithmetic and issue can bind it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
from aurakernel.hostmem import retain_freed_memory  # noqa: E402

retain_freed_memory()

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from aurakernel.bench.kernels import bench_problems  # noqa: E402
from aurakernel.hardware import load_profile  # noqa: E402
from aurakernel.measure import compare  # noqa: E402
from aurakernel.ops import OPS  # noqa: E402
from aurakernel.ops.base import Problem  # noqa: E402
from aurakernel.patch.deepseek_v4 import patch_of  # noqa: E402
from aurakernel.planner import solve_tiling  # noqa: E402
from aurakernel.targets.host.build import build_kernel  # noqa: E402
from aurakernel.targets.host.ops import kernel_of  # noqa: E402


def in_cache(problem: Problem, hw) -> tuple[Problem, int]:
    """`problem` with its leading extent (the first one over 1: rows, or a batch's sequence) halved until
    the larger of a forward's and a backward's minimum traffic fits in three quarters of the last-level
    cache (`problem` itself where it fits already), and that extent's axis."""
    spec = OPS[problem.op]
    axis = next(i for i, n in enumerate(problem.shape) if n > 1)
    llc = hw.last_level_cache()
    cache = llc.capacity * (hw.cores if llc.per_core else 1)
    n = problem.shape[axis]
    while True:
        p = dataclasses.replace(problem, shape=problem.shape[:axis] + (n,) + problem.shape[axis + 1:])
        if n == 1 or max(spec.work(p, backward=b).bytes_moved for b in (False, True)) <= cache * 3 / 4:
            return p, axis
        n //= 2


def buffers(spec, impl, problem, kernel) -> tuple[dict, dict, dict, dict]:
    """A run's inputs, outputs (written once by the forward), output gradients and gradients."""
    inputs = spec.make_inputs(problem, 0)
    outputs = impl.empty_outputs(problem, inputs)
    impl.run_forward(kernel, inputs, outputs)
    grad_out = {k: torch.randn_like(outputs[k]) for k in spec.grad_outputs() if outputs[k].is_floating_point()}
    return inputs, outputs, grad_out, {k: torch.empty_like(inputs[k]) for k in spec.differentiable(problem)}


def breakdown(problem, hw) -> dict:
    spec, impl = OPS[problem.op], kernel_of(OPS[problem.op])
    plan = solve_tiling(impl.tiling_problem(problem, hw), op=problem.op, variant=problem.variant, shape=problem.shape,
                        dtype=problem.dtype.value, target="host")
    kernel = build_kernel(spec, problem, plan.knobs)
    small, axis = in_cache(problem, hw)
    share = small.shape[axis] / problem.shape[axis]
    # timed only where it tells something: the whole shape does not fit already, and the rows that do
    # make at least two tiles a thread (else the threads' imbalance and the call's fixed costs weigh)
    tell = share < 1 and small.shape[axis] >= 2 * plan.knobs.get("tile_rows", 1) * plan.knobs.get("threads", 1)
    diff = spec.differentiable(problem)
    inputs, outputs, grad_out, grads = buffers(spec, impl, problem, kernel)

    def fresh_forward():
        impl.run_forward(kernel, inputs, impl.empty_outputs(problem, inputs))

    def fresh_backward():
        impl.run_backward(kernel, inputs, outputs, grad_out, {k: torch.empty_like(inputs[k]) for k in diff})

    candidates = {"fwd alone": lambda: impl.run_forward(kernel, inputs, outputs), "fwd fresh": fresh_forward}
    if diff:
        candidates |= {"bwd alone": lambda: impl.run_backward(kernel, inputs, outputs, grad_out, grads),
                       "bwd fresh": fresh_backward}
    if tell:   # the same knobs: the same code on fewer rows
        small_kernel = build_kernel(spec, small, plan.knobs)
        s_inputs, s_outputs, s_grad_out, s_grads = buffers(spec, impl, small, small_kernel)
        candidates["fwd in cache"] = lambda: impl.run_forward(small_kernel, s_inputs, s_outputs)
        if diff:
            candidates["bwd in cache"] = lambda: impl.run_backward(small_kernel, s_inputs, s_outputs, s_grad_out, s_grads)
    module_candidates, _ = patch_of(spec).timing_candidates(problem, kernel.source_hash, False)
    candidates["module fwd+bwd"] = module_candidates["aurakernel"]
    candidates["eager fwd+bwd"] = module_candidates["eager"]
    us = {name: t.us for name, t in compare(candidates, threads=hw.cores).items()}
    bw = hw.stream_bandwidth(hw.cores)
    bound = {"fwd": spec.work(problem, backward=False).bytes_moved / bw * 1e6,
             "bwd": spec.work(problem, backward=True).bytes_moved / bw * 1e6 if diff else 0.0}
    # the in-cache rows' time per row as a share of the full shape's (1: the same rate in cache)
    per_row = {ph: us[f"{ph} in cache"] / share / us[f"{ph} alone"] for ph in ("fwd", "bwd") if f"{ph} in cache" in us}
    return {"problem": problem.describe(), "plan": plan.knobs, "us": us, "bound_us": bound,
            "bound_fwd_bwd_us": bound["fwd"] + bound["bwd"], "in_cache": small.shape_text if share < 1 else "all of it",
            "in_cache_per_row": per_row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=None, help="comma-separated operators (default: every streaming one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    hw = load_profile("host")
    torch.set_num_threads(hw.cores)
    names = args.ops.split(",") if args.ops else None
    rows = [breakdown(p, hw) for p in bench_problems(False, names)
            if p.op not in ("linear_cross_entropy", "sparse_attention", "indexer_score")]   # GEMM-bound: not streaming
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    t = Table(title=f"where the time goes (us; bound: minimum traffic at {hw.stream_bandwidth(hw.cores) / 1e9:.1f} GB/s)")
    for col in ("kernel", "fwd bound", "fwd alone", "fwd fresh", "bwd bound", "bwd alone", "bwd fresh",
                "module fwd+bwd", "eager fwd+bwd", "alone / bound", "in cache", "per row in cache fwd / bwd"):
        t.add_column(col, justify="right" if col != "kernel" else "left")
    for r in rows:
        u, b, c = r["us"], r["bound_us"], r["in_cache_per_row"]
        alone = u["fwd alone"] + u.get("bwd alone", 0.0)
        t.add_row(escape(r["problem"]), f"{b['fwd']:,.0f}", f"{u['fwd alone']:,.0f}", f"{u['fwd fresh']:,.0f}",
                  f"{b['bwd']:,.0f}", f"{u.get('bwd alone', 0):,.0f}", f"{u.get('bwd fresh', 0):,.0f}",
                  f"{u['module fwd+bwd']:,.0f}", f"{u['eager fwd+bwd']:,.0f}", f"{alone / r['bound_fwd_bwd_us']:.2f}x",
                  r["in_cache"], " / ".join(f"{c[ph]:.2f}" for ph in ("fwd", "bwd") if ph in c) or "-")
    Console(width=220).print(t)   # wide: the columns would be cut to an 80-column pipe


if __name__ == "__main__":
    main()
