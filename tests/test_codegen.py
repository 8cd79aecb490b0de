import jinja2
import pytest

from aurakernel.codegen import render
from aurakernel.dtypes import DType
from aurakernel.ops import get_op
from aurakernel.targets.host.ops import kernel_of as host_kernel


def params(**over):
    p = {"dtype": DType.bf16, "cols": 4096, "weighted": True, "tile_rows": 8, "col_chunk": 256, "threads": 2}
    p.update(over)
    return p


def test_render_is_deterministic_and_hash_changes_with_knobs():
    a = render("host/rms_norm.c.j2", params())
    b = render("host/rms_norm.c.j2", params())
    c = render("host/rms_norm.c.j2", params(tile_rows=16))
    assert a.text == b.text and a.hash == b.hash
    assert c.hash != a.hash
    assert "#define TILE_ROWS 16" in c.text


@pytest.mark.parametrize("bad", ["4096; system(\"rm -rf /\")", b"8", None, object()])
def test_free_text_never_reaches_source(bad):
    with pytest.raises(TypeError, match="only int, float, bool"):
        render("host/rms_norm.c.j2", params(cols=bad))


def test_non_finite_float_rejected():
    with pytest.raises(ValueError, match="not finite"):
        render("host/rms_norm.c.j2", params(eps=float("nan")))


def test_missing_value_is_an_error_not_an_empty_string():
    p = params()
    del p["col_chunk"]
    with pytest.raises(jinja2.UndefinedError):
        render("host/rms_norm.c.j2", p)


def test_op_render_params_are_typed():
    spec = get_op("rms_norm")
    problem = spec.problem("64x100", "fp16", "unweighted")
    p = host_kernel(spec).render_params(problem, {"tile_rows": 4, "col_chunk": 32, "threads": 1})
    assert all(isinstance(v, int | bool | DType) for v in p.values())


def test_a_damaged_cached_build_is_rebuilt_and_killed_builds_temp_dirs_removed(tmp_path, monkeypatch):
    """A truncated cached .so (a full disk, a kill outside our atomic rename) would fail every later
    run: it is found damaged and rebuilt. A build killed mid-way leaves a temp dir in the cache: one
    older than an hour is removed, a live build's is left alone."""
    import os
    import time

    from aurakernel import paths
    from aurakernel.ops.base import Problem
    from aurakernel.targets.host import library
    from aurakernel.targets.host.build import build_kernel

    monkeypatch.setenv("AURAKERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(paths, "_swept", set())
    (tmp_path / "host").mkdir()
    stale, live = tmp_path / "host" / "tmpkilled", tmp_path / "host" / "tmpbuilding"
    stale.mkdir()
    live.mkdir()
    hour_ago = time.time() - paths.STALE_BUILD_S - 60
    os.utime(stale, (hour_ago, hour_ago))

    spec = get_op("rms_norm")
    problem = Problem("rms_norm", "weighted", (8, 64), DType.fp32)
    knobs = {"tile_rows": 8, "col_chunk": 64, "threads": 1}

    def fresh_process_build():
        monkeypatch.setattr(library, "_BUILT", {})
        monkeypatch.setattr(library, "_loaded", {})
        return build_kernel(spec, problem, knobs)

    artifact = fresh_process_build().artifact
    assert not stale.exists() and live.exists()
    whole = artifact.read_bytes()
    assert paths.whole_build(artifact)

    def damage(content):   # as another process would (this one has the library mapped: a new inode)
        (tmp_path / "damaged").write_bytes(content)
        os.replace(tmp_path / "damaged", artifact)

    damage(whole[: len(whole) // 2])   # truncated
    kernel = fresh_process_build()
    assert kernel.artifact == artifact and artifact.read_bytes() == whole   # rebuilt, and loaded
    damage(b"")
    assert not paths.whole_build(artifact) and not artifact.exists()   # a damaged file is removed


def test_bf16_stores_round_like_torch_and_keep_nan(tmp_path):
    """Every bf16 kernel narrows its fp32 results with the common header's ak_store: round to nearest
    even exactly as torch (ties both ways, subnormals, overflow to inf, inf), and a NaN stays a NaN (so
    the trainer's non-finite step guard sees what a kernel computed)."""
    import struct

    import torch

    from aurakernel.targets.host.library import Entry, compile_source

    (tmp_path / "probe.c.j2").write_text('{% include "host/_common.h.j2" %}\n'
                                         "void ak_probe(const float* x, elem_t* y, int64_t n) {\n"
                                         "    #pragma omp simd\n"
                                         "    for (int64_t i = 0; i < n; ++i) y[i] = ak_store(x[i]);\n}\n")
    kernel = compile_source(render("probe.c.j2", {"dtype": DType.bf16}, (tmp_path,)),
                            {"probe": Entry("ak_probe", ("ptr", "ptr", "i64"))})
    bits = [0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0x00008000, 0x80018000, 0x7f7fffff, 0xff7f8000,
            0x7f800000, 0xff800000, 0x00000000, 0x80000000, 0x7fc00000, 0xffc00001, 0x7f800001, 0x7fffffff]
    special = torch.tensor([struct.unpack("f", struct.pack("I", b))[0] for b in bits])
    x = torch.cat([special, torch.randn(4093) * 1e3, torch.randn(4091) * 1e-39])   # odd lengths: vector tails
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    kernel.call("probe", x, y, x.numel())
    nan = x.isnan()
    assert y[nan].isnan().all() and nan.sum() == 4
    assert torch.equal(y[~nan].view(torch.int16), x[~nan].to(torch.bfloat16).view(torch.int16))


def test_the_short_exps_keep_the_precision_their_outputs_need(tmp_path):
    """The common header's exps of x <= 0, against float64 over [-87, 0] (and past it): ak_exp_neg within
    a few fp32 ulp; ak_exp_neg_sum16 (16-bit losses' sums) < 4e-6; ak_exp_neg16 (what a 16-bit store
    keeps) < 6e-5, below bf16's 3.9e-3 and fp16's 4.9e-4 half-ulp by far; all 0 below -87, NaN kept."""
    import torch

    from aurakernel.targets.host.library import Entry, compile_source

    (tmp_path / "exps.c.j2").write_text(
        '{% include "host/_common.h.j2" %}\n'
        "void ak_probe(const float* x, float* y, int64_t n) {\n"
        "    #pragma omp simd\n"
        "    for (int64_t i = 0; i < n; ++i) { y[i] = ak_exp_neg(x[i]); y[n + i] = ak_exp_neg_sum16(x[i]);"
        " y[2 * n + i] = ak_exp_neg16(x[i]); }\n}\n")
    kernel = compile_source(render("exps.c.j2", {"dtype": DType.bf16}, (tmp_path,)),
                            {"probe": Entry("ak_probe", ("ptr", "ptr", "i64"))})
    x = torch.cat([-torch.rand(200_001, generator=torch.Generator().manual_seed(0)) * 87, torch.linspace(-87, 0, 9999),
                   torch.tensor([0.0, -1e-30, -87.5, -200.0, float("-inf"), float("nan")])])
    y = torch.empty(3, x.numel())
    kernel.call("probe", x, y, x.numel())
    ok = x >= -87
    want = x[ok].double().exp()
    for row, bound in ((0, 3e-7), (1, 4e-6), (2, 6e-5)):
        err = ((y[row][ok].double() - want).abs() / want).max().item()
        assert err < bound, (row, err)
        assert torch.equal(y[row][(x < -87)], torch.zeros(3)) and y[row][-1].isnan()


@pytest.mark.parametrize("vec", [8, 16])
def test_the_register_blocked_gemm_matches_a_reference_at_every_edge(vec, tmp_path):
    """ak_gemm (the portable GEMM of sparse_attention, mhc and indexer_score) at both vector widths
    (AVX2's register blocks of 6 rows and 3-vector blocks, AVX-512's of 8 and its 24-column block;
    16-lane vectors are lowered where the CPU has none): every row count around its blocks of
    8/6/4/2, column counts around whole vectors, overwrite and accumulate, a transposed A."""
    import torch

    from aurakernel.targets.host.library import Entry, compile_source

    (tmp_path / "gemm.c.j2").write_text(
        '{% include "host/_common.h.j2" %}\n#define VEC {{ vec }}\n{% include "host/_gemm.h.j2" %}\n'
        "void ak_probe(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t acs, const float* B,"
        " float* C, int64_t overwrite) { ak_gemm((int)M, (int)N, (int)K, A, lda, acs, B, N, C, N, (int)overwrite); }\n")
    kernel = compile_source(render("gemm.c.j2", {"dtype": DType.fp32, "vec": vec}, (tmp_path,)),
                            {"probe": Entry("ak_probe", ("i64", "i64", "i64", "ptr", "i64", "i64", "ptr", "ptr", "i64"))})
    g = torch.Generator().manual_seed(0)
    for m in range(1, 19):
        for n in (1, 7, 8, 9, 16, 24, 33, 40, 48, 56, 88):
            for k, overwrite, transposed in ((5, 1, False), (13, 0, False), (9, 0, True)):
                a = torch.randint(-4, 5, (k, m) if transposed else (m, k), generator=g).float()
                b = torch.randint(-4, 5, (k, n), generator=g).float()
                c = torch.randint(-4, 5, (m, n), generator=g).float()
                want = a.T @ b if transposed else a @ b
                if not overwrite:
                    want = want + c
                kernel.call("probe", m, n, k, a, 1 if transposed else k, m if transposed else 1, b, c, overwrite)
                assert torch.equal(c, want), (m, n, k, overwrite, transposed)


@pytest.mark.parametrize("vec", [8, 16])
def test_the_blocked_gemm_driver_matches_a_reference_across_panels_strips_and_splits(vec, tmp_path):
    """ak_gemm_strided (linear's, the grouped GEMMs', the fused loss's) with small blocking, so that
    every shape spans several panels of B, blocks of A and k-panels: B packed as column strips whose
    last one is a lone vector, three vectors or the leftover columns; B read across rows or down
    columns (its transposed packing); A read in place or packed (strides past PACK_A_STRIDE); C
    overwritten or added to; one thread and two (rows, columns or the depth shared)."""
    import torch

    from aurakernel.targets.host.library import Entry, compile_source

    (tmp_path / "drv.c.j2").write_text(
        '{% include "host/_common.h.j2" %}\n#define GEMM_PARTIAL_FLOATS ((int64_t)1 << 16)\n'
        '{% include "host/_gemm_driver.h.j2" %}\n'
        "int64_t ak_ws(void) { return ak_gemm_scratch_floats(); }\n"
        "void ak_probe(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t acs, const float* B,"
        " int64_t brs, int64_t bcs, float* C, int64_t acc, float* ws) {"
        " ak_gemm_strided(M, N, K, A, ars, acs, B, brs, bcs, C, N, (int)acc, ws); }\n")
    entries = {"ws": Entry("ak_ws", (), "i64"),
               "probe": Entry("ak_probe", ("i64",) * 3 + ("ptr", "i64", "i64", "ptr", "i64", "i64", "ptr", "i64", "ptr"))}
    g = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        kernel = compile_source(render("drv.c.j2", {"dtype": DType.fp32, "vec": vec, "kc": 16, "nc": 6 * vec,
                                                    "mc": 24, "threads": threads}, (tmp_path,)), entries)
        ws = torch.empty(int(kernel.call("ws")))
        for m, n, k in ((1, 1, 1), (7, 8, 5), (30, 3 * vec, 37), (50, 7 * vec, 16), (29, 9 * vec + 5, 40),
                        (13, 2 * vec + 3, 1100), (1100, 13, 9), (5, 11 * vec, 33)):
            for b_down, acc in ((False, 0), (True, 1)):
                a = torch.randint(-3, 4, (m, k), generator=g).float()
                b = torch.randint(-3, 4, (n, k) if b_down else (k, n), generator=g).float()
                c = torch.randint(-3, 4, (m, n), generator=g).float()
                want = a @ (b.T if b_down else b) + (c if acc else 0)
                kernel.call("probe", m, n, k, a, k, 1, b, 1 if b_down else n, k if b_down else 1, c, acc, ws)
                assert torch.equal(c, want), (threads, m, n, k, b_down, acc)
                at = a.T.contiguous()   # A read down its columns (a weight gradient's dy^T)
                c2 = torch.zeros(m, n)
                kernel.call("probe", m, n, k, at, 1, m, b, 1 if b_down else n, k if b_down else 1, c2, 0, ws)
                assert torch.equal(c2, a @ (b.T if b_down else b)), (threads, m, n, k, b_down, "A down columns")
