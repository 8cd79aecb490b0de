"""Where an emulated kernel waits: a summary of an `AK_TRACE` pipe timeline.

A traced run (`AK_TRACE=<file>`, see README.md "Timing") appends every core's instructions to the
file, `block core pipe start end instruction` a line (the API call that issued it), each launch after a
`#` line naming its kernel. The
kernel's time is its slowest block's; within that block the question is which pipe sets the pace
and why it idles. `summarize` answers with the block's busy share per core and pipe, which API calls
that time went to (a kernel's costliest instructions, per pipe), and the idle
stretches of one pipe (by default the busiest), each with what every other pipe did meanwhile: a
stretch where the others are busy is a wait on them (a buffer, a flag); one where nothing runs is
latency nobody hides.

    python -m aurakernel.emulator.timeline TRACE [--launch NAME] [--block N] [--pipe AIC.MTE2] [--gap 300] [--top 12]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

Spans = list[tuple[float, float]]
PIPE_NAMES = {"V": "Vector", "S": "Scalar", "M": "Cube"}   # the trace's short names, as the reports name them


@dataclass
class Launch:
    """One launch of a trace: its `#` line and every (block, core, pipe)'s instructions in pipe order."""
    header: str
    spans: dict[tuple[int, str, str], Spans] = field(default_factory=lambda: defaultdict(list))
    # (block, core, pipe) -> instruction -> [count, busy cycles]
    calls: dict[tuple[int, str, str], dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(lambda: [0, 0.0])))

    def end(self, block: int) -> float:
        return max((e for (b, _, _), s in self.spans.items() if b == block for _, e in s), default=0.0)

    def slowest_block(self) -> int:
        return max({b for b, _, _ in self.spans}, key=self.end)


@dataclass
class Gap:
    start: float
    end: float
    others: dict[str, float]   # "core.pipe" -> its busy cycles within the gap

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass
class Summary:
    launch: str
    block: int
    makespan: float
    busy: dict[str, float]     # "core.pipe" -> busy cycles in the block
    calls: dict[tuple[str, str], list[float]]   # ("core.pipe", instruction) -> [count, busy cycles], costliest first
    pipe: str                  # the pipe whose idle stretches are listed
    gaps: list[Gap]            # its idle stretches of at least the minimum, longest first
    idle_in_gaps: float        # their total

    @property
    def kernel(self) -> str:
        """The launch's kernel: its entry and build hash (the header's file name)."""
        return self.launch.split(",")[0].rsplit("/", 1)[-1]

    def share(self, key: str) -> float:
        return self.busy[key] / self.makespan if self.makespan else 0.0


def read(path: Path) -> list[Launch]:
    """The launches of a trace file, in order."""
    launches: list[Launch] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.startswith("#"):
            launches.append(Launch(line.lstrip("# ")))
            continue
        parts = line.split()
        if not launches or len(parts) not in (5, 6):
            raise UserError(f"{path}:{n}: not an AK_TRACE line (`block core pipe start end [instruction]` after a `#` "
                            f"line): {line[:80]!r}")
        block, core, pipe, start, end = parts[:5]
        key = (int(block), core, PIPE_NAMES.get(pipe, pipe))
        launches[-1].spans[key].append((float(start), float(end)))
        call = launches[-1].calls[key][parts[5] if len(parts) == 6 else "?"]
        call[0] += 1
        call[1] += float(end) - float(start)
    if not launches:
        raise UserError(f"{path}: no launch in it (an AK_TRACE file starts with a `#` line)")
    return launches


def _busy_within(spans: Spans, lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in spans)


def summarize(launch: Launch, block: int | None = None, pipe: str | None = None, min_gap: float = 300.0) -> Summary:
    """The block's (default: the slowest) busy cycles per core.pipe, and the idle stretches of at least
    `min_gap` cycles of `pipe` ("core.pipe", default: the busiest) with the other pipes' work in each."""
    blocks = {b for b, _, _ in launch.spans}
    block = launch.slowest_block() if block is None else block
    if block not in blocks:
        raise UserError(f"block {block} is not in the launch: it has blocks {min(blocks)}..{max(blocks)}")
    mine = {f"{c}.{p}": s for (b, c, p), s in launch.spans.items() if b == block}
    busy = {k: sum(e - s for s, e in v) for k, v in sorted(mine.items())}
    calls = {(f"{c}.{p}", name): v for (b, c, p), named in launch.calls.items() if b == block for name, v in named.items()}
    calls = dict(sorted(calls.items(), key=lambda kv: -kv[1][1]))
    pipe = pipe or max(busy, key=busy.get)
    if pipe not in mine:
        raise UserError(f"pipe {pipe!r} ran nothing in block {block}: accepted are {', '.join(busy)}")
    def gap(lo: float, hi: float) -> Gap:
        others = {k: _busy_within(v, lo, hi) for k, v in mine.items() if k != pipe}
        return Gap(lo, hi, {k: round(c) for k, c in others.items() if c > 0})

    gaps, prev = [], 0.0
    end = launch.end(block)
    for s, e in [*sorted(mine[pipe]), (end, end)]:   # the last: the pipe's tail, the others finishing after it
        if s - prev >= min_gap:
            gaps.append(gap(prev, s))
        prev = max(prev, e)
    gaps.sort(key=lambda g: -g.length)
    return Summary(launch.header, block, end, busy, calls, pipe, gaps, sum(g.length for g in gaps))


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(prog="python -m aurakernel.emulator.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--launch", help="a substring of the launch's kernel name (default: the trace's last launch)")
    ap.add_argument("--block", type=int, help="default: the slowest block")
    ap.add_argument("--pipe", help="core.pipe whose idle stretches to list, e.g. AIC.MTE2 (default: the busiest)")
    ap.add_argument("--gap", type=float, default=300.0, help="shortest idle stretch listed, cycles")
    ap.add_argument("--top", type=int, default=12, help="idle stretches and instructions listed")
    args = ap.parse_args(argv)
    console = Console()
    try:
        launches = read(args.trace)
        picked = [l for l in launches if args.launch is None or args.launch in l.header]
        if not picked:
            raise UserError(f"no launch of {args.trace} names {args.launch!r}: it has {[l.header for l in launches]}")
        s = summarize(picked[-1], args.block, args.pipe, args.gap)
    except (UserError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)   # one line, as the aurakernel CLI's
        return 2
    t = Table(title=f"{s.kernel}: block {s.block}, {s.makespan:,.0f} cycles")
    for col in ("core.pipe", "busy cycles", "share"):
        t.add_column(col, justify="left" if col == "core.pipe" else "right")
    for k, v in s.busy.items():
        t.add_row(k, f"{v:,.0f}", f"{s.share(k):.0%}")
    console.print(t)
    c = Table(title=f"the costliest instructions of block {s.block}")
    for col in ("core.pipe", "instruction", "count", "busy cycles", "share"):
        c.add_column(col, justify="left" if col in ("core.pipe", "instruction") else "right")
    for (key, name), (count, cycles) in list(s.calls.items())[:args.top]:
        c.add_row(key, name, f"{count:,.0f}", f"{cycles:,.0f}", f"{cycles / s.makespan:.0%}" if s.makespan else "")
    console.print(c)
    g = Table(title=f"{s.pipe} idle >= {args.gap:g} cycles: {len(s.gaps)} stretches, {s.idle_in_gaps:,.0f} cycles "
                    f"({s.idle_in_gaps / s.makespan:.0%} of the block)" if s.makespan else s.pipe)
    for col in ("from", "to", "cycles", "the other pipes meanwhile (busy cycles)"):
        g.add_column(col, justify="left" if col.startswith("the") else "right")
    for gap in s.gaps[:args.top]:
        g.add_row(f"{gap.start:,.0f}", f"{gap.end:,.0f}", f"{gap.length:,.0f}",
                  ", ".join(f"{k} {v:,}" for k, v in sorted(gap.others.items(), key=lambda kv: -kv[1])) or "nothing")
    console.print(g)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
