"""The AscendC kernel of adamw (templates/ascendc/): its planner phases, template values and emulator run."""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from .... import emulator
from ....emulator import from_bytes, to_bytes
from ....ops.adamw import ELEMS_PER_ROW, HYPER, SPEC
from ....ops.base import Problem, Tensors
from ....planner.ascend import AscendRowPhase, row_split
from ..kernel import AscendKernel


class AdamWAscend(AscendKernel):
    # --- AscendC (templates/ascendc/adamw/) ----------------------------------------------------
    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        return max(1, math.ceil(problem.shape[0] / ELEMS_PER_ROW)), ELEMS_PER_ROW

    def phases(self, problem: Problem):
        # p, g, m, v in; p, m, v out; 13 vector passes of which Sqrt and Div are slow
        return [AscendRowPhase("update", 4, 3, 0, 0, 0, 2, fast_ops_per_elem=11, slow_ops_per_elem=2,
                               instrs_per_chunk=13)]

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"row_elems": ELEMS_PER_ROW, "tile_rows": int(knobs["tile_rows"]), "buffers": int(knobs["buffers"]),
                "chunk": int(knobs["chunk"]), "block_dim": int(knobs["block_dim"])}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Sizes that leave a short last row on a tail core, a short tail tile, and fewer elements
        than one row."""
        n = problem.shape[0]
        rows_tail = (2 * knobs["block_dim"] + 3) * ELEMS_PER_ROW + 13
        return [Problem(problem.op, problem.variant, (min(n, rows_tail),), problem.dtype),
                Problem(problem.op, problem.variant, (min(n, 100),), problem.dtype)]

    @staticmethod
    def tiling(n: int, knobs: dict[str, int], step: int, hyper: dict = HYPER) -> bytearray:
        """AkAdamWTiling for n elements at step `step`, as the tiling header's AkAdamWMakeTiling makes it: the
        moments' factors and the decay in fp32 arithmetic, the bias corrections in double."""
        beta1, beta2 = hyper["betas"]
        f32 = np.float32
        block_rows = row_split(math.ceil(n / ELEMS_PER_ROW), knobs["block_dim"])[0]
        return bytearray(struct.pack("<4I7f", n, block_rows * ELEMS_PER_ROW, knobs["tile_rows"] * ELEMS_PER_ROW, knobs["chunk"],
                                     f32(1) - f32(hyper["lr"]) * f32(hyper["weight_decay"]), f32(1) - f32(beta1), beta2,
                                     f32(1) - f32(beta2), hyper["eps"], hyper["lr"] / (1 - beta1 ** step),
                                     1 / math.sqrt(1 - beta2 ** step)))

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """The update in the emulator: ({p, m, v}, {}, {"update": RunReport})."""


        (n,) = inputs["p"].shape
        block_dim = row_split(math.ceil(n / ELEMS_PER_ROW), knobs["block_dim"])[1]
        tiling = self.tiling(n, knobs, self.spec.step)
        outs = {k: torch.full((n,), float("nan")) for k in ("p", "m", "v")}
        bufs = [to_bytes(inputs[k]) for k in ("p", "g", "m", "v")] + [to_bytes(outs[k]) for k in ("p", "m", "v")]
        bufs += [bytearray(32), bytearray(tiling)]
        report = emulator.run(emu.exe("fwd", 9), block_dim, bufs)
        return {k: from_bytes(bufs[4 + i], outs[k]) for i, k in enumerate(("p", "m", "v"))}, {}, {"update": report}


PARTS = (AdamWAscend(SPEC),)
