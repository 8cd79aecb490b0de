"""Host kernel libraries: a rendered C source -> system C compiler -> shared library -> ctypes entry points.

The compiler runs with -O3 -march=native -fopenmp (AURAKERNEL_HOST_ISA=avx2 builds the portable
x86-64-v3 path instead). Libraries are cached in the user's cache dir, keyed by the source hash and
the compiler command, and written atomically (compile to a temp name, then rename), so concurrent
processes and killed builds never leave a broken library behind. The kernels link libgomp.so.1;
torch has already loaded its own copy under that soname, so both share one OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch  # (loads torch's libgomp first so kernels share it)

from ...codegen import Source
from ...errors import BuildError
from ...hardware import HOST_ISAS, _cpu_flags, host_isa
from ...paths import build_cache, whole_build

_CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "f32": ctypes.c_float, "f64": ctypes.c_double}


@dataclass(frozen=True)
class Entry:
    """A C entry point: its symbol, argument kinds ('ptr', 'i64', 'f32', 'f64') and result kind."""

    symbol: str
    args: tuple[str, ...]
    result: str | None = None
    optional: bool = False   # rendered for some dtypes only: absent from the others' builds


@dataclass
class Kernel:
    """Rendered source + build artifact + callable entry points."""

    source: Source
    artifact: Path
    entries: dict[str, Entry]
    backend: str
    build_s: float = 0.0
    meta: dict = field(default_factory=dict)   # the typed values the source was rendered from
    impl: Any = None                            # the operator's HostKernel (targets/host/kernel.py)
    _functions: dict = field(default_factory=dict, repr=False)
    _scratch: dict = field(default_factory=dict, repr=False)

    @property
    def source_hash(self) -> str:
        return self.source.hash

    def bind(self, lib: ctypes.CDLL) -> None:
        for name, entry in self.entries.items():
            if entry.optional and not hasattr(lib, entry.symbol):
                continue
            fn = getattr(lib, entry.symbol)
            fn.restype = _CTYPES[entry.result] if entry.result else None
            fn.argtypes = [_CTYPES[a] for a in entry.args]
            self._functions[name] = (fn, entry)

    def has(self, name: str) -> bool:
        """Whether entry `name` is in this build (an optional entry may not be)."""
        return name in self._functions

    def call(self, name: str, *args):
        """Call entry `name`; tensors are passed by data pointer (the caller guarantees layout)."""
        fn, entry = self._functions[name]
        if len(args) != len(entry.args):
            raise TypeError(f"{entry.symbol} takes {len(entry.args)} arguments, got {len(args)}")
        return fn(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])

    # the operator's calls into this kernel (HostKernel.run_forward / run_backward / empty_outputs)
    def run_forward(self, inputs, outputs) -> None:
        self.impl.run_forward(self, inputs, outputs)

    def run_backward(self, inputs, outputs, grad_outputs, grads) -> None:
        self.impl.run_backward(self, inputs, outputs, grad_outputs, grads)

    def empty_outputs(self, problem, inputs):
        return self.impl.empty_outputs(problem, inputs)

    def workspace(self, name: str) -> torch.Tensor:
        """The fp32 scratch buffer whose size (in floats) entry `name` reports. Allocated once per
        kernel and reused: fresh multi-MB buffers cost page faults on every call. Kernels write
        before they read their scratch, and calls into one kernel do not overlap."""
        buf = self._scratch.get(name)
        if buf is None:
            buf = self._scratch[name] = torch.empty(int(self.call(name)), dtype=torch.float32)
        return buf

    def workspace_of(self, floats: int) -> torch.Tensor:
        """A reusable fp32 scratch buffer of at least `floats` (grows when a call needs more)."""
        buf = self._scratch.get("_sized")
        if buf is None or buf.numel() < floats:
            buf = self._scratch["_sized"] = torch.empty(max(floats, 1), dtype=torch.float32)
        return buf


CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno",
          "-fno-trapping-math")  # no FP traps: lets floorf, selects and clamps vectorise


def cflags() -> tuple[str, ...]:
    """The compiler flags: CFLAGS and the -march of AURAKERNEL_HOST_ISA (native by default). With
    AVX-512, gcc is told to use its 512-bit registers: it keeps to 256 bits on -march=native by
    default, and the 512-bit loops run the streaming kernels 10-25% faster (rms_norm forward 3.0 ->
    2.4 ms, swiglu backward 12.9 -> 10.0 ms, cross_entropy forward 26 -> 19 ms on a 2-core Xeon)."""
    wide = ("-mprefer-vector-width=512",) if "avx512f" in _cpu_flags() else ()   # (none under the forced AVX2)
    return (f"-march={HOST_ISAS[host_isa()]}", *wide, *CFLAGS)

_loaded: dict[str, ctypes.CDLL] = {}


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def compile_source(source: Source, entries: dict[str, Entry]) -> Kernel:
    """Build a rendered C source into a shared library (cached by hash) and bind its entry points."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler found (set CC or install gcc)")
    flags = cflags()
    key = hashlib.sha256((source.hash + cc + " ".join(flags)).encode()).hexdigest()[:24]
    out_dir = build_cache("host")
    artifact = out_dir / f"{key}.so"
    t0 = time.perf_counter()
    if str(artifact) not in _loaded and not whole_build(artifact):
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = Path(tmp) / "kernel.c"
            src.write_text(source.text)
            tmp_so = Path(tmp) / "kernel.so"
            proc = subprocess.run([cc, *flags, "-o", str(tmp_so), str(src), "-lm"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:   # the first line names the compiler and its first complaint
                first = next((ln.strip() for ln in proc.stderr.splitlines() if ln.strip()), "(no output)")
                raise BuildError(f"{source.template}: {cc} failed (exit {proc.returncode}): {first}\n{proc.stderr[-4000:]}")
            (out_dir / f"{key}.c").write_text(source.text)  # kept next to the library for reading
            os.replace(tmp_so, artifact)
    kernel = Kernel(source=source, artifact=artifact, entries=entries, backend="host",
                    build_s=time.perf_counter() - t0)
    lib = _loaded.get(str(artifact))
    if lib is None:
        try:
            lib = _loaded[str(artifact)] = ctypes.CDLL(str(artifact))
        except OSError as exc:   # whole but not loadable (another machine's build in a shared cache)
            artifact.unlink(missing_ok=True)
            raise BuildError(f"{source.template}: the cached build {artifact} would not load ({exc}); it was "
                             "removed and is rebuilt on the next run") from None
    kernel.bind(lib)
    return kernel


_BUILT: dict[str, Kernel] = {}


def keep(kernel: Kernel) -> Kernel:
    """Remember a built kernel for this process under its source hash."""
    return _BUILT.setdefault(kernel.source_hash, kernel)


def built_kernel(source_hash: str) -> Kernel:
    """A kernel built earlier in this process, by source hash."""
    return _BUILT[source_hash]


def find_built(source_hash: str) -> Kernel | None:
    return _BUILT.get(source_hash)
