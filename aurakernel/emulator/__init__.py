"""AuraKernel's emulator of the AscendC kernel API: build a kernel against include/kernel_operator.h
with g++, run every block on the CPU, and read back outputs, per-pipe counters and rule errors.

    exe = build(kernel_source, entry="rms_norm_fwd", nargs=6, hw=profile)
    report = run(exe, block_dim=48, buffers=[x_bytes, gamma_bytes, ...])   # buffers updated in place

A build's `cores` is its launch: per block one vector core ("aiv", the default), one Cube core
("aic"), or an AI core's Cube core with one or two vector cores beside it ("mix_1_1", "mix_1_2",
the split-core chips' mixed kernels); each core runs on its own thread.

The runner executes in a subprocess so that an out-of-bounds GM access (a guard page fault) is a
reported error, not a crash of the caller.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import BuildError
from ..hardware import HardwareProfile
from ..paths import build_cache, whole_build

HERE = Path(__file__).parent
INCLUDE = HERE / "include"
RUNNER = HERE / "runner.cpp"
LAUNCH = HERE / "launch.cpp"
HEADER = INCLUDE / "kernel_operator.h"
PIPES = ("MTE2", "MTE3", "Vector", "Scalar", "MTE1", "Cube", "FIX")
CUBE_PIPES = ("MTE1", "Cube", "FIX")   # reported only where a kernel used them
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# a launch's cores per block: (AIC, AIV)
CORES = {"aiv": (0, 1), "aic": (1, 0), "mix_1_1": (1, 1), "mix_1_2": (1, 2)}


def documented_apis() -> set[str]:
    """The AscendC API names the emulator implements (its AK_EMULATED_APIS list)."""
    text = _text(HEADER)
    block = text[text.index("#define AK_EMULATED_APIS"):]
    return set(" ".join(re.findall(r'"([^"]*)"', block)).split())


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


# A kernel's object is compiled at -Og: its build is most of a verification's time. An -O2 object
# took 7.0 s for the router, 9.4 for sparse attention, -O1 4.5 and 6.6 (measured one after the
# other); -Og takes ~30% less than -O1 (sparse attention, router and mhc_pre together, alternating
# runs: 15.7 / 16.9 s at -O1, 10.4 / 12.1 at -Og) and the emulation runs as fast (sparse attention
# csa 256 queries: 1.59 / 3.68 s forward / backward at -Og, 1.68 / 3.81 at -O1; -O0 ran 3x slower).
# The runner, compiled once per profile, keeps -O2.
KERNEL_OPT, RUNNER_OPT = "-Og", "-O2"


@functools.cache
def link_flags() -> tuple[str, ...]:
    """A faster linker than ld where one is installed (a router link took 0.13 s with ld, 0.05 with
    gold): every kernel entry and launch shape is a link of its own, ~300 in the test suite."""
    return next(((f"-fuse-ld={name}",) for name in ("mold", "lld", "gold") if shutil.which(f"ld.{name}")), ())


def pipe_defines(hw: HardwareProfile) -> dict[str, float]:
    """The emulator's compile-time figures for `hw` (HardwareProfile.ascend_pipes: the planner's too);
    the HBM share of a core follows from the launch's block count at run time."""
    p = hw.ascend_pipes(1)   # one block: the core's own MTE limit (the whole HBM is no limit to it)
    return {"AK_UB_BYTES": int(hw.memory["UB"].capacity), "AK_UB_USABLE": p.ub_usable,
            "AK_MTE_CORE_BYTES_PER_CYCLE": p.mte_bytes_per_cycle,
            "AK_HBM_BYTES_PER_CYCLE": hw.memory["HBM"].bandwidth_gbps / hw.clock_ghz,
            "AK_VECTOR_CORES": int(hw.cores), "AK_MTE_LATENCY": p.mte_latency,
            "AK_VEC_ISSUE": p.vec_issue, "AK_VEC_SLOW_FACTOR": p.vec_slow_factor, "AK_SCALAR_OP": p.scalar_op,
            "AK_L1_USABLE": p.l1_usable, "AK_L0A_BYTES": p.l0a_bytes, "AK_L0B_BYTES": p.l0b_bytes, "AK_L0C_BYTES": p.l0c_bytes,
            "AK_CUBE_MACS_16BIT": p.cube_macs_16bit, "AK_CUBE_MACS_FP32": p.cube_macs_fp32,
            "AK_MTE1_BYTES_PER_CYCLE": p.mte1_bytes_per_cycle, "AK_FIX_BYTES_PER_CYCLE": p.fix_bytes_per_cycle,
            "AK_L2_BYTES_PER_CYCLE": p.l2_bytes_per_cycle}


def build(kernel_source: str, *, entry: str, nargs: int, hw: HardwareProfile, include_dirs: tuple[Path, ...] = (),
          batch_mode: bool = False, cores: str = "aiv", l2_args: tuple[int, ...] = (), l2_vector_reads: tuple[int, ...] = ()) -> Path:
    """Compile kernel + runner into an executable (cached by content hash); BuildError on failure.
    `batch_mode`: the launch's schedule mode (the tiling's SetScheduleMode(1)), which SyncAll needs;
    `cores`: the launch's cores per block (CORES); `l2_args`: the arguments (a workspace that fits
    the L2) whose traffic stays in L2: timed at the L2 rate, counted apart from HBM traffic;
    `l2_vector_reads`: arguments whose reads by the vector cores find them in L2, because their AI
    core's Cube side read the same bytes just before (the kernel's plan keeps what lies between the
    two reads within the L2): those reads count as L2 traffic."""
    if not _NAME.match(entry) or not 0 < nargs <= 32:
        raise ValueError(f"bad kernel entry {entry!r} / nargs {nargs}")
    if cores not in CORES:
        raise ValueError(f"bad launch cores {cores!r}: one of {', '.join(CORES)}")
    if any(not 0 <= i < nargs for i in (*l2_args, *l2_vector_reads)):
        raise ValueError(f"l2_args {l2_args} / l2_vector_reads {l2_vector_reads} outside the kernel's {nargs} arguments")
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found for the AscendC emulator (set CXX or install g++)")
    base = ["-std=c++20", "-pthread", f"-I{INCLUDE}", *(f"-D{k}={v}" for k, v in pipe_defines(hw).items())]
    launch = {"AK_KERNEL": entry, "AK_BATCH_MODE": int(bool(batch_mode)),
              "AK_AIC_PER_BLOCK": CORES[cores][0], "AK_AIV_PER_BLOCK": CORES[cores][1],
              "AK_L2_ARGS": sum(1 << i for i in set(l2_args)),
              "AK_L2_VECTOR_READS": sum(1 << i for i in set(l2_vector_reads)),
              "AK_PARAMS": ",".join(["uint8_t*"] * nargs), "AK_ARGS": ",".join(f"gm[{i}]" for i in range(nargs))}
    flags = [*base, RUNNER_OPT, *link_flags(), *(f"-D{k}={v}" for k, v in launch.items())]
    # the kernel's own headers (its tiling struct) are copied beside it, so the cache key holds their
    # content, not the (temporary) directory they came from
    kernel = {"kernel.cpp": kernel_source,
              **{h.name: h.read_text() for d in include_dirs for h in sorted(Path(d).glob("*.h"))}}
    out_dir = build_cache("ascendc-emu")
    exe = out_dir / f"{entry}-{_digest(*_named(kernel), *map(_named_file, (LAUNCH, RUNNER, HEADER)), cxx, *flags)}"
    if whole_build(exe):
        return exe
    # the kernel's object serves every entry of it (forward, backward), the runner's every kernel
    objects = [_object(out_dir, "kernel", kernel, cxx, [*base, KERNEL_OPT], f"AscendC emulator build of {entry}"),
               _object(out_dir, "runner", {"runner.cpp": _text(RUNNER)}, cxx, [*base, RUNNER_OPT], "AscendC emulator runner build")]
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_exe = Path(tmp) / "runner"
        proc = subprocess.run([cxx, *flags, str(LAUNCH), *map(str, objects), "-o", str(tmp_exe)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"AscendC emulator build of {entry} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp_exe, exe)   # atomic: a concurrent build never sees half a file
    return exe


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _named(files: dict[str, str]) -> list[str]:
    return [f"{name}\0{text}" for name, text in files.items()]


@functools.cache
def _text(path: Path) -> str:   # the emulator's own sources: read once per process, not per build
    return path.read_text()


def _named_file(path: Path) -> str:
    return f"{path.name}\0{_text(path)}"


def _object(out_dir: Path, stem: str, files: dict[str, str], cxx: str, flags: list[str], what: str) -> Path:
    """The first of `files` (the rest: headers beside it) compiled against the emulator's header,
    cached by their content and the flags: most of a build's time, shared by every build that
    links the same source."""
    obj = out_dir / f"{stem}-{_digest(*_named(files), _named_file(HEADER), cxx, *flags)}.o"
    if whole_build(obj):
        return obj
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        tmp_obj = Path(tmp) / "out.o"
        proc = subprocess.run([cxx, *flags, f"-I{tmp}", "-c", str(Path(tmp) / next(iter(files))), "-o", str(tmp_obj)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{what} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp_obj, obj)
    return obj


@dataclass
class BlockReport:
    """One core's run (a vector core's, or in a Cube / mixed launch each AIC's and AIV's)."""
    busy: dict[str, float]          # cycles each pipe worked
    makespan: float                 # cycles until the core's last instruction completed
    gm_read: int                    # HBM traffic
    gm_written: int
    ub_used: int
    buffers: list[tuple[str, int]]  # every InitBuffer: name, bytes
    error: str | None
    block: int = 0                  # its block (AI core)
    core: str = "AIV0"              # "AIC", "AIV0" or "AIV1"
    l2_bytes: int = 0               # traffic to the buffers the launch keeps in L2 (its workspace)


@dataclass
class RunReport:
    blocks: list[BlockReport] = field(default_factory=list)   # every core, by block
    fatal: str | None = None

    @property
    def errors(self) -> list[str]:
        """The rule errors, a hang after the others (a core that stopped on an error leaves its
        partners waiting: the error is the cause)."""
        errs = [f"block {b.block}{'' if b.core == 'AIV0' and self._vector_only else ' ' + b.core}: {b.error}"
                for b in self.blocks if b.error]
        errs.sort(key=lambda e: ": hang: " in e)
        return ([self.fatal] if self.fatal else []) + errs

    @property
    def _vector_only(self) -> bool:
        return all(b.core == "AIV0" for b in self.blocks)

    @property
    def cube_blocks(self) -> bool:
        """Whether the launch's blocks are AI cores (a Cube or mixed kernel), not single vector cores."""
        return any(b.core == "AIC" for b in self.blocks)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def cycles(self) -> float:
        """The kernel's estimate: the slowest core's makespan (cores run in parallel)."""
        return max((b.makespan for b in self.blocks), default=0.0)

    def _slowest_block(self) -> list[BlockReport]:
        slowest = max(self.blocks, key=lambda b: b.makespan).block
        return [b for b in self.blocks if b.block == slowest]

    def pipe_cycles(self) -> dict[str, float]:
        """Busy cycles per pipe of the slowest block (of a mixed one: its AIC's Cube pipes, its busier AIV's)."""
        busy: dict[str, float] = {}
        for b in self._slowest_block():
            for pipe, c in b.busy.items():
                busy[pipe] = max(busy.get(pipe, 0.0), c)
        return {p: busy[p] for p in PIPES if p in busy}

    def busiest_gm_bytes(self) -> int:
        """Bytes the busiest block (all its cores) moved across GM (what its share of HBM bandwidth must carry)."""
        per_block: dict[int, int] = {}
        for b in self.blocks:
            per_block[b.block] = per_block.get(b.block, 0) + b.gm_read + b.gm_written
        return max(per_block.values(), default=0)

    def total_gm_bytes(self) -> int:
        """Bytes every core together moved across GM (what the whole chip's HBM bandwidth must carry)."""
        return sum(b.gm_read + b.gm_written for b in self.blocks)

    def ub_used(self) -> int:
        return max((b.ub_used for b in self.blocks), default=0)

    def buffers(self) -> list[tuple[str, int]]:
        """The InitBuffers of the core that used the most UB."""
        return max(self.blocks, key=lambda b: b.ub_used).buffers if self.blocks else []


def run(exe: Path, block_dim: int, buffers: list[bytearray], timeout_s: float = 600.0) -> RunReport:
    """Run every block over the GM buffers (updated in place) and return the report."""
    with tempfile.TemporaryDirectory() as tmp:
        for i, b in enumerate(buffers):
            Path(tmp, f"arg{i}.bin").write_bytes(bytes(b))
        proc = subprocess.run([str(exe), str(block_dim), tmp, str(len(buffers))], capture_output=True, text=True,
                              timeout=timeout_s)
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
        data = json.loads(last) if last.startswith("{") else {}
        if "fatal" in data:
            return RunReport(fatal=data["fatal"])
        if proc.returncode != 0 or "blocks" not in data:
            return RunReport(fatal=f"emulator exited with {proc.returncode}: {proc.stderr.strip()[-500:]}")
        for i, b in enumerate(buffers):
            b[:] = Path(tmp, f"arg{i}.bin").read_bytes()
    report = RunReport()
    for blk in data["blocks"]:
        busy = {p: c for p, c in zip(PIPES, blk["busy"]) if c > 0 or p not in CUBE_PIPES}
        report.blocks.append(BlockReport(busy, blk["makespan"], blk["gm_read"],
                                         blk["gm_written"], blk["ub_used"], [tuple(x) for x in blk["buffers"]],
                                         blk["error"], blk["block"], blk["core"], blk["l2_read"] + blk["l2_written"]))
    return report


# --- tensors as GM buffers -------------------------------------------------------------------------

def to_bytes(t: torch.Tensor) -> bytearray:
    return bytearray(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def from_bytes(buf: bytearray, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8).view(like.dtype).reshape(like.shape).clone()


def workspace(nbytes: int) -> bytearray:
    """A kernel's GM workspace as the NPU hands it over: not zeroed. All ones (NaN as fp32 and as 16-bit
    floats), so a kernel that reads a slot before writing it, or adds into an accumulator it did not
    clear or write first, fails verification."""
    return bytearray(b"\xff" * nbytes)
