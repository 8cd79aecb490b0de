"""The AscendC kernel of rope (templates/ascendc/): its planner phases, template values and emulator run."""

from __future__ import annotations

import struct

import torch

from .... import emulator
from ....emulator import from_bytes, to_bytes
from ....errors import UserError
from ....ops.base import Problem, Tensors
from ....ops.rope import SPEC
from ....planner.ascend import AscendRowPhase, row_split, ub_pitch
from ..kernel import AscendKernel


def ascend_tiling(shape, x_strides, cs_strides, rope_dim: int, itemsize: int,
                  knobs: dict[str, int]) -> tuple[bytearray, int]:
    """AkRopeTiling (templates/ascendc/rope/tiling.h.j2) for x [B, H, S, D] with element strides
    x_strides and cos/sin [B, S, R/2] fp32 with strides cs_strides; and the cores it runs on. The
    tiling header's AkRopeMakeTiling, which the binding and the CANN host code call, makes the same."""

    b, h, s, d = shape
    rope_pitch = -(-rope_dim // 16) * 16                 # UB row pitch of the rope slice: 32 B in T and in fp32
    cos_pitch = rope_pitch // 2
    # rows per compute group: a fp32 work chunk; Brcb's repeats (8 cos per repeat) stay <= 255
    group = max(1, min(knobs["chunk"] // rope_pitch, 2040 // cos_pitch))
    work = -(-group * rope_pitch // 64) * 64
    block_rows, block_dim = row_split(b * h * s, knobs["block_dim"])
    fields = [b, h, s, d, rope_dim, d - rope_dim, ub_pitch(d - rope_dim, itemsize), rope_pitch, cos_pitch, block_rows,
              knobs["tile_rows"], group, work, x_strides[0], x_strides[1], x_strides[2],
              cs_strides[0] if b > 1 else 0, cs_strides[1]]   # one batch row of cos/sin: the binding's broadcast stride 0
    if any(not 0 <= int(f) < 2 ** 32 for f in fields):
        raise ValueError(f"rope tiling field out of uint32 range: {fields}")
    return bytearray(struct.pack(f"<{len(fields)}I", *map(int, fields))), block_dim


class RopeAscend(AscendKernel):
    # --- AscendC (templates/ascendc/rope/): (token, head) rows over the vector cores ------------
    # The interleaved pair swap needs each element's partner x[j ^ 1]: a vector Gather by a byte-offset
    # table made once (lane j reads lane j ^ 1), and rotate_half's sign a Mul by a +-1 table, so the
    # rope slice is read once. cos/sin (one per pair) are widened to both lanes of their pair with
    # Brcb and block-strided level-0 copies.
    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        tokens, heads, head_dim, _ = problem.shape
        return tokens * heads, head_dim

    def phases(self, problem: Problem):
        _, heads, head_dim, rope_dim = problem.shape
        e = problem.dtype.itemsize
        # per row: the row in (nope + rope slice), out; cos/sin once per position for all heads (rows
        # run (b, s-tile, h, s)), a share of it per row. Vector work only
        # on the rope slice: ~22 instructions per group of rows (cast in, Gather (a slow op), 3 Mul,
        # Add, cast out; per cos and sin: Brcb, 4 strided copies, 3 Selects), each pass over rope_dim
        # fp32 lanes; Brcb writes 8 lanes per cos element. Work buffers (fp32 chunks): x, its swap,
        # the offset and sign tables, 4 widened copies, cos and sin, the Brcb blocks (4 chunks) and
        # the lane masks (1).
        frac = rope_dim / head_dim
        ops = 21 * frac + 2 * 8 * frac / 2
        instrs = max(1, round(22 * (-(-rope_dim // 16) * 16) / head_dim))
        phase = dict(streams_in=1, streams_out=1, small_in_bytes=-(-rope_dim * 4 // heads), small_out_bytes=0,
                     resident_bytes=0, work_buffers=15, fast_ops_per_elem=ops, slow_ops_per_elem=frac,
                     instrs_per_chunk=instrs)
        return [AscendRowPhase("forward", **phase), AscendRowPhase("backward", **phase)]

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, heads, head_dim, rope_dim = problem.shape
        if rope_dim >= head_dim or rope_dim < 2:
            raise UserError(f"rope shape {problem.shape_text}: the AscendC kernel needs 2 <= ROPE_DIM < HEAD_DIM "
                            "(a nope part to copy through)")
        return {"dtype": problem.dtype, "heads": int(heads), "head_dim": int(head_dim), "rope_dim": int(rope_dim),
                "tile_rows": int(knobs["tile_rows"]), "buffers": int(knobs["buffers"]), "chunk": int(knobs["chunk"]),
                "block_dim": int(knobs["block_dim"])}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Tokens that leave a tail core and (b, h) runs longer than a tile; then one more head, a
        head width that is not a multiple of 16 and a rope slice that is not either."""
        tokens, heads, head_dim, rope_dim = problem.shape
        t1 = min(tokens, knobs["tile_rows"] + 5)
        if t1 % knobs["block_dim"] == 0 and t1 > 1:
            t1 -= 1
        r2 = rope_dim - 2 if rope_dim % 16 == 0 and rope_dim > 2 else rope_dim
        return [Problem(problem.op, problem.variant, (t1, heads, head_dim, rope_dim), problem.dtype),
                Problem(problem.op, problem.variant, (min(tokens, 7), heads + 1, head_dim + 3, r2), problem.dtype)]

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""
        x, cos, sin = inputs["x"], inputs["cos"], inputs["sin"]
        b, h, s, d = x.shape
        half = cos.shape[-1]
        c32 = cos.float().expand(b, s, half).contiguous()
        s32 = sin.float().expand(b, s, half).contiguous()
        outs, reports = {}, {}
        dy = grad_out["y"].to(x.dtype)
        for phase, entry, src in (("forward", "fwd", x), ("backward", "bwd", dy)):
            if src.stride(-1) != 1 or (s > 1 and src.stride(2) < d):
                src = src.contiguous()
            # the strided tensor's storage span: the kernel walks it with the strides in the tiling
            extent = sum((n - 1) * st for n, st in zip(src.shape, src.stride())) + 1
            span = torch.as_strided(src, (extent,), (1,), src.storage_offset())
            tiling, block_dim = ascend_tiling(src.shape, src.stride(), c32.stride(), 2 * half, problem.dtype.itemsize,
                                              knobs)
            y = torch.full((b, h, s, d), float("nan")).to(x.dtype)
            bufs = [to_bytes(span), to_bytes(c32), to_bytes(s32), to_bytes(y), bytearray(32), tiling]
            reports[phase] = emulator.run(emu.exe(entry, 6), block_dim, bufs)
            outs[phase] = from_bytes(bufs[3], y)
        return {"y": outs["forward"]}, {"x": outs["backward"]}, reports


PARTS = (RopeAscend(SPEC),)
