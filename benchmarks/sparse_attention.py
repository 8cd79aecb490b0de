"""Sparse attention, forward + backward, at the tiny config's widths (4 heads of 64, window 64, top-16
of S/4 compressed entries; the hca layer: every ready entry of S/128), against the peers that train
on a CPU: transformers' eager attention (dense scores and mask), torch.compile of it, and PyTorch's
scaled_dot_product_attention with a float mask (window + selected entries; the sink as one extra key
of zeros whose mask value is the sink logit); forward alone also against FlexAttention (compiled,
block mask; the sink folded in from its logsumexp), which has no CPU backward in torch 2.13.
Candidates are timed in the same interleaved rounds (aurakernel.measure); a peer whose dense
tensors would not fit in this machine's free memory is reported with the size it needs.

    python -m benchmarks.sparse_attention [--seqs 1024,4096,16384] [--json]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
from aurakernel.hostmem import retain_freed_memory  # noqa: E402

retain_freed_memory()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from aurakernel.dtypes import DType  # noqa: E402
from aurakernel.hardware import free_memory_bytes, load_profile  # noqa: E402
from aurakernel.measure import compare  # noqa: E402
from aurakernel.ops import get_op  # noqa: E402
from aurakernel.ops.base import Problem  # noqa: E402
from aurakernel.ops.sparse_attention import block_bias, window_mask  # noqa: E402
from aurakernel.patch.deepseek_v4 import patch_of  # noqa: E402
from aurakernel.planner import solve_tiling  # noqa: E402
from aurakernel.targets.host.build import build_kernel  # noqa: E402
from aurakernel.targets.host.ops import kernel_of  # noqa: E402

SPEC = get_op("sparse_attention")
HEADS, DIM, WINDOW = 4, 64, 64
VARIANTS = {"csa": 16, "hca": 128}   # EXTRA: the indexer's top-k, the compression ratio


def _dense_bytes(problem: Problem) -> int:
    """What the dense peers hold at once: scores, mask and probabilities, kept for the backward."""
    batch, heads, seq, _, _, _ = problem.shape
    keys = seq + seq // (4 if problem.variant == "csa" else problem.shape[5])
    return 4 * batch * heads * seq * keys * 4


def _sdpa(module, q, kv, ckv, idx):
    """scaled_dot_product_attention over [kv; ckv; a zero sink key] with the model's mask as floats."""
    batch, heads, seq, dim = q.shape
    mask = window_mask(seq, WINDOW).expand(batch, heads, seq, seq)
    parts = [mask]
    keys = [kv, ckv]
    parts.append(block_bias(module.variant, batch, seq, ckv.shape[1], module.extra, idx).expand(batch, heads, seq, -1))
    parts.append(module.sinks.detach().view(1, heads, 1, 1).expand(batch, heads, seq, 1))   # the sink's logit
    keys.append(kv.new_zeros(batch, 1, dim))
    k = torch.cat(keys, dim=1).unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, k, attn_mask=torch.cat(parts, dim=-1), scale=dim ** -0.5,
                                         enable_gqa=True)   # K = V; the sink key's value row is zero
    return out.transpose(1, 2)


def _flex_forward(variant: str, extra: int, q, kv, ckv, idx, sinks):
    """FlexAttention over [kv; ckv; a zero sink key]: a block mask of what V4 attends to, and a score
    mod that gives the sink key its logit (CPU flex has no return_lse to fold the sink in after)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, heads, seq, dim = q.shape
    entries = ckv.shape[1]
    sink = seq + entries
    k = torch.cat([kv, ckv, kv.new_zeros(batch, 1, dim)], dim=1).unsqueeze(1)
    if variant == "csa":
        picked = torch.zeros(batch, seq, entries + 1, dtype=torch.bool)
        picked.scatter_(-1, torch.where(idx >= 0, idx, entries), True)
        picked = picked[..., :entries]

    def visible(b, h, s, j):
        in_window = (j <= s) & (j > s - WINDOW)
        e = (j - seq).clamp(min=0, max=max(entries - 1, 0))
        compressed = picked[b, s, e] if variant == "csa" else (e + 1) * extra <= s + 1   # e < (s + 1) // extra
        return torch.where(j < seq, in_window, torch.where(j < sink, compressed, j == sink))

    def with_sink(score, b, h, s, j):
        return torch.where(j == sink, sinks[h], score)

    block = create_block_mask(visible, batch, None, seq, sink + 1, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)   # a dynamic recompile for the next shape fails on CPU
    keys = k.expand(batch, heads, -1, -1)
    return lambda: compiled(q, keys, keys, score_mod=with_sink, block_mask=block, scale=dim ** -0.5)


def bench(seq: int, variant: str, dtype: DType, hw) -> dict:
    problem = Problem("sparse_attention", variant, (1, HEADS, seq, DIM, WINDOW, VARIANTS[variant]), dtype)
    knobs = solve_tiling(kernel_of(SPEC).tiling_problem(problem, hw), op=problem.op, variant=variant,
                         shape=problem.shape, dtype=dtype.value, target="host").knobs
    kernel = build_kernel(SPEC, problem, knobs)
    inputs = SPEC.make_inputs(problem, seed=0)
    module, args = SPEC.module_call(problem, inputs)
    leaves = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    grad = torch.randn(1, seq, HEADS, DIM).to(dtype.torch)
    wrt = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad] + [module.sinks]

    def step_of(fn):
        return lambda: torch.autograd.grad(fn(*leaves), wrt, grad, allow_unused=True)

    ours = patch_of(SPEC).timing_candidates(problem, kernel.source_hash, False)[0]["aurakernel"]
    row = {"seq": seq, "variant": variant, "dtype": dtype.value, "knobs": knobs, "skipped": {}}
    candidates = {"aurakernel": ours}
    need = _dense_bytes(problem)
    if need < 0.5 * free_memory_bytes():
        candidates["eager"] = step_of(module)
        candidates["sdpa"] = step_of(lambda *a: _sdpa(module, *a))
        compiled = torch.compile(module)
        try:
            step_of(compiled)()
            candidates["compiled"] = step_of(compiled)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot compile is reported
            row["skipped"]["compiled"] = f"torch.compile failed: {type(exc).__name__}"
    else:
        for peer in ("eager", "sdpa", "compiled"):
            row["skipped"][peer] = f"needs ~{need / 2**30:.1f} GiB of dense scores, {free_memory_bytes() / 2**30:.1f} free"
    times = compare(candidates, threads=hw.cores, budget_s=4.0)
    row["fwd_bwd_us"] = {name: t.us for name, t in times.items()}
    # forward alone: the kernel against FlexAttention
    with torch.no_grad():
        fwd = {"aurakernel": lambda: ours_forward(module, problem, kernel, leaves)}
        try:
            flex = _flex_forward(variant, VARIANTS[variant], *[t.detach() for t in leaves[:2]], leaves[2].detach(),
                                 leaves[3], module.sinks.detach())
            flex()
            fwd["flex"] = flex
        except Exception as exc:  # noqa: BLE001
            row["skipped"]["flex"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        row["fwd_us"] = {name: t.us for name, t in compare(fwd, threads=hw.cores, budget_s=3.0).items()}
    return row


def ours_forward(module, problem, kernel, leaves):
    patched = getattr(module, "_bench_patched", None)
    if patched is None:
        import copy
        patched = module._bench_patched = copy.deepcopy(module)
        patch_of(SPEC).patch(patched, lambda key, dtype: kernel.source_hash)
    return patched(*leaves)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,4096,16384")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    hw = load_profile("host")
    rows = [bench(int(s), v, DType.parse(a.dtype), hw) for s in a.seqs.split(",") for v in VARIANTS]
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    t = Table(title=f"sparse attention fwd+bwd, {HEADS} heads x {DIM}, window {WINDOW}, {a.dtype} ({hw.cores} threads)")
    for col in ("seq", "layer", "ours ms", "vs eager", "vs compile", "vs sdpa", "fwd vs flex", "not run"):
        t.add_column(col)
    for r in rows:
        us, f = r["fwd_bwd_us"], r["fwd_us"]

        def ratio(peer, table=us):
            return f"{table[peer] / table['aurakernel']:.1f}x" if peer in table else "-"
        t.add_row(str(r["seq"]), r["variant"], f"{us['aurakernel'] / 1e3:.2f}", ratio("eager"), ratio("compiled"),
                  ratio("sdpa"), ratio("flex", f), "; ".join(f"{k}: {v}" for k, v in r["skipped"].items()))
    Console(width=220).print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
