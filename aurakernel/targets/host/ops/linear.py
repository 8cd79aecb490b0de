"""The host kernel of linear: three strided, packed GEMMs (templates/host/linear.c.j2), their tiling
model and calls.

Where the time goes (tiny V4 config, 1024 tokens, fp32, AVX2 EPYC, 2 cores at ~88 GFLOP/s of FMA
each): the training step spent 121 of ~230 ms in torch's GEMMs, nearly all of them these
projections and the experts', at 100-143 GFLOP/s (1024 x 256 x 128: 101; x 64: 98). The shapes are
narrow (N = 64-256, K = 128-1024): MKL's blocking for them leaves the FMA units idle a third to half
of the time. Packing a kc x nc panel of B once per thread and sweeping it with the 6 x 16 register
blocks reaches 130-180 GFLOP/s on the same shapes, the forward's transposed W and dW's transposed dy
included (8 x 8 register transposes while packing, where a transposed copy would be one more pass).
What it measured (AVX2 EPYC, noisy; ratios from one run each): the kernel alone, 1024 x 256 x 128,
forward 431 vs 538 us and backward 880 vs 1110 (1.2-1.35x torch's GEMMs, which stay 1.15-1.3x
behind with the tiny model's real activations in place of random ones); through the module,
interleaved with eager (a custom op's and autograd's ~0.35 ms around the same three GEMMs), at
parity, so autotune keeps torch's GEMM at those shapes; the tiny training step with every plain
projection on the kernel, 4-6% faster than without (three A/B runs of 14 alternating steps, same
losses). Where it pays clearly is large shapes: linear_cross_entropy's fp32 chunk GEMMs (1024 x 1024
x 16384) run on the same driver, forward 265 vs 359 ms.
A narrow layer (OUT <= NARROW_OUT: a router's gate, an indexer's per-head weights) filled a register
block's 2 vectors of columns with OUT of them: 1024 x 256 x 4 took 814 us through the module against
eager's 233 (autotune kept torch's). The template's narrow path streams x instead (narrow_model prices
it). Kernel alone against torch's GEMMs on the same tensors (Zen 4, medians of 200): 1024 x 256 x 4
forward 32 vs 52 us, backward 59 vs 105; x 8 forward ~55 vs ~110, backward ~95-126 vs ~112-134;
1024 x 4096 x 8 forward 1.0-1.4 vs 1.4-2.3 ms, backward 2.4 vs 3.6-4.0 ms. Through the module at
the tiny sizes the custom op's and autograd's own ~0.1-0.3 ms take that back (1024 x 256 x 4: 409 vs
330 us, x 8: 385 vs 382, one noisy run each), so autotune decides there.
B's panel was packed row-major, so a strip's kc rows lay nc floats apart: at the planned nc = 128
(512 B) its 256 lines fell on 8 of L1's 64 sets, and the strip the register blocks sweep did not
stay in L1. Packed as column strips (each strip's rows contiguous), the panel no longer needs L2
(a strip at a time is read from wherever it is), so nc grows to the whole width and A is packed and
read once per k-panel, not once per 128 columns. Measured on the AVX2 EPYC (noisy; medians of
interleaved runs, same process): the driver alone at 256^3 on one core 55-58 -> 79-82 GFLOP/s in two
runs of three; the kernel, 1024 x 256 x 128, forward 1.05-1.14x and backward 1.03-1.07x the
row-major panels at the same knobs (six runs); 1024 x 1024 x 4096 at the new plan (nc = 4096,
mc = 192) forward 93.4 -> 85.6 ms, backward 186 -> 163 ms; grouped_linear at the tiny step's
shapes 1.00-1.06x. One `aurakernel bench --ops linear,grouped_linear,block_linear,linear_cross_entropy`
run after it: linear 0.93x eager / 1.06x torch.compile, grouped_linear 1.05x / 1.26x, block_linear
1.01x / 1.02x (0.92x / 0.94x in the stored run before), linear_cross_entropy 1.04x / 1.07x (0.86x
torch.compile before; its plan took torch's GEMMs: the calibration measured torch's fp32 GEMM at 0.132
TFLOP/s and ours at 0.114 at 4096^3); 42-64% of the FMA roof. Through the module, the tiny config's
projections still lose to torch's by 5-12% (the kernel alone is at parity with torch's GEMM there; a
custom op's eager call costs ~50 us more than F.linear's each way), so autotune keeps torch's.
The model below prices the FMA work at the calibrated peak with each k-panel's accumulator loads
and stores and each block's call, B's packing and its strips' trips to L1 (from L2, or from the
last-level cache where the panel does not fit beside a block of A), A's packing and reads, the
accumulation passes over C and a depth split's partial sums, under L1 (a kc-long strip of B) and
L2 (a block of A and a strip of B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


from ....ops.base import Problem, Tensors
from ....ops.linear import SPEC
from ....planner.costmodel import thread_candidates
from ....planner.model import ChoiceModel, Constraint, Phase, Term
from ..kernel import HostKernel
from ..library import Entry

# cycles a register block spends loading and storing its accumulators around one k-panel, in
# k-steps of the block's FMAs: what makes short panels slow
BLOCK_EDGE_STEPS = 24
# one register-blocked pass over a block (an ak_gemm call): its loops' setup, the strips' first misses
BLOCK_CALL_S = 0.3e-6
# mc's smallest value: a multiple of the register block's rows on AVX2 (6) and AVX-512 (8)
ROW_BLOCK = 24
# A is packed where its elements along a row or a column lie this many floats apart (the template's
# PACK_A_STRIDE): a block read in place would fall on a few cache sets
PACK_A_STRIDE = 1024
# the widest OUT the template's narrow path takes (streaming x, no GEMM blocks: the register blocks'
# 2 vectors of columns would be mostly empty)
NARROW_OUT = 16


@dataclass(frozen=True)
class Gemm:
    """C[m, n] = A[m, k] B[k, n] as _gemm_driver.h.j2 runs it: whether B is read down its columns
    (packed by transposes), the longer of A's two strides, and the floats of the partial sums a
    depth split may keep (the including kernel's GEMM_PARTIAL_FLOATS)."""

    m: int
    n: int
    k: int
    b_transposed: bool
    a_stride: int
    partial_floats: int

    @property
    def partials_fit(self) -> bool:
        return self.m * self.n <= self.partial_floats


def gemms(problem: Problem) -> dict[str, list[Gemm]]:
    """Each phase's GEMMs: the forward's y = x W^T; the backward's dx = dy W and dW = dy^T x (the
    partial sums hold one dW)."""
    tokens, d_in, d_out = problem.shape
    dw = d_in * d_out
    return {"forward": [Gemm(tokens, d_out, d_in, True, d_in, dw)],
            "backward": [Gemm(tokens, d_in, d_out, False, d_out, dw), Gemm(d_out, d_in, tokens, False, d_out, dw)]}


def split_of(g: Gemm, team: int) -> str:
    """How the threads share a GEMM (the template's split_of): by the floats each way moves beyond
    one pass (rows: every thread packs all of B; columns: every thread reads all of A; depth: the
    partial sums of every thread but the first are written, read and added)."""
    rows, cols = (team - 1) * g.k * g.n * 2, (team - 1) * g.m * g.k
    depth = (team - 1) * g.m * g.n * 3 if g.partials_fit else math.inf
    return "rows" if rows <= cols and rows <= depth else "cols" if cols <= depth else "depth"


def gemm_seconds(g: Gemm, kc: int, nc: int, mc: int, threads: int, *, vec: int, peak: float, l2: float,
                 l2_bw: float, llc_bw: float, stream: float) -> tuple[float, float]:
    """(FMA seconds, memory seconds) of one GEMM: the FMAs at the per-core `peak` with each k-panel's
    accumulator loads and stores and each block's call; B's packing, and its strips brought to L1
    once per block of A's rows (from L2 where the panel fits there beside a block of A, else from the
    last-level cache); A's packing (where its strides are long) once per panel of B, and A read once
    per strip of B, from L2 where a block of it fits there beside a strip, else from memory; C in and
    out per k-panel; a depth split's partial sums."""
    units = {"rows": math.ceil(g.m / (6 if vec == 8 else 8)), "cols": math.ceil(g.n / (2 * vec)),   # _gemm.h.j2's AK_MB
             "depth": math.ceil(g.k / kc) if g.partials_fit else 1}
    team = max(1, min(threads, max(units.values())))
    how = split_of(g, team)
    if units[how] < team:
        how = max(units, key=units.get)
    share = {"rows": (g.m / team, g.n, g.k), "cols": (g.m, g.n / team, g.k), "depth": (g.m, g.n, g.k / team)}[how]
    m, n, k = share
    depth = min(kc, k)
    blocks = math.ceil(m / mc) * math.ceil(n / nc) * math.ceil(k / kc)
    fma = 2 * m * n * k / peak * (depth + BLOCK_EDGE_STEPS) / depth + blocks * BLOCK_CALL_S
    b_packed = k * n * 4 * 2 * (2 if g.b_transposed else 1)
    b_strips = k * n * 4 * math.ceil(m / mc)
    a_packed = m * k * 8 * math.ceil(n / nc) if g.a_stride >= PACK_A_STRIDE else 0.0
    a_reads = m * k * 4 * math.ceil(n / (2 * vec))
    c = m * n * 8 * math.ceil(k / kc)
    a_rate = l2_bw if (min(mc, m) + 2 * vec) * min(kc, k) * 4 <= l2 else stream / team
    b_rate = l2_bw if (min(mc, m) + min(nc, n)) * min(kc, k) * 4 <= l2 else llc_bw
    memory = (b_packed + a_packed) / l2_bw + b_strips / b_rate + a_reads / a_rate + c / max(l2_bw, stream / team)
    if how == "depth" and team > 1:
        memory += (team - 1) * g.m * g.n * 12 / stream
    return fma, memory


def _candidates(start: int, cover: int, limit: int = 8) -> list[int]:
    """start, doubling, up to the first value that covers `cover` (at most `limit` values)."""
    out, v = [start], start
    while v < cover and len(out) < limit:
        v *= 2
        out.append(v)
    return out


def blocking(every: list[Gemm], hw) -> tuple[dict[str, list[int]], list[Constraint], dict[str, float]]:
    """The blocked GEMM's knobs (kc, nc, mc and the vector width) for GEMMs `every`, their cache
    constraints (a strip of B in L1; a block of A and a strip of B in L2) and the rates gemm_seconds
    takes: the knobs any kernel built on _gemm_driver.h.j2 plans."""
    vec = max(hw.simd_bytes // 4, 4)
    domains = {"kc": _candidates(64, max(g.k for g in every), 5), "nc": _candidates(4 * vec, max(g.n for g in every)),
               "mc": _candidates(ROW_BLOCK, max(g.m for g in every), 6), "vec": [vec]}
    l1, l2 = hw.memory["L1"].capacity / 2, hw.memory["L2"].capacity / 2   # half: the other half streams
    constraints = [
        Constraint("L1 capacity (a strip of B)", Term.of(("kc", "vec"), domains, lambda kc, v: kc * 2 * v * 4), l1,
                   "kc x 2 vectors x 4 B"),
        Constraint("L2 capacity (a block of A and a strip of B)",
                   Term.of(("kc", "mc", "vec"), domains, lambda kc, mc, v: kc * (mc + 2 * v) * 4), l2,
                   "kc x (mc + 2 vectors) x 4 B")]
    llc = hw.last_level_cache()
    rates = {"vec": vec, "peak": gemm_peak(hw, library=False), "l2": l2,
             "l2_bw": hw.memory["L2"].bandwidth_gbps * 1e9,
             "llc_bw": llc.bandwidth_gbps * 1e9 / (1 if llc.per_core else max(hw.cores, 1)),   # a core's share
             "stream": hw.stream_bandwidth(hw.cores)}
    return domains, constraints, rates


def gemm_peak(hw, library: bool) -> float:
    """FLOP/s per core of torch's fp32 GEMM (`library`) or of our blocked one, as calibrated on this
    machine (ours at torch's rate where it was not measured)."""
    rates = hw.peak_tflops if library else {**hw.peak_tflops, **hw.own_gemm_tflops}
    return rates.get("fp32", 0.1) * 1e12 / max(hw.cores, 1)


def calls_seconds(hw, calls: int, forks: int, threads: int) -> float:
    """`calls` C calls' overhead, and `forks` OpenMP teams' where more than one thread runs."""
    return calls * hw.call_overhead_us * 1e-6 + (forks * hw.fork_overhead_us * 1e-6 if threads > 1 else 0.0)


def gemm_model(phases: dict[str, list[Gemm]], hw, groups: int = 1) -> ChoiceModel:
    """The tiling model of a kernel that runs `phases` (forward and backward, each a list of GEMMs on
    _gemm_driver.h.j2, one call each) `groups` times over (a grouped kernel's equal groups): their FMA
    and memory time per knob choice, and a call (and a fork) per GEMM. With groups > 1, the knob
    `by_group`: 1 the threads take whole groups, each GEMM on one thread, one fork a call (the slower
    thread's share: ceil(groups / threads) groups)."""
    domains, constraints, rates = blocking([g for phase in phases.values() for g in phase], hw)
    domains["threads"] = thread_candidates(hw.cores)
    if groups > 1:
        domains["by_group"] = [0, 1]

    def seconds(phase: str, which: int):
        def cost(kc: int, nc: int, mc: int, th: int, by_group: int = 0) -> float:
            team, share = (1, -(-groups // th)) if by_group else (th, groups)
            return share * sum(gemm_seconds(g, kc, nc, mc, team, **rates)[which] for g in phases[phase])
        return cost

    def calls_s(n: int):
        def cost(th: int, by_group: int = 0) -> float:
            return calls_seconds(hw, n, 1 if by_group else n, th)
        return cost

    knobs = ("kc", "nc", "mc", "threads", *(("by_group",) if groups > 1 else ()))
    model_phases = [Phase(name, {"FMA": [Term.of(knobs, domains, seconds(name, 0))],
                                 "memory": [Term.of(knobs, domains, seconds(name, 1))]},
                          [Term.of(knobs[3:], domains, calls_s(groups * len(phases[name])))])
                    for name in ("forward", "backward")]
    return ChoiceModel(domains, constraints, model_phases)


def narrow_model(problem: Problem, hw) -> ChoiceModel:
    """The narrow path's model (OUT <= NARROW_OUT: the template streams x, no GEMM blocks, so kc, nc
    and mc are their smallest values and only the threads are a choice): per phase the FMAs at half the
    per-core peak (OUT chains of dependent FMAs a row, too few to fill the units at small OUT), against
    x (and dy, dx) streamed; the backward's per-thread partial dW written, read and added; a call and a
    fork a phase."""
    tokens, d_in, d_out = problem.shape
    domains, _, rates = blocking(gemms(problem)["forward"], hw)
    domains = {**{k: v[:1] for k, v in domains.items()}, "threads": thread_candidates(hw.cores)}
    knobs = ("kc", "nc", "mc", "threads")

    def fma(passes: int):
        return lambda kc, nc, mc, th: passes * 2 * tokens * d_in * d_out / (rates["peak"] / 2 * th)

    def memory(backward: bool):
        def cost(kc, nc, mc, th):
            # forward: x read, y written; backward: x read, dx written, dy read, the partials' three passes
            streamed = tokens * (d_in * (2 if backward else 1) + d_out) * 4
            partials = th * d_out * d_in * 4 * 3 if backward else 0
            return (streamed + partials) / hw.stream_bandwidth(th)
        return cost

    phases = [Phase(name, {"FMA": [Term.of(knobs, domains, fma(passes))], "memory": [Term.of(knobs, domains, memory(passes > 1))]},
                    [Term.of(("threads",), domains, lambda th: calls_seconds(hw, 1, 1, th))])
              for name, passes in (("forward", 1), ("backward", 2))]
    return ChoiceModel(domains, [], phases)


class LinearHost(HostKernel):
    knob_docs = {"kc": "reduction depth of a packed panel (a kc x 2-vector strip of B stays in L1)",
                 "nc": "columns of C per packed panel of B (A is packed and read once per panel)",
                 "mc": "rows of A per block (a packed block stays in L2)", "threads": "OpenMP threads",
                 "vec": "fp32 lanes per vector (the register blocks' width)"}
    entries = {"fwd": Entry("ak_linear_fwd", ("ptr", "ptr", "ptr", "i64", "ptr")),
               "bwd": Entry("ak_linear_bwd", ("ptr", "ptr", "ptr", "ptr", "ptr", "i64", "ptr")),
               "scratch": Entry("ak_linear_scratch", (), "i64")}

    def tiling_problem(self, problem: Problem, hw):
        return narrow_model(problem, hw) if problem.shape[2] <= NARROW_OUT else gemm_model(gemms(problem), hw)

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "d_in": int(problem.shape[1]), "d_out": int(problem.shape[2]),
                "kc": int(knobs["kc"]), "nc": int(knobs["nc"]), "mc": int(knobs["mc"]),
                "threads": int(knobs["threads"]), "vec": int(knobs["vec"]), "narrow_out": NARROW_OUT}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        x = inputs["x"]
        return {"y": x.new_empty(x.shape[0], inputs["weight"].shape[0])}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        kernel.call("fwd", inputs["x"], inputs["weight"], outputs["y"], inputs["x"].shape[0], kernel.workspace("scratch"))

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        kernel.call("bwd", grad_outputs["y"], inputs["x"], inputs["weight"], grads["x"], grads["weight"],
                    inputs["x"].shape[0], kernel.workspace("scratch"))

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        """The tuned shape; tokens that split unevenly over the threads' row blocks and over the
        k-panels of dW (a short last panel); widths off the SIMD grid (the GEMMs' edge columns)."""
        tokens, d_in, d_out = problem.shape
        odd = knobs["kc"] + 2 * 6 * knobs["threads"] + 7
        out = [problem, Problem(problem.op, problem.variant, (min(tokens, odd), d_in, d_out), problem.dtype)]
        if d_in % simd_elems == 0 or d_out % simd_elems == 0:
            out.append(Problem(problem.op, problem.variant, (min(tokens, odd), d_in + 3, d_out + 5), problem.dtype))
        return out


PARTS = (LinearHost(SPEC),)
