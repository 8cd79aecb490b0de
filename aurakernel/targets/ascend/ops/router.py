"""The AscendC kernel of router (templates/ascendc/): its planner phases, template values and emulator run.

Where the time goes (ascend910b2, 8192 x 256 experts, top-6, bf16; 171 rows per vector core; emulator
cycles per core; the backward's tiles of 24 rows, the most that fit its UB, and 24 against 16 cut the
instructions per row, 22.1 -> 20.6 us for forward + backward):
- forward (~13.6k cycles against an HBM bound of ~5.3k): the vector unit. Selection sorts only the
  members of each row's top K + 1 groups (was all 256 + two merges: 22.8k -> 18.7k cycles), but the
  NPU's sorting and gathering instructions (Sort32, MrgSort, Gather) run at the slow-op rate per 256 B
  they write (the emulator's estimate). The traced instruction mix (`python -m
  aurakernel.emulator.timeline`, a 24-row tile ~2.1k cycles) was ~40 cycles a row for selection
  and ~32 for the tail on [rows][32 B] compact tiles (ascending order, weights, tie flag:
  issue-bound, 12 cycles an instruction), against the ~31 a row of its HBM share. A core's short
  tile comes first (only its copy runs before the vector unit starts): 20.1k -> 19.7k cycles. The
  candidate tables start from one group's lanes, the rest by Progression (the vector unit waited
  ~1k cycles on 192 scalar writes): 19.1k. Groups of experts j, j + 64, ... (64 groups of 4 at 256
  experts, not 32 of 8): their maxima are two Sort32 lists merged, but the top 8 groups' 32 members
  are one list, so the candidates' gathers and sort halve and their merge goes (a 24-row tile 2.1k
  -> 1.9k cycles): 17.9k; that frees UB for 32-row forward tiles (`forward_tile_rows`: the forward
  launch has its own, as the hash router's; the model's UB now counts the tail's tables exactly,
  where whole rows of E rounded it to 204 KB against the 186 KB used), fewer instructions per row:
  16.9k. The tail's ascending sort of a row's K experts takes 8 lanes a row, four rows a Sort32 list
  (keys -(expert + j VP) keep the list's rows apart), where each row was a list of 32 lanes, 26 of
  them -inf: 15.8k. Every router kernel now copies its bias and first tiles in before it makes its
  tables (InitGather, the selection's offsets: ~1.9k cycles of scalar writes and Progressions came
  before any copy): 15.0k, the backward 11.2k -> 11.0k, the hash forward 7.8k -> 7.6k. The tail had
  ~35 instructions a tile over its compact tiles, 12 cycles of issue each: the ascending sort's keys
  are now integer adds on their bits (0xCB000000 + n is the float -(2^23 + n); lanes past K get
  0xFF000000 + ..., below them), where a Cast, a Muls and a Select made them; the index words' high
  halves are gathered from a zero word past the sorted lists (no Select); the weights' row sums read K
  lanes (no fill of the others); the tie flag is one compare (kth - next >= 2^-100) and a Select
  (five instructions were seven; a row tied at +inf, whose difference is NaN, was not flagged): 14.8k
  -> 14.0k. A tile's index words go out once the weights have read them, under its weights and tie
  flags (the last tile's three copies out ran one after the other at the end): 13.7k; v's -inf fill
  only where E leaves lanes past the pitch: 13.6k. A 32-row tile is now ~2.0k cycles, ~1.5k of it the
  passes over v (cast, bias, the NaN sum, the maxima: ~600) and the selection's sorts and gathers
  (~900). Wider tiles would spread the issue costs: with the UB limit lifted, 40 rows (212 KB of UB)
  emulate 13.7k and 48 rows (254 KB) 13.2k.
- backward (~13k cycles against ~10k; was ~17k): the scatter of each row's K gradients on the
  scalar unit. A2/A3 have no vector Scatter (the documented one is Ascend 950's), so the scalar unit
  writes the K gradients one by one; it reads the row's experts and gradients (in the dtype) from the
  compact tiles the vector unit leaves, 64 bits a read: for K = 6 in bf16 3 + 2 reads (int32 experts)
  and 6 writes a row (~44 cycles), where one value a read (6 + 6 + 6) took ~73; 2 + 2 with 16-bit
  experts (below). The writes are the floor.
  A third d logits tile lets the vector unit zero tile t + 2 while tile t is copied out (7.3 -> 7.1 us).
  The experts and d weights come up to 8 tiles a copy (SIDE_TILES), where each tile paid two copies'
  latency (~200 cycles each): 13.1k -> 11.9k cycles. The scalar scatter then set the pace (traced:
  busy without a gap, ~1056 cycles a 24-row tile against the vector unit's ~1000 and the copies'
  864): 16-bit dtypes now give it the experts as 16 bits too (one more Gather), four a read, so a
  row is 2 + 2 reads and 6 writes (11.9k -> 11.5k, the vector unit then the pace), and sigmoid(x)
  comes from softplus' exp(-|x|) with the routing scale folded into 2 s (one Exp, one Reciprocal
  and a Muls fewer): 11.2k cycles against ~10k of HBM.
- hash forward (the `given` kernel; 8.7k -> 7.8k cycles at its own 64-row tiles against ~5.3k of HBM):
  MTE2-bound (6.1k: the logits, one copy of the experts, a latency per tile) plus ~1.7k at the ends
  (the first tile and the core's experts before any compute). Its tile rows are a knob of their own
  (forward_tile_rows): its launch holds no backward, so 40-64 rows fit where the backward takes 24.
  The planner's row model ranked 16/40 (backward/forward rows) above 24/64, which emulates 0.85 us
  faster (11.42 against 10.57 us): it had no scalar stage and added one tile's copies for the fill
  and drain, whatever the slowest stage and the short tile. It now has the scatter's scalar ops
  (scalar_ops_per_row) and runs a core's tiles through the stages (planner/ascend.py `pipelined`),
  with the backward's third d logits tile (out_buffers): it picks 24/64 itself (10.57 us, 1.25x of
  the bound; 32/64 without the third tile, 10.82 us). Traced (AK_TRACE-style, per pipe): the forward
  is MTE2-bound to its last copy, then the last tile's compute and copy out (~1.4k cycles) run alone;
  the backward's scalar scatter is busy without a gap from the first tile's compute to the end, so
  its startup (the first tile and the side inputs' copy, ~2.4k cycles before the scalar starts) and
  the last copies out are what it adds to the scatter. A short first group of side inputs (two
  tiles) moved the rest's copy onto the third tile's path: 6.59 -> 6.66 us, not kept.
"""

from __future__ import annotations

import struct

import torch
from transformers.activations import ACT2FN

from .... import emulator
from ....dtypes import DType
from ....emulator import from_bytes, to_bytes
from ....errors import UserError
from ....ops.base import Problem, Tensors
from ....ops.router import SCALE, SPEC
from ....planner.ascend import AscendRowPhase, VectorWork, cast_passes, row_split, ub_pitch
from ..kernel import AscendKernel


# tiles' rows of the side inputs (the experts, the d weights) a copy brings: a copy's latency (~200 cycles)
# once per SIDE_TILES tiles where each tile paid its own, for SIDE_TILES x their UB queue buffers
SIDE_TILES = 8


class RouterAscend(AscendKernel):
    tile_rows_step = 8   # the compact tiles round a tile's rows up to 8 (Brcb) anyway: 24 rows fit where 32 do not
    # --- AscendC (templates/ascendc/router/): token rows split over the vector cores --------------
    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        return problem.shape[0], problem.shape[1]

    @staticmethod
    def tiling(dtype: DType, rows: int, experts: int, knobs: dict[str, int], from_logits: bool,
               scale: float = SCALE) -> bytearray:
        """AkRouterTiling for rows x experts, as the tiling header's AkRouterMakeTiling makes it."""
        return bytearray(struct.pack("<6If", rows, experts, ub_pitch(experts, dtype.itemsize),
                                     row_split(rows, knobs["block_dim"])[0], knobs["tile_rows"], int(from_logits), scale))

    def phases(self, problem: Problem):
        """Per row of E experts; the fp32 copy of a tile and the compact [rows][L] fp32 tiles are
        counted as per-row side buffers (so per queue buffer: the UB estimate errs on the safe side)."""
        rows, experts, top_k = problem.shape
        e = problem.dtype.itemsize
        lanes = 32 // e
        idx_bytes = -(-top_k * 8 // 32) * 32
        repeats = max(1.0, experts * 4 / 256)
        if problem.variant == "hash":   # the weights of the table's experts, from the logits; the experts
            # SIDE_TILES tiles a copy; per row the compact fp32 tile, four int32 gather tables, the gathered
            # values (dtype) and the lane mask
            fast, slow = 22, 5   # vector instructions over the compact tile, each issued once a tile
            fwd = AscendRowPhase("forward", 1, 0, idx_bytes, lanes * e, 0, 0,
                                 fast_ops_per_elem=fast * lanes * 4 / 256 / repeats,
                                 slow_ops_per_elem=slow * lanes * 4 / 256 / repeats, instrs_per_chunk=0,
                                 f32_tiles=(5 * lanes * 4 + lanes * e + lanes) / (experts * 4),
                                 instrs_per_tile=fast + slow, small_in_tiles=SIDE_TILES,
                                 own_tile_rows=True)   # its launch's UB holds no backward: larger tiles, fewer copies
        else:   # per row v = s + bias (fp32), its 64 group maxima, their two sorted lists, merge queues and
            # merged groups (4 QG structures each), the CW candidates (three tables, the expert, its byte
            # offset, value and sorted structure), the iota; with several candidate lists their merge
            # queues and final lists (4Q structures each); the compact tiles and tables of the tail
            vp = -(-experts // 128) * 128
            q = -(-(top_k + 1) // 4) * 4
            cw, qg = self.candidates(experts, top_k), self.group_tops(experts, top_k)
            merged = cw > 32   # the candidates are several Sort32 lists, merged
            scratch = vp * 4 + 64 * 4 + 64 * 8 + 4 * qg * 8 + cw * (6 * 4 + 8) + 64 * 4 + merged * 2 * 4 * q * 8
            # the tail's: gather offsets and key offsets, the K experts and their keys' bits (KP lanes a row),
            # their sorted structures, the weights' sums and broadcast, a row's scratch, the tie values (two
            # floats, two halves and a mask bit), the index words' lane mask, the gather tables (InitGather),
            # ReduceSum's scratch
            kp = self.sort_lanes(top_k)
            scratch += ((2 + 2 * kp + idx_bytes // 4) * 4 + 2 * kp * 4 + kp * 8 + 2 * lanes * 4 + 4 + e + 12
                        + idx_bytes / 32 + 4 * lanes * 4 + lanes * e + lanes / 8 + vp * 4 / 256 * 4)
            # per element of a row: cast, bias, the NaN sum, the maxima (fast), the groups' and candidates'
            # copies to their merges; at the slow rate per 256 B written: the maxima's two lists and the
            # tail's Sort32, the groups' merge, the two Gathers and Sort32 of the candidates, their merge.
            # The scratch (one per tile row, not queued) in fp32 rows of E (a fraction: its bytes exactly)
            fwd = AscendRowPhase("forward", 1, 0, 0, idx_bytes + lanes * e + 1, vp * 4 + 288, 0,
                                 fast_ops_per_elem=4 + (4 * cw + 4 * qg + merged * 4 * q) / experts
                                 + 22 * lanes * 4 / 256 / repeats,
                                 slow_ops_per_elem=(128 + 2 * kp + 8 * qg + 4 * cw + merged * 8 * q) / experts, instrs_per_chunk=0,
                                 f32_tiles=scratch / (experts * 4), instrs_per_tile=42,
                                 short_tile_first=True,   # vector-bound: its short tile's copy is all that waits
                                 own_tile_rows=True)      # its launch holds no backward: 32 rows fit where the backward takes 24
        # logits in, d logits out; index and d weights in (two copies, SIDE_TILES tiles each); per row, beside the queues, the
        # compact tiles: the gathered logits and the fp32 gradients (one per tile parity), six of work,
        # and per parity the experts (int32) and the gradients in the dtype, which the scatter reads;
        # and a third d logits tile (the kernel's DX_BUFFERS), counted whether or not buffers is 2. The scatter
        # (scalar unit) reads a row's experts and gradients 64 bits at a time and writes its K gradients
        compact = (2 + 6 + 2) * lanes * 4 + 2 * lanes * (4 + 2 * e) + experts * e
        fast, slow = 30, 8   # the backward's over the compact tiles, each issued once a tile
        bwd = AscendRowPhase("backward", 1, 1, idx_bytes + lanes * e, 0, 0, 0,
                             fast_ops_per_elem=fast * lanes * 4 / 256 / repeats + 1,
                             slow_ops_per_elem=slow * lanes * 4 / 256 / repeats, instrs_per_chunk=0,
                             instrs_per_tile=fast + slow,
                             small_in_copies=2, small_in_tiles=SIDE_TILES,
                             f32_tiles=compact / (experts * 4), scalar_ops_per_row=2 * -(-top_k * e // 8) + top_k,
                             out_buffers=3)
        return [fwd, bwd]

    @staticmethod
    def group_members(experts: int) -> int:
        """M: the members of each of the top-k kernel's 64 groups (VP / 64, VP = E rounded up to 128)."""
        return -(-experts // 128) * 128 // 64

    @classmethod
    def top_groups(cls, experts: int, top_k: int) -> int:
        """The top-k kernel's G: the groups whose members it sorts, G >= K + 1 and G x M a multiple of 32
        (whole Sort32 lists); its Init derives the same from the run's E."""
        members = cls.group_members(experts)
        groups = top_k + 1
        while groups * members % 32:
            groups += 1
        return groups

    @classmethod
    def candidates(cls, experts: int, top_k: int) -> int:
        """The top-k kernel's candidates per row: the members of its top G groups."""
        return cls.top_groups(experts, top_k) * cls.group_members(experts)

    @staticmethod
    def sort_lanes(top_k: int) -> int:
        """KP: the lanes a row takes in the forward's ascending sort of its K experts (32 / KP rows a Sort32
        list; rendered into the kernel)."""
        return 8 if top_k <= 8 else 16

    @classmethod
    def group_tops(cls, experts: int, top_k: int) -> int:
        """QG: the group maxima each of the two sorted lists gives their merge (G in whole 32 B)."""
        return -(-cls.top_groups(experts, top_k) // 4) * 4

    def vector_floor(self, problem: Problem) -> dict[str, VectorWork]:
        """Per logit: the cast, the bias (top-k) and one pass of a selection (no selection reads a
        value less than once); the K weights per row are negligible; backward the zeroed row and its
        cast. Far below the HBM traffic: HBM-bound."""
        rows, experts, _ = problem.shape
        elems, c = rows * experts, cast_passes(problem.dtype)
        fwd = VectorWork(elems * c) if problem.variant == "hash" else VectorWork(elems * (2 + c))
        return {"forward": fwd, "backward": VectorWork(elems * (1 + c))}

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        rows, experts, top_k = problem.shape
        if top_k > 32 // problem.dtype.itemsize:
            raise UserError(f"router on AscendC: top_k {top_k} > {32 // problem.dtype.itemsize} "
                            f"(a row's experts are kept in 32 B of {problem.dtype.value})")
        if problem.variant != "hash" and self.candidates(experts, top_k) > 128:   # one merge of four candidate lists
            raise UserError(f"router on AscendC: top-{top_k} of {experts} experts; the top-k kernel sorts the members "
                            f"of a row's top k + 1 groups (experts / 64 each), at most 128 (e.g. top-15 of 384 or 512)")
        return {"dtype": problem.dtype, "experts": int(experts), "top_k": int(top_k), "hash": problem.variant == "hash",
                "scale": float(SCALE), "tile_rows": int(knobs["tile_rows"]), "side_tiles": SIDE_TILES,
                "sort_lanes": self.sort_lanes(int(top_k)),
                "forward_tile_rows": int(knobs.get("forward_tile_rows", knobs["tile_rows"])), "buffers": int(knobs["buffers"]),
                "block_dim": int(knobs["block_dim"])}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Tokens that leave a tail core and a short last tile, a width of E - 3 experts (not a
        multiple of 16; narrower, not wider, than the plan's: E + 3 rounds the top-k kernel's rows up to
        the next 128 lanes, beyond the UB the plan sized for E), and (where the problem has that many
        tokens) two full tiles per core and a short third, so the prefetch and the kernels' two-stage
        loops run."""
        rows, experts, top_k = problem.shape
        bd, tr = knobs["block_dim"], knobs["tile_rows"]
        shapes = [(min(rows, 2 * bd + 3), experts, top_k), (min(rows, bd + 5), max(experts - 3, top_k + 1), top_k)]
        shapes += [(min(rows, bd * (2 * r + 1) - 5), experts, top_k) for r in (tr, knobs.get("forward_tile_rows", tr))]
        return [Problem(problem.op, problem.variant, s, problem.dtype) for s in dict.fromkeys(shapes)]

    def select(self, problem: Problem, knobs: dict[str, int], scores: torch.Tensor, bias: torch.Tensor, emu):
        """The top-k kernel alone (the forward entry): (indices, weights, tie flags, RunReport)."""
        rows, top_k = scores.shape[0], problem.shape[2]
        idx = torch.full((rows, top_k), -1, dtype=torch.long)
        w = torch.full((rows, top_k), float("nan")).to(scores.dtype)
        tie = torch.full((rows,), 255, dtype=torch.uint8)
        bufs = [to_bytes(scores), to_bytes(bias), to_bytes(idx), to_bytes(w), to_bytes(tie), bytearray(32),
                self.tiling(problem.dtype, *scores.shape, knobs, False)]
        report = emulator.run(emu.exe("fwd", 7), row_split(rows, knobs["block_dim"])[1], bufs)
        return from_bytes(bufs[2], idx), from_bytes(bufs[3], w), from_bytes(bufs[4], tie), report

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward (selection + weights; tie rows re-selected by torch.topk and weighted by
        the `given` kernel, as the host path does) and backward in the emulator."""

        logits = inputs["logits"]
        rows, experts = logits.shape
        top_k = problem.shape[2]
        _, block_dim = row_split(rows, knobs["block_dim"])

        def given(x: torch.Tensor, idx: torch.Tensor, from_logits: bool):
            w = torch.full((x.shape[0], top_k), float("nan")).to(x.dtype)
            bufs = [to_bytes(x), to_bytes(idx), to_bytes(w), bytearray(32),
                    self.tiling(problem.dtype, *x.shape, knobs, from_logits)]
            rep = emulator.run(emu.exe("given", 5), row_split(x.shape[0], knobs["block_dim"])[1], bufs)
            return from_bytes(bufs[2], w), rep

        reports = {}
        if problem.variant == "hash":
            indices = inputs["tid2eid"][inputs["input_ids"]].long().contiguous()
            weights, reports["forward"] = given(logits, indices, True)
        else:
            scores = ACT2FN["sqrtsoftplus"](logits)
            bias = inputs["bias"].float().contiguous()
            indices, weights, tie, reports["forward"] = self.select(problem, knobs, scores, bias, emu)
            tied = tie.nonzero().flatten()
            if reports["forward"].ok and tied.numel():   # exact ties: torch.topk decides, as in the reference
                picked = torch.topk(scores[tied] + bias, top_k, dim=-1, sorted=False).indices.sort(dim=-1).values
                indices[tied] = picked
                weights[tied], reports["forward_ties"] = given(scores[tied].contiguous(), picked.contiguous(), False)
        d_logits = torch.full_like(logits, float("nan"))
        bwd_bufs = [to_bytes(logits), to_bytes(indices), to_bytes(grad_out["weights"].to(logits.dtype)),
                    to_bytes(d_logits), bytearray(32), self.tiling(problem.dtype, *logits.shape, knobs, True)]
        reports["backward"] = emulator.run(emu.exe("bwd", 6), block_dim, bwd_bufs)
        return ({"weights": weights, "indices": indices}, {"logits": from_bytes(bwd_bufs[3], d_logits)}, reports)


PARTS = (RouterAscend(SPEC),)
