"""Analytical cost model of host kernels, per pipe, from the HardwareProfile.

Row-wise kernels (norms, activations, pooling over a row) share one structure: rows are cut into
tiles of `tile_rows`, tiles are split statically over `threads`, and each tile sweeps its columns in
chunks of `col_chunk` elements, one or more passes. Per phase (forward, backward):

    busiest thread rows   r_b = min(R, ceil(ceil(R / tile_rows) / threads) * tile_rows)
    DRAM pipe             r_b * dram_bytes_per_row / (stream_bw(threads) / threads) * dram_scale
    vector pipe           r_b * (vector_elems_per_row * cyc_elem + chunks_per_row * cyc_chunk) / clock
    L2 pipe               tiles_b * l2_bytes_per_tile / L2 bandwidth * l2_scale  (e.g. the weight, re-read per tile)
    overhead              call + phase_overhead + (threads > 1) * fork + tiles_b * tile_overhead

Capacities: the rows of one tile stay in the per-core L2 between passes; one column chunk of every
stream (inputs, outputs, weight) stays in L1 while the chunk is reused across the tile's rows.
The coefficients (cyc_elem, cyc_chunk, tile overhead, cache fraction) come from the profile's
`costmodel` section, so fitting them to measurements changes predictions without code changes.
`calibrate --fit` (planner/fit.py) also sets the scales of the DRAM and L2 pipes and the fixed cost
of a phase beyond the ctypes call (the custom op and autograd dispatch around it); a profile
without them gets the neutral values in DEFAULTS. Every pipe term is linear in the coefficients:
the fit relies on that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..hardware import HardwareProfile
from .model import ChoiceModel, Constraint, Phase, Term


@dataclass(frozen=True)
class RowwisePhase:
    name: str
    dram_bytes_per_row: float       # bytes every row must move through DRAM
    vector_elems_per_row: float     # fp32 element operations per row (all passes)
    chunked_passes: int             # sweeps over a row done chunk by chunk (loop setup per chunk)
    resident_bytes_per_row: float   # bytes per row that must stay cached between passes
    l1_bytes_per_col: float         # L1 bytes per column of a chunk (all streams + weight)
    l2_bytes_per_tile: float        # bytes re-read from L2 once per tile (e.g. a weight vector)
    fixed_resident_bytes: float = 0.0  # bytes resident in L2 regardless of tile (weight, dw partial)
    written_bytes_per_row: float = 0.0  # fresh outputs a row writes (what streaming stores take around the caches)


# coefficients a profile may leave out (planner/fit.py fits them): neutral values
DEFAULTS = {"dram_time_scale": 1.0, "l2_time_scale": 1.0, "phase_overhead_us": 0.0}


def tile_rows_candidates(rows: int, multiple: int = 1) -> list[int]:
    """Powers of two up to 64 (and not beyond the rows), multiples of `multiple` (a GEMM micro-kernel's
    row block: smaller tiles would run its scalar edge path)."""
    cands = [v for v in (1, 2, 4, 8, 16, 32, 64) if v % multiple == 0 and v <= max(rows, multiple)]
    return cands or [multiple]


def col_chunk_candidates(cols: int, simd_elems: int) -> list[int]:
    """Multiples of the SIMD width (fp32 lanes), doubling, up to the first that covers the row."""
    out, c = [], simd_elems
    while True:
        out.append(c)
        if c >= cols or len(out) >= 12:
            return out
        c *= 2


def thread_candidates(cores: int) -> list[int]:
    return list(range(1, max(cores, 1) + 1))


def stream_choices(hw: HardwareProfile, rows: int, phases) -> list[int]:
    """Values of a kernel's `stream` knob: 1 (outputs written by streaming stores) only where a call's
    fresh outputs outgrow the last-level cache, so they would leave it anyway; below that the next
    kernel reads them from cache, which a streamed output would have bypassed."""
    written = rows * max((p.written_bytes_per_row for p in phases), default=0.0)
    return [0, 1] if written > hw.last_level_cache().capacity else [0]


def rowwise_model(rows: int, cols: int, phases: list[RowwisePhase] | dict[int, list[RowwisePhase]],
                  hw: HardwareProfile, fixed: dict[str, int] | None = None, row_block: int = 1,
                  resident_level: str = "L2", chunk_level: str = "L1", formulation: str | None = None,
                  streamed: bool = False) -> ChoiceModel:
    """The tiling model of a row-wise kernel. `fixed` adds single-valued knobs (e.g. the vector
    width); `row_block` makes tiles whole GEMM row blocks; `resident_level` is the cache the tile must
    stay in between passes (a per-core share of it when the level is shared); `chunk_level` the one
    a column chunk's working set must stay in while the tile's rows reuse it. With `formulation`,
    `phases` maps each value of that knob to the phases the kernel then runs (the same launches,
    e.g. an intermediate recomputed in the backward or kept from the forward), each priced alike.
    With `streamed` the kernel can write its outputs by streaming stores (the template's STREAM:
    ak_stream_copy from a row in cache): the `stream` knob (stream_choices), the DRAM traffic of the
    phases that write (written_bytes_per_row) then priced at the rate of an update in place (no read
    for ownership of the lines they write), the copy as vector work (a 16th of an element a byte)."""
    variants = phases if formulation else {0: phases}
    choice = (formulation,) if formulation else ()
    every = [p for ps in variants.values() for p in ps]
    cm = {**DEFAULTS, **hw.costmodel}
    clock = hw.clock_ghz * 1e9
    simd_elems = max(hw.simd_bytes // 4, 1)
    domains = {
        "tile_rows": tile_rows_candidates(rows, row_block),
        "col_chunk": col_chunk_candidates(cols, simd_elems),
        "threads": thread_candidates(hw.cores),
        **{name: [value] for name, value in (fixed or {}).items()},
        **({formulation: sorted(variants)} if formulation else {}),
        **({"stream": stream_choices(hw, rows, every)} if streamed else {}),
    }
    frac = cm.get("cache_fraction", 0.5)
    chunk_mem = hw.memory[chunk_level]
    chunk_limit = chunk_mem.capacity * frac / (1 if chunk_mem.per_core else max(hw.cores, 1))
    level = hw.memory[resident_level]
    resident_limit = level.capacity * frac / (1 if level.per_core else max(hw.cores, 1))
    l2_bw = hw.memory["L2"].bandwidth_gbps * 1e9

    def busiest_rows(tr: int, th: int) -> int:
        tiles = math.ceil(rows / tr)
        return min(rows, math.ceil(tiles / th) * tr)

    def busiest_tiles(tr: int, th: int) -> int:
        return math.ceil(math.ceil(rows / tr) / th)

    constraints: list[Constraint] = []
    resident = max(p.resident_bytes_per_row for p in every)
    fixed_bytes = max(p.fixed_resident_bytes for p in every)
    per_col = max(p.l1_bytes_per_col for p in every)
    if resident_level == chunk_level:   # the tile and a chunk's working set share that level
        constraints.append(Constraint(
            f"{resident_level} capacity (tile and chunk)",
            Term.of(("tile_rows", "col_chunk"), domains, lambda tr, cc: tr * resident + fixed_bytes + cc * per_col),
            resident_limit, f"tile_rows x {resident:,.0f} B + {fixed_bytes:,.0f} B + col_chunk x {per_col:,.0f} B"))
    else:
        constraints.append(Constraint(
            f"{resident_level} capacity", Term.of(("tile_rows",), domains, lambda tr: tr * resident + fixed_bytes),
            resident_limit, f"tile_rows x {resident:,.0f} B + {fixed_bytes:,.0f} B"))
        constraints.append(Constraint(
            f"{chunk_level} capacity (chunk)", Term.of(("col_chunk",), domains, lambda cc: cc * per_col), chunk_limit,
            f"col_chunk x {per_col:,.0f} B"))

    def term(knobs: tuple[str, ...], fn, i: int) -> Term:
        """fn(phase, *knob values) of the i-th phase, as the formulation's value picks it."""
        return Term.of((*knobs, *choice), domains,
                       lambda *v: fn(variants[v[-1] if choice else 0][i], *v[:len(knobs)]))

    def bandwidth(p: RowwisePhase, th: int, st: int) -> float:   # a phase that writes nothing fresh streams nothing
        return hw.inplace_bandwidth(th) if st and p.written_bytes_per_row else hw.stream_bandwidth(th)

    stream = ("stream",) if streamed else ()
    model_phases = []
    for i, p in enumerate(variants[min(variants)]):
        dram = term(("tile_rows", "threads", *stream), lambda p, tr, th, st=0: busiest_rows(tr, th) * p.dram_bytes_per_row
                    / (bandwidth(p, th, st) / th) * cm["dram_time_scale"], i)
        vector = term(("tile_rows", "threads", "col_chunk", *stream),
                      lambda p, tr, th, cc, st=0: busiest_rows(tr, th) * (
                          (p.vector_elems_per_row + st * p.written_bytes_per_row / 16) * cm["vector_cycles_per_elem"]
                          + p.chunked_passes * math.ceil(cols / cc) * cm["chunk_overhead_cycles"]) / clock, i)
        l2_pipe = term(("tile_rows", "threads"), lambda p, tr, th: busiest_tiles(tr, th) * p.l2_bytes_per_tile / l2_bw
                       * cm["l2_time_scale"], i)
        overhead = Term.of(("tile_rows", "threads"), domains,
                           lambda tr, th: (hw.call_overhead_us + cm["phase_overhead_us"]
                                           + (hw.fork_overhead_us if th > 1 else 0.0)) * 1e-6
                           + busiest_tiles(tr, th) * cm["tile_overhead_ns"] * 1e-9)
        model_phases.append(Phase(p.name, {"DRAM": [dram], "vector": [vector], "L2": [l2_pipe]}, [overhead]))
    return ChoiceModel(domains, constraints, model_phases)
