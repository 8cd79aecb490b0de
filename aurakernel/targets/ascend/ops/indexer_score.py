"""The AscendC kernel of indexer_score (templates/ascendc/): its planner phases, template values and emulator run."""

from __future__ import annotations

import struct

import torch

from .... import emulator
from ....emulator import from_bytes, to_bytes
from ....errors import PlanInfeasible
from ....ops.base import Problem, Tensors
from ....ops.indexer_score import SPEC
from ....planner.ascend import AscendRowPhase, row_split
from ..kernel import AscendKernel


class IndexerScoreAscend(AscendKernel):
    syncs_cores = True   # its blocks meet in SyncAll
    # --- AscendC (templates/ascendc/indexer_score/): vector-unit kernel, query rows over the cores ---
    # The products are Cube work on real hardware; the emulator covers the vector unit only, so the
    # kernel multiplies on the vector pipe (see the template's header) and is compute-bound there.
    # The row-wise UB model sees it as rows = B x S query rows of T keys: `chunk` is the key tile
    # (keys per UB tile), `tile_rows` the query rows sharing a key tile, `buffers` the row queues' depth.
    split_cols = False

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        batch, seq, _, _, entries = problem.shape
        return batch * seq, entries

    def phases(self, problem: Problem):
        _, _, heads, dim, _ = problem.shape
        e = problem.dtype.itemsize
        pieces = -(-dim // 64)                        # 64-lane fp32 repeats per key row
        fp32_streams = max(1, 4 // e)                 # a fp32 row of T keys in units of T elements of the dtype
        cast = 0 if e == 4 else 1
        rows_in = heads * dim * e + heads * 4         # q and w per query row
        key_tile = dim * e // 4 + cast * dim          # per key (floats): the k tile as loaded, its fp32 copy
        # fast ops per key-row element: one unit = T/64 repeats per query row (see planner/ascend.py)
        dots = 128 * pieces + pieces - 1              # Mul + WholeReduceSum per piece, pieces added
        # the score / gradient rows' UB pitch rounds T up to the key tile: up to 1 KB more per row
        return [
            # q, w in; score row (fp32) out; per head: the dot products, ReLU, weight, accumulate
            # (resident per row: q as fp32, c w[h] and its Brcb blocks); per key of the tile: the k tile,
            # the Mul products of one piece, every head's dot products (two pieces' worth)
            AscendRowPhase("forward", 0, fp32_streams, rows_in + cast * heads * dim * 4 + heads * 36, 1024, 288,
                           work_buffers=key_tile + 64 + 1 + 2 * heads,
                           fast_ops_per_elem=heads * (128 * pieces + 4) + 64 * pieces * cast,
                           slow_ops_per_elem=0, instrs_per_chunk=heads * 2 * pieces + 10 + cast),
            # q, w, score gradient row in; dq and dw accumulated per row (fp32, resident over the key
            # tiles); per key tile the dk accumulator and the key-row products; per head: dots, dw,
            # coef (Compare/Select), Brcb, dk += coef q (Mul, Add), dq += coef k (Mul, halving tree)
            AscendRowPhase("backward", fp32_streams, 0, rows_in + 1024, heads * dim * 4 + heads * 32,
                           dim * 4 + heads * 36,
                           work_buffers=key_tile + 2 * dim + 4 + 8 + 1,
                           fast_ops_per_elem=heads * (dots + 6 + 8 + 4 * 64 * pieces) + 64 * pieces * cast,
                           slow_ops_per_elem=0, instrs_per_chunk=heads * (5 * pieces + 14) + 6),
        ]

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, _, heads, dim, _ = problem.shape
        key_tile = int(knobs["chunk"])
        if dim % 16 or dim > 2040:   # fp32 key rows of whole 32 B blocks, a level-0 repeat stride <= 255 blocks
            raise PlanInfeasible("index_head_dim", f"{dim} must be a multiple of 16 and <= 2040 (V4: 128)")
        if heads > 255:              # one level-0 repeat per head
            raise PlanInfeasible("index_n_heads", f"{heads} must be <= 255 (V4: 64)")
        if key_tile % 64 or key_tile > 255 or key_tile * 4 < heads * problem.dtype.itemsize:
            raise PlanInfeasible("key tile", f"{key_tile} keys must be a multiple of 64, <= 255 (one level-0 repeat "
                                             f"per key) and hold a row of dq")
        return {"dtype": problem.dtype, "heads": int(heads), "dim": int(dim), "key_tile": key_tile,
                "tile_rows": int(knobs["tile_rows"]), "buffers": int(knobs["buffers"]),
                "block_dim": int(knobs["block_dim"])}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """One batch row of (at most 64) queries over the cores, leaving a tail core; and two batch rows
        whose query rows straddle cores (dk partials from several cores per batch row) with a key
        count that is not a multiple of 16 (a short last key tile)."""
        batch, seq, heads, dim, entries = problem.shape
        s1, t1 = min(seq, 64), min(entries, 256)
        t2 = t1 + 5 if t1 % 16 == 0 else t1
        return [Problem(problem.op, problem.variant, (1, s1, heads, dim, t1), problem.dtype),
                Problem(problem.op, problem.variant, (2, min(seq, knobs["block_dim"] // 2 + 3), heads, dim, t2),
                        problem.dtype)]

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""

        q, k = inputs["q"].contiguous(), inputs["k"].contiguous()
        hidden, proj = inputs["hidden"], inputs["proj"]
        batch, seq, heads, dim = q.shape
        entries = k.shape[1]
        rows = batch * seq
        block_rows, block_dim = row_split(rows, knobs["block_dim"])
        tiling = bytearray(struct.pack("<10If", rows, seq, entries, batch, block_rows, block_dim, knobs["chunk"],
                                       knobs["tile_rows"], -(-entries // knobs["chunk"]) * knobs["chunk"], -(-batch * entries // block_dim),
                                       dim ** -0.5))
        w = self.spec.weights(hidden, proj, heads).contiguous()
        score = torch.full((batch, seq, entries), float("nan"))
        fwd_bufs = [to_bytes(q), to_bytes(k), to_bytes(w), to_bytes(score), bytearray(32), tiling]
        fwd = emulator.run(emu.exe("ak_indexer_score_fwd", 6), block_dim, fwd_bufs)
        dq, dk, dw = (torch.full_like(t, float("nan")) for t in (q, k, w))
        g = grad_out["y"].float().contiguous()
        bwd_bufs = [to_bytes(q), to_bytes(k), to_bytes(w), to_bytes(g), to_bytes(dq), to_bytes(dk), to_bytes(dw),
                    bytearray(block_dim * batch * entries * dim * 4), bytearray(tiling)]
        bwd = emulator.run(emu.exe("ak_indexer_score_bwd", 9), block_dim, bwd_bufs)
        dq, dk, dw = (from_bytes(bwd_bufs[4 + i], t) for i, t in enumerate((dq, dk, dw)))
        dw = dw * heads**-0.5   # back through the scaling and the projection (torch, as run_backward does)
        grads = {"q": dq, "k": dk, "hidden": (dw.to(hidden.dtype) @ proj).to(hidden.dtype),
                 "proj": dw.reshape(-1, heads).t() @ hidden.reshape(-1, hidden.shape[-1])}
        return {"y": from_bytes(fwd_bufs[3], score)}, grads, {"forward": fwd, "backward": bwd}


PARTS = (IndexerScoreAscend(SPEC),)
