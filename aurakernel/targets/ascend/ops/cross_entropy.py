"""The AscendC kernel of cross_entropy (templates/ascendc/): its planner phases, template values and emulator run."""

from __future__ import annotations

import struct

import torch

from .... import emulator
from ....dtypes import DType
from ....emulator import from_bytes, to_bytes
from ....ops.base import Problem, Tensors
from ....ops.cross_entropy import IGNORE, SPEC
from ....planner.ascend import AscendRowPhase, row_split
from ....planner.schedule import phase_schedule
from ..kernel import AscendKernel


class CrossEntropyAscend(AscendKernel):
    # --- AscendC (templates/ascendc/cross_entropy/): a row streams through the UB in column tiles --
    split_cols = True

    # planner/schedule.py: the forward reads its running max and sum back on the scalar unit every
    # chunk (a copy issued after that compute step cannot run under it), the backward only at the label
    compute_waits_scalar = {"forward": True, "backward": False}

    def phases(self, problem: Problem):
        cast = 0 if problem.dtype is DType.fp32 else 1
        return [
            # label in, loss and lse out per row; cast, ReduceMax, Adds, ReduceSum; Exp
            AscendRowPhase("forward", 1, 0, 8, 8, 0, 1, fast_ops_per_elem=3 + cast, slow_ops_per_elem=1,
                           instrs_per_chunk=8 + cast),
            # label and lse in per row; cast, Adds, Muls, cast; Exp
            AscendRowPhase("backward", 1, 1, 12, 0, 0, 1, fast_ops_per_elem=2 + 2 * cast, slow_ops_per_elem=1,
                           instrs_per_chunk=4 + 2 * cast),
        ]

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        fwd = phase_schedule(knobs, "forward", ("in",))
        bwd = phase_schedule(knobs, "backward", ("in", "out"))
        return {"dtype": problem.dtype, "vocab": int(problem.shape[1]), "col_tile": int(knobs["col_tile"]),
                "chunk": int(knobs["chunk"]), "block_dim": int(knobs["block_dim"]),
                "fwd_prefetch": fwd["prefetch"], "fwd_in_buffers": fwd["in_buffers"],
                "bwd_prefetch": bwd["prefetch"], "bwd_in_buffers": bwd["in_buffers"],
                "bwd_out_buffers": bwd["out_buffers"]}

    @staticmethod
    def tiling(rows: int, vocab: int, knobs: dict[str, int], scale: float) -> bytearray:
        """AkCrossEntropyTiling for rows x vocab logits, as the tiling header's AkCrossEntropyMakeTiling makes it."""
        return bytearray(struct.pack("<5Iif", rows, vocab, row_split(rows, knobs["block_dim"])[0], knobs["col_tile"],
                                     knobs["chunk"], IGNORE, scale))

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""

        logits, labels = inputs["logits"], inputs["labels"].to(torch.int64)
        rows, vocab = logits.shape
        block_dim = row_split(rows, knobs["block_dim"])[1]
        valid = max(int((labels != IGNORE).sum()), 1)
        scale = float(grad_out["loss"]) / valid

        loss_rows, lse = torch.full((rows,), float("nan")), torch.full((rows,), float("nan"))
        fwd_bufs = [to_bytes(logits), to_bytes(labels), to_bytes(loss_rows), to_bytes(lse), bytearray(32),
                    self.tiling(rows, vocab, knobs, 1.0)]
        fwd = emulator.run(emu.exe("fwd", 6), block_dim, fwd_bufs)
        loss_rows, lse = from_bytes(fwd_bufs[2], loss_rows), from_bytes(fwd_bufs[3], lse)
        dlogits = torch.full_like(logits, float("nan"))
        bwd_bufs = [to_bytes(logits), to_bytes(labels), to_bytes(lse), to_bytes(dlogits), bytearray(32),
                    self.tiling(rows, vocab, knobs, scale)]
        bwd = emulator.run(emu.exe("bwd", 6), block_dim, bwd_bufs)
        return ({"loss": loss_rows.sum() / valid, "loss_rows": loss_rows, "lse": lse},
                {"logits": from_bytes(bwd_bufs[3], dlogits)}, {"forward": fwd, "backward": bwd})


PARTS = (CrossEntropyAscend(SPEC),)
