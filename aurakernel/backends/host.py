"""Host CPU backend: system C compiler (-O3 -march=native -fopenmp; AURAKERNEL_HOST_ISA=avx2 builds the
portable AVX2 path instead) -> shared library -> ctypes.

Builds are cached in the user's cache dir, keyed by the source hash and the compiler command, and
written atomically (compile to a temp name, then rename), so concurrent processes and killed
builds never leave a broken library behind. The kernels link libgomp.so.1; torch has already
loaded its own copy under that soname, so both share one OpenMP runtime and thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first so kernels share it)

from ..codegen import Source
from ..errors import BuildError
from ..hardware import HOST_ISAS, host_isa
from ..paths import cache_dir
from .base import Entry, Kernel

CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno",
          "-fno-trapping-math")  # no FP traps: lets floorf, selects and clamps vectorise


def cflags() -> tuple[str, ...]:
    """The compiler flags: CFLAGS and the -march of AURAKERNEL_HOST_ISA (native by default)."""
    return (f"-march={HOST_ISAS[host_isa()]}", *CFLAGS)

_loaded: dict[str, ctypes.CDLL] = {}


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


class HostBackend:
    name = "host"

    def available(self) -> tuple[bool, str]:
        if compiler() is None:
            return False, "no C compiler found (set CC or install gcc)"
        return True, ""

    def build(self, source: Source, entries: dict[str, Entry]) -> Kernel:
        cc = compiler()
        if cc is None:
            raise BuildError("no C compiler found (set CC or install gcc)")
        flags = cflags()
        key = hashlib.sha256((source.hash + cc + " ".join(flags)).encode()).hexdigest()[:24]
        out_dir = cache_dir() / "host"
        out_dir.mkdir(parents=True, exist_ok=True)
        artifact = out_dir / f"{key}.so"
        t0 = time.perf_counter()
        if not artifact.is_file():
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "kernel.c"
                src.write_text(source.text)
                tmp_so = Path(tmp) / "kernel.so"
                proc = subprocess.run([cc, *flags, "-o", str(tmp_so), str(src), "-lm"],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    raise BuildError(f"{source.template}: compiler failed:\n{proc.stderr[-4000:]}")
                (out_dir / f"{key}.c").write_text(source.text)  # kept next to the library for reading
                os.replace(tmp_so, artifact)
        kernel = Kernel(source=source, artifact=artifact, entries=entries, backend=self.name,
                        build_s=time.perf_counter() - t0)
        lib = _loaded.get(str(artifact))
        if lib is None:
            lib = _loaded[str(artifact)] = ctypes.CDLL(str(artifact))
        kernel.bind(lib)
        return kernel

    def run(self, kernel: Kernel, entry: str, *args) -> None:
        kernel.call(entry, *args)
