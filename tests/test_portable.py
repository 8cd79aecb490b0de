"""The portable kernel paths: machines that run this project are AVX2-only (no AVX-512, no AMX).
With AURAKERNEL_HOST_ISA=avx2 every operator's kernel is built for x86-64-v3 and planned for 32-byte
vectors, and the operator tests (tests/test_ops.py: forward and backward against the reference,
tails, every dtype) and the planner's must pass on that path too, on that machine's cache sizes (the
planner's are left out where the native run already planned for that very profile, and the operator
tests where the native kernels are the portable ones: an AVX2-only machine with those caches); the
built libraries are checked to hold no AVX-512 or AMX instruction, so the test cannot pass on the
native path by accident."""

import os
import subprocess
import sys

import pytest

from aurakernel.errors import UserError
from aurakernel.hardware import _cpu_flags, _machine_flags, host_isa, host_profile

from conftest import REPO


def _disassembly(lib) -> str:
    return subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True, check=True).stdout


PORTABLE_CACHES = {"L1": 32 << 10, "L2": 512 << 10}   # the AVX2 EPYC's, per core
PLANNER_TESTS = ("tests/test_planner.py", "tests/test_planner_depth.py", "tests/test_planner_fit.py")


def planner_sees_the_portable_machine_natively() -> bool:
    """Whether this machine's own profile is the one the portable run plans for (32-byte vectors, the
    EPYC's caches): then the planner tests of the native run have already planned exactly that."""
    profile = host_profile(calibrated=False)
    return profile.simd_bytes == 32 and all(profile.memory[level].capacity == size for level, size in PORTABLE_CACHES.items())


def native_is_portable() -> bool:
    """Whether this machine's native kernels are the portable ones: no AVX-512 and no AMX (the kernels'
    only other paths) and the portable run's caches, so the native run's operator tests ran exactly
    the code and the plans the portable run would (only -march differs)."""
    return (not any(f.startswith(("avx512", "amx")) for f in _machine_flags())
            and planner_sees_the_portable_machine_natively())


def test_every_kernel_passes_on_the_portable_avx2_path(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "AURAKERNEL_HOST_ISA": "avx2",
           "AURAKERNEL_HOST_CACHES": ",".join(f"{level}={size >> 10}K" for level, size in PORTABLE_CACHES.items()),
           "AURAKERNEL_TEST_CACHE_DIR": str(cache)}
    # the kernels are always rebuilt for x86-64-v3 and rerun; the planner's tests only where the native
    # run planned for another machine (on the EPYC itself they would repeat it exactly: ~50 s)
    planner = () if planner_sees_the_portable_machine_natively() else PLANNER_TESTS
    # on an AVX2-only machine with those caches the native run's operator tests already ran every
    # portable path: the forced build is checked on rms_norm's tests alone (~150 s less)
    ops = () if native_is_portable() else ("tests/test_ops.py",)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *ops,
                           *planner, "tests/test_rms_norm.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    libs = sorted((cache / "host").glob("*.so"))
    assert len(libs) >= (12 if ops else 2)   # at least one library per operator (or rms_norm's two variants)
    for lib in libs:
        code = _disassembly(lib)
        assert "%zmm" not in code and "tdpbf16ps" not in code and "ldtilecfg" not in code, lib.name


def test_the_planner_tests_are_left_out_only_where_the_native_profile_is_the_portable_one(monkeypatch):
    monkeypatch.setenv("AURAKERNEL_HOST_ISA", "avx2")
    monkeypatch.setenv("AURAKERNEL_HOST_CACHES", "L1=32K,L2=512K")
    assert planner_sees_the_portable_machine_natively()
    monkeypatch.setenv("AURAKERNEL_HOST_CACHES", "L1=32K,L2=2M")   # a Xeon's L2: the planner would plan otherwise
    assert not planner_sees_the_portable_machine_natively() and not native_is_portable()


def test_the_forced_isa_is_what_the_planner_sees(monkeypatch):
    monkeypatch.setenv("AURAKERNEL_HOST_ISA", "native")   # what the CPU has, whatever the suite runs under
    native_avx512 = "avx512f" in _cpu_flags()
    monkeypatch.setenv("AURAKERNEL_HOST_ISA", "avx2")
    assert host_isa() == "avx2"
    assert not any(f.startswith(("avx512", "amx")) for f in _cpu_flags())
    assert host_profile(calibrated=False).simd_bytes == 32
    monkeypatch.setenv("AURAKERNEL_HOST_ISA", "native")
    assert host_profile(calibrated=False).simd_bytes == (64 if native_avx512 else 32)
    monkeypatch.setenv("AURAKERNEL_HOST_ISA", "sse2")
    with pytest.raises(UserError, match="accepted are native, avx2"):
        host_isa()


@pytest.mark.parametrize("op,shape,variant", [("sparse_attention", "1x4x40x64x16x8", "csa"),
                                              ("indexer_score", "1x40x4x64x48", "default"),
                                              ("mhc_pre", "40x4x256", "default")])
def test_the_tile_paths_compile_on_every_machine(op, shape, variant, tmp_path):
    """The AMX code of the bf16 kernels is compiled only for a CPU with AMX: on an AVX2-only machine
    it is built for Sapphire Rapids here, so an edit that breaks it cannot pass unseen where it cannot run."""
    from aurakernel.codegen import render
    from aurakernel.ops import get_op
    from aurakernel.planner import solve_tiling
    from aurakernel.targets.host.library import CFLAGS
    from aurakernel.targets.host.ops import kernel_of

    spec = get_op(op)
    impl = kernel_of(spec)
    problem = spec.problem(shape, "bf16", variant)
    knobs = solve_tiling(impl.tiling_problem(problem, host_profile()), op=op, variant=variant, shape=problem.shape,
                         dtype="bf16", target="host").knobs
    source = tmp_path / f"{op}.c"
    source.write_text(render(impl.template(), impl.render_params(problem, knobs), spec.template_dirs).text)
    flags = [f for f in CFLAGS if f != "-shared"]
    proc = subprocess.run(["gcc", "-march=sapphirerapids", *flags, "-Werror", "-c", str(source), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tdpbf16ps" in _disassembly(tmp_path / "k.o")
