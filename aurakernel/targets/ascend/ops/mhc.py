"""The AscendC kernel of mhc (templates/ascendc/): its planner phases, template values and emulator run.

Where the time goes (ascend910b2, 1024 x 4 x 4096 bf16, 43 tokens per AI core; emulator cycles per core):
- forward (mixed): split by tokens (43 per AI core), each AIC read all of fn's hi + lo parts from L2
  (1.5 MB, ~25k cycles: as much as its x) beside its x (~38k at its HBM share), ~72k, and the AIVs' head
  and second pass (~31k) ran after it: one super-tile per core left nothing to overlap (103k). Now the
  AI cores split W's columns: each keeps its fn slice in L1 (88 KB, read once) and streams every token's
  x over it, adding its partial mixes and x x^T into accumulators (atomic Fixpipes into the workspace);
  the tokens go in rounds with a SyncAll between, the AIVs' head and pass 2 of round r beside the AICs'
  round r + 1 (two rounds at 1024 tokens: the AICs' 20k a round against the AIVs' ~11k): 67k cycles,
  mhc_pre 148.7 -> 129 us (1.96x -> 1.70x of the bound), mhc_head 128 -> 120 us. The x x^T diagonal
  blocks cost the Cube a Mmad and the MTE1 two loads per 16-token group and step (the MTE1 ~32k).
  Then each tile's x copy goes out before the previous tile's Mmads, across the SyncAlls too (the
  AIC's MTE2, ~41k of x at its HBM share, runs without a gap), and the head's softmax, sigmoids and
  rstd scaling run as whole-matrix ops by row groups (~130 fewer instructions a head): 60k cycles,
  three rounds of 8 tokens per AIV. What is left above the ~47.7k bound is the AIVs' last round
  (~13k: its head, ~4.5k of issue-bound instructions, and pass 2 at ~0.9k a token), which nothing
  overlaps; a last round made shorter (whole rounds first) left the middle ones AIV-bound (measured
  no better).
- bwd_head (vector): d_pre's pass over x and dy (~67k MTE2, latency-bound at small tiles before the
  2048-column tiles; ~26k vector) and the head in reverse on 16-lane vectors (~41k vector, issue-bound:
  the 20-step Sinkhorn). They ran one after the other per block of 16 tokens (63.3 us); now block b's
  d_pre streams while the vector unit runs block b - 1's head in reverse, dealt out in 80 steps between
  its copies (58.1 us), the short block first, where its d_pre runs alone (54.3 us: a reverse costs
  the same at any block size, its vectors being 16 lanes). At 43 tokens per core (3 blocks) the first
  block's d_pre and the last one's reverse still run alone; more tokens per core overlap more. The
  reverse keeps each recomputed normalisation's 1 / (sum + eps) (10 KB of UB), so undoing one needs
  no group sum or Div, and a by-column group op is one instruction repeated over the rows (~41k ->
  ~31k vector cycles; 51.4 us). What is left above the bound: the copies' fixed cost (two per token
  and column tile, ~18k of the 67k MTE2 cycles) and the last block's reverse (~15k). Now several
  tokens' x and dy rows come in one copy each (up to 4, 32 KB; mhc_pre at 1024-column tiles, which
  its Sinkhorn states leave UB for), the softmax backward runs on every row at once (10 instructions
  a block where there were 76), a token's x rows are cast in one instruction, and the next block's
  first copy goes out before this block's tail: mhc_pre's bwd_head 77.5k -> 68.3k cycles (vector-
  bound now, ~55k: the reverse's ~600 issue-bound instructions a block of 16 tokens), mhc_head's
  -> 60.5k (its MTE2, ~57k).
- backward (mixed, 16-bit): the AI cores split D's columns (every stream's), so d_fn's columns are
  whole sums written once and dy's columns are read once for the HC streams: ~98k cycles, at the
  busiest AI core's HBM share (3 column tiles of 64 where the even share is 2.67). Splitting the
  tokens instead, each AI core wrote a d_fn partial (NOUT x W fp32, 1.5 MB: at 43 tokens per AI core
  as much HBM traffic as its x) for the binding to sum (157k). The vector products of the vector
  backward (3 NOUT + 12 fp32 passes per element, 1.0M cycles) are the Cube's. Its read of x follows
  bwd_head's whole read of it: where x and dy fit in half the L2 (1024 tokens: 40 of 192 MB; not at
  65536) x is found there (`x_stays_in_l2`), so the launch is no longer bound by HBM traffic but by
  its MTE2 (~81k cycles: the per-super-tile copies): mhc_head 53.3 -> 47.3 us, mhc_pre 53.3 ->
  47.7 us (1.81x -> 1.73x and 2.18x -> 2.09x of the op's bound). The AIVs' pre, rstd and k now come
  a window of 512 tokens a copy (once, for every tile, at 1024 tokens) where each super-tile had its
  copy: 85.9k -> 83.3k cycles. Per super-tile an AIV still made three copies (dy from HBM, dn and x
  from L2: ~1.5k cycles, 600 of them latencies) for 48 super-tiles, its MTE2 ~71k of the 80k. Now the
  Cube makes g = rstd dn - k x itself: dn's A is c = dmix rstd (the parts d_fn uses), and -k x is one
  more Mmad over the super-tile's tokens, diag(-k) x, with x's B already in L0B and diag(-k) as rows
  of the parts bwd_head writes (token t's -k in row t mod the super-tile's tokens), so the AIVs read
  no x (mhc_pre 80.3k -> 67.1k cycles; mhc_head 79.7k -> 57.2k, then paced by the AIC's MTE2); the
  parts stay in L1 for the core's later column tiles where they fit (eight buffers, each one copy in
  the first tile: mhc_head 54.8k); the AIVs split a tile's columns, not its tokens, so an AIV's dy
  rows of four super-tiles are contiguous and come in one copy (mhc_head 50.9k, fwd+bwd 90.6 us,
  1.23x of the HBM bound). mhc_pre's backward is paced by the AIC's MTE1 (55k: fn's B loaded per
  super-tile and stream) and Cube (52k, -k x's Mmad a quarter of it): 67.5k.
- the plan: cube_model models all three launches (the forward with its vector side and pass-2 chunk,
  bwd_head, the Cube backward) and predicts each within ~15% of the emulator at 1024 tokens (mhc_pre
  173 us predicted, 158.5 emulated; 538 against 566 at 4096). Row-wise phases beside it had counted the
  forward's vector side twice and bwd_head at the fp32 backward's cost (642 us predicted), which is
  what `aurakernel profile --target` charged for mHC.
- bwd_head for 16-bit x is a mixed kernel now: each AI core's Cube computes its tokens' d_pre as the
  diagonals of x_i dy^T (16-token blocks, L1 tiles of head_cols columns, the most that fit twice:
  1536 on ascend910b2; x's HC streams and dy a copy each, at the AI core's HBM share), and its two
  vector cores run every other block's head in reverse, waiting for the Cube only before the tail;
  the diagonals come in one copy and one Gather. The vector cores' d_pre pass (a cast, HC products and
  folds per element, ~26k cycles) and its two copies per 4 tokens and 1024 columns (~11k of latency)
  are gone: mhc_pre's bwd_head 67.0k -> 55.6k cycles (the AIC's MTE2: x and dy at its HBM share, ~47k,
  and a copy's latency per tile), mhc_head's 60.3k -> ~54k; fwd+bwd mhc_pre 96.1 us (1.28x of the
  bound), mhc_head ~87 us (1.18x). What is left in mhc_pre: the forward's last vector round (~11k
  after the AICs' last copy: its head, ~4.4k of issue-bound instructions, and pass 2; a fourth round
  measured the same, 57.1k cycles: each round's head repeats) and the Cube backward's Cube (54.5k,
  a quarter of it diag(-k) x over the super-tile's tokens; g is one Mmad, [ch | ch | cl] [fh; fl; fh], with fn's B
  resident in L0B: 58.3k cycles).
- bwd_head's blocks each run the part of their head in reverse that needs no d_pre (the comb's
  Sinkhorn, its softmax, the post sigmoids: all but the pre sigmoids) under their own d_pre copies,
  where block b - 1's whole reverse ran under block b's and the last block's ran alone (~15.7k cycles):
  mhc_pre's bwd_head 51.4 -> 44.9 us at 1024 tokens.
- mhc_pre's token-major rows (the forward's post and comb out, bwd_head's d_post and d_comb in) are
  transposed by one vector Gather against an offset table made once, where the scalar unit moved them a
  value at a time (~2.5k cycles a block in bwd_head, ~3.8k a super-tile in the forward's AIV tail):
  forward 59.4 -> 57.3 us, bwd_head 44.9 -> 43.7 us (fwd+bwd 148.7 us, 1.96x of the bound).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .... import emulator
from ....emulator import from_bytes, to_bytes
from ....errors import PlanInfeasible
from ....hardware import AscendPipes, HardwareProfile
from ....ops.base import Problem, Tensors
from ....ops.mhc import EPS, HEAD, ITERS, PRE
from ....planner.ascend import (AscendRowPhase, CubeCells, CubeWork, VectorWork, cast_passes, align32 as a32, cube_cores,
                                l2_half, row_split)
from ....planner.model import ChoiceModel, Constraint, Phase, Term
from ....planner.schedule import phase_schedule
from ..kernel import AscendKernel


def fn_parts(fn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fn as the Cube takes it, [parts, NOUT16, W] in the dtype of x (each part's rows padded with zeros
    to a multiple of 16: whole fractals): fp32 fn itself; for 16-bit x its hi part (fn rounded) and lo
    part (fn - hi, rounded), so hi + lo keeps fp32's precision (the binding makes the same on the NPU)."""
    fn = fn.float()
    parts = [fn] if dtype == torch.float32 else [fn.to(dtype).float(), fn - fn.to(dtype).float()]
    out = torch.zeros(len(parts), -(-fn.shape[0] // 16) * 16, fn.shape[1], dtype=dtype)
    for p, part in enumerate(parts):
        out[p, :fn.shape[0]] = part.to(dtype)
    return out


@dataclass(frozen=True)
class _CubeFigures:
    """What both Cube models start from: the shape, the element size, W = HC x D, NOUT (and rounded up
    to whole fractals), the tokens per group, the AI cores and their pipes."""
    hc: int
    d: int
    e: int
    w: int
    n: int
    n16: int
    tr: int
    cores: int
    p: AscendPipes


class MhcAscend(AscendKernel):
    # --- AscendC (templates/ascendc/mhc_pre/, shared by mhc_head) -------------------------------------
    # forward: a mixed kernel. The AI cores split W's columns: each AIC keeps its slice of fn in L1 and
    #   streams every token's x over it (cube_groups x 16 tokens an L1 tile, Mmads of cube_k0 columns),
    #   the mix projection x fn^T and the groups' x x^T (its diagonal: each token's sum of squares) on the
    #   Cube, added into accumulators; the AIVs the head and y = sum_i pre_i x_i (`chunk` columns at a
    #   time), reading x again from L2, in rounds of at most head_lanes tokens each (cube_model plans it).
    # backward: the head in reverse on the vector cores (bwd_head), then dx and d_fn: for 16-bit x a
    #   mixed kernel (dn = dmix fn and d_fn = c^T x on the Cube in super-tiles of bwd_groups x 16 tokens
    #   and column tiles of bwd_k, dx on the AIVs: cube_model); for fp32 on the vector cores, a token's
    #   flattened streams in column tiles against fn's tile, TR tokens per fn tile (the row-wise model).
    split_cols = True
    syncs_cores = True   # the forward's cores meet in SyncAll between rounds

    template_dir = "mhc_pre"

    ROW_BLOCK = 16   # tokens per fn tile (and lanes of the head's vectors), a Cube token group: a multiple of 8

    # planner/schedule.py. The backward's compute reads each token block's coefficients on the scalar
    # unit (an MTE2_S wait), and at every column tile the fn tile enters MTE2's in-order queue ahead of
    # the x tiles issued after it: modelled as a compute step that holds back the copies issued after
    # it, so the schedule prefetches x tiles (tests/test_planner_depth.py).
    compute_waits_scalar = {"backward": True}

    def col_tiles(self, problem: Problem) -> list[int]:
        """Columns of a stream per tile: a multiple of 512 (the partial sums fold 64 lanes into whole
        32 B blocks), (NOUT + 1) * CT / 64 <= 255 (one WholeReduceSum) and CT / 8 <= 255 (a level-0
        repeat stride); the fn tile's double buffer bounds it further."""
        return [512] if self.spec.nout(problem.shape[1]) > 8 else [1024]

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        return problem.shape[0], problem.shape[1] * problem.shape[2]

    def _ub(self, problem: Problem) -> tuple[int, int]:
        """(forward, backward) UB bytes of the kernels' fixed buffers (everything but the planner's queues):
        the forward AIV's mix and square rows of a round, its head vectors (HEAD_LANES lanes), post / comb
        staging and Gather tables; the backward's fn tile, d_fn accumulator, products and coefficients."""
        hc, e = problem.shape[1], problem.dtype.itemsize
        n, ct, tr = self.spec.nout(hc), self.col_tiles(problem)[0], self.ROW_BLOCK
        ncomb = 0 if self.spec.head else hc * hc
        ht = max(self.HEAD_LANES)   # the head's lanes: an AIV's tokens of a round, at most
        # its mix and square rows in, the head vectors, the rows of post and comb for GM, the Gather tables
        fwd = (n + 8) * ht * 4 + ((n + 1) + 2 * hc + ncomb + 5 * hc) * ht * 4 + 2 * a32(ht * (hc + ncomb) * 4) + a32(n * ht * 4)
        kcoef = 2 * n + hc + 2
        bwd = 3 * n * ct * 4 + kcoef * tr * 4 + 2 * n * tr * 32 + (32 if e == 4 else 2 * ct * 4)
        return fwd, bwd

    def phases(self, problem: Problem):
        """The row-wise model's phases: only the fp32 backward, which runs on the vector cores. The forward
        (a mixed kernel, its vector side and `chunk` included), bwd_head and the 16-bit backward are
        cube_model's: a row phase for them counted their time twice (the forward's vector side in both
        models) or at the wrong kernel's cost (bwd_head at the fp32 backward's NOUT products per element),
        which put mhc_pre's prediction at 4x its emulated time."""
        if self.cube_backward(problem):
            return []
        n, ct = self.spec.nout(problem.shape[1]), self.col_tiles(problem)[0]
        _, bwd_ub = self._ub(problem)
        return [
            # x and dy tiles in, dx out; resident: the fn tile, the d_fn accumulator, the products, the
            # coefficients and their per-token broadcast blocks, two fp32 tiles. Per element: casts, dn
            # (NOUT products + the halving tree), dx, d_fn (NOUT products + one add); per tile the
            # instructions of a column tile's loops
            AscendRowPhase("backward", 2, 1, 0, 0, bwd_ub, 0, fast_ops_per_elem=3 * n + 9, slow_ops_per_elem=0,
                           instrs_per_chunk=0, instrs_per_tile=ct // 32 + 16),
        ]

    # the forward's Cube tiling: 16-token groups per L1 tile of x; its rounds of tokens
    CUBE_GROUPS = (1, 2, 3, 4, 6, 8)

    @staticmethod
    def cube_backward(problem: Problem) -> bool:
        """16-bit x runs the backward's products on the Cube too (its transposes are the 2D LoadData's, of
        16 x 16 fractals only); fp32 keeps the backward on the vector cores."""
        return problem.dtype.itemsize == 2

    def _cube_figures(self, problem: Problem, hw: HardwareProfile) -> _CubeFigures:
        _, hc, d = problem.shape
        cores, n = cube_cores(hw), self.spec.nout(hc)
        return _CubeFigures(hc, d, problem.dtype.itemsize, hc * d, n, -(-n // 16) * 16, self.ROW_BLOCK, cores,
                            hw.ascend_pipes(cores))

    def cube_model(self, problem: Problem, hw: HardwareProfile) -> ChoiceModel:
        """The forward: the AI cores split W's columns (each keeps its slice of fn in L1) and stream every
        token's x over it in tiles of cube_groups x 16 tokens, Mmads of cube_k0 columns; the tokens go in
        rounds (forward_rounds: full ones of head_lanes tokens an AIV, the rest last), the AICs' round
        r + 1 beside the AIVs' head and second pass over round r (from L2, `chunk` columns of W a copy),
        every core meeting between rounds. With A the AICs' time over every token (their slowest pipe), A_0
        their first round's, V an AIV's per full round and V' its last, rounds R take about
        max(A + V', A_0 + (R - 1) V + V'): each AIC pipe carries V' beside its own cycles, the AIVs' pipe the
        rest; exposed besides, what the AIC computes after its last copy (last_tiles). Then bwd_head
        (head_phase) and, for 16-bit x, the Cube backward (backward_model)."""
        f = self._cube_figures(problem, hw)
        e, w, n, n16, cores, p = f.e, f.w, f.n, f.n16, f.cores, f.p
        rows = problem.shape[0]
        lat, rate, l2, issue = p.mte_latency, p.mte_bytes_per_cycle, p.l2_bytes_per_cycle, p.vec_issue
        parts, c0 = (1 if e == 4 else 2), 32 // e
        macs = p.cube_macs_fp32 if e == 4 else p.cube_macs_16bit
        kc = -(-w // 16 // cores) * 16   # the busiest AI core's columns of W
        domains = {"cube_groups": list(self.CUBE_GROUPS),
                   "cube_k0": [64, 128, 256],
                   "head_lanes": list(self.HEAD_LANES),
                   "cube_blocks": [cores],
                   "chunk": [64 << i for i in range(12) if 64 << i < 2 * w]}

        def rounds(lanes):
            """The rounds, their tokens, an AIV's tokens of a full round and of the last."""
            round_rows, per_aiv, _ = self.forward_rounds(rows, n, lanes, cores)
            r = -(-rows // round_rows)
            return r, round_rows, per_aiv, -(-(rows - (r - 1) * round_rows) // (2 * cores))

        def step(ng, k0):
            """MTE1 and Cube cycles of one Mmad step over ng token groups: the groups' fractals into L0A and
            L0B (fn^T's parts beside them), then the Mmads."""
            return ((2 * ng + parts) * issue + (2 * ng * 16 + parts * n16) * k0 * e / p.mte1_bytes_per_cycle,
                    parts * (issue + ng * 16 * n16 * k0 / macs) + ng * (issue + 256 * k0 / macs))

        @functools.cache   # every pipe's term reads the same cell
        def per_core(g, k0, lanes):
            """An AIC's cycles per pipe over every token: per tile its x rows in, its Mmad steps, its atomic Fixpipes."""
            r, round_rows, *_ = rounds(lanes)
            tiles = (r - 1) * -(-round_rows // (g * 16)) + -(-(rows - (r - 1) * round_rows) // (g * 16))
            tb = min(g * 16, round_rows)
            step_mte1, step_cube = step(-(-tb // 16), k0)
            steps = -(-kc // k0)
            return {"MTE2": tiles * lat + rows * kc * e / rate,
                    "MTE1": tiles * steps * step_mte1,
                    "Cube": tiles * steps * step_cube,
                    "FIX": tiles * 2 * issue + rows * (n + 16) * 4 / p.fix_bytes_per_cycle}

        def last_tiles(g, k0, lanes):
            """What the AIC computes after its last copy, before the last round's SyncAll: the last tile's
            Mmad steps, and what of the tile before's outlasts that copy (a wide tile before a short one)."""
            r, round_rows, *_ = rounds(lanes)
            tb, left = min(g * 16, round_rows), rows - (r - 1) * round_rows
            last = left - (-(-left // tb) - 1) * tb
            prev = tb if left > tb or r > 1 else 0

            def compute(n):
                return -(-kc // k0) * max(step(-(-n // 16), k0)) if n else 0.0
            return compute(last) + max(0.0, compute(prev) - (lat + last * kc * e / rate))

        # the head's vector instructions, issue-bound on one repeat (ESTIMATE, counted from the emulator's
        # trace): mhc_pre's four per Sinkhorn normalisation and ~25 more, mhc_head's a sigmoid
        head_instrs = 12 if self.spec.head else 4 * (2 * ITERS - 1) + 25

        def aiv(lanes, ch, last=False):
            """An AIV's round (a full one, or the last): its mix and square rows in, the head, then per
            token y = sum_i pre_i x_i a pass-2 chunk at a time: x's HC rows of the chunk from L2, a cast and
            a multiply-add per element and stream (2 HC + 1 vector ops), y out; double buffered, so a token
            costs the slowest of the three."""
            hr = rounds(lanes)[3 if last else 2]
            chunks = -(-f.d // self.pass2_chunk(ch, f.hc))
            x_in = chunks * lat + w * e / l2
            vector = chunks * (2 * f.hc + 1) * issue + (2 * f.hc + 1) * f.d * 4 / 256
            y_out = chunks * lat + f.d * e / rate
            return 3 * lat + head_instrs * (issue + 5) + hr * (max(x_in, vector, y_out) + 4 * issue)

        fwd_ub = self._ub(problem)[0]
        clock = hw.clock_ghz * 1e9
        cells = CubeCells(("cube_groups", "cube_k0", "head_lanes"), domains, per_core, hw)
        cap = cells.cap
        constraints = [
            cap("L1 capacity", lambda g, k0, lanes: (parts * n16 + 2 * g * 16) * kc * e, p.l1_usable,
                "(parts x NOUT16 + 2 x cube_groups x 16) x the core's columns x elem (fn's slice, x double buffered)"),
            cap("L0A capacity", lambda g, k0, lanes: 2 * g * 16 * k0 * e, p.l0a_bytes, "2 x cube_groups x 16 x cube_k0 x elem"),
            cap("L0B capacity", lambda g, k0, lanes: 2 * (parts * n16 + g * 16) * k0 * e, p.l0b_bytes,
                "2 x (parts x NOUT16 + cube_groups x 16) x cube_k0 x elem (fn^T and the groups' x^T)"),
            cap("L0C capacity", lambda g, k0, lanes: 2 * (n16 + 16) * g * 16 * 4, p.l0c_bytes,
                "2 x (NOUT16 + 16) x cube_groups x 16 fp32 (the mixes and the groups' x x^T)"),
            cap("Mmad step", lambda g, k0, lanes: (k0 // c0) * (n16 // 16) / 255, 1,
                "cube_k0 / C0 x NOUT16 / 16 <= 255 (fn^T in one LoadData)"),
            # the AIVs read x again from L2: the round the AICs read before, beside the one they read now
            cap("L2 reuse", lambda g, k0, lanes: 2 * rounds(lanes)[1] * w * e, l2_half(hw), "2 x a round's tokens x W x elem <= L2 / 2"),
            Constraint("forward UB capacity",
                       Term.of(("chunk",), domains, lambda ch: fwd_ub + self._pass2_ub(ch, f.hc, e)), p.ub_usable,
                       "the AIV's head buffers + 2 x (HC + 1) x chunk / HC x elem (x in, y out) + 2 x chunk / HC fp32"),
        ]
        aic = ("MTE2", "MTE1", "Cube", "FIX")
        last_aiv = Term.of(("head_lanes", "chunk"), domains, lambda lanes, ch: aiv(lanes, ch, last=True) / clock)
        pipes = {pipe: terms + [last_aiv] for pipe, terms in cells.pipes(aic).items()}

        def first_round(g, k0, lanes):
            """The AICs' first round: what the AIVs wait before theirs."""
            return max(per_core(g, k0, lanes)[q] for q in aic) * min(1.0, rounds(lanes)[1] / rows)
        pipes["AIV"] = [cells.seconds(first_round),
                        Term.of(("head_lanes", "chunk"), domains,
                                lambda lanes, ch: ((rounds(lanes)[0] - 1) * aiv(lanes, ch) + aiv(lanes, ch, last=True)) / clock)]
        # before round 0: fn's slice into L1 (from L2) beside the AIVs' zeroing of the accumulators
        setup = Term.of(("cube_blocks",), domains, lambda bd: (2 * lat + parts * n * kc * e / l2) / clock)
        forward = Phase("forward", pipes, [setup, cells.seconds(last_tiles), cells.launch()])
        model = self.cube_choice_model(problem, hw, domains, forward, constraints)
        model.phases.insert(1, self.head_phase(problem, hw, domains))
        return model

    @classmethod
    def _pass2_ub(cls, chunk: int, hc: int, e: int) -> int:
        """UB bytes of the forward's second pass: x's HC rows and y, two of each, and two fp32 rows of a chunk."""
        pc = cls.pass2_chunk(chunk, hc)
        return 2 * (hc + 1) * a32(pc * e) + 2 * pc * 4

    def reverse_instrs(self) -> int:
        """Vector instructions of the part of bwd_head's head in reverse that needs no d_pre, per block of
        16 tokens (16-lane vectors: each costs the issue and one repeat): mhc_pre's 4 x ITERS steps
        (recompute and undo each Sinkhorn normalisation, the post sigmoids, the comb's softmax) ~14 each;
        mhc_head has none. ESTIMATES, counted from the emulator's cycles (tests/test_ascendc.py keeps the
        phase's model near its emulated time)."""
        return 0 if self.spec.head else 14 * 4 * ITERS

    def head_phase(self, problem: Problem, hw: HardwareProfile, domains: dict) -> Phase:
        """bwd_head (16-bit x: _mixed_head_phase) on the vector cores, which has no knob of its own (its
        column tile is the backward's, its 16-token blocks fixed): per head_tokens tokens and column tile x's HC stream rows and dy in (two copies),
        a cast of each element, x . dy's product and fold per x element (d_pre); per block its saved mixes,
        rstd (and d_post and d_comb, transposed by a Gather) in, the head in reverse but for the
        pre sigmoids (reverse_instrs) dealt out between the block's own d_pre copies, then, exposed, the
        tail that needs d_pre (the pre sigmoids' backward and the coefficients) and the coefficients out.
        Time: the busier pipe plus each block's exposed load, tail and copy-out, and one copy's fill."""
        rows, hc, d = problem.shape
        e, n, head = problem.dtype.itemsize, self.spec.nout(hc), self.spec.head
        if self.cube_backward(problem):
            return self._mixed_head_phase(problem, hw, domains)
        rb, bd = row_split(rows, hw.cores)
        p = hw.ascend_pipes(bd)
        lat, issue = p.mte_latency, p.vec_issue
        tile = self.col_tiles(problem)[0]
        dct, tp = min(d, tile), self.head_tokens(problem, tile)
        pairs, blocks = rb * -(-d // dct), -(-rb // self.ROW_BLOCK)
        copies = -(-rb // tp) * -(-d // dct)   # x's and dy's copies, each of tp tokens
        cast = 1 if e < 4 else 0
        copy = 2 * lat + tp * (hc + 1) * dct * e / p.mte_bytes_per_cycle
        loads = 2 if head else 4
        gather = (hc + hc * hc) * self.ROW_BLOCK * 4 / 256   # d_post and d_comb's transposing Gather, in repeats
        tail = self.head_tail_instrs(n)
        exposed = (tail * (issue + 1)
                   + loads * lat + (0 if head else 2 * issue + gather * (1 + p.vec_slow_factor))   # the load
                   + 2 * lat + 10 * issue)                                                          # the coefficients out
        cycles = {"MTE2": copies * copy + blocks * loads * lat,
                  "MTE3": blocks * 2 * lat,
                  "Vector": pairs * ((cast + hc * (1 + cast) + 2) * issue + (cast + hc * (2 + cast)) * dct / 64)
                            + blocks * (self.reverse_instrs() + tail) * (issue + 1) + 2 * (n + 8) * issue}
        return self._fixed_head_phase(cycles, blocks * exposed + copy, hw, domains)

    @staticmethod
    def head_tail_instrs(nout: int) -> int:
        """Vector instructions of bwd_head's tail per block, the part that needs d_pre (the pre sigmoids'
        backward and the coefficients: whole-block ops, but for k's sum over the NOUT vectors, a fold in
        halves)."""
        return 22 + (nout - 1).bit_length()

    @staticmethod
    def _fixed_head_phase(cycles: dict[str, float], exposed: float, hw: HardwareProfile, domains: dict) -> Phase:
        """bwd_head's phase from its cycles per pipe and what no pipe overlaps (it has no knob of its own)."""
        clock = hw.clock_ghz * 1e9

        def constant(v: float) -> Term:
            return Term.of(("cube_blocks",), domains, lambda _: v / clock)
        return Phase("backward_head", {k: [constant(v)] for k, v in cycles.items()},
                     [constant(exposed), constant(hw.call_overhead_us * 1e-6 * clock)])

    HEAD_K0_BYTES = 32768   # the mixed bwd_head's x A per Mmad step (HC streams of 16 tokens, twice in L0A)
    RES_PARTS = 8           # the Cube backward's L1 buffers of resident parts (each one copy in the first tile)
    DY_SUPERS = 4           # the Cube backward's super-tiles of dy rows an AIV's copy brings

    @staticmethod
    def head_cols(problem: Problem, hw: HardwareProfile) -> int:
        """The mixed bwd_head's columns of D per L1 tile: the most (whole 256) whose x (HC streams) and dy
        rows of a 16-token block fit L1 twice (ascend910b2: 1536 of V4's 4096, three tiles a block)."""
        _, hc, d = problem.shape
        cols = hw.ascend_pipes(hw.cores).l1_usable // (2 * (hc + 1) * 16 * problem.dtype.itemsize) // 256 * 256
        return max(256, min(cols, -(-d // 256) * 256))

    def _mixed_head_phase(self, problem: Problem, hw: HardwareProfile, domains: dict) -> Phase:
        """bwd_head for 16-bit x, a mixed kernel: per AI core its tokens, in blocks of 16; its Cube the
        blocks' d_pre (x_i dy^T over L1 tiles of head_cols columns, x's HC streams and dy a copy each, at the
        core's HBM share), its two vector cores every other block's head in reverse (reverse_instrs, the
        tail) once the Cube's d_pre is out. Time: the AIC's MTE2 (or the busier AIV's vector), plus the last
        block's last tile on the Cube and its tail on the vector core, and the launch."""
        rows, hc, d = problem.shape
        e, n, tr = problem.dtype.itemsize, self.spec.nout(hc), self.ROW_BLOCK
        f = self._cube_figures(problem, hw)
        p, cores = f.p, f.cores
        lat, issue = p.mte_latency, p.vec_issue
        rb = -(-rows // cores)
        cols = self.head_cols(problem, hw)
        blocks, chunks = -(-rb // tr), -(-d // cols)
        k0 = self.HEAD_K0_BYTES // (hc * tr * e) // 16 * 16
        steps = -(-min(d, cols) // k0)
        tile_mte1 = steps * ((hc + 1) * issue + (hc + 1) * tr * k0 * e / p.mte1_bytes_per_cycle)
        tile_cube = steps * hc * (issue + tr * tr * k0 / p.cube_macs_16bit)
        tail = self.head_tail_instrs(n)
        loads = 2 if self.spec.head else 4
        aiv_block = (self.reverse_instrs() + tail + 8) * (issue + 1) + (loads + 3) * lat
        cycles = {"MTE2": blocks * chunks * 2 * lat + rb * (hc + 1) * d * e / p.mte_bytes_per_cycle,
                  "MTE1": blocks * chunks * tile_mte1, "Cube": blocks * chunks * tile_cube,
                  "Vector": -(-blocks // 2) * aiv_block}
        exposed = tile_mte1 + tile_cube + 2 * lat + (tail + 8) * (issue + 1)
        return self._fixed_head_phase(cycles, exposed, hw, domains)

    def backward_model(self, problem: Problem, hw: HardwareProfile, domains: dict) -> tuple[Phase, list[Constraint]]:
        """The Cube backward's tiling: D's column tiles of bwd_k (every stream's) dealt out to the AI cores
        (fn's parts into L1 once per tile, d_fn's columns accumulated in L0C over every token and written
        once, dy's columns read once for the HC streams), every token through each tile in super-tiles
        of bwd_groups x 16 (their parts from L2 and x rows into L1; Mmad steps of bwd_k0 columns): per
        super-tile the AIC's loads, the Mmads of g = rstd dn - k x (the -k x one over the super-tile's
        tokens: diag(-k) x) and of d_fn, g's Fixpipes; the AIVs' read of g and dy (one copy each) and
        dx = g + pre dy. Objective:
        the slowest pipe of the AI core with the most tiles, plus one super-tile's fill and the launch."""
        f = self._cube_figures(problem, hw)
        e, hc, d, n, n16, tr, p = f.e, f.hc, f.d, f.n, f.n16, f.tr, f.p
        rows = problem.shape[0]
        lat, rate, l2, issue = p.mte_latency, p.mte_bytes_per_cycle, p.l2_bytes_per_cycle, p.vec_issue
        x_rate = l2 if self.x_stays_in_l2(problem, hw) else rate   # the AIC's read of x, the AIVs' of dy
        m1 = n16 // 16
        domains["bwd_groups"] = [g for g in (1, 2, 3, 4) if g == 1 or (g - 1) * tr < rows]
        domains["bwd_k"] = [k for k in (64, 128, 256) if k == 64 or k // 2 < d]

        @functools.cache
        def per_core(g, bk):
            bgt, bk0, prows = g * tr, self.bwd_k0(hc, n, g, bk), self.parts_rows(n, g)
            col_tiles = -(-d // bk)
            tiles = -(-col_tiles // f.cores)                  # the busiest AI core's column tiles
            supers, steps = -(-rows // bgt), -(-bk // bk0)
            units = tiles * supers
            windows = -(-supers // (512 // bgt))             # the AIVs' windows of resident scalars
            nb, tok = min(g, -(-rows // tr)), min(bgt, rows)
            # per super-tile A: g's [ch | ch | cl], d_fn's ch^T and cl^T, diag(-k)
            a_mte1 = (4 * nb + 2 * m1) * issue + (tok * 3 * n16 + 2 * n16 * tok + tok * nb * 16) * e / p.mte1_bytes_per_cycle
            step_mte1 = nb * issue + tok * bk0 * e / p.mte1_bytes_per_cycle   # x's B (fn's stays in L0B for the tile)
            step_cube = 4 * issue + (nb * 16 * bk0 * (3 * n16 + nb * 16) + 2 * n16 * bk0 * nb * 16) / p.cube_macs_16bit
            mine = -(-tok // 2)
            # the parts come once per super-tile where they stay in L1 (the kernel's test), else per tile too
            rp = self.RES_PARTS
            resident = tiles > 1 and rp * -(-supers // rp) * bgt * prows * e + 2 * hc * (2 * n16 + bgt) * bk * e <= p.l1_usable
            return {"MTE2": tiles * (lat + hc * 2 * n16 * bk * e / l2) + units * (lat + hc * tok * bk * e / x_rate)
                            + (min(supers, rp) * lat + supers * prows * tok * e / l2 if resident
                               else units * (lat + prows * tok * e / l2)),
                    "MTE1": units * (a_mte1 + hc * steps * step_mte1)
                            + tiles * hc * (steps * 3 * m1 * issue + 3 * n16 * bk * e / p.mte1_bytes_per_cycle),
                    "Cube": units * hc * steps * step_cube,
                    # dn into L2 at the Fixpipe's rate per step; the tile's d_fn once, at the core's HBM share
                    "FIX": units * hc * steps * (issue + tok * bk0 * 4 / p.fix_bytes_per_cycle)
                           + tiles * hc * (issue + n * bk * 4 / min(p.fix_bytes_per_cycle, rate)),
                    # per AIV and super-tile (half its columns): g (L2) in and dx out, one copy each, dy a copy
                    # per DY_SUPERS super-tiles (pre comes a window of 512 tokens a copy, once for every tile
                    # where the tokens fit one); 3 fp32 passes per x element (pre dy, the add, the store), 2
                    # per dy element, pre's Brcb
                    "AIV MTE2": units * (lat * (1 + 1 / self.DY_SUPERS) + mine * hc * bk * 4 / l2 + mine * bk * e / x_rate)
                                + (lat + hc * 512 * 4 / l2) * windows * (1 if windows == 1 else tiles),
                    "AIV MTE3": units * (lat + mine * hc * bk * e / rate),
                    "Vector": units * (mine * (hc * bk * 3 + bk * 2) / 64 + issue * (hc + 6 + hc * bk / 64)),
                    "tile": units}
        cells = CubeCells(("bwd_groups", "bwd_k"), domains, per_core, hw)
        cap = cells.cap
        constraints = [
            cap("backward L1 capacity", lambda g, bk: 2 * (self.parts_rows(n, g) * g * tr + hc * (2 * n16 + g * tr) * bk) * e,
                p.l1_usable, "2 x (parts rows x 16 bwd_groups + HC x (2 NOUT16 + 16 bwd_groups) x bwd_k) x elem"),
            cap("backward L0A capacity", lambda g, bk: 2 * g * tr * (3 * n16 + 2 * n16 + g * tr) * e, p.l0a_bytes,
                "2 x 16 bwd_groups x (3 NOUT16 + 2 NOUT16 + 16 bwd_groups) x elem (g's, d_fn's and diag(-k)'s A)"),
            cap("backward L0B capacity", lambda g, bk: (hc * 3 * n16 * bk + 2 * g * tr * self.bwd_k0(hc, n, g, bk)) * e, p.l0b_bytes,
                "(HC x 3 NOUT16 x bwd_k + 2 x 16 bwd_groups x bwd_k0) x elem (the tile's fn B, resident; x's, double buffered)"),
            cap("backward L0C capacity", lambda g, bk: (hc * n16 * bk + 2 * g * tr * self.bwd_k0(hc, n, g, bk)) * 4, p.l0c_bytes,
                "(HC x NOUT16 x bwd_k + 2 x 16 bwd_groups x bwd_k0) x fp32 (the tile's d_fn per stream, dn twice)"),
            cap("backward UB capacity", lambda g, bk: g * tr // 2 * (hc * bk * (2 * 4 + e + 4) + bk * (2 * e + 4) + hc * 32)
                + hc * 512 * 4, p.ub_usable, "per AIV: 8 tokens x bwd_groups x (HC x bwd_k x (2 g, dx + a fp32 row) "
                "+ bwd_k x (dy twice + a fp32 row) + pre as Brcb blocks) + a window of 512 tokens' pre"),
        ]
        pipes = cells.pipes(("MTE2", "MTE1", "Cube", "FIX", "AIV MTE2", "AIV MTE3", "Vector"))
        return Phase("backward", pipes, [cells.tile_fill(), cells.launch()]), constraints

    @staticmethod
    def head_tokens(problem: Problem, col_tile: int) -> int:
        """The vector bwd_head's tokens per copy of x (and of dy), in the backward's column tiles: a copy's
        latency shared by up to 4 tokens, the copy at most 32 KB (two of them in flight beside the head's
        state)."""
        hc, e = problem.shape[1], problem.dtype.itemsize
        return max(1, min(4, 32768 // (hc * col_tile * e)))

    @staticmethod
    def parts_rows(nout: int, bwd_groups: int) -> int:
        """Rows per token of the Cube backward's parts (bwd_head writes them): c = dmix rstd's hi and lo parts
        (NOUT16 rows each), then the super-tile's rows of diag(-k) (bwd_groups x 16: the token's own holds -k)."""
        return 2 * (-(-nout // 16) * 16) + bwd_groups * 16

    @staticmethod
    def x_stays_in_l2(problem: Problem, hw: HardwareProfile) -> bool:
        """Whether the Cube backward finds x and dy in the L2: bwd_head, launched just before it, read both
        whole; where the two fit in half the L2 (V4-Flash at 1024 tokens: 40 of 192 MB) nothing evicts
        them between the launches. At more tokens the backward reads them from HBM a second time."""
        rows, hc, d = problem.shape
        return rows * (hc + 1) * d * problem.dtype.itemsize <= l2_half(hw)

    @staticmethod
    def bwd_k0(hc: int, nout: int, groups: int, bwd_k: int) -> int:
        """Columns per Mmad step of the Cube backward: 128 where x's B (16 groups rows of 16-bit, twice)
        fits L0B's 64 KB beside the tile's fn B (HC x 3 NOUT16 x bwd_k, resident), else 64; never more
        than the tile's bwd_k."""
        fn_b = hc * 3 * -(-nout // 16) * 16 * bwd_k * 2
        return min(bwd_k, 128 if fn_b + 2 * 16 * groups * 128 * 2 <= 65536 else 64)

    def cube_floor(self, problem: Problem) -> dict[str, CubeWork]:
        """The forward's mix projection: NOUT products per x element (rows x W x NOUT MACs)."""
        rows, hc, d = problem.shape
        macs = rows * hc * d * self.spec.nout(hc)
        floors = {"forward": CubeWork(macs, fp32=problem.dtype.itemsize == 4)}
        if self.cube_backward(problem):   # dn = dmix fn and d_fn = c^T x
            floors["backward"] = CubeWork(2 * macs)
        return floors

    def vector_floor(self, problem: Problem) -> dict[str, VectorWork]:
        """Per element of the HC streams (E = tokens x HC x D; bf16 / fp16 cast once to fp32 and back):
        forward y's product (one MulAdd; the mix products and x^2 are the Cube's), backward's head
        d pre (dy . x), then dx = rstd dn + pre dy - k x (three products and two adds) and, on the
        vector unit (fp32), dn's and d fn's NOUT products each, which make that backward vector-bound."""
        rows, hc, d = problem.shape
        n, c, elems, ys = self.spec.nout(hc), cast_passes(problem.dtype), rows * hc * d, rows * d
        products = 0 if self.cube_backward(problem) else 2 * n
        return {"forward": VectorWork(elems * (1 + c) + ys * c),
                "backward_head": VectorWork(elems * (1 + c) + ys * c),
                "backward": VectorWork(elems * (products + 5 + 2 * c) + ys * c)}

    HEAD_LANES = (8, 16, 24, 32, 40, 48, 56, 64)   # the forward's head vector lanes (one repeat at most)

    @staticmethod
    def forward_rounds(rows: int, nout: int, lanes: int, aic: int) -> tuple[int, int, int]:
        """The forward's rounds as the kernel's host and binding make them: full ones (`lanes` tokens a
        vector core, whole 16s), the rest last, so the last round's head and second pass, which run after
        the Cube's last tile, are the shortest (1024 V4 tokens: 384, 384, 256 where even rounds of 352,
        352, 320 took 55.4k cycles against 54.3k); one round of every token where they fit. Returns the
        tokens per round, a vector core's tokens of a full round (at most), and the workspace floats of
        the accumulators ([rows][NOUT] mixes 32 B aligned, then [rows][16] squares)."""
        aivs = 2 * aic
        full = aivs * lanes // 16 * 16   # whole 16s: the Cube's token groups start at them
        round_rows = full if rows > full else -(-max(1, rows) // 16) * 16
        return round_rows, -(-round_rows // aivs), -(-rows * nout // 8) * 8 + rows * 16

    @staticmethod
    def pass2_chunk(chunk: int, hc: int) -> int:
        """Columns of each stream per chunk of the forward's second pass: the plan's chunk of W over HC."""
        return max(16, int(chunk) // hc)

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, hc, d = problem.shape
        col_tile = int(knobs["col_tile"])
        if col_tile not in self.col_tiles(problem):
            raise ValueError(f"{self.spec.name}: col_tile {col_tile}, accepted {self.col_tiles(problem)}")
        if hc * d > 65535:   # Nd2Nz's source row pitch
            raise PlanInfeasible("hc x hidden size", f"{hc * d} must be <= 65535 (V4-Pro: 4 x 7168)")
        groups, k0, lanes = int(knobs["cube_groups"]), int(knobs["cube_k0"]), int(knobs["head_lanes"])
        if groups not in self.CUBE_GROUPS or k0 not in (64, 128, 256) or lanes not in self.HEAD_LANES:
            raise PlanInfeasible("Cube tile", f"cube_groups {groups} (one of {self.CUBE_GROUPS}), cube_k0 {k0} (64, 128 "
                                              f"or 256), head_lanes {lanes} (one of {self.HEAD_LANES})")
        bwd = phase_schedule(knobs, "backward", ("in", "out"))
        return {"dtype": problem.dtype, "hc": int(hc), "d": int(d), "nout": int(self.spec.nout(hc)), "iters": int(ITERS),
                "head": bool(self.spec.head), "eps": float(EPS), "col_tile": col_tile, "chunk": self.pass2_chunk(knobs["chunk"], hc),
                "block_dim": int(knobs["block_dim"]), "row_block": int(self.ROW_BLOCK),
                "cube_groups": groups, "cube_k0": k0, "head_lanes": lanes, "cube_blocks": int(knobs["cube_blocks"]),
                "cube_backward": self.cube_backward(problem), "bwd_groups": int(knobs.get("bwd_groups", 1)),
                "bwd_k": int(knobs.get("bwd_k", 128)),
                "bwd_k0": self.bwd_k0(hc, self.spec.nout(hc), int(knobs.get("bwd_groups", 1)), int(knobs.get("bwd_k", 128))),
                "head_tokens": self.head_tokens(problem, col_tile),
                "parts_rows": self.parts_rows(self.spec.nout(hc), int(knobs.get("bwd_groups", 1))),
                "head_k0_bytes": self.HEAD_K0_BYTES, "res_parts": self.RES_PARTS, "dy_supers": self.DY_SUPERS,
                "bwd_prefetch": bwd["prefetch"], "bwd_in_buffers": bwd["in_buffers"],
                "bwd_out_buffers": bwd["out_buffers"]}

    def profile_params(self, problem: Problem, knobs: dict[str, int], hw: HardwareProfile) -> dict:
        """The Cube backward keeps every super-tile's parts in L1 where they fit (the kernel decides at the
        run's tokens against the profile's L1); the mixed bwd_head's L1 tiles (head_cols)."""
        return {"l1_bytes": int(hw.ascend_pipes(hw.cores).l1_usable), "head_cols": int(self.head_cols(problem, hw))}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Tokens that leave a tail core (and a short last token block), and a hidden size whose last
        column tile is short and not a multiple of 16 elements."""
        rows, hc, d = problem.shape
        return [Problem(problem.op, problem.variant, (min(rows, 2 * knobs["block_dim"] + 3), hc, d), problem.dtype),
                Problem(problem.op, problem.variant, (min(rows, knobs["block_dim"] + 5), hc, d + 3), problem.dtype)]

    def launch(self, problem: Problem, rows: int, d: int, knobs: dict[str, int]) -> SimpleNamespace:
        """The cores the kernels run on, the forward's tokens per round and the workspaces' offsets and sizes
        (fp32 elements) for `rows` tokens of width d: the backward's (ws_end) and the forward's accumulators
        (acc_floats)."""
        hc, n = problem.shape[1], self.spec.nout(problem.shape[1])
        on_cube = self.cube_backward(problem)
        block_rows, block_dim = row_split(rows, knobs["block_dim"])
        cube_rows, cube_blocks = row_split(rows, knobs["cube_blocks"])
        dfn_blocks = 0 if on_cube else block_dim   # the vector backward's d_fn partials, per core (the Cube's writes d_fn whole)
        ws_dfn = -(-(2 * n + hc + 2) * rows // 8) * 8
        ws_par = ws_dfn + dfn_blocks * n * hc * d
        par_blocks = 2 * cube_blocks if on_cube else block_dim   # bwd_head's vector cores (mixed with 16-bit x)
        ws_parts = ws_par + par_blocks * 32
        # the Cube backward's parts follow: [PROWS][rows] of x's dtype, then d_pre's blocks [rows][HC][16]
        parts = (-(-self.parts_rows(n, knobs["bwd_groups"]) * rows * problem.dtype.itemsize // 32) * 8 + rows * hc * 16
                 if on_cube else 0)
        round_rows, _, acc_floats = self.forward_rounds(rows, n, int(knobs["head_lanes"]), int(knobs["cube_blocks"]))
        return SimpleNamespace(block_rows=block_rows, block_dim=block_dim, cube_rows=cube_rows, cube_blocks=cube_blocks,
                               dfn_blocks=dfn_blocks, par_blocks=par_blocks, ws_dfn=ws_dfn, ws_par=ws_par,
                               ws_parts=ws_parts, ws_end=ws_parts + parts, round_rows=round_rows, acc_floats=acc_floats)

    def tiling(self, problem: Problem, rows: int, d: int, knobs: dict[str, int],
               geo: SimpleNamespace | None = None) -> bytearray:
        """AkMhcTiling for `rows` tokens of width d, as the tiling header's AkMhcMakeTiling makes it (from
        `geo`, the launch, where the caller has it)."""
        hc = problem.shape[1]
        geo = geo or self.launch(problem, rows, d, knobs)
        return bytearray(struct.pack("<7I3f3I", rows, d, geo.block_rows, -(-d // knobs["col_tile"]), self.pass2_chunk(knobs["chunk"], hc),
                                     geo.ws_dfn, geo.ws_par, EPS, EPS, 1.0 / (hc * d), geo.cube_rows, geo.ws_parts, geo.round_rows))

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and the two backward kernels in the emulator: (outputs, grads, {phase: RunReport}).
        d_base and d_scale (and the vector backward's d_fn) come back as per-core partials in the
        workspace, summed here (the binding does the same on the NPU); the Cube backward writes d_fn whole."""

        x = inputs["x"]
        rows, hc, d = x.shape
        n, w = self.spec.nout(hc), hc * d
        op = "mhc_head" if self.spec.head else "mhc_pre"
        on_cube = self.cube_backward(problem)
        geo = self.launch(problem, rows, d, knobs)
        block_dim, cube_blocks, dfn_blocks, par_blocks = geo.block_dim, geo.cube_blocks, geo.dfn_blocks, geo.par_blocks
        ws_dfn, ws_par, ws_parts = geo.ws_dfn, geo.ws_par, geo.ws_parts
        aic = int(knobs["cube_blocks"])   # the forward's AI cores split W's columns, whatever the tokens
        tiling = self.tiling(problem, rows, d, knobs, geo)
        fn, base = inputs["fn"].float().contiguous(), inputs["base"].float().contiguous()
        scale = inputs["scale"].float().contiguous()
        nan = float("nan")
        y = torch.full((rows, d), nan).to(x.dtype)
        post, comb = torch.full((rows, hc), nan), torch.full((rows, hc, hc), nan)
        mix_t, rstd = torch.full((n, rows), nan), torch.full((rows,), nan)
        fwd_bufs = [to_bytes(x.contiguous()), to_bytes(fn_parts(fn, x.dtype)), to_bytes(base), to_bytes(scale), to_bytes(y),
                    to_bytes(post), to_bytes(comb), to_bytes(mix_t), to_bytes(rstd), emulator.workspace(4 * geo.acc_floats), tiling]
        # fn's parts and the workspace (the accumulators) stay in L2; the AIVs' second read of x finds
        # the rows the AICs read a round before there
        exe = emu.exe("fwd", 11, cores="mix_1_2", l2_args=(1, 9), l2_vector_reads=(0,))
        fwd = emulator.run(exe, aic, fwd_bufs)
        outputs = {"y": from_bytes(fwd_bufs[4], y)}
        if not self.spec.head:
            outputs["post"], outputs["comb"] = from_bytes(fwd_bufs[5], post), from_bytes(fwd_bufs[6], comb)
        mix_t, rstd = from_bytes(fwd_bufs[7], mix_t), from_bytes(fwd_bufs[8], rstd)
        dy = grad_out["y"].to(x.dtype).contiguous()
        d_post = (grad_out["post"] if "post" in grad_out else torch.zeros(rows, hc)).float().contiguous()
        d_comb = (grad_out["comb"] if "comb" in grad_out else torch.zeros(rows, hc, hc)).float().contiguous()
        workspace = emulator.workspace(4 * geo.ws_end)
        head_bufs = [to_bytes(x), to_bytes(dy), to_bytes(base), to_bytes(scale), to_bytes(mix_t), to_bytes(rstd),
                     to_bytes(d_post), to_bytes(d_comb), workspace, bytearray(tiling)]
        if on_cube:   # mixed: d_pre on the Cube; the workspace (its blocks, the coefficients) in L2
            bwd_head = emulator.run(emu.exe("bwd_head", 10, cores="mix_1_2", l2_args=(8,)), cube_blocks, head_bufs)
        else:
            bwd_head = emulator.run(emu.exe("bwd_head", 10), block_dim, head_bufs)
        dx = torch.full_like(x, nan)
        if on_cube:   # a mixed kernel: fn's parts (read by every AI core), the workspace (bwd_head's coefficients
            # and parts, read per column tile) and dn's two slots per AI core in L2, x's second read (the AIVs') too;
            # x itself where bwd_head's read of it stays in the L2 until this launch
            dn_slots = emulator.workspace(4 * cube_blocks * 2 * knobs["bwd_groups"] * self.ROW_BLOCK * hc * knobs["bwd_k"])
            d_fn = torch.full((n, w), nan)
            bwd_bufs = [to_bytes(x), to_bytes(dy), fwd_bufs[1], to_bytes(dx), to_bytes(d_fn), head_bufs[8], dn_slots,
                        bytearray(tiling)]
            in_l2 = (0, 1) if self.x_stays_in_l2(problem, emu.hw) else ()   # x and dy, as bwd_head left them
            exe = emu.exe("bwd", 8, cores="mix_1_2", l2_args=(*in_l2, 2, 5, 6))
            bwd = emulator.run(exe, cube_blocks, bwd_bufs)
            d_fn, ws = from_bytes(bwd_bufs[4], d_fn), torch.frombuffer(bwd_bufs[5], dtype=torch.float32)
        else:
            bwd_bufs = [to_bytes(x), to_bytes(dy), to_bytes(fn), to_bytes(dx), head_bufs[8], bytearray(tiling)]
            bwd = emulator.run(emu.exe("bwd", 6), block_dim, bwd_bufs)
            ws = torch.frombuffer(bwd_bufs[4], dtype=torch.float32)
            d_fn = ws[ws_dfn:ws_par].view(dfn_blocks, n, w).sum(0).clone()
        par = ws[ws_par:ws_parts].view(par_blocks, 32).sum(0)
        grads = {"x": from_bytes(bwd_bufs[3], dx), "fn": d_fn,
                 "base": par[:n].clone(), "scale": par[n:n + (1 if self.spec.head else 3)].clone()}
        return outputs, grads, {"forward": fwd, "backward_head": bwd_head, "backward": bwd}


PARTS = (MhcAscend(PRE), MhcAscend(HEAD),)
