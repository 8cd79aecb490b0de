"""AscendC kernels at V4-Flash shapes on an Ascend profile, in the emulator: the estimated time of
the planner's pick and of the naive tiling (one buffer, rows split evenly over the cores, the
largest tile and chunk that fit the UB; a Cube kernel's one query row per tile), each against its
true roofline bound (1.0 = at the bound): per pass the largest of the op's minimum HBM traffic (its
`work`), the vector work its math cannot avoid and its Cube MACs at peak, and which one it is. The
"per phase" column sets each kernel against the traffic it makes itself: a phase near 1.0 there but
far from the true bound moves more than the op needs (partials per core, a second pass over x).
The emulator runs go side by side, a thread per core.

    python -m benchmarks.ascend [--target ascend910b2] [--rows 8192] [--ops OP,...] [--candidates N] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aurakernel.concurrency import map_in_order
from aurakernel.targets import ascend
from aurakernel.hardware import load_profile
from aurakernel.ops import OPS
from aurakernel.planner.model import ChoiceModel

# (op, variant, shape ({rows}: the --rows option), dtype): the V4-Flash hidden norms, the flattened
# mHC norm (4 x 4096), the experts' clamped SwiGLU (moe_intermediate_size 2048), AdamW over one
# 2048 x 4096 expert weight, the loss over the 129280-token vocabulary, the mHC stream update
CASES = (("rms_norm", "weighted", "{rows}x4096", "bf16"), ("rms_norm", "unweighted", "{rows}x16384", "bf16"),
         ("rms_norm", "unweighted", "65536x512", "bf16"),   # the per-head q norm: 1024 tokens x 64 heads of 512
         ("swiglu", "default", "{rows}x2048", "bf16"), ("adamw", "default", "8388608", "fp32"),
         ("cross_entropy", "default", "1024x129280", "bf16"),
         # the lightning indexer: 64 heads x 128, the 4096 queries of a 4096-token sequence over its 1024
         # compressed keys (CSA, m = 4); both directions mixed kernels (products on the Cube). At fewer
         # queries a core's fill and drain weigh in (96 queries, 4 per AI core: 1.48x of the bound, 1.15x here)
         ("indexer_score", "default", "1x4096x64x128x1024", "bf16"),
         # and as a model's indexer poses it: each query's entries past (position + 1) // 4 masked, not computed
         ("indexer_score", "causal", "1x4096x64x128x1024", "bf16"),
         ("mhc_post", "default", "{rows}x4x4096", "bf16"),   # 1024 tokens: the emulator runs every logit
         # mHC pre and head: 1024 tokens (the emulator runs NOUT products per element; the d_fn partials
         # are per core, so fewer tokens weigh them more)
         ("mhc_pre", "default", "1024x4x4096", "bf16"), ("mhc_head", "default", "1024x4x4096", "bf16"),
         ("rope", "default", "1024x64x512x64", "bf16"),      # q of 1024 tokens: 64 heads of 512, rope slice 64
         # the attention sink softmax: 256 queries x 64 heads over window 128 + top-k 512 keys (CSA)
         ("attn_softmax", "default", "1x64x256x640", "bf16"),
         # the compressors' pooling + kv_norm over an 8192-token sequence: CSA (m = 4) and HCA (m = 128), head_dim 512
         ("compressor", "csa", "1x2048x4x512", "bf16"), ("compressor", "hca", "1x64x128x512", "bf16"),
         # the MoE router after its gate matmul: V4-Flash's 256 experts, top-6 (biased top-k, and the hash layers)
         ("router", "topk", "{rows}x256x6", "bf16"), ("router", "hash", "{rows}x256x6", "bf16"),
         # V4-Flash's sparse attention (64 heads of 512, window 128) over 1024 tokens: CSA picking 128 of the
         # 256 compressed entries (half of those ready at the end, as V4's top-512 of 1024 at 4096 tokens;
         # random picks, so about half of them start a run of consecutive entries), and HCA (m = 128)
         ("sparse_attention", "csa", "1x64x1024x512x128x128", "bf16"),
         # and a long sequence's scattered picks (V4's 512 of up to 16384 ready entries at 65536 tokens: 3%,
         # most picks a copy of their own) at a length the emulator runs in a minute: 64 of up to 512
         ("sparse_attention", "csa", "1x64x2048x512x128x64", "bf16"),
         ("sparse_attention", "hca", "1x64x1024x512x128x128", "bf16"))


def naive_knobs(model: ChoiceModel) -> dict[str, int]:
    """One buffer, the widest column tile, the largest tile rows, then the largest chunk, that fit."""
    d = model.domains
    for ct in sorted(d["col_tile"], reverse=True):
        for tr in sorted(d["tile_rows"], reverse=True):
            for ch in sorted(d["chunk"], reverse=True):
                choice = {"tile_rows": tr, "buffers": 1, "chunk": ch, "block_dim": d["block_dim"][0], "col_tile": ct}
                choice |= {k: tr for k in d if k.endswith("_tile_rows")}   # a phase's own tile rows: the same
                if model.feasible(choice):
                    return choice
    raise RuntimeError("nothing fits the UB")


def naive_cube_knobs(model: ChoiceModel | None) -> dict[str, int]:
    """A Cube tiling without planning: one query row per tile, one q buffer, keys resident where they
    fit, the AI core gathering every key itself, then the widest key tiles and chunk that fit."""
    if model is None:
        return {}
    small_first = ("rows", "buffers", "stream", "aiv_gather")
    names = list(model.domains)
    orders = [sorted(model.domains[k], reverse=not any(w in k for w in small_first)) for k in names]
    for values in itertools.product(*orders):
        choice = dict(zip(names, values))
        if model.feasible(choice):
            return choice
    raise RuntimeError("no Cube tile fits")


def estimate(spec, problem, knobs, hw) -> dict[str, float]:
    """Emulated fwd and bwd time (us) and their roofline bound for one set of knobs."""
    reports = ascend.emulate_at(spec, problem, knobs, hw)
    errors = [e for r in reports.values() for e in r.errors]
    if errors:
        raise RuntimeError(errors[0])
    kernel = ascend.kernel_of(spec)
    d = ascend.estimate_summary(reports, hw, None, kernel.vector_floor(problem), kernel.cube_floor(problem),
                                ascend.minimum_traffic(spec, problem))
    return {"est_us": d["est_us"], "roofline_us": d["roofline_us"], "ratio": d["roofline_ratio"], "bound": d["bound"],
            "traffic_us": d["traffic_us"],
            "phases": {ph: {"est_us": v["est_us"], "roofline_us": v["roofline_us"], "bound": v["bound"],
                            "ratio": v["roofline_ratio"]} for ph, v in d["phases"].items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="ascend910b2")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--ops", default="", help="comma-separated operators to run (default: every case)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--candidates", type=int, default=1,
                    help="the plan column: the fastest in the emulator of the planner's N best tilings (1: its pick)")
    args = ap.parse_args(argv)
    only = {o for o in args.ops.split(",") if o}
    if only - {op for op, *_ in CASES}:
        ap.error(f"--ops {','.join(sorted(only - {op for op, *_ in CASES}))}: not a case here; "
                 f"one of {', '.join(sorted({op for op, *_ in CASES}))}")
    hw = load_profile(args.target)
    console = Console(stderr=args.json, width=160)
    cases = []   # planned, then estimated side by side
    for op, variant, shape, dtype in CASES:
        if only and op not in only:
            continue
        spec = OPS[op]
        problem = spec.problem(shape.format(rows=args.rows), dtype, variant)
        console.log(problem.describe())
        plan = ascend.plan(spec, problem, hw, target=args.target, solver="highs")
        if args.candidates > 1:   # the planner's N best, the fastest the emulator estimates
            plan, _ = ascend.fastest_emulated(spec, problem, hw, plan, args.candidates, target=args.target, solver="highs")
        naive = {**naive_knobs(ascend.model(spec, problem, hw)),
                 **naive_cube_knobs(ascend.kernel_of(spec).cube_model(problem, hw))}
        cases.append((spec, problem, plan, naive))
    jobs = [(spec, problem, knobs) for spec, problem, plan, naive in cases for knobs in (plan.knobs, naive)]
    estimates = list(map_in_order(lambda job: estimate(*job, hw), jobs, side_by_side=True))
    rows = []
    for (spec, problem, plan, naive), picked, base in zip(cases, estimates[0::2], estimates[1::2]):
        rows.append({"op": f"{spec.name}[{problem.variant}]", "shape": problem.shape_text, "dtype": problem.dtype.value,
                     "plan": plan.knobs, "cols": ascend.kernel_of(spec).rows_cols(problem)[1],
                     "naive": naive, "plan_est_us": picked["est_us"], "naive_est_us": base["est_us"],
                     "roofline_us": picked["roofline_us"], "traffic_us": picked["traffic_us"], "bound": picked["bound"], "plan_vs_roofline": picked["ratio"],
                     "naive_vs_roofline": base["ratio"], "plan_speedup_vs_naive": base["est_us"] / picked["est_us"],
                     "plan_phases": picked["phases"], "naive_phases": base["phases"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    t = Table(title=f"AscendC fwd+bwd on {args.target} (emulator estimates; 1.0x = at the roofline bound)")
    for col in ("op", "shape", "bound", "bound us", "plan", "plan us", "vs bound", "per phase, vs its own traffic", "naive", "naive us",
                "vs bound", "plan vs naive"):
        t.add_column(col)
    def knobs(k, cols):
        cube = (f"; Cube: rows {k['cube_rows']} x keys {k['cube_keys']}, chunk {k['key_chunk']}, q buffers "
                f"{k['cube_buffers']}, AI cores {k['cube_blocks']}" if "cube_rows" in k else
                f"; Cube: keys {k['kv_tile']}" + (f" (+ a last {k['pair_keys']} joined)" if k.get("pair_keys") else "")
                + f" x D slices {k['d_chunk']} (backward {k['bwd_kv_tile']} x {k['bwd_d_chunk']}), "
                f"AI cores {k['cube_blocks']}" + (f", {k['aiv_gather']}/8 of the picks gathered by the vector cores"
                                                 if k.get("aiv_gather") else "") if "kv_tile" in k else "")
        own = "".join(f" ({name.removesuffix('_tile_rows')} {v})" for name, v in k.items()
                      if name.endswith("_tile_rows") and name != "tile_rows")   # a phase's own tile rows
        return (f"rows {k['tile_rows']}{own}, buffers {k['buffers']}, chunk {k['chunk']}, cores {k['block_dim']}"
                + (f", col tile {k['col_tile']}" if k["col_tile"] < cols else "") + cube)
    def per_phase(phases):   # each phase against its own bound, and what bounds it
        return " / ".join(f"{v['ratio']:.2f}x {v['bound']}" for v in phases.values())
    for r in rows:
        t.add_row(escape(r["op"]), r["shape"], r["bound"], f"{r['roofline_us']:.0f}", knobs(r["plan"], r["cols"]),
                  f"{r['plan_est_us']:.0f}",
                  f"{r['plan_vs_roofline']:.2f}x", per_phase(r["plan_phases"]), knobs(r["naive"], r["cols"]), f"{r['naive_est_us']:.0f}", f"{r['naive_vs_roofline']:.2f}x",
                  f"{r['plan_speedup_vs_naive']:.2f}x")
    console.print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
