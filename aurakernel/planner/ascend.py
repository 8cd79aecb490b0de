"""The tiling model of a row-wise AscendC vector kernel (norms, activations): how many rows a UB
tile holds, how deep the queues are, how long the fp32 compute chunk is, and how many vector
cores share the rows.

    knobs     tile_rows in {1, 2, 4, ..., 64} (<= rows per core; a kernel may add the multiples of
              its tile_rows_step), buffers in {1, 2},
              chunk in {64, 128, ...} fp32 elements (<= the row), block_dim = min(rows, AIV cores),
              col_tile: the whole row, or (kernels that stream a row in pieces, split_cols) a power
              of two >= 1024 elements with one row per tile: rows wider than the UB (the vocabulary);
              a phase with own_tile_rows takes `<phase>_tile_rows` instead (its launch its own tiling)
    UB        buffers * (streams * tile_rows * row_pitch + per-row outputs + per-tile inputs) + resident
              + work * chunk * 4 + fp32 tiles * tile_rows * row_pitch(fp32) + reduce scratch
              <= UB - reserved top        (the sum over every InitBuffer)
    per core  rb = ceil(rows / block_dim) rows, ceil(rb / tile_rows) tiles
    MTE2/MTE3 tiles * copies * latency + rb * bytes / rate, rate = min(core MTE rate, HBM / block_dim)
    HBM       rb * (bytes in + bytes out) / (HBM / block_dim): the two MTE pipes draw on one share
    Vector    rb * (fp32 repeats per row * cycles + ceil(D / chunk) * instructions per chunk * issue)
              + tiles * instructions per tile * issue      (copies of per-tile inputs count in MTE2)
    Scalar    rb * scalar ops per row * cycles (a scatter's GetValue / SetValue)
    time      buffers = 2: the slowest pipe + fill x what the loop's fill and drain add to it: its
              tiles (the short one last, or first) run through the stages copy in, vector, scalar,
              copy out as pipes of their own, two buffers deep (`pipelined`), beyond that pipe and
              the HBM floor;
              buffers = 1: Vector + serial_mte x (MTE2 + MTE3): the pipes one after another, less
              what the separate in and out queues still overlap (a tile's copy-out under the next
              tile's copy-in).
Figures come from the profile's `pipes` section (the same ones the emulator charges), so the plan's
prediction and the emulator's estimate can be compared. The instruction and copy counts above are
the planner's own estimates of what the kernel issues; `calibrate --fit --target <ascend>`
(planner/fit.py) fits the SCALES below (in the profile's `costmodel`, from a fitted overlay in the
cache dir; 1.0 = as written) to the emulator: the count scales to its per-pipe busy cycles, fill and
serial_mte to its cycle estimates. The emulator keeps the raw figures. Each scale multiplies its own
term only (fill and serial_mte take the unscaled copy times), so the model stays linear in them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..hardware import HardwareProfile
from .model import ChoiceModel, Constraint, Phase, Term


@dataclass(frozen=True)
class AscendRowPhase:
    name: str
    streams_in: int            # row tiles copied in per tile (x, dy, ...)
    streams_out: int           # row tiles copied out per tile
    small_in_bytes: int        # per-row side inputs (e.g. rstd, 4 B), queued with the tile
    small_out_bytes: int       # per-row side outputs
    resident_bytes: int        # UB held for the whole kernel (gamma, a dgamma accumulator)
    work_buffers: int          # fp32 chunk buffers
    fast_ops_per_elem: float   # fp32 vector passes over the row (1 cycle per 256 B repeat)
    slow_ops_per_elem: float   # Exp/Sqrt/Div-class passes
    instrs_per_chunk: int      # vector instructions issued per chunk of a row
    f32_tiles: float = 0       # fp32 buffers of a whole tile (tile_rows x the row), beside the chunk buffers
    tile_in_bytes: int = 0     # copied in once per tile (a row its rows share, e.g. a mask), queued with it
    instrs_per_tile: int = 0   # vector instructions (and scalar-sync drains) issued once per tile
    copies_in: int | None = None    # DataCopys per tile of the row tiles (one strided copy can bring several
    copies_out: int | None = None   # streams' rows); None: one per stream
    own_tile_rows: bool = False     # its tile rows are a knob of its own, `<name>_tile_rows` (the phase's
                                    # launch takes its own tiling): a phase with more UB to spare takes more rows
    small_in_copies: int = 1        # copies that bring the per-row side inputs (one per tensor)
    small_in_tiles: int = 1         # tiles' rows of side inputs a copy brings (queued that many tiles at a time)
    scalar_ops_per_row: float = 0   # GetValue / SetValue per row on the scalar unit (a scatter), after the row's
                                    # vector work and beside the next tile's
    short_tile_first: bool = False  # a core's short tile (its rows' remainder) runs first, not last
    out_buffers: int = 2            # output tiles double buffering rotates through (a third lets the vector
                                    # unit fill tile t + 2 while tile t is copied out)

    def side_copies(self, tiles: int) -> int:
        """The side inputs' copies over `tiles` tiles."""
        return -(-tiles // self.small_in_tiles) * self.small_in_copies if self.small_in_bytes else 0

    def side_in_bytes(self, tile_rows: int) -> int:
        """UB of a queue buffer of side inputs."""
        return align32(tile_rows * self.small_in_tiles * self.small_in_bytes)


# planner-only scales (1.0: the model as written; fitted by planner/fit.py); every term is linear in them
SCALES = {"mte_copy_scale": 1.0,      # tiles x copies x latency
          "mte_byte_scale": 1.0,      # bytes / MTE rate
          "vec_repeat_scale": 1.0,    # fp32 repeats of the fast vector passes
          "vec_slow_scale": 1.0,      # repeats of the Exp/Div-class passes
          "vec_issue_scale": 1.0,     # chunks x instructions x issue cost
          "fill_scale": 1.0,          # double-buffered: one tile's copy in and out, exposed at the ends
          "serial_mte_scale": 1.0}    # single-buffered: the share of the copies the vector pipe waits for


def _pow2_upto(limit: int, start: int = 1) -> list[int]:
    out, v = [], start
    while v <= max(limit, start):
        out.append(v)
        v *= 2
    return out


def row_split(rows: int, block_dim: int) -> tuple[int, int]:
    """(rows per core, cores used) when `rows` are split evenly over at most `block_dim` cores."""
    block_rows = -(-rows // min(rows, block_dim))
    return block_rows, -(-rows // block_rows)


def ub_pitch(cols: int, itemsize: int) -> int:
    """Elements per UB row: `cols` rounded up to 32 B (DataCopyPad pads each row to it)."""
    return -(-cols * itemsize // 32) * 32 // itemsize


def align32(b: float) -> int:
    """Bytes rounded up to the 32 B a UB buffer (and a DataCopy) must span."""
    return int(math.ceil(b / 32) * 32)


def pipelined(stages: tuple[tuple[float, float], ...], rows_of: list[float], rows: float, out_buffers: int = 2) -> float:
    """Cycles of a double-buffered tile loop through `stages` in order (copy in, compute..., copy out),
    each a pipe of its own: stage s of tile i starts once stage s - 1 of tile i and stage s of tile
    i - 1 are done; a tile's copy in once the vector stage is done with tile i - 2 (its buffer), its
    vector stage once tile i - out_buffers is copied out. A stage's (per-tile part, total of the
    per-row part). (schedule.simulate replays a loop's issue order at equal tiles; this one's tiles
    differ in rows: the short one.)"""
    n, k = len(rows_of), len(stages)
    end = [[0.0] * k for _ in range(n)]
    for i, r in enumerate(rows_of):
        for s, (per_tile, per_rows) in enumerate(stages):
            start = max(end[i][s - 1] if s else 0.0, end[i - 1][s] if i else 0.0)
            if i >= 2 and s == 0:
                start = max(start, end[i - 2][1])
            if i >= out_buffers and s == 1:
                start = max(start, end[i - out_buffers][k - 1])
            end[i][s] = start + per_tile / n + per_rows * r / rows
    return end[-1][-1]


def ascend_rowwise_model(rows: int, cols: int, elem_bytes: int, phases: list[AscendRowPhase],
                         hw: HardwareProfile, split_cols: bool = False,
                         col_tiles: list[int] | None = None, tile_rows_step: int | None = None) -> ChoiceModel:
    clock = hw.clock_ghz * 1e9
    block_dim = max(1, min(rows, hw.cores))
    figures = hw.ascend_pipes(block_dim)
    latency, issue, slow, rate = figures.mte_latency, figures.vec_issue, figures.vec_slow_factor, figures.mte_bytes_per_cycle
    sc = {k: float(hw.costmodel.get(k, v)) for k, v in SCALES.items()}
    rb = math.ceil(rows / block_dim)
    if col_tiles is None:   # else the kernel's own column tiles (a split row: one row per tile)
        col_tiles = sorted({c for c in _pow2_upto(cols, 1024) if c < cols} | {cols}) if split_cols else [cols]
    tile_rows = _pow2_upto(min(rb, 64))   # and, for a kernel that takes them, every multiple of its step
    if tile_rows_step:
        tile_rows = sorted(set(tile_rows) | set(range(tile_rows_step, min(rb, 64) + 1, tile_rows_step)))
    domains = {"tile_rows": [1] if split_cols else tile_rows,   # column-streaming kernels: a row at a time
               "buffers": [1, 2],
               "chunk": _pow2_upto(max(64, math.ceil(cols / 64) * 64), 64)[:12],
               "block_dim": [block_dim],
               "col_tile": col_tiles}

    def tr_knob(p: AscendRowPhase) -> str:
        return f"{p.name}_tile_rows" if p.own_tile_rows else "tile_rows"

    for p in phases:
        domains[tr_knob(p)] = domains["tile_rows"]

    def ub_bytes(p: AscendRowPhase, tr: int, nb: int, ch: int, ct: int) -> float:
        if ct < cols and tr > 1:
            return 1e12                                            # a split row is one row per tile
        pitch = math.ceil(ct * elem_bytes / 32) * 32               # UB row pitch in bytes
        per_buf = ((p.streams_in + p.streams_out) * tr * pitch + p.side_in_bytes(tr) + align32(tr * p.small_out_bytes)
                   + align32(p.tile_in_bytes))
        return (nb * per_buf + align32(p.resident_bytes) + p.work_buffers * ch * 4 + align32((8 + ch * 4 / 256) * 4)
                + p.f32_tiles * tr * align32(ct * 4))

    # one UB constraint over the phases that share tile_rows, one for each phase with rows of its own
    groups = {}
    for p in phases:
        groups.setdefault(tr_knob(p), []).append(p)
    constraints = [Constraint("UB capacity", Term.of((k, "buffers", "chunk", "col_tile"), domains,
                                                     lambda tr, nb, ch, ct, ps=ps: max(ub_bytes(p, tr, nb, ch, ct) for p in ps)),
                              figures.ub_usable,
                              "buffers x (row tiles + per-row outputs) + resident + work chunks + reduce scratch")
                   for k, ps in groups.items()]

    def tiles(tr: int, ct: int) -> int:
        return rb * math.ceil(cols / ct) if ct < cols else math.ceil(rb / tr)

    model_phases = []
    for p in phases:
        knobs = (tr_knob(p), "buffers", "chunk", "col_tile")
        def mte2_parts(tr, ct, p=p):   # (copy latencies, transfer) cycles of the copies in
            n = tiles(tr, ct)
            copies = n * ((p.streams_in if p.copies_in is None else p.copies_in) + (1 if p.tile_in_bytes else 0)) \
                + p.side_copies(n)
            return (copies * latency,
                    (rb * (p.streams_in * cols * elem_bytes + p.small_in_bytes) + tiles(tr, ct) * p.tile_in_bytes) / rate)

        def mte3_parts(tr, ct, p=p):   # ... and of the copies out
            out_copies = p.streams_out if p.copies_out is None else p.copies_out
            return (tiles(tr, ct) * (out_copies + (1 if p.small_out_bytes else 0)) * latency,
                    rb * (p.streams_out * cols * elem_bytes + p.small_out_bytes) / rate)

        def scaled(parts):
            copies, transfer = parts
            return copies * sc["mte_copy_scale"] + transfer * sc["mte_byte_scale"]

        def vector_parts(tr, ch, ct, p=p, s=sc):   # (per-tile instructions, per-row passes) cycles
            repeats = cols * 4 / 256
            return (tiles(tr, ct) * p.instrs_per_tile * issue * s["vec_issue_scale"],
                    rb * (repeats * (p.fast_ops_per_elem * s["vec_repeat_scale"]
                                     + slow * p.slow_ops_per_elem * s["vec_slow_scale"])
                          + math.ceil(cols / min(ch, ct)) * p.instrs_per_chunk * issue * s["vec_issue_scale"]))

        def vector(tr, ch, ct, f=vector_parts):
            return sum(f(tr, ch, ct))

        def scalar(tr, ch, ct, p=p):
            return rb * p.scalar_ops_per_row * figures.scalar_op

        def copies(tr, ct, m2=mte2_parts, m3=mte3_parts):   # unscaled copy cycles in and out
            return sum(m2(tr, ct)) + sum(m3(tr, ct))

        def overlapped(fn):   # a pipe's seconds when double buffering overlaps the pipes (else 0)
            return Term.of(knobs, domains, lambda tr, nb, ch, ct: fn(tr, ch, ct) / clock if nb == 2 else 0.0)

        serial = Term.of(knobs, domains, lambda tr, nb, ch, ct, v=vector, sp=scalar, cp=copies:
                         (v(tr, ch, ct) + sp(tr, ch, ct) + sc["serial_mte_scale"] * cp(tr, ct)) / clock if nb == 1 else 0.0)

        def traffic(tr, ct, p=p):   # the bytes in and out: MTE2 and MTE3 each run at `rate`, but both draw on
            # the core's one share of HBM, so together they take no less than their sum at it (the emulator's floor)
            return (rb * ((p.streams_in + p.streams_out) * cols * elem_bytes + p.small_in_bytes + p.small_out_bytes)
                    + tiles(tr, ct) * p.tile_in_bytes) / figures.hbm_share_per_cycle

        def exposed(tr, ch, ct, m2=mte2_parts, m3=mte3_parts, v=vector_parts, sp=scalar, p=p):
            """What a double-buffered loop adds to its slowest stage: its tiles run through the stages
            (copy in, vector, scalar, copy out; each a pipe of its own, a tile's input buffer free once its
            vector work is done, its output buffer once copied out), a stage's per-tile part (copy
            latencies, per-tile instructions) the same for every tile, the rest by the tile's rows.
            Unscaled figures, as the copies' (fill_scale alone scales it: the model stays linear in them)."""
            stages = (m2(tr, ct), v(tr, ch, ct, s=SCALES), (0.0, sp(tr, ch, ct)), m3(tr, ct))
            n = tiles(tr, ct)
            rows_of = [rb / n] * n if ct < cols else [tr] * (n - 1) + [rb - (n - 1) * tr]
            if p.short_tile_first:
                rows_of.reverse()
            return max(0.0, pipelined(stages, rows_of, rb, p.out_buffers) - max(max(sum(st) for st in stages), traffic(tr, ct)))

        fill = Term.of(knobs, domains, lambda tr, nb, ch, ct, f=exposed:
                       sc["fill_scale"] * f(tr, ch, ct) / clock if nb == 2 else 0.0)
        mte2 = overlapped(lambda tr, ch, ct, f=mte2_parts: scaled(f(tr, ct)))
        mte3 = overlapped(lambda tr, ch, ct, f=mte3_parts: scaled(f(tr, ct)))
        hbm = overlapped(lambda tr, ch, ct, f=traffic: f(tr, ct) * sc["mte_byte_scale"])
        launch = Term.of(("block_dim",), domains, lambda bd: hw.call_overhead_us * 1e-6)
        model_phases.append(Phase(p.name, {"MTE2": [mte2], "MTE3": [mte3], "HBM": [hbm],
                                           "Vector": [overlapped(lambda tr, ch, ct, f=vector: f(tr, ch, ct))],
                                           **({"Scalar": [overlapped(lambda tr, ch, ct, f=scalar: f(tr, ch, ct))]}
                                              if p.scalar_ops_per_row else {}),
                                           "serial": [serial]}, [fill, launch]))
    return ChoiceModel(domains, constraints, model_phases)


def cube_cores(hw: HardwareProfile) -> int:
    """The profile's AI cores (one Cube core each; its `cores` are the vector cores)."""
    return int(hw.extra.get("cube_cores", hw.cores))


def l2_half(hw: HardwareProfile) -> float:
    """Half the profile's L2 (0 without one): the data a launch may keep there and still find at its next
    read, the other half left to what streams through."""
    return hw.memory["L2"].capacity / 2 if "L2" in hw.memory else 0.0


def hbm_us(total_bytes: float, hw: HardwareProfile) -> float:
    """`total_bytes` at the whole chip's HBM bandwidth."""
    return total_bytes / (hw.memory["HBM"].bandwidth_gbps * 1e9) * 1e6


def roofline_us(gm_bytes_busiest_block: float, hw: HardwareProfile, cube: bool = False) -> float:
    """The bound for a block that moves `gm_bytes_busiest_block`: its share of HBM bandwidth (every
    block of the chip streaming: a vector kernel's blocks are its AIV cores, a Cube or mixed
    kernel's its AI cores), so a balanced kernel's bound is total bytes / HBM bandwidth."""
    return hbm_us(gm_bytes_busiest_block * (cube_cores(hw) if cube else hw.cores), hw)


def largest_floor(floors: dict[str, float]) -> tuple[float, str]:
    """The bound among `floors` (time per resource: "HBM", "vector", "Cube") and which one it is."""
    kind = max(floors, key=floors.get)
    return floors[kind], kind


@dataclass(frozen=True)
class VectorWork:
    """The vector work a kernel's math cannot avoid, in fp32 element operations (one lane of a
    256 B repeat): `fast` ones (Add, Mul, MulAdd, Cast, a reduction's pass, ...) and `slow` ones
    (Exp, Ln, Sqrt, Div, Reciprocal: the profile's vec_slow_factor cycles per repeat)."""
    fast: float
    slow: float = 0.0

    def floor_us(self, hw: HardwareProfile) -> float:
        """That work spread evenly over every vector core, at one repeat per cycle (no issue cost)."""
        lanes = hw.simd_bytes / 4
        cycles = (self.fast + self.slow * hw.ascend_pipes(hw.cores).vec_slow_factor) / lanes / hw.cores
        return cycles / (hw.clock_ghz * 1e3)


def cast_passes(dtype) -> int:
    """fp32 passes a 16-bit dtype costs each way (A2/A3 compute in fp32: one Cast in, one out); fp32 none."""
    return 0 if dtype.itemsize == 4 else 1


@dataclass(frozen=True)
class CubeWork:
    """The multiply-accumulates a kernel's matmuls cannot avoid, with 16-bit or fp32 operands."""
    macs: float
    fp32: bool = False

    def floor_us(self, hw: HardwareProfile) -> float:
        """Those MACs spread evenly over every Cube core at the profile's peak rate."""
        pipes = hw.ascend_pipes(hw.cores)
        rate = pipes.cube_macs_fp32 if self.fp32 else pipes.cube_macs_16bit
        return self.macs / rate / cube_cores(hw) / (hw.clock_ghz * 1e3)


def bound_us(gm_bytes_busiest_block: float, work: VectorWork | None, hw: HardwareProfile, *,
             cube: CubeWork | None = None, cube_blocks: bool = False) -> tuple[float, str]:
    """A kernel's roofline bound and what sets it: the largest of its HBM traffic (roofline_us; its
    blocks AI cores where `cube_blocks`), the vector work its math cannot avoid and its Cube MACs at
    peak ("HBM", "vector" or "Cube")."""
    return largest_floor({"HBM": roofline_us(gm_bytes_busiest_block, hw, cube_blocks),
                          "vector": work.floor_us(hw) if work is not None else 0.0,
                          "Cube": cube.floor_us(hw) if cube is not None else 0.0})


# ---- the Cube side: what one Mmad tile costs on each of the AI core's pipes ---------------------

@dataclass(frozen=True)
class CubeTileCycles:
    """Cycles of one m x n x k matmul tile on the AIC's pipes, as the emulator charges them: the
    L1 -> L0 loads of its operands (MTE1), the Mmad (Cube) and the Fixpipe of its fp32 result (FIX)."""
    mte1_a: float
    mte1_b: float
    cube: float
    fix: float


def cube_tile_cycles(m: int, n: int, k: int, elem_bytes: int, hw: HardwareProfile, block_dim: int,
                     a_loads: int = 1, b_loads: int = 1, out_bytes: int = 4) -> CubeTileCycles:
    """One tile's cycles: A (m x k) and B (k x n) in 16 x 32 B fractals, loaded in `a_loads` / `b_loads`
    LoadData calls; the Mmad over whole fractals (16-bit: 16 x 16 x 16 per cycle at the profile's
    rate); the result (m x n, out_bytes each) out through Fixpipe."""
    p = hw.ascend_pipes(block_dim)
    c0 = 32 // elem_bytes
    m16, n16, kc = math.ceil(m / 16) * 16, math.ceil(n / 16) * 16, math.ceil(k / c0) * c0
    rate = p.cube_macs_fp32 if elem_bytes == 4 else p.cube_macs_16bit
    return CubeTileCycles(mte1_a=a_loads * p.vec_issue + m16 * kc * elem_bytes / p.mte1_bytes_per_cycle,
                          mte1_b=b_loads * p.vec_issue + n16 * kc * elem_bytes / p.mte1_bytes_per_cycle,
                          cube=p.vec_issue + m16 * n16 * kc / rate,
                          fix=p.vec_issue + m * n * out_bytes / p.fix_bytes_per_cycle)


class CubeCells:
    """A Cube model's knob cells: `per_core(*cell)` gives the busiest AI core's cycles per pipe (and a
    `tile` count where the fill is one tile's share, and details of its own under names that start
    with "_") for one value of each of `knobs`; this turns them into the model's Terms and Constraints."""

    def __init__(self, knobs: tuple[str, ...], domains: dict[str, list[int]], per_core, hw: HardwareProfile):
        self.knobs, self.domains, self.hw = knobs, domains, hw
        self.per_core = per_core
        self._clock = hw.clock_ghz * 1e9

    def seconds(self, fn) -> Term:
        """fn(*cell) cycles as seconds."""
        return Term.of(self.knobs, self.domains, lambda *cell: fn(*cell) / self._clock)

    def pipes(self, names: tuple[str, ...]) -> dict[str, list[Term]]:
        return {pipe: [self.seconds(lambda *cell, pipe=pipe: self.per_core(*cell)[pipe])] for pipe in names}

    def tile_fill(self) -> Term:
        """One tile's share of every pipe: the fill and drain a pipelined loop adds to its slowest pipe."""
        def fill(*cell):
            c = self.per_core(*cell)
            return sum(v for k, v in c.items() if k != "tile" and not k.startswith("_")) / c["tile"]
        return self.seconds(fill)

    def launch(self) -> Term:
        return Term.of(("cube_blocks",), self.domains, lambda bd: self.hw.call_overhead_us * 1e-6)

    def cap(self, name: str, fn, limit: float, formula: str) -> Constraint:
        return Constraint(name, Term.of(self.knobs, self.domains, fn), limit, formula)
