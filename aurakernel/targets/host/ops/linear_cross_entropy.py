"""The host kernel of linear_cross_entropy: token chunks through three GEMMs around the C loss
kernel, its tiling model and calls. fp32 builds run the GEMMs themselves (linear's blocked GEMM over
strided operands, _gemm_driver.h.j2: W^T and d logits^T read through their strides, the weight
gradient accumulated in place, the blocking planned with the chunk); 16-bit ones take torch's
(oneDNN/MKL: AMX where the CPU has it). On the AVX2 EPYC at 1024 x 1024 x 16384 fp32 that took the
operator from 1.04x to 1.47x eager (860 vs 1266 ms, same run): MKL ran these shapes' GEMMs at
60-75% of the FMA peak. On another AVX2 EPYC MKL ran them at ~86% and ours behind it (the operator
0.89x eager in one `aurakernel bench` run; A/B of the same chunk loop, ours 824 against torch's 726
ms), so which GEMM runs them is a knob (`torch_gemm`), planned from the two rates the machine's
calibration measures (`aurakernel calibrate`: torch.mm's and our blocked GEMM's at one square size,
0.179 and 0.145 TFLOP/s there): it now takes torch's, 1.24x eager and 1.14x torch.compile in one
bench run.

Where the time goes (V4's head, 4096 tokens x 4096 hidden x 129280 vocabulary, bf16): the three
GEMMs are 13 TFLOP, nearly all of it; every chunk also streams the whole weight twice (logits,
hidden-state gradient) and the weight gradient once in and out, 4 x vocab x hidden x 2 B = 4.2 GB a
chunk. So chunk_rows trades memory (a chunk's logits, chunk_rows x vocab) against that traffic:
small chunks make the GEMMs memory-bound on the weight, large ones hold more logits. The loss kernel
itself is two sweeps over a chunk's logits. The model below prices both and caps a chunk's logits.
Measured at that shape in fp32 (benchmarks/linear_cross_entropy.py, AVX2 EPYC, 2 cores, three rounds):
94.1 s against eager's 103.9 s (1.10x: the same GEMMs, torch's, are ~95% of both), allocator peak
2,337 MiB against 6,060 (0.39x), of which 2,020 MiB is the fp32 weight gradient itself (an output);
the rest is one 512-row chunk's logits (252 MiB) against eager's whole logits and their gradient.
"""

from __future__ import annotations

import math

import torch

from ....ops.base import Problem, Tensors
from ....ops.cross_entropy import IGNORE
from ....ops.linear_cross_entropy import SPEC
from ....planner.costmodel import DEFAULTS, col_chunk_candidates, thread_candidates
from ....planner.model import ChoiceModel, Constraint, Phase, Term
from ..kernel import HostKernel
from ..library import Entry
from .linear import Gemm, LinearHost, blocking, gemm_peak, gemm_seconds

# a chunk's logits may take this much memory, or as much as the hidden states (whichever is more):
# the loss then holds a fixed, small share of what the unfused logits take
CHUNK_BUDGET_BYTES = 256 * 2**20
# rows of a chunk at which its three GEMMs reach half the calibrated matmul peak: measured on a
# 2-core Xeon (AMX), 512-row chunks ran them at 0.9-1.5 of 2.8 TFLOP/s, 1024-row ones at ~0.5x-0.6x
GEMM_HALF_ROWS = 512


def chunk_rows_candidates(tokens: int) -> list[int]:
    """Powers of two from 16 to the first that covers every token."""
    out, c = [], 16
    while True:
        out.append(c)
        if c >= tokens:
            return out
        c *= 2


def own_gemm(problem: Problem, knobs: dict[str, int]) -> bool:
    """Whether the chunk's GEMMs run on the kernel's own blocked GEMM: fp32, where the plan did not
    find torch's faster on this machine (plans from before the choice: ours)."""
    return problem.dtype.value == "fp32" and not knobs.get("torch_gemm", 0)


def chunk_gemms(rows: int, hidden: int, vocab: int, chunk_rows: int) -> list[Gemm]:
    """A chunk of `rows` tokens' three GEMMs as the fp32 kernel runs them: logits = h W^T, d hidden =
    d logits W, d weight += d logits^T h; a depth split's partial sums hold a whole chunk's d hidden."""
    partial = chunk_rows * hidden
    return [Gemm(rows, vocab, hidden, True, hidden, partial), Gemm(rows, hidden, vocab, False, vocab, partial),
            Gemm(vocab, hidden, rows, False, vocab, partial)]


def _mm(kernel, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """out (+)= a @ b through the kernel's GEMM where its build has one (fp32), else torch's; a and b
    may be transposed views (read through their strides: one of each one's strides must be 1), out's
    rows are contiguous."""
    if kernel.has("gemm") and 1 in a.stride() and 1 in b.stride() and out.stride(1) == 1:
        kernel.call("gemm", a.shape[0], b.shape[1], a.shape[1], a, a.stride(0), a.stride(1), b, b.stride(0),
                    b.stride(1), out, out.stride(0), int(accumulate), kernel.workspace("gemm_scratch"))
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def forward(kernel, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int):
    """(mean loss, d loss / d hidden, d loss / d weight), a chunk of tokens at a time."""
    tokens = hidden.shape[0]
    valid = int((labels != IGNORE).sum())
    loss_rows = torch.empty(tokens)
    dhidden, dweight = torch.empty_like(hidden), torch.empty_like(weight)
    logits = torch.empty(min(chunk_rows, tokens), weight.shape[0], dtype=hidden.dtype)
    for r0 in range(0, tokens, chunk_rows):
        r1 = min(r0 + chunk_rows, tokens)
        h, chunk = hidden[r0:r1], logits[: r1 - r0]
        _mm(kernel, h, weight.t(), chunk)
        kernel.call("rows", chunk, labels[r0:r1], loss_rows[r0:r1], r1 - r0, 1.0 / max(valid, 1))
        _mm(kernel, chunk, weight, dhidden[r0:r1])   # the chunk now holds d loss / d logits
        _mm(kernel, chunk.t(), h, dweight, accumulate=r0 > 0)
    loss = loss_rows.sum() / valid if valid else loss_rows.sum() * float("nan")
    return loss, dhidden, dweight


class LinearCrossEntropyHost(HostKernel):
    knob_docs = {"chunk_rows": "tokens per chunk (a chunk's logits are what the loss holds)",
                 "col_chunk": "vocabulary columns per sweep chunk (kept in L1)", "threads": "OpenMP threads",
                 "torch_gemm": "fp32: 1 runs the chunk's GEMMs on torch's (MKL / oneDNN), 0 on the kernel's own",
                 **{k: f"fp32, own GEMM: {doc}" for k, doc in LinearHost.knob_docs.items() if k != "threads"}}
    entries = {"rows": Entry("ak_lce_rows", ("ptr", "ptr", "ptr", "i64", "f32")),
               # fp32 builds only: the chunk's GEMMs (16-bit ones take torch's)
               "gemm": Entry("ak_lce_gemm", ("i64", "i64", "i64", "ptr", "i64", "i64", "ptr", "i64", "i64", "ptr", "i64",
                                             "i64", "ptr"), optional=True),
               "gemm_scratch": Entry("ak_lce_gemm_scratch", (), "i64", optional=True)}

    def tiling_problem(self, problem: Problem, hw):
        tokens, hidden, vocab = problem.shape
        e = problem.dtype.itemsize
        cm = {**DEFAULTS, **hw.costmodel}
        clock = hw.clock_ghz * 1e9
        domains = {"chunk_rows": chunk_rows_candidates(tokens),
                   "col_chunk": col_chunk_candidates(vocab, max(hw.simd_bytes // 4, 1)),
                   "threads": thread_candidates(hw.cores)}
        peak = hw.peak_tflops.get(problem.dtype.value, min(hw.peak_tflops.values())) * 1e12
        budget = max(CHUNK_BUDGET_BYTES, tokens * hidden * e)
        l1 = hw.memory["L1"].capacity * cm.get("cache_fraction", 0.5)
        constraints = [
            Constraint("memory (a chunk's logits)", Term.of(("chunk_rows",), domains, lambda c: min(c, tokens) * vocab * e),
                       max(budget, 16 * vocab * e), f"chunk_rows x {vocab * e:,} B"),
            Constraint("L1 capacity (chunk)", Term.of(("col_chunk",), domains, lambda cc: cc * 2 * e), l1,
                       f"col_chunk x {2 * e} B")]

        def chunks(c: int) -> int:
            return math.ceil(tokens / c)

        def gemm_s(c: int) -> float:   # three GEMMs per chunk, at the efficiency of its row count
            rows = min(c, tokens)
            return chunks(c) * 6 * rows * hidden * vocab / (peak * rows / (rows + GEMM_HALF_ROWS))

        def weight_traffic_s(c: int) -> float:   # the weight twice, its gradient in and out, per chunk
            return chunks(c) * 4 * vocab * hidden * e / hw.stream_bandwidth(hw.cores) * cm["dram_time_scale"]

        def loss_s(th: int, cc: int) -> float:   # the C kernel: two sweeps over every row of logits
            per_row = 3 * vocab * cm["vector_cycles_per_elem"] + math.ceil(vocab / cc) * cm["chunk_overhead_cycles"]
            return math.ceil(tokens / th) * per_row / clock

        def calls_s(c: int, th: int) -> float:
            return chunks(c) * (4 * hw.call_overhead_us + (hw.fork_overhead_us if th > 1 else 0.0)) * 1e-6

        pipes = {"DRAM": [Term.of(("chunk_rows",), domains, weight_traffic_s)]}
        if problem.dtype.value == "fp32":   # the kernel's own blocked GEMM (its knobs, caches and cost) or torch's
            largest = max(domains["chunk_rows"])
            gemm_domains, gemm_constraints, rates = blocking(chunk_gemms(min(tokens, largest), hidden, vocab, largest), hw)
            # torch's is a choice where this machine's calibration timed ours (a tie otherwise: ours)
            domains |= gemm_domains | {"torch_gemm": [0, 1] if hw.own_gemm_tflops else [0]}
            constraints += gemm_constraints
            knobs = ("chunk_rows", "kc", "nc", "mc", "threads", "torch_gemm")

            def blocked_s(which: int):   # the same GEMMs either way, at the calibrated rate of the one that runs them
                def cost(c: int, kc: int, nc: int, mc: int, th: int, library: int) -> float:
                    at = {**rates, "peak": gemm_peak(hw, library=bool(library))}
                    return chunks(c) * sum(gemm_seconds(g, kc, nc, mc, th, **at)[which]
                                           for g in chunk_gemms(min(c, tokens), hidden, vocab, c))
                return cost
            pipes["GEMM"] = [Term.of(knobs, domains, blocked_s(0))]
            pipes["L2"] = [Term.of(knobs, domains, blocked_s(1))]
        else:   # torch's GEMMs
            pipes["GEMM"] = [Term.of(("chunk_rows",), domains, gemm_s)]
        fwd = Phase("forward", pipes,
                    [Term.of(("threads", "col_chunk"), domains, loss_s),
                     Term.of(("chunk_rows", "threads"), domains, calls_s)])
        # backward: the two gradients scaled by the loss's gradient, one pass over each
        scale_s = 2 * (tokens + vocab) * hidden * e / hw.stream_bandwidth(hw.cores)
        bwd = Phase("backward", {"DRAM": [Term.of(("threads",), domains, lambda th: scale_s)]},
                    [Term.of(("threads",), domains, lambda th: (hw.call_overhead_us + cm["phase_overhead_us"]) * 1e-6)])
        return ChoiceModel(domains, constraints, [fwd, bwd])

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        params = {"dtype": problem.dtype, "vocab": int(problem.shape[2]), "chunk_rows": int(knobs["chunk_rows"]),
                  "col_chunk": int(knobs["col_chunk"]), "threads": int(knobs["threads"]),
                  "own_gemm": own_gemm(problem, knobs)}
        if own_gemm(problem, knobs):   # the GEMMs' blocking
            params |= {"hidden": int(problem.shape[1]), **{k: int(knobs[k]) for k in ("kc", "nc", "mc", "vec")}}
        return params

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"loss": torch.empty((), dtype=torch.float32), "dhidden": torch.empty_like(inputs["hidden"]),
                "dweight": torch.empty_like(inputs["weight"])}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        loss, dh, dw = forward(kernel, inputs["hidden"], inputs["weight"], inputs["labels"], kernel.meta["chunk_rows"])
        outputs["loss"].copy_(loss)
        outputs["dhidden"].copy_(dh)
        outputs["dweight"].copy_(dw)

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        g = grad_outputs["loss"]
        torch.mul(outputs["dhidden"], g, out=grads["hidden"])
        torch.mul(outputs["dweight"], g, out=grads["weight"])

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        """The tuned shape; tokens not a multiple of the chunk (a short last chunk); a vocabulary
        off the SIMD grid."""
        tokens, hidden, vocab = problem.shape
        tail = knobs["chunk_rows"] + 3   # two chunks, the second short
        odd = vocab + 5 if vocab % simd_elems == 0 else vocab
        return [problem, Problem(problem.op, problem.variant, (tail, hidden, min(odd, 4099)), problem.dtype)]


PARTS = (LinearCrossEntropyHost(SPEC),)
