"""The AscendC kernel of sparse_attention (templates/ascendc/sparse_attention/): a mixed kernel, the
Cube's Q K^T and P V over each position's gathered keys, the vector cores' online softmax with the sink.

One position's H heads are the Cube's M (they share the one KV head), so each AI core takes whole
positions; its keys (the window's, then the compressed entries it sees) are gathered into L1 a tile
of `kv_tile` keys at a time, and D is sliced `d_chunk` columns per Mmad (Q K^T contracts over it,
P V produces it). 16-bit q and kv only: P V needs K's fractals transposed (V = K), which LoadData
does for 16-bit data.

Where the time goes (ascend910b2, V4-Flash widths, 1024 tokens, csa picking 128 of 256 entries at
random; emulator, per AI core). kv and the compressed kv are kept in L2 (their re-reads by every
position are L2 hits on the NPU): against the op's true bound (q, kv, y once; the Cube's MACs at peak)
csa is 2.6x, hca 2.4x.
- forward (csa 307 us, hca 191 us; 127 us at its own HBM traffic): the AIC's MTE2, ~465k of ~553k
  cycles (csa), gathering each position's keys from L2 at a copy per run of consecutive entries
  (random picks: about half of them start a run; each copy costs the profile's 200-cycle latency),
  the window and hca's entries one copy each. Two key tiles are in flight (the Cube stages t + 2 after
  P_t V_t; the AIVs make P_{t+1} before adding O_t): with one, the chain AIV softmax -> AIC P V -> AIV
  O update was serial, 534 us (csa) and 386 us (hca) at 64-key tiles. 128-key tiles halve the per-tile
  latencies of the vector cores' sequence (S in, P out, O_t in), which the model prices as its own
  term; positions are dealt to the AI cores round-robin (contiguous ranges left the last core the
  longest windows and the most picks, 6x the first one's gather).
- backward (csa 556 us, hca 421 us: at its own HBM traffic, 546 / 421 us): q, dy, y, y_lo, and the fp32
  key gradients added at their rows (atomic adds into HBM), beyond the op's minimum. Where those
  accumulators fit in half the L2 beside kv (`gradients_stay_in_l2`: 1024 tokens, not 65536) the NPU's
  atomic adds stay in L2: hca 421 -> 332 us (1.3x its own traffic; the op 2.41x -> 2.06x of its
  bound); csa unchanged at 555 us, now latency-bound, not by HBM: its AIC's MTE2 is busy 609k of
  ~1.0M cycles gathering each position's keys a copy per run (as in the forward), the Cube 410k. S and dP run two
  tiles ahead across positions and a position's dq goes out after the next one's first tile: with
  the Cube waiting at every position's start and the AIVs at its end it took 677 / 477 us. Its tiles
  are its own knobs (bwd_*): its L1 holds dy and dS too and its L0C S, dP and the gradient slices, so
  64-key tiles suit it where 128 suit the forward.
- csa's gather (merge_gap): with the same keys in consecutive entries (one run a position) the csa
  forward and backward took 380k and 821k cycles, against 553k and 1.0M with random picks, so the
  copies' latency was a third of the forward. Picks at most `merge_gap` entries apart are now
  gathered in one copy, the entries between them as holes: the binding lists them among the slots
  (-2 - entry), the Cube copies each run of consecutive entries whatever they are, and the vector
  cores mask the holes out (KeyMask: a position's slots come in once, as a row of values laid out
  like its key tiles). A hole costs a key's work (Cube, L0 loads, softmax, a zero gradient added),
  a run a copy's latency: at 1024 tokens, where half the ready entries are picked, merge_gap 2 took
  485k / 957k cycles (fwd+bwd 1553k -> 1442k); the planner prices both sides per gap (`position_keys`:
  runs and holes of random picks) and merges where picks are dense: merge_gap 2 with three dQ / dKV
  slices, csa 863 -> 782 us fwd+bwd (2.62x -> 2.37x of the bound); at 4096 tokens (top-512 of up to
  1024 ready) 8.60 -> 7.09 ms (the model: 8.24 -> 6.87). The model had priced the vector
  cores' pipes as one serial sequence and a position's tiles as the mean keys over kv_tile; emulated
  runs showed each position's own tile count, a vector core's busiest two pipes, and the Cube core's
  gather and L0 loads mostly taking turns in both kernels (AIC_TURNS: L1 holds two key tiles, and a
  tile's is read until its last product; wider O slices, with fewer vector-core copies, left the
  forward at 484k cycles), so it prices those: at the plans it predicts csa within 6% (826 against
  782 us) and hca within 13% (592 against 522), both high. A third key tile in L1 (the gather one
  tile further ahead of P V) does not fit beside two q buffers at 128-key tiles (528 KB): with one q
  buffer it took 536k cycles against 485k, and at 64-key tiles 664k against 690k, both behind (it is
  kept now: see the third key tile below, with the gather a walk of its own and q copied early). In
  the backward (P and dS in one L1 buffer, to stay within the 8 MTE1 -> MTE2 event IDs) it took the
  same 920k cycles: the turns there come from the Cube's MTE2 queue, in order, where each tile's P
  and dS copies wait on the vector cores' flag before the gathers queued after them.
- the backward's turns, taken apart: the gather of tile t + 1 waited for tile t - 1's gradients (its
  L1 buffer), tile t's P and dS copies queued behind that gather in the in-order MTE2, and tile t's L0
  loads behind tile t + 1's S (which waits for the gather) in the in-order MTE1, so per tile the
  gather and the L0 loads ran one after the other. Now L1 holds three key tiles (P and dS share one
  buffer, for the 8 MTE2 -> MTE1 event IDs), a tile's gather goes one tile before its S (a queue
  entry taken at its S, not at the copy), the next tile's P and dS copies go ahead of the gather, and
  a position's q and dy follow the gather as soon as their buffer is free (ahead of it they held it
  back at every position start: 846k -> 862k): csa's backward 921k -> 815k cycles (512 -> 453 us;
  fwd+bwd 782 -> 723 us, 2.37x -> 2.19x of the bound), hca's 597k -> 516k (522 -> 477 us, 2.06x ->
  1.88x). The model's backward share of MTE2 + MTE1 that does not overlap is now 0.77 (BWD_AIC_TURNS;
  emulated 0.80 csa, 0.73 hca).
- the forward's window, where it is a key tile of its own (window = kv_tile: V4's 128): consecutive
  positions of a core are cubeBlocks apart, so their windows share all but that many rows. The tile
  stays in L1 as a ring (kv row g at row (g - rot) % kv_tile) and a position copies only the rows its
  buffer's earlier window lacks: its buffer (of two, in turn) holds the window of the core's previous
  position where that one had two tiles (hca: window and entries), of the one before where both had one
  (sliding); csa's positions of three tiles leave compressed entries there. Traced
  (`python -m aurakernel.emulator.timeline`): hca's AIC MTE2 223k -> 162k cycles, csa's 344k -> 318k,
  the forwards 343k -> 332k and 485k -> 481k cycles: the Cube core's gathers were not what set their
  pace. hca's forward is now paced by its vector cores' chain per tile (S in, softmax, P out, P V in:
  their MTE2, vector and MTE3 each ~55% busy); csa's by the Cube core's L0 loads of P V_t, which queue
  in MTE1 behind S_{t+1}'s (they wait for tile t + 1's gather), and the gather of t + 2 waits for
  those loads to free t's buffer: a third key tile would break that chain and does not fit beside two
  q buffers (see above). The backward gathers at 64-key tiles (the window two of them, three buffers
  in turn) and keeps its whole-window copies.
- the backward's fixed costs per tile and position (a copy's 200-cycle latency; the hca backward's
  vector cores' MTE2 was ~75% busy, a third of it the latencies): a tile's S and dP come to the AIVs,
  and its P and dS go out and into the Cube's L1, in one copy each (the workspace holds two slots of the
  first, then two of the second: one copy of two blocks, or of two ND matrices, where there were two);
  a position's first dQ tile writes its accumulator and the rest add, so the AIVs no longer zero it
  after reading it out (64 KB of writes a position each); and the AIVs' read of dy for Delta follows
  their Cube core's read of the same rows, so it is an L2 hit (`l2_vector_reads`). csa's backward
  815k -> 759k cycles, hca's 516k -> 478k (fwd+bwd 720 -> 689 us, 2.19x -> 2.09x; 471 -> 450 us, 1.85x
  -> 1.77x).
- the forward's vector cores read each tile's P V in o_chunk slices, a copy each (four a tile at 128
  columns: hca's forward is paced by their chain per tile). One P tile and one y slice in UB (where two
  of each were) leave room for 256-column slices with one score tile, which the planner now considers
  and picks (it prices the y and y_lo copies out one after the other at a position's end): hca's forward
  332k -> 313k cycles, csa's 481k -> 469k (two y slices cost 37k cycles at 128 columns, not kept).
- a whole key tile's D slice goes to L0B in one LoadData (its fractals are consecutive in L1 and in
  L0B), where a call per D fractal column was (8 at 128 columns, each paying the issue cost): the
  Cube core's MTE1 -26k cycles in hca's backward, -50k in csa's; csa fwd 469k -> 459k, bwd 759k ->
  744k; hca bwd 478k -> 464k cycles.
  The plans predict fwd+bwd csa 680 us (669 emulated), hca 490 us (432): the backward's
  chain of latencies between the Cube and the vector cores is what the model sees least of.
- hca's forward, traced (1024 tokens): a position is its window's tile (128 keys) and a tile of its
  up to 8 ready entries, and that small tile cost as much as the window's: its S slot, softmax, P
  slot, a P V of 64 x 512 fp32 through the workspace (four Fixpipes) and the vector cores' read and
  update of all of O. The vector cores idled 42% of the launch (1.4k cycles at every position, waiting
  on the Cube core's chain for the next one). A position's last tile of at most `pair_keys` keys now
  joins the tile before (PositionKeys: tiles of kv_tile keys, the last up to kv_tile + pair_keys): its
  rows follow the window's ring in the same L1 buffer, its S and P V are Mmads of their own (so L0B
  keeps kv_tile-key slices), P V added in L0C, and the vector cores see one tile of up to kw = kv_tile +
  pair_keys columns (one softmax, one O update). hca's forward 313.0k -> 228.6k cycles, as much as the
  sliding window's alone (228.6k): fwd+bwd 432 -> 385 us. Tried first, and not kept: the short tile
  as a tile of its own whose softmax shares the window tile's max (its P V added in L0C, one O update):
  387k cycles, as the pair's second S then waited for the window's P V and nothing ran ahead. The
  planner picks pair_keys (0, 32 or 64; hca only, where the last tile is short at every position) under
  the wider tiles' capacities: 32 at 1024 and 4096 tokens (64 would need 528 KB of L1 with two q buffers).
  The backward's positions are three tiles of 64 keys (two of the window, one of entries) and a joined
  last tile does not fit there: three key tiles of 80 keys beside two q and dy buffers need 516 KB of
  L1; with two key tiles (and two dQ / dKV slices in L0C) it took 494k cycles against 464k.
- the backward's vector cores, traced (hca, 1024 tokens): their MTE2 is the busiest pipe (345k of 464k
  cycles), much of it copies' latencies: at every position Delta read y, y_lo and dy a copy each per
  128-column slice, 12 copies. Delta now takes as many columns a step as UB holds beside the tiles
  (`delta_chunk`: 256 at V4-Flash widths), its fp32 steps in the space the accumulators' zeroing and
  conversion steps use before and after the tiles: hca's backward 464.2k -> 445.0k cycles, csa's 744k
  -> 710k; fwd+bwd hca 385 -> 374 us (1.47x of its bound), csa 669 -> 649 us (1.97x).
- the backward's start, traced: the Cube core waited in the SyncAll for the vector cores' zeroing of
  the accumulators (~3.7k cycles: the key mask's table, then the zeros' copies) and only then copied
  its first keys, q and dy. It now copies the first tile's keys and the first position's q and dy
  before that SyncAll (all the copies the first two tiles need took longer than the zeroing: 713k):
  csa's backward 709.8k -> 706.5k cycles, hca's 445.0k -> 442.7k.
- the backward's end: after the last SyncAll each vector core turns its share of the fp32 key
  gradients into T in steps that waited for every pipe (copy in, cast, copy out: ~680 cycles a step of
  2048 floats); the steps now pass through the dQ / dKV queues, idle by then, two in flight: csa's
  backward 706.5k -> 703.5k cycles, hca's 442.7k -> 440.3k (fwd+bwd csa 645.9 us, 1.96x of its
  bound; hca 371.6 us, 1.46x).
- the forward's position ends, traced (csa): a vector core's Finish (y and y_lo out, a slice at a
  time through one UB buffer: ~3k cycles) came before the next position's second softmax, so the Cube
  core, its P V of the next tile done, waited for that P (its MTE2 idle 31% of the launch). The vector
  cores now make that P first where the tile is the next position's (not where it is a later one's:
  their m and l are kept per position parity), and O_t goes to one of two P V slots in turn (the Cube
  core writes O_{t+1} while the vector cores still read O_t; the workspace grows by H x D fp32 per AI
  core): csa's forward 459.2k -> 442.1k cycles (fwd+bwd 645.9 -> 636.4 us, 1.93x of its bound); hca's
  unchanged (228.6k: its positions' tiles are paced by the chain within one). What paces csa's forward
  now: the Cube core's gathers (MTE2, 318k busy) and L0 loads (MTE1, 191k) taking turns, as above;
  the window's ring is reused only after a position of two tiles, and half of the positions at 1024
  tokens have three (505 of 1024; 82k of the 123k window rows are copied).
- a third key tile in L1 beside one q buffer (464 KB where two q buffers and three key tiles need 528):
  the gather is its own walk, up to K_BUFFERS tiles ahead of P V, so tile t + 2's copy no longer waits
  for P_t V_t's L0 loads, and a position's q is copied as soon as the walk reaches its first tile,
  under the P V before (staged with its S, after that position's gathers, it cost two-buffer csa 47k
  cycles: the gathers wait on a buffer, q on nothing). Where positions have three tiles (csa) the
  window's buffer is again the previous position's: window_rows counts the rows each buffer lacks for
  any number of buffers. csa's forward 442.1k -> 396.2k cycles, fwd+bwd 636.4 -> 611.0 us (1.93x ->
  1.86x of its bound; forward 1.72x its own HBM traffic); its Cube core's MTE2 and MTE1 now overlap to
  0.79 of their sum (AIC_TURNS[3], 0.77 with the halves below; 0.9 with two key tiles), and the planner takes one q buffer
  for csa at 1024 and 4096 tokens (the V4-Flash step modeled 2187.0 -> 2181.1 ms); hca keeps two (its
  joined tiles of 160 keys leave no room for a third, and with three its window's buffer holds entries).
  The q buffer's wait, priced on its own before (a copy per position), is inside that emulated share.
- the backward's Cube core, traced: at every position it waited ~2.6k cycles for the next tile's P and
  dS, queued in its in-order MTE2 behind the next position's q and dy (64 KB each from HBM, ~2k cycles
  a copy), issued together once the position began. dy now comes a tile after q (Fetch), so each
  holds one tile's P and dS back, not two copies' worth: csa's backward 703.5k -> 661.3k cycles, hca's
  440.3k -> 430.6k (fwd+bwd csa 605.0 -> 581.6 us, hca 371.6 -> 366.2 us); BWD_AIC_TURNS 0.77 -> 0.68.
  Halves of each (four copies a position, one a tile) took 669.7k: their latencies cost more than
  they hid; dy two tiles after q 663.5k.
- O_t is flagged to the vector cores in halves of D (flag 2 per half, OPARTS): they read and add the
  first half while the Cube core's Fixpipes write the second, where they waited for all four slices
  (the chain P_t out -> P_t V_t -> O_t in paced the forward's vector cores, idle ~1.2k cycles a tile):
  csa's forward 396.2k -> 385.5k cycles (fwd+bwd 611.0 -> 605.0 us, 1.84x); hca's unchanged (at its
  own HBM traffic). A flag per o_chunk slice overflowed the cross-core counter (15) at V4-Pro's
  32-column slices, 16 a tile.
- a position's end, traced (csa: the Cube core idled ~2k cycles at most positions' ends): Finish
  took y's fp32 rounding error in a P V buffer (inPV_) for each slice, so the next position's first O_t
  reads waited for Finish's slices, and that position's next S read queued behind them in the vector
  cores' in-order MTE2. The first slice's error now goes to a P V buffer and each later one's to the O
  slice before it (done with by then): csa's forward 385.5k -> 381.8k cycles (hca's unchanged).
  Measured, and not a lever: the O update's multiply by alpha (dropped for timing: 385.4k), a quarter of
  O_t's reads (381.2k) or of its Fixpipes (381.5k); every gather but a 16-row copy took 356.7k, where no
  pipe is busier than 61%: the chain S -> P -> P V across the Cube and vector cores, not one pipe, sets
  the pace. A core's positions in runs of consecutive ones (their windows share all but a row; dealt in
  turn, every other round reversed) took 401.0k (runs of 2) to 467.4k (runs of 8): the rows saved are
  few, the imbalance of whole runs is not. Where the time is, by what dropping a step's work gives
  (timing only, from 381.8k): the softmax's exp 377.7k; S's Mmads at k = 16, 381.2k; a position's q
  copied as 16 rows, not 64 (the backward's dy too): 347.8k, backward 661.3k -> 612.1k. q and dy come
  from HBM at the AI core's share (~2k cycles a 64 KB copy), in the in-order MTE2 ahead of the gathers
  and P copies, and no vector-core read can warm the L2 for them (6 KB of their UB is free). S made
  three tiles ahead of P V (three score and P slots, m and l per position mod 3) took 439.4k: tile
  t + 2's S then waits on its gather, issued one step before it, where it had a P V of slack.
  The backward's dy the other way round (the vector cores read it first, from HBM, for Delta a position
  ahead, flag 5 before the Cube core's copy, which then finds it in L2): 661.3k -> 665.4k with Delta at
  a position's start (its HBM reads lengthen the vector cores' step before the first coefficients); after
  the first tile's coefficients the Cube core's wait comes before the S that tile needs (a hang).
  Tried and not kept: q and dy in the backward's L1 a D slice at a time, each slice's fractals in ZZ
  order, so a slice's A (and B transposed) is one LoadData where it takes one per 16 heads: MTE1 -102k
  cycles, but four copies of each where there was one queue in the in-order MTE2: 703.5k -> 740.9k.
  The forward's q the same way (a queue buffer per D / DC column slice, a position's first S taking
  each slice as its Mmads reach it, so they start on the first): 381.8k -> 405.7k cycles (four slices)
  and 389.2k (two): the AI core's MTE2, 81% busy, pays a copy's latency per slice, more than the
  earlier start hides.
- long sequences (the planner at V4-Flash's 65536 tokens: 512 picks of up to 16384 ready entries, most
  a copy of their own): the Cube core's MTE2 gathering them was 137 ms of the forward's ~140 ms a call
  and 144 ms of the backward's (the Cube 20 and 51 ms), a copy's latency per pick. With aiv_gather the
  two vector cores copy a share of each tile's picks (its last eighths) into a packed workspace slot,
  which the Cube core copies into L1 in one copy (PackedKeys), so three MTE2 queues pay those
  latencies; the backward still adds each pick's gradient at its own row. The planner gives them six
  eighths there, none at 1024 tokens (dense picks: long runs, and the packed rows cross the Cube core's
  MTE2 all the same): csa 281.5 -> 160.1 ms a call, the modeled step 51.45 -> 48.90 s (MFU 31.7% ->
  33.3%). Emulated at 2048 tokens with 64 picks: 2.75M -> 1.93M cycles fwd+bwd; at 4096 with 128
  (merge_gap 0), forward 4.15M -> 2.20M, backward 5.05M -> 3.17M.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from .... import emulator
from ....emulator import from_bytes, to_bytes, workspace
from ....errors import PlanInfeasible
from ....hardware import HardwareProfile
from ....ops.base import Problem, Tensors
from ....ops.sparse_attention import CSA_RATIO, SPEC, entries_of
from ....planner.ascend import CubeCells, CubeWork, align32, cube_cores, cube_tile_cycles, l2_half
from ....planner.model import ChoiceModel, Constraint, Phase
from ..kernel import AscendKernel

TILING = "<8If"   # AkSparseAttentionTiling
# the forward's knobs: keys per tile, D columns per Mmad, O columns per vector step, score tiles per
# vector core, q buffers in L1 (two: the next position's copy runs under this one's tiles), and the most
# keys a position's last tile may have to join the tile before (pair_keys: one softmax, P V and O update
# for both, where hca's few entries made a tile of their own after the window's), and the eighths of csa's
# compressed rows the vector cores gather for the AI core (aiv_gather)
KNOBS = ("kv_tile", "d_chunk", "o_chunk", "s_buffers", "q_buffers", "merge_gap", "pair_keys", "aiv_gather")
# the backward's own (its L1 holds dy and dS too, its L0C S, dP and the gradient slices, so its best
# tiles differ): keys per tile, D columns per Mmad, dq columns per vector step, q / dy buffers in L1,
# dQ / dKV slices in L0C (three: the Cube's next slices do not wait for the Fixpipes scattering one)
BWD_KNOBS = ("bwd_kv_tile", "bwd_d_chunk", "bwd_o_chunk", "bwd_q_buffers", "g_buffers", "merge_gap", "aiv_gather")
PAIR_KEYS = (0, 32, 64)    # pair_keys' values: whole 32-column steps of the softmax (a tile of KN + pair_keys columns)
# the forward's share of its Cube core's gathers and L0 loads that do not overlap, by its key tiles in L1:
# with three (one q buffer) the gather runs two tiles ahead (emulated, csa at 1024 tokens: 385.5k cycles
# against MTE2 + MTE1 of 501k)
AIC_TURNS = {2: 0.9, 3: 0.77}
BWD_AIC_TURNS = 0.68       # the backward's, gathering two tiles ahead of its gradients, the next position's dy a
                           # tile after its q (emulated: csa 0.70, hca 0.67; with both at once 0.80 and 0.73)
FIX_WAIT = 20              # cycles the backward's Cube waits a dQ / dKV slice with two slices in L0C (emulated at
                           # 1024 tokens, three against two: csa 921k / 957k, hca 597k / 616k cycles)
HOLE_MASK_TILE, HOLE_MASK_POS = 4, 2   # with holes, vector instructions of KeyMask per tile and per position

# csa's merge_gap: the widest gap between two picks gathered as one run, none or two entries. Emulated at
# V4-Flash widths, 1024 tokens (picks 128 of up to 256 ready: half of them), 0 / 1 / 2 / 3 / 4 took
# 1553k / 1490k / 1442k / 1445k / ~1449k cycles fwd+bwd; each value more costs the MILP ~1.5 s
GAPS = (0, 2)
# csa's aiv_gather: eighths of a tile's compressed rows (its last) the vector cores gather for the AI core.
# Emulated at 4096 tokens (V4-Flash widths, 128 picks of up to 1024 ready entries, merge_gap 0), 0 / 4 / 6:
# forward 4.15M / 2.84M / 2.20M cycles, backward 5.05M / 3.79M / 3.17M (the model: 3.88M / 2.72M / 2.66M and
# 4.39M / 3.33M / 2.87M); at 1024 tokens (half the ready entries picked: long runs) it is not picked
AIV_GATHER = (0, 4, 6)
PACK_ROWS = 16             # rows a vector core stages in UB on their way to a packed slot (two such buffers)
SLOT_PAD = 8               # -1s before the first position's slots (rendered into the kernels and the binding)
BWD_KEY_TILES = 3          # key tiles in the backward's L1: a tile's gather one tile before its S, two before its gradients
CVT = 2048                 # floats per step of the backward's key-gradient zeroing


def tail_mask_ub(kw: int) -> int:
    """UB of a tile's key mask (KeyMask) at kw columns a row: the column numbers of whole rows in whole
    32 B blocks of bits (256 of them for kw 64, 128 and 256; 1280 for 160), and at least a block of bits."""
    return kw // math.gcd(kw, 256) * 256 * 4 + 32


def position_tiles(keys: float, kn: int, pk: int = 0) -> int:
    """A position's key tiles (PositionKeys::Tiles): kn keys each, the last the rest, which joins the tile
    before where it has at most pk keys."""
    tiles = max(1, math.ceil(keys / kn))
    return tiles - 1 if pk and tiles > 1 and keys - (tiles - 1) * kn <= pk else tiles


def bwd_ub(mine: int, kn: int, vc: int, dv: int, e: int, extra: int) -> int:
    """A backward vector core's UB: S and dP in, P and dS out (kn keys), the dq accumulator's and dq's
    slices (vc columns; the accumulators' conversion steps pass through them after the tiles), Delta's
    reads and fp32 steps (dv columns; the accumulators' zeroing steps share that space, before the
    tiles), the key mask, the per-head vectors and their Brcb blocks, and `extra` (with csa's holes
    hole_mask_ub, with its packed gathers staging_ub)."""
    return (2 * mine * kn * (4 + e) + 2 * mine * vc * (4 + e) + 2 * mine * dv * e + max(2 * mine * dv * 4, CVT * 4)
            + tail_mask_ub(kn) + extra + mine * kn // 8 + 7 * mine * 4 + 2 * mine * 32)


def delta_chunk(mine: int, dim: int, kn: int, vc: int, e: int, extra: int, ub_usable: int) -> int:
    """Columns of D per step of the backward's Delta (three copies a step, y, y_lo and dy): the widest
    multiple of vc dividing D that the UB holds (at V4-Flash widths 256 where the dq slices take 128)."""
    widths = [dv for dv in range(dim, vc - 1, -vc) if dim % dv == 0 and dv % vc == 0]
    return next((dv for dv in widths if bwd_ub(mine, kn, vc, dv, e, extra) <= ub_usable), vc)


def staging_ub(aiv_gather: int, row_bytes: int) -> int:
    """A vector core's UB for its share of the gathers (PackedKeys): two buffers of PACK_ROWS rows."""
    return 2 * PACK_ROWS * row_bytes if aiv_gather else 0


def ub_extra(window: int, picks: int, gap: int, kn: int, aiv_gather: int, row_bytes: int) -> int:
    """What csa adds to a vector core's UB in either kernel: its holes' mask and its packed gathers' staging."""
    return hole_mask_ub(window, picks, gap, kn) + staging_ub(aiv_gather, row_bytes)


def hole_mask_ub(window: int, picks: int, gap: int, kn: int) -> int:
    """UB of KeyMask's holes (0 without): a tile's 256 values, and a position's slots as int32 and as
    fp32 in whole tiles (window + slots at most: picks and (picks - 1) x gap holes)."""
    return 0 if gap == 0 else 256 * 4 + 8 * -(-(window + picks + (picks - 1) * gap) // kn) * kn


def key_loads(kn: int, dc: int) -> int:
    """LoadData calls of a key tile's D slice as B (KeysAsB): one where the tile's fractals of the slice
    fit one call's 255 repeats (whole tiles; the model takes every tile as whole), else one per D fractal
    column"""
    return 1 if dc // 16 * (kn // 16) <= 255 else dc // 16


def key_mask_cycles(gap: int, tiles: float, positions: float, lat: float, issue: float) -> tuple[float, float]:
    """A vector core's KeyMask work for csa's holes (none at gap 0): its copies (a position's slots, one
    copy each) and its vector cycles (a cast per position, each tile's mask made from that row)."""
    if gap == 0:
        return 0.0, 0.0
    return positions * lat, (tiles * HOLE_MASK_TILE + positions * HOLE_MASK_POS) * issue


def key_buffers(q_buffers: int) -> int:
    """The forward's key tiles in L1 (the kernel's K_BUFFERS): three beside one q buffer, else two."""
    return 3 if q_buffers == 1 else 2


def aic_turns(pipes: dict[str, float], share: float) -> float:
    """The Cube core's gathers (MTE2) and L0 loads (MTE1) taking turns in part: `share` of their sum."""
    return share * (pipes["MTE2"] + pipes["MTE1"])


def compact_picks(indices: torch.Tensor, entries: int, gap: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's picks [B, S, K] as the kernels read them: each row's slots, then -1s (int32), and
    their count per row [B, S] (int32). A slot is a distinct valid pick, in ascending order; with gap > 0
    the entries between two picks at most `gap` apart are slots too, as holes (-2 - entry): the Cube
    gathers a run of consecutive entries in one copy and the vector cores mask the holes out of the
    softmax, so a hole costs a key's work where a new run costs a copy's latency. The dense mask the
    reference builds sees a repeated pick once; so do the kernels."""
    none = entries + 1
    x = torch.where(indices >= 0, indices, torch.full_like(indices, none)).sort(-1).values
    repeat = torch.zeros_like(x, dtype=torch.bool)
    repeat[..., 1:] = x[..., 1:] == x[..., :-1]
    x = torch.where(repeat, torch.full_like(x, none), x).sort(-1).values.long()
    count = (x < none).sum(-1)
    if gap <= 0 or x.shape[-1] < 2:
        return torch.where(x < none, x, torch.full_like(x, -1)).to(torch.int32), count.to(torch.int32)
    holes = x[..., 1:] - x[..., :-1] - 1                            # after pick i, before pick i + 1
    holes = torch.where((holes <= gap) & (x[..., 1:] < none), holes, torch.zeros_like(holes))
    holes = torch.cat([torch.zeros_like(x[..., :1]), holes], -1)    # before pick i
    slot = torch.arange(x.shape[-1]) + holes.cumsum(-1)             # pick i's slot
    total = count + torch.where(x < none, holes, torch.zeros_like(holes)).sum(-1)
    width = max(int(total.max()), 1)
    first = torch.zeros(*x.shape[:-1], width + 1, dtype=torch.long)   # 1 + the pick at or before each slot
    first.scatter_(-1, torch.where(x < none, slot, torch.full_like(slot, width)),   # no pick: past the end
                   torch.arange(1, x.shape[-1] + 1).expand_as(x).contiguous())
    pick = first[..., :width].cummax(-1).values.clamp(min=1) - 1
    col = torch.arange(width)
    at = slot.gather(-1, pick)
    entry = x.gather(-1, pick) + (col - at)
    out = torch.where(col == at, entry, -2 - entry)
    out = torch.where(col < total.unsqueeze(-1), out, torch.full_like(out, -1))
    return out.to(torch.int32), total.to(torch.int32)


@functools.cache
def position_keys(variant: str, seq: int, window: int, extra: int, gap: int = 0) -> tuple[tuple[float, ...], float]:
    """Per position s of a batch row the keys it attends to (its window, then the compressed entries:
    csa's slots, hca's ready entries), and the mean copies over the positions that gather the compressed
    ones. csa's k picks are drawn at random among its r ready entries, each entry after a pick another
    pick with odds k / r: a run ends at a gap of more than `gap` entries (at gap 0: k - k (k - 1) / r
    runs) and the entries of the gaps it spans are holes among the slots. Real indexer picks cluster
    more; this is what random picks cost."""
    keys, runs = [], 0.0
    for s in range(seq):
        ready = (s + 1) // (CSA_RATIO if variant == "csa" else max(extra, 1))
        entries = 0.0
        if variant == "csa" and ready:
            k = min(extra, ready)
            q = 1.0 - k / ready                                      # an entry after a pick is no pick
            runs += k - (k - 1) * (1.0 - q ** (gap + 1))
            entries = k + (k - 1) * sum(h * q**h * (1.0 - q) for h in range(1, gap + 1))
        elif variant == "hca":
            entries, runs = ready, runs + (ready > 0)
        keys.append(min(s + 1, window) + entries)
    return tuple(keys), runs / seq


def window_rows(keys: tuple[float, ...], window: int, kn: int, apart: int, buffers: int = 2) -> float:
    """The window's kv rows the forward copies over a batch row's positions, `keys` each (position_keys).
    Where the window is a key tile of its own (kn == window, full from position window - 1 on) that tile
    stays in L1 in ring order and copies only the rows its buffer's earlier window lacks. Its buffer (of
    `buffers`, in turn) last held the tile that many before it: the window of a core's earlier position
    (a core's positions are `apart` apart: position_split's AI cores) where the tiles of the positions
    since then, that one's included, are exactly `buffers` (two buffers: the previous position of two
    tiles, or the two before of one each; three: the previous one of three tiles, ...); else compressed
    entries, and the whole window is copied."""
    def tiles(s: int) -> int:
        return -(-int(keys[s]) // kn)

    rows = 0.0
    for s in range(len(keys)):
        back, behind, k = 0, 0, 0
        if kn == window and s >= window - 1:
            while behind < buffers and s - (k + 1) * apart >= 0:
                k += 1
                behind += tiles(s - k * apart)
                if behind == buffers and s - k * apart >= window - 1:   # that position's window, in ring order
                    back = k
        rows += min(window, back * apart) if back else min(s + 1, window)
    return rows


def slot_bytes(heads: int, dim: int, keys: int, slots: int, packed: int = 0) -> int:
    """An AI core's workspace slots (one source for the kernels' layout, the binding's workspace and the
    emulator runs): `slots` fp32 score tiles (S; the backward's S and dP) and as many 16-bit probability
    tiles (P; P and dS) of heads x keys, then two fp32 heads x dim (the forward's P V slots, the backward's
    dQ accumulators), then `packed` 16-bit key tiles of keys x dim (the vector cores' share of the gathers)."""
    return slots * heads * keys * (4 + 2) + 2 * heads * dim * 4 + packed * keys * dim * 2


def pack_slots(aiv_gather: int, ahead: int) -> int:
    """A kernel's packed key slots (PackedKeys): none where the AI core gathers every key, else one per
    tile its gathers run `ahead` (the forward's key_buffers, the backward's BWD_KEY_TILES) and two more,
    so the vector cores pack ahead of its need."""
    return ahead + 2 if aiv_gather else 0


def workspace_slots(heads: int, dim: int, knobs: dict[str, int]) -> dict[str, int]:
    """Both kernels' workspace slots at a plan's knobs: each one's packed key slots and an AI core's
    slot bytes (slot_bytes; the forward's tiles kv_tile + pair_keys keys wide)."""
    share = int(knobs.get("aiv_gather", 0))
    fwd, bwd = pack_slots(share, key_buffers(int(knobs["q_buffers"]))), pack_slots(share, BWD_KEY_TILES)
    kw = int(knobs["kv_tile"]) + int(knobs.get("pair_keys", 0))
    return {"pack_slots": fwd, "bwd_pack_slots": bwd,
            "fwd_slot_bytes": slot_bytes(heads, dim, kw, FWD_SLOTS, fwd),
            "bwd_slot_bytes": slot_bytes(heads, dim, int(knobs["bwd_kv_tile"]), BWD_SLOTS, bwd)}


def packed_gather(aiv_gather: int, copies: float, rows: float, tiles: float, kn: int, row_bytes: int, lat: float,
                  l2: float) -> tuple[float, float, float]:
    """A position's gather with the vector cores' share of its `rows` compressed rows (aiv_gather eighths):
    the AI core's copies (of `copies`: the window's and one per run), and a vector core's MTE2 and MTE3
    cycles. Each copies half the share's runs in (a run cut at the middle: a copy more) and its rows out
    packed, PACK_ROWS at a time; the AI core copies a tile's packed rows in one copy, not a copy per run."""
    share = aiv_gather / 8
    if not share or not rows:
        return copies, 0.0, 0.0
    packs = min(tiles, rows / kn + 1)   # tiles with a share
    moved = share * rows * row_bytes / 2 / l2
    return (copies - share * (copies - 1) + packs, (share * (copies - 1) / 2 + packs) * lat + moved,
            (share * rows / 2 / PACK_ROWS + packs) * lat + moved)


FWD_SLOTS, BWD_SLOTS = 2, 4   # the forward's S and P slots (tile t in slot t % 2); the backward's two each of S, dP / P, dS


def position_split(positions: int, cores: int) -> tuple[int, int]:
    """Positions per AI core and the AI cores used (as AkSparseAttentionMakeTiling)."""
    per = -(-positions // max(1, min(positions, cores)))
    return per, -(-positions // per)


class SparseAttentionAscend(AscendKernel):
    syncs_cores = True   # the backward's blocks meet in SyncAll

    def phases(self, problem: Problem):
        return []   # every phase is the Cube model's

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        batch, heads, seq, dim, _, _ = problem.shape
        return batch * seq * heads, dim

    @staticmethod
    def cube_backward(problem: Problem) -> bool:
        return True

    def _figures(self, problem: Problem, hw: HardwareProfile):
        """What both models start from: the AI cores, their pipe figures, a core's HBM rate (bytes per
        cycle), the positions per core, per merge_gap and key tile the mean keys and key tiles per
        position (csa's holes included: each is a key's work) and the copies that gather them, and per
        merge_gap the mean compressed rows per position."""
        batch, heads, seq, dim, window, extra = problem.shape
        cores = cube_cores(hw)
        p = hw.ascend_pipes(cores)
        hbm = p.mte_bytes_per_cycle   # its own limit or its share of HBM

        per, blocks = position_split(batch * seq, cores)   # a core's positions come `blocks` apart

        keys_of = functools.cache(lambda gap: position_keys(problem.variant, seq, window, extra, gap))
        window_keys = sum(min(s + 1, window) for s in range(seq))   # over the positions

        @functools.cache
        def compressed(gap: int) -> float:
            """Mean compressed rows per position (csa's holes included)."""
            return (sum(keys_of(gap)[0]) - window_keys) / seq

        @functools.cache
        def keys_copies(gap: int, kn: int, pk: int = 0, buffers: int = 2) -> tuple[float, float, float, float]:
            """Mean keys and key tiles of kn per position (a last tile of at most pk keys joined to the
            one before), the copies that gather its keys, and the keys the forward copies (its window in
            ring order where that is a tile of its own, in one of `buffers` key tiles: window_rows)."""
            keys, runs = keys_of(gap)
            copied = compressed(gap) + window_rows(keys, window, kn, blocks, buffers) / seq
            return sum(keys) / seq, sum(position_tiles(k, kn, pk) for k in keys) / seq, 1 + runs, copied
        return cores, p, hbm, per, keys_copies, compressed

    def cube_model(self, problem: Problem, hw: HardwareProfile) -> ChoiceModel:
        """The forward's tiling per AI core: per position its key tiles (gather, Q K^T, P V on the AIC;
        the softmax and O's update on the AIVs) under L1 / L0A / L0B / L0C / UB; objective the slowest
        pipe of the busiest core plus one tile's fill and the launch (the backward's phase beside it)."""
        self.check(problem)
        batch, heads, seq, dim, window, extra = problem.shape
        e = problem.dtype.itemsize
        cores, p, hbm, per, keys_copies, compressed = self._figures(problem, hw)
        lat, l2, issue = p.mte_latency, p.l2_bytes_per_cycle, p.vec_issue
        mine = heads // 2
        domains = {"merge_gap": list(GAPS) if problem.variant == "csa" else [0], "kv_tile": [64, 128, 256],
                   "aiv_gather": list(AIV_GATHER) if problem.variant == "csa" else [0],
                   "d_chunk": [c for c in (32, 64, 128, 256, 512) if c <= dim and dim % c == 0] or [dim],
                   "o_chunk": [c for c in (16, 32, 64, 128, 256) if dim % c == 0],
                   "s_buffers": [1, 2],
                   "q_buffers": [1, 2],
                   "pair_keys": list(PAIR_KEYS) if problem.variant == "hca" else [0],   # csa's and the window's
                   "cube_blocks": [cores]}                                            # last tiles are mostly full
        domains |= {f"bwd_{k}": domains[k] for k in ("kv_tile", "d_chunk", "o_chunk", "q_buffers")} | {"g_buffers": [2, 3]}
        domains["bwd_o_chunk"] = [c for c in domains["o_chunk"] if c <= 128]   # wider dq slices never fit the backward's UB

        @functools.cache
        def per_core(kn, dc, vc, sb, qb, gap, pk, ag):
            keys, tiles_per_position, copies, copied = keys_copies(gap, kn, pk, key_buffers(qb))
            kw = kn + pk   # the widest tile's keys: the vector cores' tile width
            tiles, chunks, vchunks = per * tiles_per_position, dim // dc, dim // vc
            n = min(kn, keys) if pk == 0 else min(keys / tiles_per_position, kw)   # a tile's keys
            # a joined tile's keys past kn are Mmads of their own, and its key slices a LoadData per D fractal column
            s = cube_tile_cycles(heads, n, dc, e, hw, cores, a_loads=heads // 16, b_loads=key_loads(kn, dc) if pk == 0 else dc // 16)
            pv = cube_tile_cycles(heads, dc, n, e, hw, cores, a_loads=heads // 16, b_loads=-(-n // 16))
            copies, pack_in, pack_out = packed_gather(ag, copies, compressed(gap), tiles_per_position, kn,
                                                      dim * e, lat, l2)
            gather = (1 + copies) * lat + heads * dim * e / hbm + copied * dim * e / l2   # q; the keys, L2 hits
            # every tile narrower than kw is masked: with pk > 0 every tile
            vec = issue * (22 + 4 * -(-kw // 64)) + mine * kw / 64 * 9 + vchunks * (issue * (1 + -(-vc // 64)) + mine * vc / 64 * 2)
            vec += (4 * issue + mine * kw / 64) if pk else 0
            wait = 0 if sb == 2 else tiles * (lat + mine * kw * 4 / l2)   # one score tile: its copy in is not hidden
            # one y slice in UB: at a position's end each slice's y and y_lo copies out wait for the one before,
            # about a copy's latency a slice exposed (emulated, hca at 128 columns: 369k against 332k cycles
            # with two slices, 43 positions a core)
            wait += per * vchunks * lat
            mask_copies, mask_vec = key_mask_cycles(gap, tiles, per, lat, issue)
            return {"HBM": per * (3 * heads * dim * e + heads * 4) / hbm,   # the block's share: q; y, y_lo, lse
                    "MTE2": per * gather + tiles * (lat + heads * (n if pk else kn) * e / l2),
                    "MTE1": tiles * (chunks * (s.mte1_a + s.mte1_b + pv.mte1_b) + pv.mte1_a),
                    "Cube": tiles * chunks * (s.cube + pv.cube),
                    "FIX": tiles * (s.fix + chunks * pv.fix),
                    "AIV MTE2": tiles * (lat + mine * kw * 4 / l2 + vchunks * (lat + mine * vc * 4 / l2)) + mask_copies + per * pack_in,
                    "Vector": tiles * vec + wait + mask_vec,
                    "AIV MTE3": tiles * (lat + mine * kw * e / l2) + per * 2 * vchunks * (lat + mine * vc * e / hbm) + per * pack_out,
                    "_pack out": per * pack_out, "tile": tiles}
        cells = CubeCells(KNOBS, domains, per_core, hw)
        cap = cells.cap
        constraints = [   # kw = kv_tile + pair_keys: the widest tile's keys
            cap("L1 capacity", lambda kn, dc, vc, sb, qb, gap, pk, ag: (qb * heads * dim + key_buffers(qb) * (kn + pk) * dim
                                                                  + heads * (kn + pk)) * e,
                p.l1_usable, "(q_buffers x H x D + (5 - q_buffers) x kw x D + H x kw) x elem (q, two key tiles or three "
                "beside one q buffer, P)"),
            cap("L0A capacity", lambda kn, dc, vc, sb, qb, gap, pk, ag: (2 * heads * dc + heads * (kn + pk)) * e, p.l0a_bytes,
                "(2 x H x d_chunk + H x kw) x elem (q's slices, P)"),
            cap("L0B capacity", lambda kn, dc, vc, sb, qb, gap, pk, ag: 2 * kn * dc * e, p.l0b_bytes,
                "2 x kv_tile x d_chunk x elem (K / V slices)"),
            cap("L0C capacity", lambda kn, dc, vc, sb, qb, gap, pk, ag: (heads * (kn + pk) + 2 * heads * dc) * 4, p.l0c_bytes,
                "(H x kw + 2 x H x d_chunk) x fp32 (S, two P V slices)"),
            cap("UB capacity", lambda kn, dc, vc, sb, qb, gap, pk, ag: (sb * mine * (kn + pk) * 4 + mine * (kn + pk) * e + mine * vc * (2 * 4 + e)
                                                           + mine * dim * 4 + tail_mask_ub(kn + pk) + ub_extra(window, extra, gap, kn, ag, dim * e)
                                                           + mine * (kn + pk) // 8 + 9 * mine * 4 + 3 * mine * 32),
                p.ub_usable, "per AIV (H/2 heads): s_buffers S tiles, a P tile, two P V slices and a y slice of o_chunk, O (fp32), "
                             "the key mask (with holes: a position's slots), with aiv_gather two staging buffers of gathered rows"),
        ]
        # one q buffer (three key tiles): the next position's q waits for this one's last S, its copy issued
        # under the P V before the next position's first S; what of it is exposed is in AIC_TURNS[3], emulated
        # a vector core's copies and steps wait on one another (S in, softmax, P out, then O_t in and the
        # update), so its three pipes overlap only in part: emulated (csa at 1024 tokens, with random and
        # with consecutive picks, merge_gap 0 to 4), a vector core's time is that of its busiest two
        # pipes' sum, within 3% where the Cube does not wait on its gather; the Cube waits on that. The
        # packed gathers' copies out are not in that chain (two staging buffers: they overlap the next
        # copies in), only their copies in, queued among the S and O_t reads
        def aiv_cycles(*cell):
            c = per_core(*cell)
            return sum(sorted((c["AIV MTE2"], c["Vector"], c["AIV MTE3"] - c["_pack out"]))[1:])
        aiv = cells.seconds(aiv_cycles)
        # L1 holds two key tiles and tile t's is read (MTE1) until P_t V_t: the gather of tile t + 2
        # (MTE2) follows it, so the two pipes mostly take turns, as in the backward (emulated at 1024
        # tokens: 0.81-0.95 of their sum; with wider O slices and fewer vector copies the forward took
        # the same time, 484k cycles)
        cube = cells.seconds(lambda kn, dc, vc, sb, qb, gap, pk, ag: aic_turns(per_core(kn, dc, vc, sb, qb, gap, pk, ag),
                                                                                 AIC_TURNS[key_buffers(qb)]))
        forward = Phase("forward", cells.pipes(("HBM", "MTE2", "MTE1", "Cube", "FIX", "AIV MTE2", "Vector", "AIV MTE3"))
                        | {"AIV sequence": [aiv], "AIC sequence": [cube]}, [cells.tile_fill(), cells.launch()])
        return self.cube_choice_model(problem, hw, domains, forward, constraints)

    def backward_model(self, problem: Problem, hw: HardwareProfile, domains: dict) -> tuple[Phase, list[Constraint]]:
        """The backward at the same tiles: per key tile S and dP (one K slice feeds both), dQ into the
        AIVs' accumulators, dKV added into GM at its keys' rows (a Fixpipe per pick for csa)."""
        batch, heads, seq, dim, window, extra = problem.shape
        e = problem.dtype.itemsize
        cores, p, hbm, per, keys_copies, compressed = self._figures(problem, hw)
        lat, l2, issue = p.mte_latency, p.l2_bytes_per_cycle, p.vec_issue
        mine = heads // 2
        in_l2 = self.gradients_stay_in_l2(problem, hw)
        add_rate = p.fix_bytes_per_cycle if in_l2 else hbm   # the dKV slices' atomic adds: L2 or the HBM share

        def delta(kn, vc, gap, ag):   # Delta's columns a step at these tiles (delta_chunk)
            return delta_chunk(mine, dim, kn, vc, e, ub_extra(window, extra, gap, kn, ag, dim * e), p.ub_usable)

        @functools.cache
        def per_core(kn, dc, vc, qb, gb, gap, ag):
            keys, tiles_per_position, copies, _ = keys_copies(gap, kn)
            dchunks = dim // delta(kn, vc, gap, ag)
            tiles, n, chunks, vchunks = per * tiles_per_position, min(kn, keys), dim // dc, dim // vc
            s = cube_tile_cycles(heads, n, dc, e, hw, cores, a_loads=heads // 16, b_loads=key_loads(kn, dc))
            dq = cube_tile_cycles(heads, dc, n, e, hw, cores, a_loads=0, b_loads=-(-n // 16))
            dkv = cube_tile_cycles(n, dc, heads, e, hw, cores, a_loads=0, b_loads=heads // 16)
            scatter = copies * n / keys + 1   # Fixpipes per dKV slice: the window's run, the entries' runs or rows
            copies, pack_in, pack_out = packed_gather(ag, copies, compressed(gap), tiles_per_position, kn,
                                                      dim * e, lat, l2)
            gather = (2 + copies) * lat + 2 * heads * dim * e / hbm + keys * dim * e / l2   # q, dy; the keys, L2 hits
            vec = issue * (24 + 4 * kn // 64) + mine * kn / 64 * 10
            mask_copies, mask_vec = key_mask_cycles(gap, tiles, per, lat, issue)
            wait = tiles * (lat + 2 * mine * kn * 4 / l2)   # one S and dP tile each (the queues' events run out at two)
            # the block's share of HBM: q, y, y_lo, dy, lse in; dq out, the keys' fp32 gradients added at
            # their rows; the accumulators zeroed, read back and converted (its share of them), or, where
            # they stay in L2, only the converted gradients written. The keys themselves are L2 hits (run
            # keeps kv and the compressed kv in L2, as the NPU would)
            rows = (batch * seq + batch * entries_of(problem)) * dim / cores
            acc = rows * e + (0 if in_l2 else per * keys * dim * 4 + rows * 8)   # holes add their zeros too
            hbm_bytes = per * (5 * heads * dim * e + heads * 4) + acc
            return {"HBM": hbm_bytes / hbm,
                    "MTE2": per * gather + tiles * (lat + 2 * heads * kn * e / l2),   # P and dS: one copy
                    "MTE1": tiles * (chunks * (2 * s.mte1_a + s.mte1_b + dq.mte1_b + 2 * dkv.mte1_b) + 3 * heads * kn * e / p.mte1_bytes_per_cycle),
                    "Cube": tiles * chunks * (2 * s.cube + dq.cube + 2 * dkv.cube),
                    "FIX": tiles * (2 * s.fix + chunks * (dq.fix + dkv.fix + (scatter - 1) * issue)),
                    "AIV MTE2": tiles * (lat + 2 * mine * kn * 4 / l2)   # S and dP: one copy
                                + per * (3 * dchunks + vchunks) * lat   # Delta's y, y_lo and dy; the dq accumulator
                                + per * vchunks * (mine * vc * e * (2 / hbm + 1 / l2) + mine * vc * 4 / l2) + mask_copies
                                + per * pack_in,
                    "Vector": tiles * vec + wait + per * vchunks * (issue * 7 + mine * vc / 64 * 6) + mask_vec,
                    "AIV MTE3": tiles * (lat + 2 * mine * kn * e / l2) + per * vchunks * (lat + mine * vc * e / hbm)   # P, dS; dq
                                + per * pack_out,
                    "tile": tiles}
        cells = CubeCells(BWD_KNOBS, domains, per_core, hw)
        cap = cells.cap
        constraints = [
            cap("backward L1 capacity", lambda kn, dc, vc, qb, gb, gap, ag: (2 * qb * heads * dim + BWD_KEY_TILES * kn * dim
                                                                         + 2 * heads * kn) * e,
                p.l1_usable, f"(2 x q_buffers x H x D + {BWD_KEY_TILES} x kv_tile x D + 2 x H x kv_tile) x elem (q, dy, key tiles, P, dS)"),
            cap("backward L0A capacity", lambda kn, dc, vc, qb, gb, gap, ag: (2 * heads * dc + 3 * heads * kn) * e, p.l0a_bytes,
                "(2 x H x d_chunk + 3 x H x kv_tile) x elem (q's / dy's slices, dS, dS^T, P^T)"),
            cap("backward L0B capacity", lambda kn, dc, vc, qb, gb, gap, ag: 2 * max(heads, kn) * dc * e, p.l0b_bytes,
                "2 x max(H, kv_tile) x d_chunk x elem (K, V, q^T, dy^T slices)"),
            cap("backward L0C capacity", lambda kn, dc, vc, qb, gb, gap, ag: (2 * heads * kn + gb * max(heads, kn) * dc) * 4,
                p.l0c_bytes, "(2 x H x kv_tile + g_buffers x max(H, kv_tile) x d_chunk) x fp32 (S, dP, dQ / dKV slices)"),
            cap("backward UB capacity", lambda kn, dc, vc, qb, gb, gap, ag: bwd_ub(mine, kn, vc, delta(kn, vc, gap, ag), e,
                                                                                   ub_extra(window, extra, gap, kn, ag, dim * e)),
                p.ub_usable, "per AIV: S and dP tiles, P and dS out, dq slices of o_chunk, Delta's steps (the key gradients' "
                             "conversion steps in their space), the key mask (with holes: a position's slots)"),
        ]
        pipes = cells.pipes(("HBM", "MTE2", "MTE1", "Cube", "FIX", "AIV MTE2", "Vector", "AIV MTE3"))
        # L1 holds three key tiles: the gather of tile t + 3 (MTE2) runs under tile t + 2's S and dP and
        # tile t + 1's gradients (MTE1), behind tile t + 1's P and dS copies. With two, it waited for tile
        # t's gradients and the L0 loads queued behind it waited for the gather: 0.85-0.93 of the two
        # pipes' sum (emulated at 1024 tokens, csa and hca), now 0.80 (csa) and 0.73 (hca): BWD_AIC_TURNS
        pipes["AIC sequence"] = [cells.seconds(lambda *cell: aic_turns(per_core(*cell), BWD_AIC_TURNS))]
        # one q / dy buffer: the next position's copies exposed; two dQ / dKV slices in L0C: the Cube waits
        # for each slice's Fixpipes before the one after next (FIX_WAIT a slice, emulated), and the dKV
        # slices' atomic adds into HBM run at the core's share of it (FIX above counts them at the
        # Fixpipe's own rate): their excess over the Cube's slice time is exposed
        def exposed_cycles(kn, dc, vc, qb, gb, gap, ag):
            c = per_core(kn, dc, vc, qb, gb, gap, ag)
            slices = c["tile"] * (dim // dc)
            scatter = slices * min(kn, keys_copies(gap, kn)[0]) * dc * 4 / add_rate
            return ((0 if qb == 2 else per * (2 * lat + 2 * heads * dim * e / hbm))
                    + (0 if gb == 3 else 2 * slices * FIX_WAIT + max(0.0, scatter - c["Cube"])))
        exposed = cells.seconds(exposed_cycles)
        return Phase("backward", pipes, [cells.tile_fill(), cells.launch(), exposed]), constraints

    @staticmethod
    def gradients_stay_in_l2(problem: Problem, hw: HardwareProfile) -> bool:
        """Whether the backward's fp32 key-gradient accumulators stay in the L2 beside kv and the
        compressed kv (which the kernels keep there): where the three fit in half of it (V4-Flash at
        1024 tokens: 4 of 192 MB; not at 65536: 252 MB). The NPU adds atomic stores in the memory
        system, so the Cube's per-position adds into them are then L2 traffic: only the gradients'
        final 16-bit copies reach HBM."""
        batch, heads, seq, dim, _, _ = problem.shape
        return (batch * seq + batch * entries_of(problem)) * dim * (problem.dtype.itemsize + 4) <= l2_half(hw)

    def cube_floor(self, problem: Problem) -> dict[str, CubeWork]:
        batch, heads, seq, dim, _, _ = problem.shape
        macs = 2 * batch * seq * heads * dim * SPEC.keys_per_query(problem)   # Q K^T and P V
        return {"forward": CubeWork(macs), "backward": CubeWork(2.5 * macs)}   # S, dP, dQ, dK, dV

    @staticmethod
    def check(problem: Problem) -> None:
        """What the kernel computes at all, whatever the tiling: said before the tiling model, whose
        capacities would otherwise be the first to object (fp32 overflows L1 before its dtype is named)."""
        _, heads, _, dim, _, _ = problem.shape
        if problem.dtype.itemsize != 2:
            raise PlanInfeasible("dtype", f"{problem.dtype.value}: the Cube kernel takes 16-bit q and kv (bf16); "
                                          "P V transposes K's fractals, which LoadData does for 16-bit data only")
        if heads % 16 or heads > 4095:
            raise PlanInfeasible("heads", f"{heads} must be a multiple of 16 (the Cube's M; V4: 64 / 128)")
        if dim % 16:
            raise PlanInfeasible("head_dim", f"{dim} must be a multiple of 16 (V4: 512)")

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        batch, heads, seq, dim, window, extra = problem.shape
        self.check(problem)
        tiles = {}
        for prefix in ("", "bwd_"):   # the forward's and the backward's own tiles
            kv_tile, d_chunk, o_chunk = (int(knobs[prefix + k]) for k in ("kv_tile", "d_chunk", "o_chunk"))
            if kv_tile not in (64, 128, 256):   # 64-lane reductions; a row's tail mask within one 256-bit block
                raise PlanInfeasible(prefix + "kv_tile", f"{kv_tile} keys: 64, 128 or 256")
            if d_chunk % 16 or dim % d_chunk:
                raise PlanInfeasible(prefix + "d_chunk", f"{d_chunk} columns must be a multiple of 16 dividing head_dim {dim}")
            if o_chunk % 16 or dim % o_chunk:
                raise PlanInfeasible(prefix + "o_chunk", f"{o_chunk} columns must be a multiple of 16 dividing head_dim {dim}")
            if int(knobs[prefix + "q_buffers"]) not in (1, 2):
                raise PlanInfeasible(prefix + "q_buffers", f"{knobs[prefix + 'q_buffers']} q (and dy) buffers in L1: 1 or 2")
            tiles |= {prefix + "kv_tile": kv_tile, prefix + "d_chunk": d_chunk, prefix + "o_chunk": o_chunk,
                      prefix + "q_buffers": int(knobs[prefix + "q_buffers"])}
        s_buffers, g_buffers = int(knobs["s_buffers"]), int(knobs["g_buffers"])
        if s_buffers not in (1, 2):
            raise PlanInfeasible("s_buffers", f"{s_buffers} score tiles: 1 or 2")
        if g_buffers not in (2, 3):
            raise PlanInfeasible("g_buffers", f"{g_buffers} dQ / dKV slices in L0C: 2 or 3")
        merge_gap = int(knobs.get("merge_gap", 0))   # plans from before the knob gathered picks only
        if merge_gap not in (GAPS if problem.variant == "csa" else (0,)):
            raise PlanInfeasible("merge_gap", f"{merge_gap}: one of {GAPS} for csa (entries between picks gathered "
                                              "as holes), 0 for hca and sliding")
        pair_keys = int(knobs.get("pair_keys", 0))   # plans from before the knob joined no tiles
        if pair_keys not in PAIR_KEYS or pair_keys > tiles["kv_tile"] or (pair_keys and merge_gap):
            raise PlanInfeasible("pair_keys", f"{pair_keys}: one of {PAIR_KEYS}, at most kv_tile, and 0 where csa "
                                              "gathers holes (merge_gap > 0: their mask is a tile of kv_tile keys)")
        aiv_gather = int(knobs.get("aiv_gather", 0))   # plans from before the knob: the AI core gathered every key
        if aiv_gather not in (AIV_GATHER if problem.variant == "csa" else (0,)):
            raise PlanInfeasible("aiv_gather", f"{aiv_gather}: one of {AIV_GATHER} eighths of a tile's picks for csa "
                                                "(gathered by the vector cores), 0 for hca and sliding")
        slots = workspace_slots(heads, dim, knobs)
        return {"dtype": problem.dtype, "csa": problem.variant == "csa", "hca": problem.variant == "hca", "heads": int(heads),
                "dim": int(dim), "window": int(window), **tiles, "s_buffers": s_buffers, "g_buffers": g_buffers,
                "cube_blocks": int(knobs["cube_blocks"]), "merge_gap": merge_gap, "slot_pad": SLOT_PAD,
                "pair_keys": pair_keys, "key_buffers": key_buffers(tiles["q_buffers"]),
                "bwd_key_tiles": BWD_KEY_TILES,
                "aiv_gather": aiv_gather, "pack_rows": PACK_ROWS, **slots,
                # (at least one slot rendered: the kernels' constants, unused without a share)
                "pack_slots": max(1, slots["pack_slots"]), "bwd_pack_slots": max(1, slots["bwd_pack_slots"])}

    def profile_params(self, problem: Problem, knobs: dict[str, int], hw: HardwareProfile) -> dict:
        """Delta's columns a step in the backward: as wide as the profile's UB holds beside its tiles."""
        batch, heads, seq, dim, window, extra = problem.shape
        kn, vc, gap = int(knobs["bwd_kv_tile"]), int(knobs["bwd_o_chunk"]), int(knobs.get("merge_gap", 0))
        pipes, e = hw.ascend_pipes(cube_cores(hw)), problem.dtype.itemsize
        extra_ub = ub_extra(window, extra, gap, kn, int(knobs.get("aiv_gather", 0)), dim * e)
        return {"delta_chunk": delta_chunk(heads // 2, dim, kn, vc, e, extra_ub, pipes.ub_usable)}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Short sequences at the plan's heads and width: one batch row of 40 positions at the problem's
        window (longer than the first positions'); and two batch rows over more
        positions than AI cores (a tail core) with a window wider than a key tile (the kernel reads the
        window from its tiling), so positions span tiles and end in part ones; csa there picks 8 of up to
        (kn + 13) / 4 ready entries, so its picks break into several runs of consecutive entries; and one
        batch row at a window of exactly the forward's key tile, past it by a little more than one of a
        core's steps between positions (two for sliding): the forward keeps such a window in L1 as a ring,
        and there positions find their buffer's earlier window (one or two of their core's positions
        back) and copy only the rows it lacks."""
        batch, heads, seq, dim, window, extra = problem.shape
        kn = max(knobs["kv_tile"], knobs["bwd_kv_tile"])   # both kernels' positions span tiles
        first = {"csa": min(extra, 20), "hca": min(extra, 4), "sliding": 1}[problem.variant]
        second = min(extra, 8) if problem.variant == "csa" else first
        fk = knobs["kv_tile"]
        return [Problem(problem.op, problem.variant, (1, heads, 40, dim, window, first), problem.dtype),
                Problem(problem.op, problem.variant, (2, heads, kn + 13, dim, kn + 13, second), problem.dtype),
                Problem(problem.op, problem.variant, (1, heads, fk + (56 if problem.variant == "sliding" else 32), dim, fk,
                                                      second), problem.dtype)]

    def _buffers(self, problem: Problem, knobs: dict[str, int], inputs: Tensors):
        """The GM buffers both kernels read (q as [B, S, H, D], kv, compressed kv, the compacted picks and
        their counts, the sinks) and the tiling, as the binding passes them."""
        batch, _, seq, dim, _, extra = problem.shape
        entries = entries_of(problem)
        q = inputs["q"].transpose(1, 2).contiguous()                    # [B, S, H, D]: a position's heads together
        ckv = inputs["compressed_kv"].contiguous() if entries else torch.zeros(batch, 1, dim, dtype=q.dtype)
        if problem.variant == "csa":
            idx, cnt = compact_picks(inputs["indices"], entries, int(knobs.get("merge_gap", 0)))
            width = idx.shape[-1]
            idx = torch.cat([torch.full((SLOT_PAD,), -1, dtype=torch.int32), idx.flatten()])
        else:
            idx, cnt, width = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), extra
        tiling = self.tiling(problem, knobs, width)
        reads = [to_bytes(q), to_bytes(inputs["kv"]), to_bytes(ckv), to_bytes(idx), to_bytes(cnt), to_bytes(inputs["sinks"].float())]
        return q, ckv, reads, tiling, position_split(batch * seq, knobs["cube_blocks"])[1]

    @staticmethod
    def tiling(problem: Problem, knobs: dict[str, int], width: int) -> bytearray:
        """AkSparseAttentionTiling for the problem's shape and `width` slots a position (csa: the compacted
        picks' rows; else the shape's last value), as the binding's AkSparseAttentionMakeTiling makes it."""
        batch, _, seq, dim, window, _ = problem.shape
        per, blocks = position_split(batch * seq, knobs["cube_blocks"])
        return bytearray(struct.pack(TILING, batch, seq, entries_of(problem), window, width, batch * seq, per, blocks, dim ** -0.5))

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""
        batch, heads, seq, dim, window, extra = problem.shape
        q, ckv, reads, tiling, blocks = self._buffers(problem, knobs, inputs)
        y = torch.full((batch, seq, heads, dim), float("nan"), dtype=q.dtype)
        lse = torch.full((batch, seq, heads), float("nan"))
        layout = workspace_slots(heads, dim, knobs)
        slots = workspace(blocks * layout["fwd_slot_bytes"])
        fwd_bufs = [*reads, to_bytes(y), to_bytes(y), to_bytes(lse), slots, tiling]
        # kv and the compressed kv stay in L2 (V4-Flash at 65536 tokens: 64 + 16 MB of the 192 MB): every
        # position gathers its keys from them, so all but their first read are L2 hits on the NPU (that
        # first read, ~1% of the traffic at these shapes, is not counted as HBM traffic here)
        fwd = emulator.run(emu.exe("fwd", 11, cores="mix_1_2", l2_args=(1, 2, 9)), blocks, fwd_bufs)
        y, y_lo, lse = from_bytes(fwd_bufs[6], y), from_bytes(fwd_bufs[7], y), from_bytes(fwd_bufs[8], lse)
        dy = grad_out["y"].to(q.dtype).contiguous()                      # [B, S, H, D], as y
        dq, dkv, dckv = (torch.full_like(t, float("nan")) for t in (q, inputs["kv"], ckv))
        dsinks = torch.full((heads,), float("nan"))
        slots = workspace(blocks * layout["bwd_slot_bytes"])
        acc = workspace((batch * seq + batch * entries_of(problem)) * dim * 4)   # fp32 dkv and dckv, added into
        bwd_bufs = [*reads, to_bytes(y), to_bytes(y_lo), to_bytes(lse), to_bytes(dy), to_bytes(dq), to_bytes(dkv), to_bytes(dckv),
                    to_bytes(dsinks), slots, acc, bytearray(tiling)]
        acc_in_l2 = (15,) if self.gradients_stay_in_l2(problem, emu.hw) else ()
        # dy: the vector cores' read of a position's rows (Delta) follows their AI core's Cube side's read of
        # the same rows (into L1, a position or so ahead), so on the NPU it finds them in L2
        bwd = emulator.run(emu.exe("bwd", 17, cores="mix_1_2", l2_args=(1, 2, 14, *acc_in_l2),
                                   l2_vector_reads=(9,)), blocks, bwd_bufs)
        grads = {"q": from_bytes(bwd_bufs[10], dq).transpose(1, 2), "kv": from_bytes(bwd_bufs[11], dkv),
                 "sinks": from_bytes(bwd_bufs[13], dsinks)}
        if problem.variant != "sliding":
            grads["compressed_kv"] = from_bytes(bwd_bufs[12], dckv)
        return {"y": y}, grads, {"forward": fwd, "backward": bwd}


PARTS = (SparseAttentionAscend(SPEC),)
