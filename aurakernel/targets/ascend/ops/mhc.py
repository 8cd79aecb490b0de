"""The AscendC kernel of mhc (templates/ascendc/): its planner phases, template values and emulator run."""

from __future__ import annotations

import struct

import torch

from .... import emulator
from ....emulator import from_bytes, to_bytes
from ....ops.base import Problem, Tensors
from ....ops.mhc import EPS, HEAD, ITERS, PRE
from ....planner.ascend import AscendRowPhase, VectorWork, cast_passes, align32 as a32, row_split
from ....planner.schedule import phase_schedule
from ..kernel import AscendKernel


class MhcAscend(AscendKernel):
    # --- AscendC (templates/ascendc/mhc_pre/, shared by mhc_head): a token's flattened streams go
    # through in column tiles against fn's tile, TR tokens per fn tile -------------------------------
    split_cols = True

    template_dir = "mhc_pre"

    ROW_BLOCK = 16   # tokens per fn tile (and lanes of the head's vectors): a multiple of 8

    # planner/schedule.py. Neither phase's per-tile compute reads results back on the scalar unit,
    # but both hold back the x stream the same way: at every column tile the fn tile (NOUT x CT fp32,
    # ~11 x tiles' worth of MTE2 time) enters MTE2's in-order queue ahead of the x tiles issued after
    # it, so an x tile issued after that point cannot arrive under the compute already queued; and the
    # backward reads each token block's coefficients on the scalar unit (an MTE2_S wait). Modelled as
    # a compute step that holds back the copies issued after it: the schedule then prefetches x tiles
    # (more of them in flight) as the emulator shows it should (tests/test_planner_depth.py).
    compute_waits_scalar = {"forward": True, "backward": True}

    def col_tiles(self, problem: Problem) -> list[int]:
        """Columns of a stream per tile: a multiple of 512 (the partial sums fold 64 lanes into whole
        32 B blocks), (NOUT + 1) * CT / 64 <= 255 (one WholeReduceSum) and CT / 8 <= 255 (a level-0
        repeat stride); the fn tile's double buffer bounds it further."""
        return [512] if self.spec.nout(problem.shape[1]) > 8 else [1024]

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        return problem.shape[0], problem.shape[1] * problem.shape[2]

    def _ub(self, problem: Problem) -> tuple[int, int]:
        """(forward, backward) UB bytes of the kernels' fixed buffers (everything but the planner's queues)."""
        hc, e = problem.shape[1], problem.dtype.itemsize
        n, ct, tr = self.spec.nout(hc), self.col_tiles(problem)[0], self.ROW_BLOCK
        ncomb = 0 if self.spec.head else hc * hc
        nseg = ct // 64
        fwd = (2 * n * ct * 4 + (32 if e == 4 else ct * 4) + (n + 1) * ct * 4 + a32((n + 1) * nseg * 4)
               + tr * (n + 1) * nseg * 4 + ((n + 1) + 2 * hc + ncomb + 3 * hc) * tr * 4 + a32(tr * (hc + ncomb) * 4))
        kcoef = 2 * n + hc + 2
        bwd = 3 * n * ct * 4 + kcoef * tr * 4 + 2 * n * tr * 32 + (32 if e == 4 else 2 * ct * 4)
        return fwd, bwd

    def phases(self, problem: Problem):
        hc, e = problem.shape[1], problem.dtype.itemsize
        n, ct = self.spec.nout(hc), self.col_tiles(problem)[0]
        fwd_ub, bwd_ub = self._ub(problem)
        return [
            # x tiles in; resident: fn's double buffer, the products, partial sums and head vectors;
            # per chunk of pass 2: the HC stream rows in (2 buffers), y out (2) and two fp32 vectors.
            # Per x element: cast, NOUT products, x^2, the fold; pass 2: cast, multiply, add
            AscendRowPhase("forward", 1, 0, 0, 0, fwd_ub, -(-(2 * hc * e + 2 * e + 8) // 4),
                           fast_ops_per_elem=2 * n + 6, slow_ops_per_elem=0, instrs_per_chunk=ct // 64 + 8),
            # x and dy tiles in, dx out; resident: the fn tile, the d_fn accumulator, the products, the
            # coefficients and their per-token broadcast blocks, two fp32 tiles. Per element: casts, dn
            # (NOUT products + the halving tree), dx, d_fn (NOUT products + one add), and the head
            # kernel's d_pre pass
            AscendRowPhase("backward", 2, 1, 0, 0, bwd_ub, 0, fast_ops_per_elem=3 * n + 12, slow_ops_per_elem=0,
                           instrs_per_chunk=ct // 32 + 16),
        ]

    def vector_floor(self, problem: Problem) -> dict[str, VectorWork]:
        """Per element of the HC streams (E = tokens x HC x D; bf16 / fp16 cast once to fp32 and back):
        forward the NOUT mix products, x^2 and y's product (one MulAdd each), backward's head d pre
        (dy . x), then dx (NOUT products of d mix, pre * dy, the norm's x term) and d fn (NOUT
        products). On the vector unit these products make both kernels vector-bound; the Cube takes
        them in issue 18."""
        rows, hc, d = problem.shape
        n, c, elems, ys = self.spec.nout(hc), cast_passes(problem.dtype), rows * hc * d, rows * d
        return {"forward": VectorWork(elems * (n + 2 + c) + ys * c),
                "backward_head": VectorWork(elems * (1 + c) + ys * c),
                "backward": VectorWork(elems * (2 * n + 2 + 2 * c) + ys * c)}

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, hc, d = problem.shape
        col_tile = int(knobs["col_tile"])
        if col_tile not in self.col_tiles(problem):
            raise ValueError(f"{self.spec.name}: col_tile {col_tile}, accepted {self.col_tiles(problem)}")
        fwd = phase_schedule(knobs, "forward", ("in",))
        bwd = phase_schedule(knobs, "backward", ("in", "out"))
        return {"dtype": problem.dtype, "hc": int(hc), "d": int(d), "nout": int(self.spec.nout(hc)), "iters": int(ITERS),
                "head": bool(self.spec.head), "eps": float(EPS), "col_tile": col_tile, "chunk": int(knobs["chunk"]),
                "block_dim": int(knobs["block_dim"]), "row_block": int(self.ROW_BLOCK),
                "fwd_prefetch": fwd["prefetch"], "fwd_in_buffers": fwd["in_buffers"],
                "bwd_prefetch": bwd["prefetch"], "bwd_in_buffers": bwd["in_buffers"],
                "bwd_out_buffers": bwd["out_buffers"]}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Tokens that leave a tail core (and a short last token block), and a hidden size whose last
        column tile is short and not a multiple of 16 elements."""
        rows, hc, d = problem.shape
        return [Problem(problem.op, problem.variant, (min(rows, 2 * knobs["block_dim"] + 3), hc, d), problem.dtype),
                Problem(problem.op, problem.variant, (min(rows, knobs["block_dim"] + 5), hc, d + 3), problem.dtype)]

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and the two backward kernels in the emulator: (outputs, grads, {phase: RunReport}).
        d_fn, d_base and d_scale come back as per-core partials in the workspace, summed here (the
        binding does the same on the NPU)."""

        x = inputs["x"]
        rows, hc, d = x.shape
        n, w = self.spec.nout(hc), hc * d
        op = "mhc_head" if self.spec.head else "mhc_pre"
        block_rows, block_dim = row_split(rows, knobs["block_dim"])
        kcoef = 2 * n + hc + 2
        ws_dfn = -(-kcoef * rows // 8) * 8
        ws_par = ws_dfn + block_dim * n * w
        tiling = bytearray(struct.pack("<7I3f", rows, d, block_rows, -(-d // knobs["col_tile"]), knobs["chunk"], ws_dfn,
                                       ws_par, EPS, EPS, 1.0 / w))
        fn, base = inputs["fn"].float().contiguous(), inputs["base"].float().contiguous()
        scale = inputs["scale"].float().contiguous()
        nan = float("nan")
        y = torch.full((rows, d), nan).to(x.dtype)
        post, comb = torch.full((rows, hc), nan), torch.full((rows, hc, hc), nan)
        mix_t, rstd = torch.full((n, rows), nan), torch.full((rows,), nan)
        fwd_bufs = [to_bytes(x), to_bytes(fn), to_bytes(base), to_bytes(scale), to_bytes(y), to_bytes(post),
                    to_bytes(comb), to_bytes(mix_t), to_bytes(rstd), bytearray(32), tiling]
        fwd = emulator.run(emu.exe(f"ak_{op}_fwd", 11), block_dim, fwd_bufs)
        outputs = {"y": from_bytes(fwd_bufs[4], y)}
        if not self.spec.head:
            outputs["post"], outputs["comb"] = from_bytes(fwd_bufs[5], post), from_bytes(fwd_bufs[6], comb)
        mix_t, rstd = from_bytes(fwd_bufs[7], mix_t), from_bytes(fwd_bufs[8], rstd)
        dy = grad_out["y"].to(x.dtype).contiguous()
        d_post = (grad_out["post"] if "post" in grad_out else torch.zeros(rows, hc)).float().contiguous()
        d_comb = (grad_out["comb"] if "comb" in grad_out else torch.zeros(rows, hc, hc)).float().contiguous()
        workspace = bytearray(torch.full((ws_par + block_dim * 32,), nan).numpy().tobytes())
        head_bufs = [to_bytes(x), to_bytes(dy), to_bytes(base), to_bytes(scale), to_bytes(mix_t), to_bytes(rstd),
                     to_bytes(d_post), to_bytes(d_comb), workspace, bytearray(tiling)]
        bwd_head = emulator.run(emu.exe(f"ak_{op}_bwd_head", 10), block_dim, head_bufs)
        dx = torch.full_like(x, nan)
        bwd_bufs = [to_bytes(x), to_bytes(dy), to_bytes(fn), to_bytes(dx), head_bufs[8], bytearray(tiling)]
        bwd = emulator.run(emu.exe(f"ak_{op}_bwd", 6), block_dim, bwd_bufs)
        ws = torch.frombuffer(bwd_bufs[4], dtype=torch.float32)
        par = ws[ws_par:].view(block_dim, 32).sum(0)
        grads = {"x": from_bytes(bwd_bufs[3], dx),
                 "fn": ws[ws_dfn:ws_par].view(block_dim, n, w).sum(0).clone(),
                 "base": par[:n].clone(), "scale": par[n:n + (1 if self.spec.head else 3)].clone()}
        return outputs, grads, {"forward": fwd, "backward_head": bwd_head, "backward": bwd}


PARTS = (MhcAscend(PRE), MhcAscend(HEAD),)
