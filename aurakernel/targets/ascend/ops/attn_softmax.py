"""The AscendC kernel of attn_softmax (templates/ascendc/): its planner phases, template values and emulator run.

Where the time goes (ascend910b2, 1x64x256x640 bf16, 342 rows per vector core; `python -m
benchmarks.ascend`): 82.4 us against an HBM bound of 67.1 (1.23x).
- forward (35.9 / 26.9 us, 16-row tiles): the vector unit. Per score: the cast in, the scale, the bf16
  round trip torch's scaled scores need, the mask, max, the subtraction, Exp (4 cycles a repeat), sum,
  the normalisation and the cast out, ~14.4 fp32 passes, plus ~30 instructions a tile. The row steps
  run whole-tile (RowSteps): before, a step was one instruction per row or per 64-lane column
  (44.8 us at 8 rows).
- backward (46.5 / 40.3 us, 8-row tiles: a third fp32 tile leaves no room for 16): near its HBM
  bound, MTE2 the busiest pipe (x, dp and lse in; a position's mask row once).
"""

from __future__ import annotations

import math
import struct

import torch

from .... import emulator
from ....dtypes import DType
from ....emulator import from_bytes, to_bytes
from ....ops.attn_softmax import AIV_MAX, SCALING, SPEC, _mask_rows
from ....ops.base import Problem, Tensors
from ....planner.ascend import AscendRowPhase, VectorWork, cast_passes, row_split
from ....planner.schedule import phase_schedule
from ..kernel import AscendKernel


def ascend_tiling(shape, has_mask: bool, msb: int, mss: int, knobs: dict[str, int], scaling: float,
                  tile_rows: int) -> tuple[bytearray, int]:
    """AkAttnSoftmaxTiling (templates/ascendc/attn_softmax/tiling.h.j2) for scores [B, H, S, K],
    mask rows at b * msb + s * mss (fp32) and tiles of `tile_rows` rows (the forward's and the
    backward's are knobs of their own); and the cores it runs on. The host tiling function computes
    the same fields."""

    batch, heads, seq, keys = shape
    pitch = -(-keys // 64) * 64                # UB row pitch: whole 256 B repeats in fp32
    block_rows, block_dim = row_split(batch * heads * seq, knobs["block_dim"])
    fields = [batch, heads, seq, keys, pitch, block_rows, tile_rows, int(has_mask), msb, mss,
              -(-heads // 8) * 8, block_dim]
    if any(not 0 <= int(f) < 2 ** 32 for f in fields):
        raise ValueError(f"attn_softmax tiling field out of uint32 range: {fields}")
    return bytearray(struct.pack(f"<{len(fields)}If", *map(int, fields), scaling)), block_dim


# RowSteps' whole-tile form (kernel.cpp.j2): per repeat of a tile a 32 B broadcast block, a spread value
# and its gather offset, as a share of the tile's fp32 bytes (32 + 4 + 4 B per 256 B)
ROW_STEP_TILES = 40 / 256


class AttnSoftmaxAscend(AscendKernel):
    syncs_cores = True   # its blocks meet in SyncAll
    # --- AscendC (templates/ascendc/attn_softmax/): rows over the vector cores in (b, s, h) order -
    # a tile is up to tile_rows heads of one query position, so they share its mask row (copied once
    # per position and spread over a tile's rows in fp32: added with one instruction a tile; the
    # copy is modelled per tile); every row is softmaxed whole in fp32 (tile-wide fp32 buffers: z,
    # the spread mask, and dp in the backward, are f32_tiles) on
    # the vector unit alone: a row-wise step is a few instructions a tile (RowSteps' whole-tile form).
    # The backward's d sinks go through the scalar unit where a tile's first head is not 32 B aligned.
    compute_waits_scalar = {"forward": False, "backward": True}

    def phases(self, problem: Problem):
        batch, heads, seq, keys = problem.shape
        cast = 0 if problem.dtype is DType.fp32 else 1
        hp = -(-heads // 8) * 8
        mask = -(-keys // 64) * 256                              # the mask row a tile's rows share (whole repeats)
        vecs = 12 * 64 * 4 + 64 * 4                                # per-row vectors, their broadcast, gather offsets
        return [
            # tile-wide: casts in (3) and out, Muls scale, Exp, and the row steps in RowSteps' whole-tile
            # form (an instruction or three and a pass over the tile each: max, the subtraction, sum, the
            # normalisation); a mask row spread once per position
            AscendRowPhase("forward", 1, 1, 0, 4, hp * 4 + vecs, 0, fast_ops_per_elem=3 + 5 + 3 * cast,
                           slow_ops_per_elem=1, instrs_per_chunk=1, f32_tiles=2 + ROW_STEP_TILES, tile_in_bytes=mask,
                           instrs_per_tile=26),
            # recompute z (as forward) and p (the subtraction of lse, Exp), cast dp, p dp and its row sum,
            # p dot, the difference, scale, cast out; resident besides: the sinks, the d sinks accumulator
            # and every core's partials (core 0 reduces them)
            # (its rows a knob of their own: a third fp32 tile and a second stream leave it less UB)
            AscendRowPhase("backward", 2, 1, 4, 0, 2 * hp * 4 + AIV_MAX * hp * 4 + vecs, 0,
                           fast_ops_per_elem=3 + 7 + 5 * cast, slow_ops_per_elem=1, instrs_per_chunk=1,
                           f32_tiles=3 + ROW_STEP_TILES, tile_in_bytes=mask, instrs_per_tile=28, own_tile_rows=True),
        ]

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        """Rows of the kernel's pitch: K rounded up to whole 64-lane fp32 repeats."""
        batch, heads, seq, keys = problem.shape
        return batch * heads * seq, -(-keys // 64) * 64

    def vector_floor(self, problem: Problem) -> dict[str, VectorWork]:
        """Per score (16-bit dtypes cast once each way): forward the scale, the max, the subtraction,
        the exponential (slow), the sum and the normalisation; backward dp . p, dp - dot, the product
        with p and the scale. Below the HBM traffic of 2 (forward) / 3 (backward) elements moved."""
        elems, c = math.prod(problem.shape), cast_passes(problem.dtype)
        return {"forward": VectorWork(elems * (5 + 2 * c), elems), "backward": VectorWork(elems * (4 + 3 * c))}

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        fwd = phase_schedule(knobs, "forward", ("in", "out"))
        bwd = phase_schedule(knobs, "backward", ("in", "out"))
        return {"dtype": problem.dtype, "heads": int(problem.shape[1]), "keys": int(problem.shape[3]),
                "scaling": float(SCALING), "tile_rows": int(knobs["tile_rows"]),
                "bwd_tile_rows": int(knobs["backward_tile_rows"]), "block_dim": int(knobs["block_dim"]),
                "fwd_prefetch": fwd["prefetch"], "fwd_in_buffers": fwd["in_buffers"], "fwd_out_buffers": fwd["out_buffers"],
                "bwd_prefetch": bwd["prefetch"], "bwd_in_buffers": bwd["in_buffers"], "bwd_out_buffers": bwd["out_buffers"]}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """One batch whose rows leave a tail core and (b, s) runs of heads longer than a tile; then
        two batches of two query positions (strided tiles), one more head and a key width that is not
        a multiple of 16 (narrower than the plan's: its rows' pitch must fit the plan's UB)."""
        batch, heads, seq, keys = problem.shape
        return [Problem(problem.op, problem.variant, (1, heads, min(seq, 5), keys), problem.dtype),
                Problem(problem.op, problem.variant, (2, heads + 1, 2, keys - 3 if keys > 3 else keys), problem.dtype)]

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport}). The
        saved lse is indexed in the kernel's (b, s, h) row order."""
        s = inputs["scores"].contiguous()
        batch, heads, seq, keys = s.shape
        mask, msb, mss = _mask_rows(inputs["mask"], s)
        mask_bytes = to_bytes(mask) if mask is not None else bytearray(32)
        sinks = inputs["sinks"].float().contiguous()
        scaling = float(inputs.get("scaling", SCALING))
        tiling, block_dim = ascend_tiling(s.shape, mask is not None, msb, mss, knobs, scaling, knobs["tile_rows"])
        bwd_tiling, _ = ascend_tiling(s.shape, mask is not None, msb, mss, knobs, scaling, knobs["backward_tile_rows"])
        rows = batch * heads * seq
        probs = torch.full_like(s, float("nan"))
        lse = torch.full((rows,), float("nan"))
        fwd_bufs = [to_bytes(s), mask_bytes, to_bytes(sinks), to_bytes(probs), to_bytes(lse), bytearray(32), tiling]
        fwd = emulator.run(emu.exe("fwd", 7), block_dim, fwd_bufs)
        hp = -(-heads // 8) * 8
        dscores, dsinks = torch.full_like(s, float("nan")), torch.full((heads,), float("nan"))
        bwd_bufs = [to_bytes(s), bytearray(mask_bytes), to_bytes(sinks), fwd_bufs[4],
                    to_bytes(grad_out["probs"].to(s.dtype)), to_bytes(dscores), to_bytes(dsinks),
                    bytearray(4 * hp * block_dim), bwd_tiling]
        bwd = emulator.run(emu.exe("bwd", 9), block_dim, bwd_bufs)
        return ({"probs": from_bytes(fwd_bufs[3], probs)},
                {"scores": from_bytes(bwd_bufs[5], dscores), "sinks": from_bytes(bwd_bufs[6], dsinks)},
                {"forward": fwd, "backward": bwd})


PARTS = (AttnSoftmaxAscend(SPEC),)
