"""The host C kernel of sparse_attention (templates/host/sparse_attention.c.j2): its tiling model,
template values and C calls.

Tiling model (an ESTIMATE, per phase; the coefficients are the profile's, as for the row kernels):
  tasks        B x ceil(S / tile_rows), split statically over threads
  csa picks    a task gathers the union of its positions' picks once and scores all its rows against
               it (masked to each position's own), or each position's picks for its H rows, whichever
               costs fewer GEMM rows x keys plus packing (pack_rows: a key's gathering and packing in
               GEMM rows of it; the kernel decides per task from the picks it is given). The model
               expects the union of picks drawn at random among the ready entries (what the tests and
               benchmarks feed; the indexer's picks of neighbouring queries overlap more)
  compute      the busiest thread's GEMM flops / (the calibrated fp32 matmul rate per core x 0.5):
               window rows see tile_rows - 1 more keys than they use (the band's waste), which
               bigger tiles pay; 1.5x when a chunk and its score blocks overflow L2 (the rows stream
               past them). bf16 on a CPU with AMX: the tile unit at the calibrated bf16 rate x 0.5,
               rows padded to 32 (a csa position's heads on their own, where it gathers its own
               picks), p and dz in two bf16 parts (twice their GEMMs), plus
               packing each chunk for the tiles (same core, so added, not overlapped; no L2 spill
               measured up to 16 x 16 rows)
  vector       converting each chunk's keys into both layouts (the transposed one 8 x 8 blocks in
               registers) and the softmax's exps, a fixed cost per chunk and one per (row, chunk) (the
               row's masked passes, reductions and accumulator rescale: what makes short chunks and
               small tiles slow); bigger tiles share the window keys' conversion; bf16's backward loads
               every chunk twice (its exact dO . O pass). It runs on the same core as the GEMMs: the
               phase's compute is their sum
  DRAM         q, out, kv, the compressed kv and lse once, at the stream bandwidth of the threads
  overhead     call + fork + a fixed cost per task
Capacity: a task's working set (q rows, the output or gradient accumulators, a key chunk in both
layouts, the score block) must fit the per-core share of the largest cache.

Measured against the model (the tiny config's widths, 4 x 4 x 256 x 64 fp32, AVX2 EPYC, kernel alone):
the model picked tile_rows 4, and 8-16 run faster, forward + backward sliding 2.41 -> 2.12 ms, hca
2.67 -> 2.33, csa 3.98 -> 3.73 (perf: the GEMMs ~55% of the time, the row passes ~18%, load_chunk
~10%). Two terms are off: the GEMMs run near the full calibrated rate, not GEMM_EFFICIENCY's half,
and each task costs about 2 us more than the model counts (the window chunk converted per task, the
GEMM calls per chunk), which bigger tiles share. GEMM_EFFICIENCY alone does not move the pick (the
band waste still outweighs the per-task terms). On a Zen 4 EPYC (AVX-512) the same: side by side,
tile_rows 4 / 8 / 16 / 32 ran csa 3245 / 3057 / 3028 / 3290 us, hca 2798 / 2585 / 2560 / 2844, sliding
3294 / 3118 / 3157 / 3670 (fwd+bwd through the module), ~3 us a task more than the model counted.
TASK_CYCLES now counts it: the model picks 8 at these widths on both machines (V4-Flash's csa at
2048 tokens stays at 8).
"""

from __future__ import annotations

import functools
import math

import torch

from ....ops.base import Problem, Tensors
from ....ops.sparse_attention import CSA_RATIO, SPEC, entries_of
from ....hardware import _cpu_flags
from ....planner.costmodel import DEFAULTS, thread_candidates
from ....planner.model import ChoiceModel, Constraint, Phase, Term
from ..kernel import HostKernel
from ..library import Entry

VARIANT_ID = {"sliding": 0, "csa": 1, "hca": 2}
GEMM_EFFICIENCY = 0.5     # of the calibrated matmul rate, for these small register-blocked GEMMs (ESTIMATE)
TRANSPOSE_CYCLES = 0.1    # per key element of the transposed copy of each chunk, 8 x 8 blocks in registers (ESTIMATE)
# per task beyond the terms below (the window chunk set up and converted, a GEMM call per chunk and
# row block): fitted to the tiny config's widths, where tasks of 8 positions ran 5-9% faster than 4
# (the pick without it) on a Zen 4 EPYC and on the AVX2 EPYC, ~200 us apart at 64 tasks a thread
TASK_CYCLES = 7000
# per (row, chunk): the online softmax's masked passes over the chunk, the row's reductions and the
# rescale of its accumulator (D wide); measured at 4 x 4 x 256 x 64 fp32 on AVX-512 (130 cycles at D = 64)
ROW_CHUNK_CYCLES = 100
ROW_CHUNK_CYCLES_PER_DIM = 0.5
L2_SPILL = 1.5            # compute slowdown when a chunk and its scores overflow L2 (ESTIMATE)
AMX_EFFICIENCY = 0.5      # of the calibrated bf16 matmul rate, for the tile path's 32-row GEMMs (ESTIMATE)
AMX_PACK_CYCLES = 0.5     # per key element packed for the tiles, both layouts (ESTIMATE: vectorised interleave and 8 x 8
                          # transposes; csa at V4 widths estimates 538 ms forward + backward, measured 511)


def sorted_indices(indices: torch.Tensor | None) -> torch.Tensor | None:
    """The picks as the kernel takes them: ascending, so repeats are adjacent (seen once, as the dense
    mask sees them) and the gathers walk forward."""
    return torch.sort(indices.to(torch.int64), dim=-1).values.contiguous() if indices is not None else None


def _args(inputs: Tensors):
    q, kv = inputs["q"].contiguous(), inputs["kv"].contiguous()
    ckv = inputs.get("compressed_kv")
    ckv = ckv.contiguous() if ckv is not None else None
    return q, kv, ckv, sorted_indices(inputs.get("indices"))


def dims(q, ckv, idx) -> tuple[int, int, int, int]:
    b, _, s, _ = q.shape
    return b, s, (ckv.shape[1] if ckv is not None else 0), (idx.shape[-1] if idx is not None else 0)


def rows_in_place(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A 4-D tensor of rows (q [B, H, S, D], dO [B, S, H, D]) as the kernel reads it in place, and its
    layout flag: 0 stored in its dims' order, 1 stored with dims 1 and 2 swapped (a transposed view:
    rope's output of the attention's q, the attention output's gradient); any other layout is copied
    into the first."""
    if t.is_contiguous():
        return t, 0
    if t.transpose(1, 2).is_contiguous():
        return t, 1
    return t.contiguous(), 0


def forward(kernel, q, kv, ckv, idx, sinks, out, lse, scaling: float) -> None:
    b, s, t, k = dims(q, ckv, idx)
    scratch = kernel.workspace_of(kernel.call("scratch", b, s, t, k, 0))
    q, q_swapped = rows_in_place(q)
    kernel.call("fwd", q, kv, ckv if ckv is not None else 0, idx if idx is not None else 0, sinks, out, lse,
                scratch, b, s, t, k, scaling, q_swapped)


def backward(kernel, q, kv, ckv, idx, sinks, out, lse, dout, dq, dkv, dckv, dsinks, scaling: float) -> None:
    """dq is written in q's layout (allocate it with empty_like of the q that rows_in_place returns)."""
    b, s, t, k = dims(q, ckv, idx)
    scratch = kernel.workspace_of(kernel.call("scratch", b, s, t, k, 1))
    (q, q_swapped), (dout, dout_swapped) = rows_in_place(q), rows_in_place(dout)
    if dq.stride() != q.stride():
        raise ValueError(f"sparse_attention backward: dq's strides {dq.stride()} are not q's {q.stride()}")
    kernel.call("bwd", q, kv, ckv if ckv is not None else 0, idx if idx is not None else 0, sinks, out, lse,
                dout, dq, dkv, dckv if dckv is not None else 0, dsinks, scratch, b, s, t, k, scaling, q_swapped,
                dout_swapped)


class SparseAttentionHost(HostKernel):
    knob_docs = {"tile_rows": "query positions per task (their heads share the window's keys)",
                 "key_chunk": "keys per online-softmax chunk", "threads": "OpenMP threads",
                 "pack_rows": "a key's gathering and packing in GEMM rows of it (csa: when a task gathers its picks' union)"}
    entries = {"fwd": Entry("ak_sparse_attention_fwd", ("ptr",) * 8 + ("i64",) * 4 + ("f32", "i64")),
               "bwd": Entry("ak_sparse_attention_bwd", ("ptr",) * 13 + ("i64",) * 4 + ("f32", "i64", "i64")),
               "scratch": Entry("ak_sparse_attention_scratch", ("i64",) * 5, "i64")}

    def tiling_problem(self, problem: Problem, hw):
        batch, heads, seq, dim, window, extra = problem.shape
        e = problem.dtype.itemsize
        entries = entries_of(problem)
        cm = {**DEFAULTS, **hw.costmodel}
        clock = hw.clock_ghz * 1e9
        vec = max(hw.simd_bytes // 4, 4)
        # bf16 on a CPU with AMX takes the tile path (the kernel's AK_AMX build): chunks of whole 32-key tiles
        amx = problem.dtype.value == "bf16" and "amx_bf16" in _cpu_flags()
        step = 32 if amx else vec
        widest = window + 16 + (min(extra, entries) if problem.variant == "csa" else entries)
        rate = hw.peak_tflops.get("bf16", 0.0) * AMX_EFFICIENCY if amx else 0.0
        per_core_rate = (rate or hw.peak_tflops.get("fp32", 0.1) * GEMM_EFFICIENCY) * 1e12 / max(hw.cores, 1)
        # a key's gathering and packing against one GEMM row of it (the forward's GEMMs: q k^T, p v)
        fwd_gemms = 3 if amx else 2
        pack_cycles = dim * (AMX_PACK_CYCLES if amx else 2 * cm["vector_cycles_per_elem"] + TRANSPOSE_CYCLES)
        pack_rows = max(1, round(pack_cycles / clock / (2 * fwd_gemms * dim / per_core_rate)))
        domains = {"tile_rows": [v for v in (1, 2, 4, 8, 16) if v <= max(seq, 1)],
                   "key_chunk": [c for c in (16, 32, 64, 128, 256, 512) if c % step == 0 and c < 2 * widest] or [step],
                   "threads": thread_candidates(hw.cores), "vec": [vec], "pack_rows": [pack_rows]}
        l2 = hw.memory["L2"].capacity * (1 if hw.memory["L2"].per_core else 1 / max(hw.cores, 1))
        last = hw.last_level_cache()
        last_share = last.capacity / (1 if last.per_core else max(hw.cores, 1))

        def working_set(qb, kb, backward):
            m = qb * heads
            return 4 * ((5 if backward else 2) * m * dim + 2 * kb * dim + (3 if backward else 1) * m * kb)

        def streamed_set(qb, kb, backward):
            """What the GEMMs reuse from L2 while the task's rows stream past: the chunk in both layouts
            and the score blocks (measured on a 512 KB L2: 8-position tasks run no slower than 2)."""
            return 4 * (2 * kb * dim + (3 if backward else 1) * qb * heads * kb)

        def pad(rows):   # the tile path's GEMMs run whole blocks of 32 rows
            return math.ceil(rows / 32) * 32 if amx else rows

        ready = [min((s + 1) // CSA_RATIO, entries) for s in range(seq)] if problem.variant == "csa" else []
        picks = [min(extra, r) for r in ready]

        @functools.cache
        def csa_task(qb, kb):
            """A csa task's picks, the mean over the sequence's tasks as the kernel takes them (union or
            each position's): (GEMM rows x keys, keys gathered, chunks, row chunks)."""
            total = [0.0, 0.0, 0.0, 0.0]
            starts = range(0, seq, qb)
            for s0 in starts:
                span = range(s0, min(s0 + qb, seq))
                own = sum(picks[s] for s in span)
                missed = math.prod(1 - picks[s] / ready[s] for s in span if ready[s])
                union = ready[span[-1]] * (1 - missed)
                rows = len(span) * heads
                if union * (pack_rows + pad(rows)) <= own * (pack_rows + pad(heads)):
                    cells = (pad(rows) * union, union, math.ceil(union / kb), rows * math.ceil(union / kb))
                else:
                    chunks = sum(math.ceil(picks[s] / kb) for s in span)
                    cells = (pad(heads) * own, own, chunks, heads * chunks)
                total = [t + c for t, c in zip(total, cells)]
            return tuple(t / len(starts) for t in total)

        def shared_keys(qb):
            """The keys every row of a task is scored against, gathered once per task: the window's band
            and the hca entries (a csa task's picks: csa_task)."""
            return min(window + qb - 1, seq) + (entries / 2 if problem.variant == "hca" else 0)

        def row_keys(qb, kb):
            """GEMM rows x keys per task: the task's rows against the shared keys, and its csa picks."""
            return pad(qb * heads) * shared_keys(qb) + (csa_task(qb, kb)[0] if problem.variant == "csa" else 0)

        def gathered(qb, kb):
            return shared_keys(qb) + (csa_task(qb, kb)[1] if problem.variant == "csa" else 0)

        def tasks(qb, th):
            return math.ceil(batch * math.ceil(seq / qb) / th)

        constraints = [Constraint(
            f"{last.name} capacity (task)", Term.of(("tile_rows", "key_chunk"), domains,
                                                    lambda qb, kb: working_set(qb, kb, True)),
            last_share, f"4 B x (5 tile_rows x {heads} x {dim} + 2 key_chunk x {dim} + 3 tile_rows x {heads} x key_chunk)")]
        phases = []
        # bf16's backward sums dO . O exactly in a first pass over the chunks: two more GEMMs, a second load
        exact = problem.dtype.value != "fp32"
        # the tile path: p (forward) and dz, p (backward) in two bf16 parts, each GEMM taking them twice
        bwd_gemms = 10 if amx else (7 if exact else 5)
        for name, backward, gemms, loads in (("forward", False, fwd_gemms, 1), ("backward", True, bwd_gemms,
                                                                                2 if exact else 1)):
            def compute(qb, kb, th, backward=backward, gemms=gemms, loads=loads):
                gemm = tasks(qb, th) * 2 * gemms * row_keys(qb, kb) * dim / per_core_rate
                if amx:   # packing each chunk for the tiles runs on the same core, between the tile ops
                    return gemm + tasks(qb, th) * loads * gathered(qb, kb) * dim * AMX_PACK_CYCLES / clock
                return gemm * (L2_SPILL if streamed_set(qb, kb, backward) > l2 else 1.0)

            def vector(qb, kb, th, backward=backward, loads=loads):
                shared = shared_keys(qb)
                csa = csa_task(qb, kb) if problem.variant == "csa" else (0.0, 0.0, 0, 0)
                elems = (3 if backward else 2) * (qb * heads * shared + csa[0])
                if not amx:   # the chunk's conversion to fp32 in both layouts (the tile path counts its packing above)
                    elems += 2 * loads * gathered(qb, kb) * dim
                shared_chunks = math.ceil(shared / kb)
                chunks = loads * (shared_chunks + csa[2])
                row_chunks = loads * (shared_chunks * qb * heads + csa[3])
                transpose = 0.0 if amx else loads * gathered(qb, kb) * dim * TRANSPOSE_CYCLES
                return tasks(qb, th) * (elems * cm["vector_cycles_per_elem"] + chunks * cm["chunk_overhead_cycles"]
                                        + row_chunks * (ROW_CHUNK_CYCLES + ROW_CHUNK_CYCLES_PER_DIM * dim)
                                        + transpose) / clock

            traffic = (2 * batch * heads * seq * dim + batch * (seq + entries) * dim) * e * (2 if backward else 1)

            def dram(th, traffic=traffic):
                return traffic / hw.stream_bandwidth(th) * cm["dram_time_scale"]

            def overhead(qb, th):
                return ((hw.call_overhead_us + cm["phase_overhead_us"] + (hw.fork_overhead_us if th > 1 else 0.0)) * 1e-6
                        + tasks(qb, th) * (cm["tile_overhead_ns"] * 1e-9 + TASK_CYCLES / clock))

            phases.append(Phase(name, {   # the GEMMs and the row work share each core's vector units: one pipe
                "compute": [Term.of(("tile_rows", "key_chunk", "threads"), domains, compute),
                            Term.of(("tile_rows", "key_chunk", "threads"), domains, vector)],
                "DRAM": [Term.of(("threads",), domains, dram)]},
                [Term.of(("tile_rows", "threads"), domains, overhead)]))
        return ChoiceModel(domains, constraints, phases)

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, heads, _, dim, window, extra = problem.shape
        return {"dtype": problem.dtype, "variant_id": VARIANT_ID[problem.variant],
                "heads": int(heads), "dim": int(dim), "window": int(window), "extra": int(extra),
                "tile_rows": int(knobs["tile_rows"]), "key_chunk": int(knobs["key_chunk"]),
                "threads": int(knobs["threads"]), "vec": int(knobs["vec"]), "pack_rows": int(knobs["pack_rows"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        q = inputs["q"]
        b, h, s, d = q.shape
        return {"y": q.new_empty(b, s, h, d), "lse": q.new_empty(b, h, s, dtype=torch.float32)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        q, kv, ckv, idx = _args(inputs)
        forward(kernel, q, kv, ckv, idx, inputs["sinks"].float().contiguous(), outputs["y"], outputs["lse"],
                q.shape[-1] ** -0.5)

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        q, kv, ckv, idx = _args(inputs)   # grads: fresh contiguous buffers of the inputs' shapes, written in place
        backward(kernel, q, kv, ckv, idx, inputs["sinks"].float().contiguous(), outputs["y"], outputs["lse"],
                 grad_outputs["y"].to(q.dtype).contiguous(), grads["q"], grads["kv"], grads.get("compressed_kv"),
                 grads["sinks"], q.shape[-1] ** -0.5)

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        """The tuned shape, and a short one with two batch rows whose length is not a multiple of the
        task (and, for hca, ends inside a compression window)."""
        batch, heads, seq, dim, window, extra = problem.shape
        tail = knobs["tile_rows"] * 3 + 1
        if problem.variant == "hca":
            tail = max(tail, 2 * extra + 5)
        elif problem.variant == "csa":
            tail = max(tail, window + 4 * min(extra, 8) + 3)
        return [problem, Problem(problem.op, problem.variant, (2, heads, min(seq, tail), dim, window, extra),
                                 problem.dtype)]


PARTS = (SparseAttentionHost(SPEC),)
