"""The AscendC kernel of compressor (templates/ascendc/): its planner phases, template values and emulator run."""

from __future__ import annotations

import struct

import torch

from .... import emulator
from ....emulator import from_bytes, to_bytes
from ....ops.base import Problem, Tensors
from ....ops.compressor import EPS, SPEC
from ....planner.ascend import AscendRowPhase, align32 as a32
from ..kernel import AscendKernel


ASCEND_UB_USABLE = 196608 - 8192   # A2/A3 UB below its reserved top (the emulator enforces the profile's)


ASCEND_TILE_ELEMS = 4096   # AscendC: slot rows x channels of one window's tile (NS x ct)


class CompressorAscend(AscendKernel):
    syncs_cores = True   # its blocks meet in SyncAll
    # --- AscendC (templates/ascendc/compressor/): a unit of work is one window's channel tile (its
    # NS slot rows x ct channels); the planner sees units as rows of NS x ct elements and picks the
    # windows per tile (tile_rows), the queue depth (buffers) and the cores. ------------------------
    def _geometry(self, problem: Problem, elems: int = ASCEND_TILE_ELEMS) -> tuple[int, int, int]:
        """(slots per window, channels per tile, channel tiles): tiles of at most `elems` elements
        (the backward's; the forward's are twice that), ct a multiple of 16 (32 B rows of bf16);
        ct = D when a window's slots fit whole."""
        _, _, ratio, d = problem.shape
        ns = (2 if problem.variant == "csa" else 1) * ratio
        ct = min(-(-d // 16) * 16, max(16, elems // ns // 16 * 16))
        ct = d if ct >= d else ct
        return ns, ct, -(-d // ct)

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        batch, windows = problem.shape[:2]
        ns, ct, nct = self._geometry(problem)
        return batch * windows * nct, ns * ct

    def phases(self, problem: Problem):
        ns, ct, nct = self._geometry(problem)
        d, e = problem.shape[3], problem.dtype.itemsize
        ctp = -(-ct // 16) * 16
        rows_b = 4 * 3 * (-(-(-(-d // 16) * 16) // 64) * 64)          # weight, two row buffers (fp32)
        whole = nct == 1
        trees = 2 * max(1, (ns // 2).bit_length())                   # tree levels (two trees) per window
        return [
            # kv, gate in; the record (lse | exact) out (+ y, rstd when whole); resident position_bias tile;
            # fp32 z, t tiles (the two work buffers); cast, add, max tree, sub, exp (slow), sum tree, cast, mul, sum tree
            AscendRowPhase("forward", 2, 0, 0, 2 * ctp * 4 + ((d * e + 4) if whole else 0), ns * ctp * 4 + rows_b,
                           2, fast_ops_per_elem=8, slow_ops_per_elem=1, instrs_per_chunk=3 * trees + 12),
            # kv, gate, record slices and dy / dx slices in; d kv, d gate out; position_bias and its
            # gradient accumulator resident; fp32 z, t; cast, add, sub, exp, cast, sub, mul, 2 muls, add, 2 casts
            AscendRowPhase("backward", 2, 2, 3 * ctp * 4, 0, 2 * ns * ctp * 4 + rows_b, 2,
                           fast_ops_per_elem=11, slow_ops_per_elem=1, instrs_per_chunk=30),
        ]

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        ns, ct, _ = self._geometry(problem)
        return {"dtype": problem.dtype, "ratio": int(problem.shape[2]), "overlap": problem.variant == "csa",
                "ct": int(ct), "tile_win": int(self._tile_win(problem, knobs)),
                "tile_win_fwd": int(self._fwd_tile_win(problem, knobs)),
                "ct_fwd": int(self._geometry(problem, 2 * ASCEND_TILE_ELEMS)[1]), "buffers": int(knobs["buffers"]),
                "block_dim": int(knobs["block_dim"]), "eps": float(EPS)}

    def _tile_win(self, problem: Problem, knobs: dict[str, int]) -> int:
        """Windows per tile: the plan's tile_rows, within the fp32 work buffers it sized (chunk)."""
        ns, ct, _ = self._geometry(problem)
        per = ns * (-(-ct // 16) * 16)
        return max(1, min(int(knobs["tile_rows"]), 64, int(knobs["chunk"]) // per))

    def _fwd_ub(self, problem: Problem, tile_win: int, buffers: int) -> int:
        """UB bytes of the forward kernel's InitBuffer calls (kernel.cpp.j2) at `tile_win` windows per tile."""
        ns, ct, _ = self._geometry(problem, 2 * ASCEND_TILE_ELEMS)
        d, e = problem.shape[3], problem.dtype.itemsize
        ctp, dp = -(-ct // 16) * 16, -(-d // 16) * 16
        row_len = -(-dp // 64) * 64
        tile = tile_win * ns * ctp
        return (2 * buffers * a32(tile * e) + ns * ctp * 4 + 2 * tile * 4 + 3 * row_len * 4
                + tile_win * 32 + a32((8 + -(-row_len * 4 // 256)) * 4)
                + buffers * (tile_win * 2 * ctp * 4 + a32(tile_win * dp * e) + a32(tile_win * 4)) + tile_win * ctp * 4)

    def _fwd_tile_win(self, problem: Problem, knobs: dict[str, int]) -> int:
        """Windows per forward tile. The plan's tile is sized by the backward (four tiles of the dtype
        and two of fp32 besides two resident fp32 slot tiles); the forward (two tiles in, none out)
        takes tiles of twice the channels (up to D), then the plan's windows times the largest of 4,
        2, 1 that still fits the UB: fewer, larger copies per window."""
        ns, ct, _ = self._geometry(problem)
        _, ct_f, _ = self._geometry(problem, 2 * ASCEND_TILE_ELEMS)
        base = max(1, self._tile_win(problem, knobs) * ct // ct_f)
        for f in (4, 2, 1):
            if base * f <= 64 and self._fwd_ub(problem, base * f, int(knobs["buffers"])) <= ASCEND_UB_USABLE:
                return base * f
        return base

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """The plan's windows (a tail core when they do not divide), and two batch rows of a few
        windows at a width that is not a multiple of 16 (a short last channel tile; CSA: split channels)."""
        batch, windows, ratio, d = problem.shape
        odd = d + 3 if d % 16 == 0 else d
        return [Problem(problem.op, problem.variant, (1, windows, ratio, d), problem.dtype),
                Problem(problem.op, problem.variant, (2, min(windows, 5), ratio, odd), problem.dtype)]

    @staticmethod
    def tiling(batch: int, seq: int, ratio: int, d: int, variant: str, knobs: dict[str, int], ct_plan: int,
               tile_win: int) -> tuple[bytearray, int, int, int]:
        """AkCompressorTiling for kv [batch, seq, (2) d] as the tiling header's AkCompressorMakeTiling makes it;
        the cores launched (its usedCores, as the binding launches), the backward's workspace bytes and dp."""
        ns = (2 if variant == "csa" else 1) * ratio
        windows = seq // ratio
        ct = d if ct_plan >= d else ct_plan
        ctp, dp = -(-ct // 16) * 16, -(-d // 16) * 16
        nct = -(-d // ct)
        rows = batch * windows
        units = nct * rows
        block_dim = min(int(knobs["block_dim"]), units)
        block_units = -(-units // block_dim)
        used = -(-units // block_units)
        block_rows = -(-rows // min(rows, block_dim))
        slot_blocks = max(1, min(ns, block_dim // nct))
        red_rows = -(-ns // slot_blocks)
        slot_blocks = -(-ns // red_rows)
        red_cols = ctp                   # few slot rows in all: split the columns too, a row at a time
        if nct * ns < block_dim:
            cb = min(-(-block_dim // (nct * ns)), -(-ctp // 64))
            red_rows, slot_blocks, red_cols = 1, ns, -(-(-(-ctp // cb)) // 16) * 16
        col_blocks = -(-ctp // red_cols)
        if tile_win * ns * ctp < dp:
            raise ValueError(f"compressor: a tile of {tile_win} x {ns} x {ctp} holds less than one row of {dp}")
        fields = (batch, seq, windows, rows, d, (2 if variant == "csa" else 1) * d, dp, ct, ctp, nct, tile_win,
                  units, block_units, block_rows, used, red_rows, slot_blocks, red_cols, col_blocks)
        tiling = bytearray(struct.pack(f"<{len(fields)}I2f", *fields, EPS, 1.0 / d))
        workspace = 4 * (rows * dp + used * nct * ns * ctp + used * dp)
        return tiling, used, workspace, dp

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""
        kv, gate = inputs["kv"], inputs["gate"]
        ratio, d = inputs["position_bias"].shape[0], inputs["weight"].shape[0]
        batch, seq = kv.shape[:2]
        windows = seq // ratio
        _, ct_plan, _ = self._geometry(problem)
        tiling_f, fwd_blocks, _, dp = self.tiling(batch, seq, ratio, d, problem.variant, knobs,
                                                  self._geometry(problem, 2 * ASCEND_TILE_ELEMS)[1], self._fwd_tile_win(problem, knobs))
        tiling, bwd_blocks, ws_bytes, dp = self.tiling(batch, seq, ratio, d, problem.variant, knobs, ct_plan,
                                                       self._tile_win(problem, knobs))
        rows = batch * windows
        pb, w = inputs["position_bias"].float().contiguous(), inputs["weight"].float().contiguous()
        y = torch.full((batch, windows, d), float("nan")).to(kv.dtype)
        rstd = torch.full((rows,), float("nan"))
        rec = torch.full((rows, 2, dp), float("nan"))
        fwd_bufs = [to_bytes(kv), to_bytes(gate), to_bytes(pb), to_bytes(w), to_bytes(y), to_bytes(rstd), to_bytes(rec),
                    bytearray(32), tiling_f]
        fwd = emulator.run(emu.exe("fwd", 9), fwd_blocks, fwd_bufs)
        y, rstd, rec = from_bytes(fwd_bufs[4], y), from_bytes(fwd_bufs[5], rstd), from_bytes(fwd_bufs[6], rec)
        grads = {"kv": torch.full_like(kv, float("nan")), "gate": torch.full_like(gate, float("nan")),
                 "position_bias": torch.full_like(pb, float("nan")), "weight": torch.full_like(w, float("nan"))}
        bwd_bufs = [to_bytes(kv), to_bytes(gate), to_bytes(pb), to_bytes(w), to_bytes(rstd), to_bytes(rec),
                    to_bytes(grad_out["y"].to(kv.dtype))] + [to_bytes(grads[k]) for k in ("kv", "gate", "position_bias", "weight")]
        bwd_bufs += [bytearray(ws_bytes), bytearray(tiling)]
        bwd = emulator.run(emu.exe("bwd", 13), bwd_blocks, bwd_bufs)
        grads = {k: from_bytes(bwd_bufs[7 + i], grads[k]) for i, k in enumerate(("kv", "gate", "position_bias", "weight"))}
        return {"y": y, "rstd": rstd}, grads, {"forward": fwd, "backward": bwd}


PARTS = (CompressorAscend(SPEC),)
