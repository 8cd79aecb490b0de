"""AuraKernel's emulator of the AscendC kernel API: build a kernel against include/kernel_operator.h
with g++, run every block on the CPU, and read back outputs, per-pipe counters and rule errors.

    exe = build(kernel_source, entry="rms_norm_fwd", nargs=6, hw=profile, block_dim=48)
    report = run(exe, block_dim=48, buffers=[x_bytes, gamma_bytes, ...])   # buffers updated in place

The runner executes in a subprocess so that an out-of-bounds GM access (a guard page fault) is a
reported error, not a crash of the caller.
"""

from __future__ import annotations

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
from ..paths import cache_dir

HERE = Path(__file__).parent
INCLUDE = HERE / "include"
RUNNER = HERE / "runner.cpp"
PIPES = ("MTE2", "MTE3", "Vector", "Scalar", "MTE1", "Cube", "FIX")
CUBE_PIPES = ("MTE1", "Cube", "FIX")   # reported only where a kernel used them
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def documented_apis() -> set[str]:
    """The AscendC API names the emulator implements (its AK_EMULATED_APIS list)."""
    text = (INCLUDE / "kernel_operator.h").read_text()
    block = text[text.index("#define AK_EMULATED_APIS"):]
    return set(" ".join(re.findall(r'"([^"]*)"', block)).split())


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def pipe_defines(hw: HardwareProfile, block_dim: int) -> dict[str, float]:
    """The emulator's compile-time figures for `hw` (HardwareProfile.ascend_pipes: the planner's too)."""
    p = hw.ascend_pipes(block_dim)
    return {"AK_UB_BYTES": int(hw.memory["UB"].capacity), "AK_UB_USABLE": p.ub_usable,
            "AK_MTE_BYTES_PER_CYCLE": p.mte_bytes_per_cycle, "AK_MTE_LATENCY": p.mte_latency,
            "AK_VEC_ISSUE": p.vec_issue, "AK_VEC_SLOW_FACTOR": p.vec_slow_factor, "AK_SCALAR_OP": p.scalar_op,
            "AK_L1_USABLE": p.l1_usable, "AK_L0A_BYTES": p.l0a_bytes, "AK_L0B_BYTES": p.l0b_bytes, "AK_L0C_BYTES": p.l0c_bytes,
            "AK_CUBE_MACS_16BIT": p.cube_macs_16bit, "AK_CUBE_MACS_FP32": p.cube_macs_fp32,
            "AK_MTE1_BYTES_PER_CYCLE": p.mte1_bytes_per_cycle, "AK_FIX_BYTES_PER_CYCLE": p.fix_bytes_per_cycle}


def build(kernel_source: str, *, entry: str, nargs: int, hw: HardwareProfile, block_dim: int,
          include_dirs: tuple[Path, ...] = (), batch_mode: bool = False) -> Path:
    """Compile kernel + runner into an executable (cached by content hash); BuildError on failure.
    `batch_mode`: the launch's schedule mode (the tiling's SetScheduleMode(1)), which SyncAll needs."""
    if not _NAME.match(entry) or not 0 < nargs <= 32:
        raise ValueError(f"bad kernel entry {entry!r} / nargs {nargs}")
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found for the AscendC emulator (set CXX or install g++)")
    defines = {**pipe_defines(hw, block_dim), "AK_KERNEL": entry, "AK_BATCH_MODE": int(bool(batch_mode)),
               "AK_PARAMS": ",".join(["uint8_t*"] * nargs), "AK_ARGS": ",".join(f"gm[{i}]" for i in range(nargs))}
    flags = ["-std=c++20", "-O2", "-pthread", f"-I{INCLUDE}", *(f"-D{k}={v}" for k, v in defines.items())]
    # the kernel's own headers (its tiling struct) are copied beside it, so the cache key holds their
    # content, not the (temporary) directory they came from
    headers = {h.name: h.read_text() for d in include_dirs for h in sorted(Path(d).glob("*.h"))}
    key = hashlib.sha256("\0".join([kernel_source, *(f"{n}\0{t}" for n, t in headers.items()), RUNNER.read_text(),
                                    (INCLUDE / "kernel_operator.h").read_text(), cxx, *flags]).encode()).hexdigest()[:24]
    out_dir = cache_dir() / "ascendc-emu"
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / f"{entry}-{key}"
    if exe.exists():
        return exe
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(kernel_source)
        for name, text in headers.items():
            (Path(tmp) / name).write_text(text)
        tmp_exe = Path(tmp) / "runner"
        proc = subprocess.run([cxx, *flags, f"-I{tmp}", str(src), str(RUNNER), "-o", str(tmp_exe)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"AscendC emulator build of {entry} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp_exe, exe)   # atomic: a concurrent build never sees half a file
    return exe


@dataclass
class BlockReport:
    busy: dict[str, float]          # cycles each pipe worked
    makespan: float                 # cycles until the block's last instruction completed
    gm_read: int
    gm_written: int
    ub_used: int
    buffers: list[tuple[str, int]]  # every InitBuffer: name, bytes
    error: str | None


@dataclass
class RunReport:
    blocks: list[BlockReport] = field(default_factory=list)
    fatal: str | None = None

    @property
    def errors(self) -> list[str]:
        errs = [f"block {i}: {b.error}" for i, b in enumerate(self.blocks) if b.error]
        return ([self.fatal] if self.fatal else []) + errs

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def cycles(self) -> float:
        """The kernel's estimate: the slowest block's makespan (blocks run in parallel, one per core)."""
        return max((b.makespan for b in self.blocks), default=0.0)

    def pipe_cycles(self) -> dict[str, float]:
        """Busy cycles per pipe of the slowest block."""
        slowest = max(self.blocks, key=lambda b: b.makespan)
        return dict(slowest.busy)

    def busiest_gm_bytes(self) -> int:
        """Bytes the busiest block moved across GM (what its share of HBM bandwidth must carry)."""
        return max((b.gm_read + b.gm_written for b in self.blocks), default=0)


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
                                         blk["error"]))
    return report


# --- tensors as GM buffers -------------------------------------------------------------------------

def to_bytes(t: torch.Tensor) -> bytearray:
    return bytearray(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def from_bytes(buf: bytearray, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=torch.uint8).view(like.dtype).reshape(like.shape).clone()
