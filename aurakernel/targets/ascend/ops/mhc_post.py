"""The AscendC kernel of mhc_post (templates/ascendc/): its planner phases, template values and emulator run.

Where the time goes (ascend910b2, 8192 x 4 x 4096 bf16, 171 tokens per vector core; emulator cycles):
- forward: at its HBM bound (682k cycles: out and the HC streams in, HC streams out). Before, post and
  comb came in with every column tile (two of its four copies, 200 cycles of latency each) and the
  planner, counting the streams' one strided copy as HC copies, kept 512-element chunks, where the
  12-cycle issue of each of the 29 vector ops per chunk outweighed their 8 repeats: vector-bound at 793k.
- backward: vector-bound (1.27M against the 1.06M bound): per chunk 54 ops (casts, the Axpy chains of d
  out and d h, 20 MulAddDst of the dot products), and the 20 dot-product accumulators limit the chunk
  to 1024 elements in the UB.
"""

from __future__ import annotations

import struct

import torch

from .... import emulator
from ....dtypes import DType
from ....emulator import from_bytes, to_bytes
from ....ops.base import Problem, Tensors
from ....ops.mhc_post import SPEC
from ....planner.ascend import AscendRowPhase, VectorWork, cast_passes, row_split, ub_pitch
from ..kernel import AscendKernel


class MhcPostAscend(AscendKernel):
    # --- AscendC (templates/ascendc/mhc_post/): a token's streams go through in column tiles ----
    split_cols = True
    MIX_TOKENS = 64   # tokens whose post and comb one pair of copies brings in (the template's MIX_TOKENS)

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        return problem.shape[0], problem.shape[2]

    def phases(self, problem: Problem):
        hc = problem.shape[1]
        mix = 4 * (-(-hc // 8) * 8 + -(-hc * hc // 8) * 8)     # post and comb blocks, bytes
        mix_block = self.MIX_TOKENS * mix                        # resident: MIX_TOKENS tokens' blocks, copied in together
        return [
            # out + HC streams in (two copies: the streams' rows in one strided copy), HC out (one);
            # HC + 1 casts in, HC out; per output stream one Muls and HC Axpy
            AscendRowPhase("forward", 1 + hc, hc, 0, 0, mix_block, hc + 2, fast_ops_per_elem=2 * hc + 1 + hc * (1 + hc),
                           slow_ops_per_elem=0, instrs_per_chunk=2 * hc + 1 + hc * (1 + hc), copies_in=2, copies_out=1),
            # out, HC streams, HC gradients in (three copies); d out and HC d streams out (two);
            # 2 HC + 1 casts in, (1 + HC) sums
            # of HC products (a Muls and HC - 1 Axpy each), HC + HC^2 dot products accumulating their
            # lanes (one MulAddDst each per chunk; summed once per token into the gradient block, resident);
            # work: hf, df (HC each), of, acc and the HC + HC^2 lane accumulators
            AscendRowPhase("backward", 1 + 2 * hc, 1 + hc, 0, 0, mix + mix_block, 2 * hc + 2 + hc + hc * hc,
                           fast_ops_per_elem=(2 * hc + 1) + (hc + 1) * hc + (hc + hc * hc),
                           slow_ops_per_elem=0, instrs_per_chunk=(2 * hc + 1) + (hc + 1) * hc + (hc + hc * hc),
                           copies_in=3, copies_out=2),
        ]

    def vector_floor(self, problem: Problem) -> dict[str, VectorWork]:
        """Per output element (E = tokens x HC x D; 16-bit dtypes cast once each way): forward HC comb
        products and post * y; backward dx (HC products), d comb and d post (HC + 1 dot-product
        MulAdds) and dy (one). Far below the HBM traffic: the kernel is HBM-bound."""
        rows, hc, d = problem.shape
        c, elems, ys = cast_passes(problem.dtype), rows * hc * d, rows * d
        return {"forward": VectorWork(elems * (hc + 1 + 2 * c) + ys * c),
                "backward": VectorWork(elems * (2 * hc + 2 + 3 * c) + 2 * ys * c)}

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, hc, d = problem.shape
        return {"dtype": problem.dtype, "hc": int(hc), "d": int(d), "col_tile": int(knobs["col_tile"]),
                "buffers": int(knobs["buffers"]), "chunk": int(knobs["chunk"]), "block_dim": int(knobs["block_dim"]),
                "mix_tokens": int(self.MIX_TOKENS)}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Tokens that leave a tail core, and a width with a short last column tile that is not a
        multiple of 16 elements."""
        rows, hc, d = problem.shape
        return [Problem(problem.op, problem.variant, (min(rows, 2 * knobs["block_dim"] + 3), hc, d), problem.dtype),
                Problem(problem.op, problem.variant, (min(rows, knobs["block_dim"] + 5), hc, d + 3), problem.dtype)]

    @staticmethod
    def tiling(dtype: DType, rows: int, d: int, knobs: dict[str, int]) -> bytearray:
        """AkMhcPostTiling for `rows` tokens of width d, as the tiling header's AkMhcPostMakeTiling makes it."""
        col_tile = min(knobs["col_tile"], d)
        return bytearray(struct.pack("<6I", rows, d, ub_pitch(col_tile, dtype.itemsize), row_split(rows, knobs["block_dim"])[0],
                                     col_tile, knobs["chunk"]))

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""

        h = inputs["h"]
        rows, hc, d = h.shape
        block_dim = row_split(rows, knobs["block_dim"])[1]
        tiling = self.tiling(problem.dtype, rows, d, knobs)
        post, comb = inputs["post"].float().contiguous(), inputs["comb"].float().contiguous()
        y = torch.full_like(h, float("nan"))
        fwd_bufs = [to_bytes(post), to_bytes(comb), to_bytes(inputs["out"]), to_bytes(h), to_bytes(y), bytearray(32),
                    tiling]
        fwd = emulator.run(emu.exe("fwd", 7), block_dim, fwd_bufs)
        grads = {"post": torch.full_like(post, float("nan")), "comb": torch.full_like(comb, float("nan")),
                 "out": torch.full_like(inputs["out"], float("nan")), "h": torch.full_like(h, float("nan"))}
        bwd_bufs = [to_bytes(post), to_bytes(comb), to_bytes(inputs["out"]), to_bytes(h),
                    to_bytes(grad_out["y"].to(h.dtype))] + [to_bytes(grads[k]) for k in ("post", "comb", "out", "h")]
        bwd_bufs += [bytearray(32), bytearray(tiling)]
        bwd = emulator.run(emu.exe("bwd", 11), block_dim, bwd_bufs)
        grads = {k: from_bytes(bwd_bufs[5 + i], grads[k]) for i, k in enumerate(("post", "comb", "out", "h"))}
        return {"y": from_bytes(fwd_bufs[4], y)}, grads, {"forward": fwd, "backward": bwd}


PARTS = (MhcPostAscend(SPEC),)
