"""The AscendC kernel of router (templates/ascendc/): its planner phases, template values and emulator run."""

from __future__ import annotations

import math
import struct

import torch
from transformers.activations import ACT2FN

from .... import emulator
from ....emulator import from_bytes, to_bytes
from ....errors import UserError
from ....ops.base import Problem, Tensors
from ....ops.router import SCALE, SPEC
from ....planner.ascend import AscendRowPhase, row_split, ub_pitch
from ..kernel import AscendKernel


class RouterAscend(AscendKernel):
    # --- AscendC (templates/ascendc/router/): token rows split over the vector cores --------------
    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        return problem.shape[0], problem.shape[1]

    def phases(self, problem: Problem):
        """Per row of E experts; the fp32 copy of a tile and the compact [rows][L] fp32 tiles are
        counted as per-row side buffers (so per queue buffer: the UB estimate errs on the safe side)."""
        rows, experts, top_k = problem.shape
        e = problem.dtype.itemsize
        lanes, chunks = 32 // e, -(-experts // 64)
        vpitch = chunks * 64            # a row of s + bias in fp32: whole 64-lane repeats
        idx_bytes = -(-top_k * 8 // 32) * 32
        rounds = top_k + 1 if experts > top_k else top_k
        repeats = max(1.0, experts * 4 / 256)
        if problem.variant == "hash":   # the weights of the table's experts, from the logits; per row the
            # compact fp32 tile, four int32 gather tables, the gathered values (dtype) and the lane mask
            fwd = AscendRowPhase("forward", 1, 0, idx_bytes + 5 * lanes * 4 + lanes * e + lanes, lanes * e, 0, 0,
                                 fast_ops_per_elem=22 * lanes * 4 / 256 / repeats,
                                 slow_ops_per_elem=5 * lanes * 4 / 256 / repeats, instrs_per_chunk=0)
        else:   # K + 1 rounds of 3 WholeReduceMax over a half tile (2 passes over the row), then the weights
            fwd = AscendRowPhase("forward", 1, 0, vpitch * 4 + 3 * lanes * 4 + 64, idx_bytes + lanes * e + 1,
                                 vpitch * 4, 0, fast_ops_per_elem=rounds * 2.5 + 4, slow_ops_per_elem=0,
                                 instrs_per_chunk=0)
        # logits in, d logits out; index and d weights in; 8 compact fp32 tiles
        bwd = AscendRowPhase("backward", 1, 1, idx_bytes + 32 + 8 * lanes * 4, 0, 0, 0,
                             fast_ops_per_elem=30 * lanes * 4 / 256 / repeats + 1,
                             slow_ops_per_elem=8 * lanes * 4 / 256 / repeats, instrs_per_chunk=0)
        return [fwd, bwd]

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        rows, experts, top_k = problem.shape
        if top_k > 32 // problem.dtype.itemsize:
            raise UserError(f"router on AscendC: top_k {top_k} > {32 // problem.dtype.itemsize} "
                            f"(a row's experts are kept in 32 B of {problem.dtype.value})")
        chunks = -(-experts // 64)      # a row's 64-lane repeat maxima, spread to whole 32 B blocks
        if chunks * (8 // math.gcd(chunks, 8)) > 64:
            raise UserError(f"router on AscendC: {experts} experts; the kernel takes up to 512, or a multiple of 512")
        return {"dtype": problem.dtype, "experts": int(experts), "top_k": int(top_k), "hash": problem.variant == "hash",
                "scale": float(SCALE), "tile_rows": int(knobs["tile_rows"]), "buffers": int(knobs["buffers"]),
                "block_dim": int(knobs["block_dim"])}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Tokens that leave a tail core and a short last tile, a width of E + 3 experts (not a
        multiple of 16), and (where the problem has that many tokens) two full tiles per core and a
        short third, so the prefetch and the kernels' two-stage loops run."""
        rows, experts, top_k = problem.shape
        bd, tr = knobs["block_dim"], knobs["tile_rows"]
        shapes = [(min(rows, 2 * bd + 3), experts, top_k), (min(rows, bd + 5), experts + 3, top_k),
                  (min(rows, bd * (2 * tr + 1) - 5), experts, top_k)]
        return [Problem(problem.op, problem.variant, s, problem.dtype) for s in dict.fromkeys(shapes)]

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward (selection + weights; tie rows re-selected by torch.topk and weighted by
        ak_router_given, as the host path does) and backward in the emulator."""

        logits = inputs["logits"]
        rows, experts = logits.shape
        top_k = problem.shape[2]
        _, block_dim = row_split(rows, knobs["block_dim"])

        def tiling(n_rows: int, from_logits: bool) -> bytearray:
            br, _ = row_split(n_rows, knobs["block_dim"])
            return bytearray(struct.pack("<6If", n_rows, experts, ub_pitch(experts, logits.element_size()), br,
                                         knobs["tile_rows"], int(from_logits), SCALE))

        def given(x: torch.Tensor, idx: torch.Tensor, from_logits: bool):
            w = torch.full((x.shape[0], top_k), float("nan")).to(x.dtype)
            bufs = [to_bytes(x), to_bytes(idx), to_bytes(w), bytearray(32), tiling(x.shape[0], from_logits)]
            rep = emulator.run(emu.exe("ak_router_given", 5), row_split(x.shape[0], knobs["block_dim"])[1], bufs)
            return from_bytes(bufs[2], w), rep

        reports = {}
        if problem.variant == "hash":
            indices = inputs["tid2eid"][inputs["input_ids"]].long().contiguous()
            weights, reports["forward"] = given(logits, indices, True)
        else:
            scores = ACT2FN["sqrtsoftplus"](logits)
            bias = inputs["bias"].float().contiguous()
            idx = torch.full((rows, top_k), -1, dtype=torch.long)
            w = torch.full((rows, top_k), float("nan")).to(logits.dtype)
            tie = torch.full((rows,), 255, dtype=torch.uint8)
            bufs = [to_bytes(scores), to_bytes(bias), to_bytes(idx), to_bytes(w), to_bytes(tie), bytearray(32),
                    tiling(rows, False)]
            reports["forward"] = emulator.run(emu.exe("ak_router_fwd", 7), block_dim, bufs)
            indices, weights, tie = from_bytes(bufs[2], idx), from_bytes(bufs[3], w), from_bytes(bufs[4], tie)
            tied = tie.nonzero().flatten()
            if reports["forward"].ok and tied.numel():   # exact ties: torch.topk decides, as in the reference
                picked = torch.topk(scores[tied] + bias, top_k, dim=-1, sorted=False).indices.sort(dim=-1).values
                indices[tied] = picked
                weights[tied], reports["forward_ties"] = given(scores[tied].contiguous(), picked.contiguous(), False)
        d_logits = torch.full_like(logits, float("nan"))
        bwd_bufs = [to_bytes(logits), to_bytes(indices), to_bytes(grad_out["weights"].to(logits.dtype)),
                    to_bytes(d_logits), bytearray(32), tiling(rows, True)]
        reports["backward"] = emulator.run(emu.exe("ak_router_bwd", 6), block_dim, bwd_bufs)
        return ({"weights": weights, "indices": indices}, {"logits": from_bytes(bwd_bufs[3], d_logits)}, reports)


PARTS = (RouterAscend(SPEC),)
