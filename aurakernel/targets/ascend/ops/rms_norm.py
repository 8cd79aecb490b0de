"""The AscendC kernel of rms_norm (templates/ascendc/): its planner phases, template values and emulator run.

Where the time goes (ascend910b2, bf16, `python -m benchmarks.ascend`): weighted 8192x4096 at its HBM
bound both ways. Unweighted 8192x16384 (the mHC width): forward at its bound; backward 643 / 504 us,
single-buffered (dy and x rows of 32 KB in and dx out do not fit the UB twice), so a tile's copies and
its vector work (8 passes an element: two casts in, g x accumulated, a Muls and an Axpy for dx, the
cast out) take turns. Before the sums were accumulated lane-wise and dx written as s g - c x, the
backward made 14 passes and a scalar stall per chunk (774 us).

Narrow rows (V4's per-head q norm and kv norm: 512 wide, 64 heads a token) were issue-bound: the chunk
loop issued ~10 vector instructions a row and read each row's sum back on the scalar unit (a stop of the
pipes a row), ~166 vector cycles a 512-wide row against ~55 of its HBM share. A row whose UB pitch fits a
level-0 repeat stride (<= 2040 fp32) now runs the whole tile per instruction (template: Narrow): 65536x512
unweighted 308 -> 226 us (forward at its HBM bound, backward 1.13x; was 1.47x of the op's bound).
"""

from __future__ import annotations

import struct

import torch

from .... import emulator
from ....dtypes import DType
from ....emulator import from_bytes, to_bytes
from ....ops.base import Problem, Tensors
from ....ops.rms_norm import EPS, SPEC
from ....planner.ascend import AscendRowPhase, row_split, ub_pitch
from ....planner.schedule import phase_schedule
from ..kernel import AscendKernel


class RmsNormAscend(AscendKernel):
    # templates/ascendc/rms_norm/
    # planner/schedule.py: both passes read row sums back on the scalar unit, so a copy issued after
    # a tile's compute step cannot run under it
    compute_waits_scalar = {"forward": True, "backward": True}

    NARROW_PITCH = 2040   # rows of at most this UB pitch are computed a whole tile at a time (rendered into the template)

    def narrow(self, problem: Problem) -> bool:
        """Whether the kernel computes whole tiles (its rows' fp32 32 B blocks fit a level-0 repeat stride)."""
        return ub_pitch(problem.shape[1], problem.dtype.itemsize) <= self.NARROW_PITCH

    def phases(self, problem: Problem):
        cols = problem.shape[1]
        weighted = problem.variant == "weighted"
        cast = 0 if problem.dtype is DType.fp32 else 1
        if self.narrow(problem):
            segs = -(-cols // 64)   # a row's 64-lane segments: a level-0 instruction each, repeated over the rows
            # beside the tiles, for up to 64 rows: the forward's rstd blocks (8 floats a row), the
            # backward's c and its and rstd's blocks (17); and the fp32 tiles' rows at the UB pitch of
            # the dtype (16-bit: 64 B), up to 32 B a row more than the model's fp32 row
            fwd_rows = 64 * 4 * 8 + 64 * 32 * (1 + cast)
            bwd_rows = 64 * 4 * 17 + 64 * 32 * (1 + 2 * cast)
            return [
                # casts, x^2, the segments folded, rstd (4 on the rows), its blocks, y = x rstd (* gamma), cast
                AscendRowPhase("forward", 1, 1, 0, 4, cols * 4 * weighted + fwd_rows, 0,
                               fast_ops_per_elem=3 + 2 * cast + weighted, slow_ops_per_elem=0, instrs_per_chunk=0,
                               f32_tiles=1 + cast, instrs_per_tile=2 * cast + 2 * segs + 8 + weighted * segs),
                # 2 casts, (dy x, xhat, the rows halved, dgamma, g = dy gamma), g x, folded, c (4 on the rows),
                # two blocks, s g, c x, their sum, cast
                AscendRowPhase("backward", 2, 1, 4, 0, cols * 8 * weighted + bwd_rows, 0,
                               fast_ops_per_elem=5 + 3 * cast + 4 * weighted, slow_ops_per_elem=0, instrs_per_chunk=0,
                               f32_tiles=1 + 2 * cast, instrs_per_tile=3 * cast + 4 * segs + 10 + weighted * (2 * segs + 9)),
            ]
        return [
            # pass 1: cast, x^2 accumulated (one ReduceSum a row); pass 2: cast, Muls rstd, (Mul gamma), cast
            AscendRowPhase("forward", 1, 1, 0, 4, cols * 4 if weighted else 0, 2,
                           fast_ops_per_elem=2 + 3 * cast + weighted, slow_ops_per_elem=0,
                           instrs_per_chunk=2 + 3 * cast + weighted),
            # pass 1: 2 casts, g x accumulated (weighted: dy x, Axpy into dgamma, times gamma accumulated);
            # pass 2: 2 casts, (Mul gamma), Muls rstd, Axpy x, cast
            AscendRowPhase("backward", 2, 1, 4, 0, cols * 8 if weighted else 0, 3,
                           fast_ops_per_elem=3 + 5 * cast + 3 * weighted, slow_ops_per_elem=0,
                           instrs_per_chunk=3 + 5 * cast + 3 * weighted),
        ]

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        fwd = phase_schedule(knobs, "forward", ("in", "out"))
        bwd = phase_schedule(knobs, "backward", ("in", "out"))
        return {"dtype": problem.dtype, "cols": int(problem.shape[1]), "weighted": problem.variant == "weighted",
                "tile_rows": int(knobs["tile_rows"]), "chunk": int(knobs["chunk"]),
                "block_dim": int(knobs["block_dim"]), "eps": float(EPS), "narrow_pitch": int(self.NARROW_PITCH),
                "fwd_prefetch": fwd["prefetch"], "fwd_in_buffers": fwd["in_buffers"], "fwd_out_buffers": fwd["out_buffers"],
                "bwd_prefetch": bwd["prefetch"], "bwd_in_buffers": bwd["in_buffers"], "bwd_out_buffers": bwd["out_buffers"]}

    @staticmethod
    def tiling(dtype: DType, rows: int, cols: int, knobs: dict[str, int], eps: float = EPS) -> bytearray:
        """AkRmsNormTiling for rows x cols, as the tiling header's AkRmsNormMakeTiling makes it."""
        return bytearray(struct.pack("<6I2f", rows, cols, ub_pitch(cols, dtype.itemsize), row_split(rows, knobs["block_dim"])[0],
                                     knobs["tile_rows"], knobs["chunk"], eps, 1.0 / cols))

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""

        x = inputs["x"]
        rows, cols = x.shape
        weighted = problem.variant == "weighted"
        gamma = (inputs["weight"] if weighted else torch.ones(cols)).float()
        block_dim = row_split(rows, knobs["block_dim"])[1]
        tiling = self.tiling(problem.dtype, rows, cols, knobs)
        y = torch.full_like(x, float("nan"))
        rstd = torch.full((rows,), float("nan"))
        fwd_bufs = [to_bytes(x), to_bytes(gamma), to_bytes(y), to_bytes(rstd), bytearray(32), tiling]
        fwd = emulator.run(emu.exe("fwd", 6), block_dim, fwd_bufs)
        y, rstd = from_bytes(fwd_bufs[2], y), from_bytes(fwd_bufs[3], rstd)
        dy = grad_out["y"].to(x.dtype)
        dx = torch.full_like(x, float("nan"))
        dgamma = torch.full((block_dim, cols), float("nan"))
        bwd_bufs = [to_bytes(dy), to_bytes(x), to_bytes(gamma), to_bytes(rstd), to_bytes(dx), to_bytes(dgamma),
                    bytearray(32), bytearray(tiling)]
        bwd = emulator.run(emu.exe("bwd", 8), block_dim, bwd_bufs)
        grads = {"x": from_bytes(bwd_bufs[4], dx)}
        if weighted:
            grads["weight"] = from_bytes(bwd_bufs[5], dgamma).sum(0)   # the cores' partials
        return {"y": y, "rstd": rstd}, grads, {"forward": fwd, "backward": bwd}


PARTS = (RmsNormAscend(SPEC),)
