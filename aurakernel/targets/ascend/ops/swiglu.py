"""The AscendC kernel of swiglu (templates/ascendc/): its planner phases, template values and emulator run."""

from __future__ import annotations

import struct

import torch

from .... import emulator
from ....dtypes import DType
from ....emulator import from_bytes, to_bytes
from ....ops.base import Problem, Tensors
from ....ops.swiglu import LIMIT, SPEC
from ....planner.ascend import AscendRowPhase, row_split, ub_pitch
from ..kernel import AscendKernel


class SwigluAscend(AscendKernel):
    # --- AscendC (templates/ascendc/swiglu/) ---------------------------------------------------
    def phases(self, problem: Problem):
        cast = 0 if problem.dtype is DType.fp32 else 1
        return [
            # casts in (2) and out; Mins, Mins, Maxs, Muls, Adds, Mul; Exp and Div
            AscendRowPhase("forward", 2, 1, 0, 0, 0, 3, fast_ops_per_elem=6 + 3 * cast, slow_ops_per_elem=2,
                           instrs_per_chunk=8 + 3 * cast),
            # 3 loads, 2 stores; 3 compares, 3 selects, 2 Mins, Maxs, 2 Muls, 3 Adds, 6 Muls; Exp and
            # Reciprocal. 5 fp32 chunks plus two bit masks (counted as one more chunk)
            AscendRowPhase("backward", 3, 2, 0, 0, 0, 6, fast_ops_per_elem=20 + 5 * cast,
                           slow_ops_per_elem=2, instrs_per_chunk=22),
        ]

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "inter": int(problem.shape[1]), "limit": float(LIMIT),
                "tile_rows": int(knobs["tile_rows"]), "buffers": int(knobs["buffers"]), "chunk": int(knobs["chunk"]),
                "block_dim": int(knobs["block_dim"])}

    @staticmethod
    def tiling(dtype: DType, rows: int, inter: int, knobs: dict[str, int], limit: float = LIMIT) -> bytearray:
        """AkSwigluTiling for rows of gate_up [rows, 2 inter], as the tiling header's AkSwigluMakeTiling makes it."""
        return bytearray(struct.pack("<6If", rows, inter, ub_pitch(inter, dtype.itemsize), row_split(rows, knobs["block_dim"])[0],
                                     knobs["tile_rows"], knobs["chunk"], limit))

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""

        gate_up = inputs["gate_up"]
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        block_dim = row_split(rows, knobs["block_dim"])[1]
        tiling = self.tiling(problem.dtype, rows, inter, knobs)
        y = torch.full((rows, inter), float("nan")).to(gate_up.dtype)
        fwd_bufs = [to_bytes(gate_up), to_bytes(y), bytearray(32), tiling]
        fwd = emulator.run(emu.exe("fwd", 4), block_dim, fwd_bufs)
        dgu = torch.full_like(gate_up, float("nan"))
        bwd_bufs = [to_bytes(gate_up), to_bytes(grad_out["y"].to(gate_up.dtype)), to_bytes(dgu), bytearray(32),
                    bytearray(tiling)]
        bwd = emulator.run(emu.exe("bwd", 5), block_dim, bwd_bufs)
        return ({"y": from_bytes(fwd_bufs[1], y)}, {"gate_up": from_bytes(bwd_bufs[2], dgu)},
                {"forward": fwd, "backward": bwd})


PARTS = (SwigluAscend(SPEC),)
