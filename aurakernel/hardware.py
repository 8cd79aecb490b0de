"""HardwareProfile: what the planner and the cost model know about a target.

Profiles are YAML files in profiles/. The host profile is overlaid with what is read off this
machine (cores, caches, SIMD width, clock) and with the figures `aurakernel calibrate` measured
(streaming bandwidth per thread count, call overhead, matmul peak), cached per machine, including
the cost-model coefficients `calibrate --fit` fitted to the tuning DB. An Ascend profile is
overlaid with the planner coefficients `calibrate --fit --target <it>` fitted to the emulator
(costmodel-<target>.json in the cache dir); the YAML files are never rewritten.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path


from .errors import UserError
from .paths import PROFILES_DIR, cache_dir, read_yaml_mapping, write_text_atomic


@dataclass(frozen=True)
class MemoryLevel:
    name: str
    capacity: int          # bytes
    per_core: bool         # a private copy per core (L1, L2) or shared (L3, DRAM)
    bandwidth_gbps: float


@dataclass(frozen=True)
class AscendPipes:
    mte_bytes_per_cycle: float   # one core's MTE2/MTE3 rate: its own limit or its share of HBM
    mte_latency: float           # cycles per DataCopy / DataCopyPad
    vec_issue: float             # cycles per vector instruction
    vec_slow_factor: float       # cycles per 256 B repeat of Exp/Ln/Sqrt/Rsqrt/Reciprocal/Div
    scalar_op: float             # cycles per scalar GetValue / SetValue
    ub_usable: int               # UB bytes below the reserved top
    # the Cube side (AIC): its buffers' capacities and its pipes' rates
    l1_usable: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    cube_macs_16bit: float        # MACs per cycle with half / bf16 operands (16 x 16 x 16)
    cube_macs_fp32: float         # with fp32 operands (16 x 8 x 16 fractals)
    mte1_bytes_per_cycle: float   # L1 -> L0A / L0B
    fix_bytes_per_cycle: float    # L0C -> GM (what Fixpipe writes)
    l2_bytes_per_cycle: float     # one core's MTE rate to data resident in L2 (its own limit, not an HBM share)
    hbm_share_per_cycle: float    # one core's share of HBM, its reads and writes together (MTE2 and MTE3 draw on it)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str                                  # "host" or "ascend"
    cores: int
    clock_ghz: float
    simd_bytes: int
    memory: dict[str, MemoryLevel]
    stream_gbps: dict[int, float]              # threads -> streaming GB/s (read + write)
    call_overhead_us: float
    fork_overhead_us: float
    peak_tflops: dict[str, float]
    costmodel: dict[str, float]
    calibrated: bool = False
    extra: dict = field(default_factory=dict)  # target-specific figures (Ascend: pipes, UB reserve...)
    # threads -> GB/s of an update in place (read + write, no read-for-ownership); {}: not measured
    inplace_gbps: dict[int, float] = field(default_factory=dict)
    # dtype -> TFLOP/s of AuraKernel's own blocked GEMM (host calibration); {}: not measured
    own_gemm_tflops: dict[str, float] = field(default_factory=dict)

    def last_level_cache(self) -> MemoryLevel:
        """The last cache level before DRAM: L3, or L2 where there is none."""
        return self.memory["L3"] if "L3" in self.memory else self.memory["L2"]

    def stream_bandwidth(self, threads: int) -> float:
        """Bytes per second when `threads` threads stream (a copy to fresh memory, counted as STREAM
        counts it: read + write); the nearest measured thread count at or below `threads`."""
        return _at_threads(self.stream_gbps, threads) * 1e9

    def inplace_bandwidth(self, threads: int) -> float:
        """Bytes per second of an update in place on `threads` threads: the copy's rate where it was
        not measured (a calibration from before it was), which understates it."""
        return _at_threads(self.inplace_gbps, threads) * 1e9 if self.inplace_gbps else self.stream_bandwidth(threads)

    def with_calibration(self, cal: dict) -> HardwareProfile:
        return dataclasses.replace(
            self,
            stream_gbps={int(k): float(v) for k, v in cal["stream_gbps"].items()},
            inplace_gbps={int(k): float(v) for k, v in cal.get("inplace_gbps", {}).items()},
            call_overhead_us=float(cal["call_overhead_us"]),
            fork_overhead_us=float(cal["fork_overhead_us"]),
            peak_tflops={k: float(v) for k, v in cal["peak_tflops"].items()},
            own_gemm_tflops={k: float(v) for k, v in cal.get("own_gemm_tflops", {}).items()},
            costmodel={**self.costmodel, **{k: float(v) for k, v in cal.get("costmodel", {}).items()}},
            calibrated=True,
        )

    def ascend_pipes(self, block_dim: int) -> AscendPipes:
        """The per-instruction cost figures of an Ascend profile (its `pipes` section), as the planner
        and the emulator both charge them, for a kernel launched on `block_dim` vector cores."""
        pipes = self.extra.get("pipes", {})
        hbm_per_core = self.memory["HBM"].bandwidth_gbps / self.clock_ghz / max(1, min(block_dim, self.cores))
        return AscendPipes(mte_bytes_per_cycle=min(float(pipes.get("mte_bytes_per_cycle", 64)), hbm_per_core),
                           mte_latency=float(pipes.get("mte_latency_cycles", 200)),
                           vec_issue=float(pipes.get("vec_issue_cycles", 12)),
                           vec_slow_factor=float(pipes.get("vec_slow_factor", 4)),
                           scalar_op=float(pipes.get("scalar_op_cycles", 4)),
                           ub_usable=self.memory["UB"].capacity - int(self.extra.get("ub_reserved", 8192)),
                           l1_usable=self._capacity("L1", 524288) - int(self.extra.get("l1_reserved", 128)),
                           l0a_bytes=self._capacity("L0A", 65536), l0b_bytes=self._capacity("L0B", 65536),
                           l0c_bytes=self._capacity("L0C", 131072),
                           cube_macs_16bit=float(pipes.get("cube_macs_per_cycle_16bit", 4096)),
                           cube_macs_fp32=float(pipes.get("cube_macs_per_cycle_fp32", 2048)),
                           mte1_bytes_per_cycle=float(pipes.get("mte1_bytes_per_cycle", 256)),
                           fix_bytes_per_cycle=float(pipes.get("fix_bytes_per_cycle", 128)),
                           l2_bytes_per_cycle=float(pipes.get("l2_bytes_per_cycle", pipes.get("mte_bytes_per_cycle", 64))),
                           hbm_share_per_cycle=hbm_per_core)

    def _capacity(self, level: str, default: int) -> int:
        return int(self.memory[level].capacity) if level in self.memory else default

    def fingerprint(self) -> str:
        """Content hash of everything a plan depends on: plans are cached under it."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _at_threads(gbps: dict[int, float], threads: int) -> float:
    below = [t for t in gbps if t <= threads]
    return gbps[max(below) if below else min(gbps)]


_REQUIRED_KEYS = ("name", "kind", "cores", "clock_ghz", "simd_bytes", "memory", "stream_gbps", "call_overhead_us",
                  "peak_tflops")


def _load_yaml(name: str) -> dict:
    path = PROFILES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
        raise UserError(f"unknown target {name!r}: accepted are {known}")
    d = read_yaml_mapping(path, "hardware profile")
    missing = [k for k in _REQUIRED_KEYS if k not in d]
    if missing:
        raise UserError(f"hardware profile {path}: missing key(s) {', '.join(missing)}")
    return d


def _profile_from_dict(d: dict) -> HardwareProfile:
    memory = {
        name: MemoryLevel(name, int(m["capacity"]), bool(m["per_core"]), float(m["bandwidth_gbps"]))
        for name, m in d["memory"].items()
    }
    return HardwareProfile(
        name=d["name"], kind=d["kind"], cores=int(d["cores"]), clock_ghz=float(d["clock_ghz"]),
        simd_bytes=int(d["simd_bytes"]), memory=memory,
        stream_gbps={int(k): float(v) for k, v in d["stream_gbps"].items()},
        call_overhead_us=float(d["call_overhead_us"]), fork_overhead_us=float(d["fork_overhead_us"]),
        peak_tflops={k: float(v) for k, v in d["peak_tflops"].items()},
        costmodel={k: float(v) for k, v in d.get("costmodel", {}).items()},
        extra={k: v for k, v in d.items() if k not in _CORE_KEYS},
    )


_CORE_KEYS = {"name", "kind", "cores", "clock_ghz", "simd_bytes", "memory", "stream_gbps",
              "call_overhead_us", "fork_overhead_us", "peak_tflops", "costmodel"}


# --- reading the host machine ---------------------------------------------------------------

def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# AURAKERNEL_HOST_ISA: the instruction set host kernels are built for and planned against.
# "native" (the default): this CPU's own (-march=native; the AVX-512 and AMX paths where it has
# them). "avx2": the portable path an AVX2-only machine takes (x86-64-v3: AVX2 + FMA, no AVX-512, no
# AMX), so that path is built and tested on a machine that has more.
HOST_ISAS = {"native": "native", "avx2": "x86-64-v3"}


def host_isa() -> str:
    isa = os.environ.get("AURAKERNEL_HOST_ISA", "native")
    if isa not in HOST_ISAS:
        raise UserError(f"AURAKERNEL_HOST_ISA={isa!r}: accepted are {', '.join(HOST_ISAS)}")
    return isa


@functools.cache
def _machine_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_flags() -> set[str]:
    """The CPU's feature flags, less those the forced portable ISA leaves out."""
    flags = set(_machine_flags())
    if host_isa() == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    return flags


def physical_memory_bytes() -> int:
    """This machine's RAM (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def free_memory_bytes() -> int:
    """Memory this machine has free now (physical pages available)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _clock_ghz(default: float) -> float:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":", 1)[1]) / 1000.0
    except (OSError, ValueError):
        pass
    return default


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


def _cache_override() -> dict[str, int]:
    """AURAKERNEL_HOST_CACHES=L1=32K,L2=512K: plan for another machine's cache sizes (the AVX2 EPYC
    this project also runs on), e.g. to test there from here."""
    text = os.environ.get("AURAKERNEL_HOST_CACHES", "").strip()
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        level, _, size = item.partition("=")
        try:
            out[level.strip().upper()] = _parse_size(size)
        except ValueError:
            size = ""
        if level.strip().upper() not in ("L1", "L2", "L3") or not size:
            raise UserError(f"AURAKERNEL_HOST_CACHES={text!r}: accepted is a list like L1=32K,L2=512K")
    return out


def _caches() -> dict[str, int]:
    """Data/unified cache sizes of cpu0 by level name (L1, L2, L3), from sysfs, with those
    AURAKERNEL_HOST_CACHES sets in their place."""
    found: dict[str, int] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = "L" + (index / "level").read_text().strip()
            found[level] = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return {**found, **_cache_override()}


def machine_id() -> str:
    flags = _cpu_flags()
    simd = "avx512f" in flags, "avx2" in flags
    text = f"{_cpu_model()}|{host_cores()}|{simd}|{platform.machine()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def calibration_path() -> Path:
    return cache_dir() / f"calibration-{machine_id()}.json"


def load_calibration() -> dict | None:
    path = calibration_path()
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a damaged cache file is the same as none: recalibrate


def save_calibration(cal: dict) -> Path:
    return write_text_atomic(calibration_path(), json.dumps(cal, indent=2))


def host_profile(calibrated: bool = True) -> HardwareProfile:
    """The host profile with this machine's figures; calibrated ones when a calibration exists."""
    base = _load_yaml("host")
    flags = _cpu_flags()
    base["cores"] = host_cores()
    base["clock_ghz"] = _clock_ghz(float(base["clock_ghz"]))
    if "avx512f" in flags:
        base["simd_bytes"] = 64
    elif "avx2" in flags or "asimd" in flags:
        base["simd_bytes"] = 32
    for level, size in _caches().items():
        if level in base["memory"]:
            base["memory"][level]["capacity"] = size
    if ram := physical_memory_bytes():
        base["memory"]["DRAM"]["capacity"] = ram
    base["stream_gbps"] = {t: v for t, v in base["stream_gbps"].items() if int(t) <= base["cores"]} or {1: 8.0}
    profile = _profile_from_dict(base)
    if calibrated:
        cal = load_calibration()
        if cal is not None:
            profile = profile.with_calibration(cal)
    return profile


def costmodel_overlay_path(target: str) -> Path:
    """Where `calibrate --fit --target` keeps a non-host target's fitted planner coefficients."""
    return cache_dir() / f"costmodel-{target}.json"


def load_costmodel_overlay(target: str) -> dict | None:
    path = costmodel_overlay_path(target)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # damaged: the profile's own coefficients, as if never fitted


def load_profile(target: str, fitted: bool = True) -> HardwareProfile:
    """A profile by target name: 'host' (detected + calibrated) or a YAML file in profiles/, with
    its fitted cost-model coefficients unless `fitted` is False."""
    if target == "host":
        return host_profile()
    profile = _profile_from_dict(_load_yaml(target))
    overlay = load_costmodel_overlay(target) if fitted else None
    if overlay and isinstance(overlay.get("costmodel"), dict):
        profile = dataclasses.replace(profile, costmodel={**profile.costmodel, **{
            k: float(v) for k, v in overlay["costmodel"].items()}})
    return profile


def available_targets() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
