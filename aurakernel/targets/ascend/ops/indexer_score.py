"""The AscendC kernel of indexer_score (templates/ascendc/): its planner phases, template values and emulator run.

Where the backward's time goes (ascend910b2, 1x96x64x128x1024 bf16, two query rows per tile, 64-key
tiles; emulator cycles per AI core): each key tile is a round trip, P_j from the Cube to the AIVs
and coef_j back. With two slots (P one tile ahead) the AI core idled on it: ~64.7k cycles against its
busiest pipe's ~27k (the AIC's MTE2; the Cube ~26k). With BWD_SLOTS = 4 (P three tiles ahead) it is
~46k (3 slots: ~51k). The rest is the AIC's own chain per tile: single-buffered L0 operands (L0A is
full at two rows: q, coef and coef^T) serialise MTE1 -> Cube -> FIX.

The keys' first pass (both kernels; the benchmark's 2 query tiles per AI core make it half the work):
each key tile was copied into the one L1 buffer of resident keys between the previous tile's LoadData
and its own (a buffer's copy and its reads need events between them), at the AI core's HBM share, so
the first query tile ran at the copies' pace: backward ~1450 cycles a key tile against ~884 on the
second, forward ~1309 against the AIVs' 712. k, read by every AI core, is now found in L2 (as mhc's fn
and sparse attention's kv: forward 20.4k -> 17.4k, backward 46.2k -> 43.6k cycles), and the resident
keys come in two parts with an event each (ResidentKeys, the first part sized to cover the rest's
copy: `key_head`), so the Cube starts on the first part while the rest arrives: forward 16.8k,
backward 40.4k (11.3 + 25.6 -> 9.3 + 22.4 us, 2.03x -> 1.74x of the bound).

Then (16.8k + 40.4k -> 15.0k + 34.9k cycles, 31.8 -> 27.7 us, 1.74x -> 1.52x):
- the forward's keys come in up to four parts (`key_parts`: a short first one, 256 of 1024, so the
  Cube starts early, each later one copied when the one before is first used): 16.8k -> 15.7k;
- its vector cores read two adjacent product slots a copy (four slots): their copies' latency, 28%
  of their reads, is paid once per two tiles: 15.7k -> 15.0k;
- the backward's Cube frees coef and K^T's L0 buffers once dq's Mmad is done, so the next tile's
  loads run under dk's Mmad (the Cube idled ~80 cycles a tile on them): 40.4k -> 39.2k;
- six P / coef slots (P five tiles ahead; four: 39.2k, eight: 38.7k): 37.3k;
- the backward's (query tile, key tile) pairs are one stream: P runs ahead across query tiles, q two
  tiles ahead in L1, so the next tile's first Ps and coefficients are made while dq goes out: 35.8k;
- its keys in parts too (`key_head`: the first covering P's lead, the rest in three), each copied
  when the one before is first used, so the first coefficients' copies no longer queue behind one
  large rest in the AIC's in-order MTE2: 34.9k.
- the backward's Cube core copies its first q and keys before the SyncAll that waits for the AIVs'
  zeroing of dk (it waited ~450 cycles on it first): 34.9k -> 34.6k; and its last SyncAll (every
  core's adds into dk done, so the AIVs may convert it) comes before its last dq goes out, not after
  (the AIVs waited for that Fixpipe): 33.8k (fwd+bwd 27.73 -> 27.13 us).
What is left: the backward's start (~3.2k before the first P: q, then the keys' first part, which
covers P's lead: a first part of one tile, the rest in three, took 35.4k) and its end (the last dq
Fixpipe beside the dk conversion, ~1k); the Cube is ~90% busy in between. The forward's AIVs read at their L2
rate (~10k of its 15k; reading the first slot alone, so they start one Fixpipe sooner, took 15.2k).

At V4's 4096 queries (170 a core) fill and drain no longer weigh (1.23x of the bound against 1.49x at
96 queries), and what is left is per query tile. The forward's vector cores read the fp32 products at
their L2 rate: 4 B a product over two AIVs at 64 B a cycle is the Cube's 128 MACs a product at 4096 a
cycle, so with a copy's latency per two slots they run at ~1.17x the Cube (1.27x with the weights' copy
per tile, before W_GROUP): a 16-bit workspace would halve that, but the scores must match the fp32 reference. The
backward (1536 queries, cycles per AI core: 476k against the Cube's 412k) waited 1.8k at every query
tile: the next tile's q, copied whole (1.1k at the HBM share), sat in the Cube's in-order MTE2 in front
of the next coefficients. It now comes in parts (`q_part`: what fits beside a coefficient copy under a
pair's Mmads, one fractal row here), one behind each coefficient copy: 452k; and dk's Mmad goes first
on a tile's first pair, while dq's L0C waits for the last tile's dq to go out (L0C holds P, dq and dk,
no second dq): 442k. At 4096 queries: backward 1.21x -> 1.12x, fwd+bwd 1.23x -> 1.16x. The forward's
vector cores copied each query tile's head weights on their own (256 B, a copy's latency); the weights
of up to W_GROUP whole tiles now come in one strided copy: forward 1.27x -> 1.22x, fwd+bwd 1.15x.

The causal variant (what a model's indexer poses: DeepseekV4Indexer masks each query's entries from
(position + 1) // 4 on) skips, per query tile, the key tiles none of its rows sees; the forward writes a
row's scores below its limit and -inf from there (INF_FILL floats a copy), the backward masks the
gradient at each row's limit (CompareScalar against a tile's column numbers, a Select). With the even
split of query tiles the last AI core would still compute every key of the last positions: the tiling
splits the tiles into parts of equal work (tile_bounds, mirrored in the tiling header). Traced at
1x2048x64x128x512, one contiguous range a core, a key tile a tile plus one for q left the first cores'
MTE2 97% busy with q copies (a tile of few keys costs its q's copy: forward 85.7k cycles); a tile
costing the more of its q's copy and its key tiles, 80.1k (against 111.4k for every entry). The
backward's tiles cost the sum (its chain of P, coefficients and dq per tile adds to the pairs): 221k
(313.8k every entry); and its last key tile of a query tile takes only the keys the tile sees, not the
whole tile: 206k. Then the first cores' pipes were MTE2 (q) and the last ones' the Cube: each core now
takes two parts of 2 x cores, part c and its mirror (an early range beside a late one): at 4096 queries
forward 266.7k -> 261.3k, backward 680.7k -> 659.7k cycles (at 2048 queries 80.1k -> 81.1k and 206.0k ->
210.4k; the weights q_cost gives stayed the best of those tried). At V4's 4096 queries
(benchmarks.ascend): fwd+bwd 512 us against 890 us scoring every entry (1.74x faster); against the causal
bound (the entries each query sees, at the Cube's peak) 1.32x, the backward 1.26x of its Cube work where
the default's is 1.12x: the early tiles' few pairs each carry a tile's chain, and a tile computes its two
rows' larger limit rounded to 16 keys.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from types import SimpleNamespace

import torch

from .... import emulator
from ....emulator import from_bytes, to_bytes
from ....errors import PlanInfeasible
from ....hardware import HardwareProfile
from ....ops.base import Problem, Tensors
from ....ops.indexer_score import SPEC, causal_limit
from ....planner.ascend import AscendRowPhase, CubeCells, CubeWork, align32, cube_cores, cube_tile_cycles, row_split
from ....planner.model import ChoiceModel, Constraint, Phase
from ..kernel import AscendKernel


def _cube_figures(problem: Problem, hw: HardwareProfile):
    """What both Cube models start from: the element size, the AI cores, their pipe figures and the
    key count rounded up to the 64-key granule of the tiles."""
    cores = cube_cores(hw)
    return problem.dtype.itemsize, cores, hw.ascend_pipes(cores), -(-problem.shape[4] // 64) * 64


INF_FILL = 2048   # floats of -inf in a forward vector core's UB (causal): the copies out past a row's limit
W_GROUP = 16    # whole query tiles whose weights a vector core copies in at once (the kernel's HeadWeights)
KEY_PARTS = 4   # the resident keys' parts, each its own L1 buffer and event (the kernel's ResidentKeys)


def _part_ends(bounds, tile_keys: int, keys: int) -> tuple[int, ...]:
    """Tile bounds [0, b1, ..., tiles] as the keys each part ends at, KEY_PARTS of them (the unused at `keys`)."""
    ends = [min(b * tile_keys, keys) for b in bounds[1:]]
    return tuple(ends + [keys] * (KEY_PARTS - len(ends)))


def key_parts(keys: int, tile_keys: int, dim: int, elem: int, tile_cycles: float, p) -> tuple[int, ...]:
    """The forward's resident keys' parts (the kernel's ResidentKeys) as the keys each ends at, KEY_PARTS
    of them (the unused ones at `keys`: empty): of every split at whole tiles into at most KEY_PARTS,
    the one whose first pass over the keys ends first, each part's copy from L2 (a latency and its
    bytes, one after the other) against its tiles' work (`tile_cycles` each, the slowest pipe's). A
    short first part starts the Cube early; the later ones must each arrive by their first tile's turn."""
    tiles = -(-keys // tile_keys)
    copy = tile_keys * dim * elem / p.l2_bytes_per_cycle

    def first_pass(bounds):
        arrive, done = 0.0, 0.0
        for a, b in zip(bounds, bounds[1:]):
            arrive += p.mte_latency + (b - a) * copy
            for _ in range(a, b):
                done = max(done, arrive) + tile_cycles
        return done
    splits = (cuts for n in range(min(KEY_PARTS, tiles)) for cuts in itertools.combinations(range(1, tiles), n))
    return _part_ends(min(((0, *cuts, tiles) for cuts in splits), key=first_pass), tile_keys, keys)   # of equals: the fewest parts


def key_head(keys: int, tile_keys: int, dim: int, elem: int, tile_cycles: float, p, ahead: int) -> tuple[int, ...]:
    """The backward's resident keys' parts (as key_parts gives them): a first part of the fewest whole
    tiles whose work (`tile_cycles` each, the Cube's) covers the copy of the rest from L2, and at least
    the `ahead` tiles P runs ahead of the first coefficients; the rest in near-equal parts. Its
    coefficients' copies share the Cube's in-order MTE2 with the keys' (each part is copied when the one
    before is first used), so one large rest would hold the first coefficients up (1x96x64x128x1024:
    parts ending at 320 and 1024 keys 35.8k cycles, at 384, 640, 832 and 1024 34.9k)."""
    tiles = -(-keys // tile_keys)
    copy = tile_keys * dim * elem / p.l2_bytes_per_cycle
    head = max(min(ahead, tiles), min(tiles, max(1, math.ceil((tiles * copy + p.mte_latency) / (tile_cycles + copy)))))
    rest, parts = tiles - head, min(KEY_PARTS - 1, tiles - head)
    bounds = [head + sum(-(-(rest - q) // parts) for q in range(k)) for k in range(1, parts + 1)]
    return _part_ends([0, head, *bounds], tile_keys, keys)


def q_part(rows: int, heads: int, dim: int, keys: int, elem: int, pair_cycles: float, p) -> int:
    """The backward's q copy into L1 in parts (the kernel's Q_PART, in fractal rows of 16 query-head
    rows), one after each coefficient copy on the Cube's in-order MTE2: the most rows whose copy (from
    HBM at the core's share) fits beside that coefficient copy under a key tile pair's Cube work, at
    least one fractal row. A tile's whole q at once delayed the next coefficients at every query tile
    (1x1536x64x128x1024: 29 stalls of 1.8k cycles a core)."""
    m1 = -(-rows * heads // 16)
    coef = p.mte_latency + rows * heads * keys * elem / p.l2_bytes_per_cycle
    slack = pair_cycles - coef - p.mte_latency
    per_row = 16 * dim * elem / min(p.mte_bytes_per_cycle, p.hbm_share_per_cycle)
    return max(1, min(m1, int(slack // per_row)))


def slot_read_cycles(rows: int, heads: int, keys: int, p) -> float:
    """A vector core's read of its rows (half a tile's) of a forward product slot, fp32 from L2: two
    adjacent slots a copy, so half a copy's latency."""
    return p.mte_latency / 2 + -(-rows // 2) * heads * keys * 4 / p.l2_bytes_per_cycle


def cube_split(tiles: int, cores: int) -> tuple[int, int]:
    """Query tiles per AI core and the AI cores used (as the tiling's AkIndexerScoreMakeTiling)."""
    block_tiles = -(-tiles // max(1, min(tiles, cores)))
    return block_tiles, -(-tiles // block_tiles)


MAX_AI_CORES = 64   # the tiling's query tile parts (AkIndexerScoreTiling's fwdFirst / bwdFirst: 2 MAX_AI_CORES + 1)


def hbm_macs(hw: HardwareProfile) -> int:
    """The Cube's 16-bit MACs per byte an AI core moves from HBM in that time (the causal split's
    weighing of a tile's q against its key tiles: tile_bounds)."""
    p = hw.ascend_pipes(cube_cores(hw))
    return max(1, round(p.cube_macs_16bit / p.hbm_share_per_cycle))


def causal_tile_limits(batch: int, seq: int, rows: int, keys: int) -> torch.Tensor:
    """Per query tile (rows query rows of a batch row) the keys its rows see under the causal rule of a
    training sequence: causal_limit at its last row."""
    per_batch = -(-seq // rows)
    last = ((torch.arange(batch * per_batch) % per_batch) * rows + rows).clamp(max=seq) - 1
    return causal_limit(1, seq, keys)[0, last]


def causal_key_tiles(batch: int, seq: int, rows: int, keys: int, kn: int) -> torch.Tensor:
    """Per query tile its key tiles under the causal rule (causal_tile_limits), at least one: what a tile
    costs the causal kernels beside its q (as the tiling's AkIndexerScoreCausalKeyTiles)."""
    return ((causal_tile_limits(batch, seq, rows, keys) + kn - 1) // kn).clamp(min=1)


def q_cost(elem: int, macs: int, kn: int, copies: int, mmads: int) -> int:
    """A query tile's q traffic (`copies` of q's size through HBM: the forward's q in; the backward's q in
    and dq out) in sixteenths of one key tile's Cube work (`mmads` Mmads of kn keys), from the profile's
    hbm_macs: the query rows cancel out."""
    return max(1, 16 * elem * macs * copies // (kn * mmads))


def pass_bounds(batch: int, seq: int, rows: int, keys: int, kn: int, cores: int, causal: bool, elem: int, macs: int,
                backward: bool) -> tuple[int, ...]:
    """tile_bounds for the forward (a tile's q in against its key tiles' Mmad, the more of the two) or the
    backward (q in and dq out against three Mmads a key tile, their sum): the kernels' and the models' split."""
    q16 = q_cost(elem, macs, kn, 2, 3) if backward else q_cost(elem, macs, kn, 1, 1)
    return tile_bounds(batch, seq, rows, keys, kn, cores, causal, q16, added=backward)


def tile_bounds(batch: int, seq: int, rows: int, keys: int, kn: int, cores: int, causal: bool, q16: int = 16,
                added: bool = False) -> tuple[int, ...]:
    """The query tiles' parts (as the tiling's AkIndexerScoreTileBounds): part p is tiles [b[p], b[p + 1]).
    Every entry: a part of ceil(tiles / cores) tiles per AI core. Causal: 2 x cores parts of equal work, a
    tile going to the part its middle falls in, and AI core c takes parts c and 2 cores - 1 - c (core_parts):
    the early tiles (few keys each: their q copies keep MTE2 busy) beside the late ones (many keys: the
    Cube), so each core's pipes overlap, where one range each left the first cores on MTE2 and the last on
    the Cube. A tile costs its key tiles (causal_key_tiles, 16 each) and its q's copies (`q16`: q_cost):
    the more of the two in the forward (they run on other pipes), their sum in the backward (`added`: a
    tile's chain of P, coefficients and dq adds to its pairs). What each split emulated: the module's
    docstring. Only the balance assumes a training sequence's limits: the kernels compute from the limits
    they are given."""
    per_batch, cores = -(-seq // rows), min(cores, MAX_AI_CORES)
    tiles = batch * per_batch
    if not causal:
        per, used = cube_split(tiles, cores)
        return tuple(min(c * per, tiles) for c in range(used + 1))
    parts = 2 * max(1, min(tiles, cores))
    k16 = 16 * causal_key_tiles(batch, seq, rows, keys, kn)
    cost = q16 + k16 if added else k16.clamp(min=q16)
    before = cost.cumsum(0) - cost
    part = ((2 * before + cost) * parts // (2 * int(cost.sum()))).clamp(max=parts - 1)   # each tile's, ascending
    return tuple(int(b) for b in torch.searchsorted(part, torch.arange(parts + 1)))


def core_parts(bounds: tuple[int, ...], causal: bool) -> list[list[tuple[int, int]]]:
    """Per AI core its ranges of query tiles from tile_bounds' parts: one each, or (causal) parts c and
    2 cores - 1 - c (as the kernels' CoreTiles)."""
    parts = len(bounds) - 1
    if not causal:
        return [[(bounds[c], bounds[c + 1])] for c in range(parts)]
    return [[(bounds[c], bounds[c + 1]), (bounds[parts - 1 - c], bounds[parts - c])] for c in range(parts // 2)]


@functools.cache
def core_loads(batch: int, seq: int, rows: int, keys: int, kn: int, chunk: int, cores: int, causal: bool, elem: int,
               macs: int, backward: bool) -> tuple[tuple[int, int, int], ...]:
    """Per AI core of pass_bounds' split: its query tiles, the key tiles they compute and their copies of q
    (one per chunk of `chunk` keys a tile sees; the backward's chunk is every key)."""
    bounds = pass_bounds(batch, seq, rows, keys, kn, cores, causal, elem, macs, backward)
    if causal:
        limit = causal_tile_limits(batch, seq, rows, keys)
        whole = limit // chunk   # chunks seen whole, then the part of the one the limit falls in
        pairs = (whole * -(-chunk // kn) + (limit - whole * chunk + kn - 1) // kn).clamp(min=1)
        copies = (limit + chunk - 1) // chunk
    else:
        per_tile = sum(-(-min(chunk, keys - c0) // kn) for c0 in range(0, keys, chunk))
        pairs = torch.full((batch * -(-seq // rows),), per_tile)
        copies = torch.full_like(pairs, -(-keys // chunk))
    return tuple((sum(b - a for a, b in ranges), sum(int(pairs[a:b].sum()) for a, b in ranges),
                  sum(int(copies[a:b].sum()) for a, b in ranges)) for ranges in core_parts(bounds, causal))


def slowest(loads, pipes) -> dict[str, float]:
    """Per pipe, the most cycles an AI core spends on it: pipes(tiles, key tiles, q copies) of each core's loads."""
    per = [pipes(*load) for load in loads]
    return {k: max(p[k] for p in per) for k in per[0]}


class IndexerScoreAscend(AscendKernel):
    syncs_cores = True   # the backward's blocks meet in SyncAll
    variants = ("default", "causal")
    # --- AscendC (templates/ascendc/indexer_score/) ---
    # forward: a mixed kernel (per AI core its Cube core and two vector cores): q k^T on the Cube in
    #   query tiles of `cube_rows` rows x `cube_keys` keys, the keys resident in L1 `key_chunk` at a
    #   time; the heads' weighted sum on the vector cores (cube_model plans it).
    # backward, 16-bit: mixed as well, `bwd_rows` query rows x `bwd_keys` keys per tile (cube_model);
    #   fp32: on the vector cores, the row-wise UB model: rows = B x S query rows of T keys, `chunk`
    #   the key tile, `tile_rows` the query rows sharing it, `buffers` the row queues' depth.
    split_cols = False
    FWD_SLOTS = 4   # the forward's product slots per AI core: its vector cores read two adjacent ones a copy
    BWD_SLOTS = 6   # the Cube backward's P and coef slots per AI core: P runs five key tiles ahead of its use
    BWD_STREAM_SLOTS = 4   # ... where the keys stream, whose L1 tiles (one per slot) each hold an MTE1 -> MTE2 event

    def bwd_slots(self, knobs: dict[str, int]) -> int:
        return self.BWD_STREAM_SLOTS if int(knobs.get("bwd_stream", 0)) else self.BWD_SLOTS

    def rows_cols(self, problem: Problem) -> tuple[int, int]:
        batch, seq, _, _, entries = problem.shape
        return batch * seq, entries

    @staticmethod
    def cube_backward(problem: Problem) -> bool:
        """16-bit q and k run the backward on the Cube too (its transposes are the 2D LoadData's, of
        16 x 16 fractals only); fp32 keeps it on the vector cores."""
        return problem.dtype.itemsize == 2

    def phases(self, problem: Problem):
        if self.cube_backward(problem):
            return []   # every phase is the Cube model's
        _, _, heads, dim, _ = problem.shape
        e = problem.dtype.itemsize
        pieces = -(-dim // 64)                        # 64-lane fp32 repeats per key row
        fp32_streams = max(1, 4 // e)                 # a fp32 row of T keys in units of T elements of the dtype
        cast = 0 if e == 4 else 1
        rows_in = heads * dim * e + heads * 4         # q and w per query row
        key_tile = dim * e // 4 + cast * dim          # per key (floats): the k tile as loaded, its fp32 copy
        # fast ops per key-row element: one unit = T/64 repeats per query row (see planner/ascend.py)
        dots = 128 * pieces + pieces - 1              # Mul + WholeReduceSum per piece, pieces added
        # the score / gradient rows' UB pitch rounds T up to the key tile: up to 1 KB more per row
        return [   # the backward (the forward runs on the Cube: cube_model)
            # q, w, score gradient row in; dq and dw accumulated per row (fp32, resident over the key
            # tiles); per key tile the dk accumulator and the key-row products; per head: dots, dw,
            # coef (Compare/Select), Brcb, dk += coef q (Mul, Add), dq += coef k (Mul, halving tree)
            AscendRowPhase("backward", fp32_streams, 0, rows_in + 1024, heads * dim * 4 + heads * 32,
                           dim * 4 + heads * 36,
                           work_buffers=key_tile + 2 * dim + 4 + 8 + 1,
                           fast_ops_per_elem=heads * (dots + 6 + 8 + 4 * 64 * pieces) + 64 * pieces * cast,
                           slow_ops_per_elem=0, instrs_per_chunk=heads * (5 * pieces + 14) + 6),
        ]

    def cube_model(self, problem: Problem, hw: HardwareProfile) -> ChoiceModel:
        """The forward's tiling on the AI cores: per query tile (cube_rows rows of one batch row, M =
        rows x H) and key tile (cube_keys keys) the AIC's loads, Mmad and Fixpipe and its AIVs' read of
        the products (from the L2-resident workspace) and weighted sum, against L0A / L0B / L0C / L1 /
        UB; the keys are loaded key_chunk at a time (q is read again for each chunk). Objective: per
        core its tiles times the slowest pipe, plus one tile's fill and the launch."""
        batch, seq, heads, dim, keys = problem.shape
        e, cores, p, keys64 = _cube_figures(problem, hw)
        lat, rate, l2, issue = p.mte_latency, p.mte_bytes_per_cycle, p.l2_bytes_per_cycle, p.vec_issue
        macs = hbm_macs(hw)
        domains = {"cube_rows": [r for r in (1, 2, 4, 8) if r <= seq and r * heads <= 4095],
                   "cube_keys": [k for k in (64, 128, 256) if k <= keys64],
                   "key_chunk": sorted({min(keys64, c) for c in (256, 512, 1024, 2048, 4096)}),
                   "cube_buffers": [1, 2],
                   "cube_blocks": [cores], "hbm_macs": [macs]}

        causal = problem.variant == "causal"

        @functools.cache   # every pipe's term and the fill read the same cell
        def per_core(rows, kn, chunk, nb):   # cycles of each pipe on the busiest AI core
            m, mine = rows * heads, -(-rows // 2)
            chunks = [min(chunk, keys - c0) for c0 in range(0, keys, chunk)]
            t = cube_tile_cycles(m, kn, dim, e, hw, cores, a_loads=-(-m // 16), b_loads=dim * e // 32)
            vec = (heads * kn / 64 * 2 + heads / 64 + 2 * kn / 64 + heads / 8) + issue * (kn / 64 + math.log2(heads) + 5)
            keys_in = sum(2 * lat + nk * dim * e / l2 for nk in chunks)   # k from L2, in two parts a chunk

            def pipes(tc, pairs, copies):   # a core's query tiles, key tiles computed and q copies (one a chunk seen)
                batches = min(batch, 1 + math.ceil((tc * rows - 1) / seq))    # batch rows one core's tiles touch
                return {"MTE2": copies * (lat + m * dim * e / rate) + batches * keys_in,
                        "MTE1": copies * t.mte1_a + pairs * t.mte1_b, "Cube": pairs * t.cube, "FIX": pairs * t.fix,
                        "AIV MTE2": pairs * slot_read_cycles(rows, heads, kn, p) + tc * len(chunks) * (lat + mine * heads * 4 / rate),
                        "Vector": pairs * mine * vec,   # (causal: a -inf copy a row and chunk from its limit on)
                        "AIV MTE3": pairs * (lat + mine * kn * 4 / rate) + causal * tc * len(chunks) * mine * lat,
                        "tile": pairs}
            return slowest(core_loads(batch, seq, rows, keys, kn, chunk, cores, causal, e, macs, False), pipes)
        cells = CubeCells(("cube_rows", "cube_keys", "key_chunk", "cube_buffers"), domains, per_core, hw)
        cap = cells.cap

        def overlapped(pipe):   # with one q buffer the next tile's q load waits for this tile's Mmads
            def cycles(r, kn, ch, nb):
                c = per_core(r, kn, ch, nb)
                return c[pipe] if nb == 2 or pipe != "MTE2" else c["MTE2"] + c["Cube"]
            return [cells.seconds(cycles)]
        pipes = {pipe: overlapped(pipe) for pipe in ("MTE2", "MTE1", "Cube", "FIX", "AIV MTE2", "Vector", "AIV MTE3")}

        def ub(r, kn, ch, nb):   # per AIV: its rows' products (2 buffers of 2 slots), their score rows (2), w (W_GROUP
            mine = -(-r // 2)    # tiles' a copy), its Brcb blocks
            return (4 * mine * heads * kn * 4 + 2 * mine * kn * 4 + W_GROUP * align32(mine * heads * 4)
                    + align32((mine * heads + 8) * 4) + (mine * heads + 8) * 32 + causal * INF_FILL * 4)
        constraints = [
            cap("L0A capacity", lambda r, kn, ch, nb: nb * r * heads * dim * e, p.l0a_bytes,
                "cube_buffers x cube_rows x H x D x elem (q's fractals)"),
            cap("L0B capacity", lambda r, kn, ch, nb: 2 * kn * dim * e, p.l0b_bytes, "2 x cube_keys x D x elem (k's fractals)"),
            cap("L0C capacity", lambda r, kn, ch, nb: 2 * r * heads * kn * 4, p.l0c_bytes, "2 x M x cube_keys x fp32"),
            cap("L1 capacity", lambda r, kn, ch, nb: (nb * r * heads + -(-min(ch, keys) // 16) * 16) * dim * e, p.l1_usable,
                "(cube_buffers x M + key_chunk) x D x elem"),
            cap("UB capacity", ub, p.ub_usable, "4 x rows/2 x H x cube_keys fp32 products + 2 score tiles + w and its Brcb blocks"
                                               " (+ INF_FILL floats of -inf, causal)"),
        ]
        forward = Phase("forward", pipes, [cells.tile_fill(), cells.launch()])
        return self.cube_choice_model(problem, hw, domains, forward, constraints)

    def backward_model(self, problem: Problem, hw: HardwareProfile, domains: dict) -> tuple[Phase, list[Constraint]]:
        """The Cube backward's tiling (bwd_rows query rows x bwd_keys keys per tile, every key in L1):
        per production the AIC's P, dq and dk Mmads with their loads and Fixpipes, the AIVs' read of P
        and g, coefficients and write of them; L0A / L0B / L0C each hold one of every operand."""
        batch, seq, heads, dim, keys = problem.shape
        e, cores, p, keys64 = _cube_figures(problem, hw)
        lat, rate, l2, issue = p.mte_latency, p.mte_bytes_per_cycle, p.l2_bytes_per_cycle, p.vec_issue
        domains["bwd_rows"] = [r for r in (1, 2, 4) if r <= seq and r * heads <= 4095]
        domains["bwd_keys"] = [k for k in (64, 128) if k <= keys64]
        domains["bwd_stream"] = [0, 1]   # 1: the keys stream through L1 a tile at a time (they do not fit it)

        causal, macs = problem.variant == "causal", hbm_macs(hw)

        @functools.cache
        def per_core(rows, kn, stream):
            m, mine = rows * heads, -(-rows // 2)
            pt = cube_tile_cycles(m, kn, dim, e, hw, cores, a_loads=-(-m // 16), b_loads=dim * e // 32)   # P
            dq = cube_tile_cycles(m, dim, kn, e, hw, cores, a_loads=-(-m // 16), b_loads=-(-kn // 16), out_bytes=0)
            dk = cube_tile_cycles(kn, dim, m, e, hw, cores, a_loads=1, b_loads=0)
            vec = 9 * heads * kn / 64 + issue * (3 * kn / 64 + 12) + causal * 2 * mine * issue   # (causal: a row's mask)

            def pipes(tc, n, _):   # a core's query tiles and its (query tile, key tile) pairs
                batches = min(batch, 1 + math.ceil((tc * rows - 1) / seq))
                key_loads = n * (lat + kn * dim * e / l2) if stream else batches * (2 * lat + keys * dim * e / l2)   # from L2
                return {"MTE2": tc * (lat + m * dim * e / rate) + key_loads + n * (lat + m * kn * e / l2),
                        "MTE1": tc * (pt.mte1_a + dk.mte1_b) + n * (pt.mte1_b + dq.mte1_a + dk.mte1_a + dq.mte1_b),
                        "Cube": n * (pt.cube + dq.cube + dk.cube),
                        "FIX": n * (pt.fix + dk.fix) + tc * (issue + m * dim * e / p.fix_bytes_per_cycle),
                        "AIV MTE2": n * (2 * lat + mine * heads * kn * 4 / l2 + mine * kn * 4 / rate) + tc * (lat + mine * heads * 4 / rate),
                        "Vector": n * mine * vec, "AIV MTE3": n * (lat + mine * heads * kn * e / l2), "tile": n}
            return slowest(core_loads(batch, seq, rows, keys, kn, keys, cores, causal, e, macs, True), pipes)
        cells = CubeCells(("bwd_rows", "bwd_keys", "bwd_stream"), domains, per_core, hw)
        cap = cells.cap

        def ub(r, kn, st):
            mine = -(-r // 2)
            return (2 * mine * heads * kn * 4 + 2 * mine * kn * 4 + W_GROUP * align32(mine * heads * 4) + 2 * mine * heads * kn * e
                    + 2 * align32(mine * heads * 4) + align32((mine * heads + 8) * 4) + (mine * heads + 8) * 32
                    + 2 * heads * kn * 4 + heads * kn // 8 + align32(heads * 4) + 4096 * (4 + e)
                    + causal * (kn * 4 + align32(kn // 8)))   # (causal: the column numbers and a row's mask)
        constraints = [
            cap("backward L0A capacity", lambda r, kn, st: (r * heads * dim + 2 * r * heads * kn) * e, p.l0a_bytes,
                "(M x D + 2 x M x bwd_keys) x elem (q, coef, coef^T)"),
            cap("backward L0B capacity", lambda r, kn, st: (2 * kn * dim + r * heads * dim) * e, p.l0b_bytes,
                "(2 x bwd_keys x D + M x D) x elem (k^T, k, q)"),
            cap("backward L0C capacity", lambda r, kn, st: (r * heads * kn + r * heads * dim + kn * dim) * 4, p.l0c_bytes,
                "(M x bwd_keys + M x D + bwd_keys x D) x fp32 (P, dq, dk)"),
            cap("backward L1 capacity", lambda r, kn, st: (2 * r * heads * dim + (self.BWD_STREAM_SLOTS * kn if st else -(-keys // 16) * 16) * dim
                                                           + 2 * r * heads * kn) * e,
                p.l1_usable, "(2 x M x D + (every key, or BWD_STREAM_SLOTS streamed key tiles) x D + 2 x M x bwd_keys) x elem"),
            cap("backward UB capacity", ub, p.ub_usable, "per AIV: 2 P and g tiles, 2 coef tiles, w, work tiles, the dk conversion"),
        ]
        pipes = cells.pipes(("MTE2", "MTE1", "Cube", "FIX", "AIV MTE2", "Vector", "AIV MTE3"))
        return Phase("backward", pipes, [cells.tile_fill(), cells.launch()]), constraints

    def cube_floor(self, problem: Problem) -> dict[str, CubeWork]:
        batch, seq, heads, dim, keys = problem.shape
        scored = int(causal_limit(batch, seq, keys).sum()) if problem.variant == "causal" else batch * seq * keys
        macs = scored * heads * dim   # (causal: the entries each query sees, as the op's work counts them)
        floors = {"forward": CubeWork(macs, fp32=problem.dtype.itemsize == 4)}
        if self.cube_backward(problem):   # P again, dq and dk
            floors["backward"] = CubeWork(3 * macs)
        return floors

    def params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, _, heads, dim, _ = problem.shape
        key_tile = int(knobs["chunk"])
        if dim % 16 or dim > 2040:   # fp32 key rows of whole 32 B blocks, a level-0 repeat stride <= 255 blocks
            raise PlanInfeasible("index_head_dim", f"{dim} must be a multiple of 16 and <= 2040 (V4: 128)")
        if heads > 255:              # one level-0 repeat per head
            raise PlanInfeasible("index_n_heads", f"{heads} must be <= 255 (V4: 64)")
        vector_backward = not self.cube_backward(problem)
        if vector_backward and (key_tile % 64 or key_tile > 255 or key_tile * 4 < heads * problem.dtype.itemsize):
            raise PlanInfeasible("key tile", f"{key_tile} keys must be a multiple of 64, <= 255 (one level-0 repeat "
                                             f"per key) and hold a row of dq")
        cube_rows, cube_keys = int(knobs["cube_rows"]), int(knobs["cube_keys"])
        if cube_keys % 64 or cube_keys > 2040 or not 0 < cube_rows * heads <= 4095:
            raise PlanInfeasible("Cube tile", f"{cube_rows} query rows x {heads} heads (M <= 4095) by {cube_keys} keys "
                                              f"(a multiple of 64: one Mul per 64 columns)")
        return {"dtype": problem.dtype, "heads": int(heads), "dim": int(dim), "key_tile": key_tile,
                "tile_rows": int(knobs["tile_rows"]), "buffers": int(knobs["buffers"]),
                "block_dim": int(knobs["block_dim"]), "cube_rows": cube_rows, "cube_keys": cube_keys,
                "key_chunk": int(knobs["key_chunk"]), "cube_blocks": int(knobs["cube_blocks"]),
                "cube_buffers": int(knobs["cube_buffers"]), "cube_backward": self.cube_backward(problem),
                "bwd_rows": int(knobs.get("bwd_rows", 1)), "bwd_keys": int(knobs.get("bwd_keys", 64)),
                "bwd_stream": int(knobs.get("bwd_stream", 0)), "bwd_slots": self.bwd_slots(knobs), "fwd_slots": self.FWD_SLOTS,
                "w_group": W_GROUP, "causal": problem.variant == "causal", "max_ai_cores": MAX_AI_CORES, "inf_fill": INF_FILL,
                "hbm_macs": int(knobs.get("hbm_macs", 1))}

    def profile_params(self, problem: Problem, knobs: dict[str, int], hw: HardwareProfile) -> dict:
        """The resident keys' parts as the keys each ends at, forward (per chunk: key_parts) and backward
        (key_head), sized against a tile's work (forward: the AIVs' read of a product slot, or the Cube's
        Mmad and Fixpipe; backward: the Cube's three Mmads)."""
        _, _, heads, dim, keys = problem.shape
        e, cores, p, _ = _cube_figures(problem, hw)
        rows, kn = int(knobs["cube_rows"]), int(knobs["cube_keys"])
        fwd = cube_tile_cycles(rows * heads, kn, dim, e, hw, cores)
        fwd_tile = max(slot_read_cycles(rows, heads, kn, p), fwd.cube, fwd.fix)
        m, bkn = int(knobs.get("bwd_rows", 1)) * heads, int(knobs.get("bwd_keys", 64))
        bwd_tile = sum(cube_tile_cycles(*mnk, e, hw, cores).cube for mnk in ((m, bkn, dim), (m, dim, bkn), (bkn, dim, m)))
        return {"fwd_key_ends": key_parts(min(int(knobs["key_chunk"]), keys), kn, dim, e, fwd_tile, p),
                "bwd_key_ends": key_head(keys, bkn, dim, e, bwd_tile, p, self.bwd_slots(knobs)),
                "bwd_q_part": q_part(int(knobs.get("bwd_rows", 1)), heads, dim, bkn, e, bwd_tile, p)}

    def verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """One batch row of (at most 64) queries over the cores, leaving a tail core; and two batch rows
        whose query rows straddle cores (dk partials from several cores per batch row) with a key
        count that is not a multiple of 16 (a short last key tile)."""
        batch, seq, heads, dim, entries = problem.shape
        s1, t1 = min(seq, 64), min(entries, 256)
        t2 = t1 + 5 if t1 % 16 == 0 else t1
        return [Problem(problem.op, problem.variant, (1, s1, heads, dim, t1), problem.dtype),
                Problem(problem.op, problem.variant, (2, min(seq, knobs["block_dim"] // 2 + 3), heads, dim, t2),
                        problem.dtype)]

    def launch(self, problem: Problem, knobs: dict[str, int]) -> SimpleNamespace:
        """The problem's split over the cores (the vector kernels' rows, the Cube's query tiles both ways) and
        the bytes of the GM workspaces, as the tiling header's AkIndexerScoreMakeTiling,
        AkIndexerScoreFwdWorkspace and AkIndexerScoreWorkspace give them: the forward's FWD_SLOTS fp32 product
        slots per AI core; the Cube backward's slots of fp32 products and 16-bit coefficients per AI core,
        then the fp32 dk all cores add into; the vector backward's dk partial per core."""
        batch, seq, heads, dim, entries = problem.shape
        causal = problem.variant == "causal"
        block_rows, block_dim = row_split(batch * seq, knobs["block_dim"])
        per_batch = -(-seq // knobs["cube_rows"])
        e, macs = problem.dtype.itemsize, knobs.get("hbm_macs", 1)
        fwd_bounds = pass_bounds(batch, seq, knobs["cube_rows"], entries, knobs["cube_keys"], knobs["cube_blocks"], causal, e,
                                 macs, False)
        bwd_rows, bwd_keys = knobs.get("bwd_rows", 1), knobs.get("bwd_keys", 64)
        bwd_per_batch = -(-seq // bwd_rows)
        bwd_bounds = pass_bounds(batch, seq, bwd_rows, entries, bwd_keys, knobs["cube_blocks"], causal, e, macs, True)
        cube_blocks, bwd_blocks = len(core_parts(fwd_bounds, causal)), len(core_parts(bwd_bounds, causal))
        if self.cube_backward(problem):
            bwd_ws = (bwd_blocks * self.bwd_slots(knobs) * bwd_rows * heads * bwd_keys * (4 + problem.dtype.itemsize)
                      + batch * entries * dim * 4)
        else:
            bwd_ws = block_dim * batch * entries * dim * 4
        return SimpleNamespace(block_rows=block_rows, block_dim=block_dim, per_batch=per_batch,
                               cube_blocks=cube_blocks, bwd_rows=bwd_rows, bwd_keys=bwd_keys, bwd_per_batch=bwd_per_batch,
                               bwd_blocks=bwd_blocks, bwd_ws=bwd_ws,
                               fwd_bounds=fwd_bounds, bwd_bounds=bwd_bounds, causal=causal,
                               fwd_ws=cube_blocks * self.FWD_SLOTS * knobs["cube_rows"] * heads * knobs["cube_keys"] * 4)

    def tiling(self, problem: Problem, knobs: dict[str, int], geo: SimpleNamespace | None = None) -> bytearray:
        """AkIndexerScoreTiling for the problem's shape, as the binding's AkIndexerScoreMakeTiling makes it (from
        `geo`, the launch, where the caller has it)."""
        batch, seq, _, dim, entries = problem.shape
        geo = geo or self.launch(problem, knobs)

        def bounds(b):   # the parts' count, then 2 MAX_AI_CORES + 1 words, the end repeated
            return (len(b) - 1, *b, *[b[-1]] * (2 * MAX_AI_CORES + 1 - len(b)))
        return bytearray(struct.pack(f"<10If11I{2 * (2 * MAX_AI_CORES + 2)}I", batch * seq, seq, entries, batch, geo.block_rows, geo.block_dim, knobs["chunk"],
                                     knobs["tile_rows"], -(-entries // knobs["chunk"]) * knobs["chunk"], -(-batch * entries // geo.block_dim),
                                     dim ** -0.5, geo.cube_blocks, knobs["cube_rows"], knobs["cube_keys"], knobs["key_chunk"],
                                     geo.per_batch, knobs["cube_buffers"], geo.bwd_rows, geo.bwd_keys, geo.bwd_per_batch,
                                     geo.bwd_blocks, knobs.get("bwd_stream", 0), *bounds(geo.fwd_bounds), *bounds(geo.bwd_bounds)))

    def run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""

        q, k = inputs["q"].contiguous(), inputs["k"].contiguous()
        hidden, proj = inputs["hidden"], inputs["proj"]
        batch, seq, heads, dim = q.shape
        entries = k.shape[1]
        geo = self.launch(problem, knobs)
        tiling = self.tiling(problem, knobs, geo)
        w = self.spec.weights(hidden, proj, heads).contiguous()
        score = torch.full((batch, seq, entries), float("nan"))
        # k, read by every AI core, is found in L2 (as mhc's fn and sparse attention's kv); the forward's
        # workspace (its product slots) is kept in L2
        limit = [to_bytes(inputs["limit"].to(torch.int64).contiguous())] if geo.causal else []   # the kernels' extra argument
        fwd_bufs = [to_bytes(q), to_bytes(k), to_bytes(w), *limit, to_bytes(score), bytearray(geo.fwd_ws), tiling]
        at = len(limit)   # the arguments after w move up by one with it
        fwd = emulator.run(emu.exe("fwd", 6 + at, cores="mix_1_2", l2_args=(1, 4 + at)),
                           geo.cube_blocks, fwd_bufs)
        dq, dk, dw = (torch.full_like(t, float("nan")) for t in (q, k, w))
        g = grad_out["y"].float().contiguous()
        if self.cube_backward(problem):   # the slots and the fp32 dk in L2
            exe, blocks = emu.exe("bwd", 9 + at, cores="mix_1_2", l2_args=(1, 7 + at)), geo.bwd_blocks
        else:
            exe, blocks = emu.exe("bwd", 9 + at), geo.block_dim
        bwd_bufs = [to_bytes(q), to_bytes(k), to_bytes(w), *limit, to_bytes(g), to_bytes(dq), to_bytes(dk), to_bytes(dw),
                    bytearray(geo.bwd_ws), bytearray(tiling)]
        bwd = emulator.run(exe, blocks, bwd_bufs)
        dq, dk, dw = (from_bytes(bwd_bufs[4 + at + i], t) for i, t in enumerate((dq, dk, dw)))
        dw = dw * heads**-0.5   # back through the scaling and the projection (torch, as run_backward does)
        grads = {"q": dq, "k": dk, "hidden": (dw.to(hidden.dtype) @ proj).to(hidden.dtype),
                 "proj": dw.reshape(-1, heads).t() @ hidden.reshape(-1, hidden.shape[-1])}
        return {"y": from_bytes(fwd_bufs[3 + at], score)}, grads, {"forward": fwd, "backward": bwd}


PARTS = (IndexerScoreAscend(SPEC),)
