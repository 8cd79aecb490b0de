"""Interleaved partial RoPE: transformers' DeepSeek-V4 `apply_rotary_pos_emb`, as the attention
uses it on q, on the shared kv, and (with -sin) to de-rotate the attention output, and as the
compressor and the indexer use it on their pooled keys and queries.

It is a module-level function, not a module: the patch makes the modules of a patched model that
call it (ROPE_CALLERS) call `rope_dispatch` instead (patch.install.swap_globals); every other
module in the process keeps the reference.
"""

from __future__ import annotations

import functools

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from ..dtypes import DType
from ..planner.costmodel import RowwisePhase, rowwise_model
from ..patch.install import swap_globals
from ..patch.torch_op import torch_op
from . import scoped
from .base import Entry, OpSpec, Problem, Tensors, Tolerance, Work

# bf16/fp16: the reference rounds each of the two gradient paths (x and rotate_half(x)) to the
# input dtype before adding them; the kernel rounds once, so they differ by about one ulp
_TOL = {DType.fp32: Tolerance(1e-6, 1e-5), DType.bf16: Tolerance(3e-2, 1.6e-2), DType.fp16: Tolerance(4e-3, 2e-3)}


class RopeReference(torch.nn.Module):
    """Calls the (possibly patched) module-level function, as the attention does."""

    def forward(self, x, cos, sin):
        return apply_rotary_pos_emb(x, cos, sin)


def _angles(tokens: int, rope_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
    freqs = torch.arange(tokens, dtype=torch.float)[None, :, None] * inv_freq
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


class RopeSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[2:]

    def check_shape(self, shape):
        from ..errors import UserError
        _, _, head_dim, rope_dim = shape
        if rope_dim % 2 or rope_dim > head_dim:
            raise UserError(f"rope shape {shape}: ROPE_DIM must be even and at most HEAD_DIM")

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        tokens, heads, head_dim, rope_dim = problem.shape
        g = torch.Generator().manual_seed(seed)
        # [B=1, H, S, D] as the transposed view the attention hands over
        x = torch.randn(1, tokens, heads, head_dim, generator=g).to(problem.dtype.torch).transpose(1, 2)
        cos, sin = _angles(tokens, rope_dim, problem.dtype.torch)
        return {"x": x, "cos": cos, "sin": sin}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("x",)

    def module_call(self, problem: Problem, inputs: Tensors):
        return RopeReference(), (inputs["x"], inputs["cos"], inputs["sin"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": SWAP.reference(inputs["x"], inputs["cos"], inputs["sin"])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype]

    def work(self, problem: Problem, backward: bool) -> Work:
        tokens, heads, head_dim, rope_dim = problem.shape
        e = problem.dtype.itemsize
        return Work(2 * tokens * heads * head_dim * e + tokens * rope_dim * 4, 3 * tokens * heads * rope_dim)

    def tiling_problem(self, problem: Problem, hw):
        tokens, heads, head_dim, rope_dim = problem.shape
        e = problem.dtype.itemsize
        phase = RowwisePhase("forward", 2 * head_dim * e, 3 * rope_dim + head_dim, 0, 0, 0, 0)
        back = RowwisePhase("backward", 2 * head_dim * e, 3 * rope_dim + head_dim, 0, 0, 0, 0)
        return rowwise_model(tokens * heads, head_dim, [phase, back], hw, fixed={"col_chunk": head_dim})

    def template(self, target_kind: str) -> str:
        return f"{target_kind}/rope.c.j2"

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        return {"dtype": problem.dtype, "head_dim": int(problem.shape[2]), "rope_dim": int(problem.shape[3]),
                "tile_rows": int(knobs["tile_rows"]), "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        x = inputs["x"]
        return {"y": torch.empty(x.shape, dtype=x.dtype)}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        _call(kernel, "fwd", inputs["x"], inputs["cos"], inputs["sin"], outputs["y"])

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        _call(kernel, "bwd", grad_outputs["y"], inputs["cos"], inputs["sin"], grads["x"])

    def verification_problems(self, problem: Problem, knobs: dict[str, int], simd_elems: int) -> list[Problem]:
        tokens, heads, head_dim, rope_dim = problem.shape
        tail = min(tokens, knobs["tile_rows"] * knobs["threads"] + 3)
        return [problem, Problem(problem.op, problem.variant, (tail, heads + 1, head_dim + 3, rope_dim), problem.dtype)]

    def call_problem(self, module, args):
        return None   # a function, not a module: the profiler records it through SWAP.recording

    def patch(self, module: torch.nn.Module, lookup) -> None:
        """Make rope run kernels in every module of `module` (a DeepseekV4Model, or RopeReference)
        whose code calls apply_rotary_pos_emb."""
        dispatch = functools.partial(rope_dispatch, lookup)
        for sub in module.modules():
            if isinstance(sub, (*ROPE_CALLERS, RopeReference)):
                swap_globals(sub, apply_rotary_pos_emb=dispatch)

    # --- AscendC (templates/ascendc/rope/): (token, head) rows over the vector cores ------------
    # The interleaved pair swap needs each element's partner x[j ^ 1], which no documented vector op
    # gathers on A2/A3 (shared/reference/ascendc.md documents no Gather). The kernel gets it from the
    # copy engine instead: DataCopyPad takes a GM address at any element, so the rope slice is read
    # three times, at offsets 0, +1 and -1 (x[j], x[j+1], x[j-1] land on the same UB lane j), and a
    # Select with an even-lane bit mask picks x[j+1] (even j) or x[j-1] (odd j). cos/sin (one per
    # pair) are widened to both lanes of their pair with Brcb and block-strided level-0 copies.
    def ascend_rows_cols(self, problem: Problem) -> tuple[int, int]:
        tokens, heads, head_dim, _ = problem.shape
        return tokens * heads, head_dim

    def ascend_phases(self, problem: Problem):
        from ..planner.ascend import AscendRowPhase
        _, _, head_dim, rope_dim = problem.shape
        e = problem.dtype.itemsize
        # per row: the row in (nope + rope slice), out; the two shifted rope reads and cos/sin queued
        # with the tile. Vector work only on the rope slice: ~25 instructions per group of rows (3
        # casts in, negate, Select, 2 Mul, Add, cast out; per cos and sin: Brcb, 4 strided copies,
        # 3 Selects), each pass over rope_dim fp32 lanes; Brcb writes 8 lanes per cos element.
        # Work buffers (fp32 chunks): x, x[j+1], x[j-1], 4 widened copies, cos and sin, the Brcb
        # blocks (4 chunks) and the lane masks (1).
        frac = rope_dim / head_dim
        ops = 25 * frac + 2 * 8 * frac / 2
        instrs = max(1, round(25 * (-(-rope_dim // 16) * 16) / head_dim))
        phase = dict(streams_in=1, streams_out=1, small_in_bytes=2 * rope_dim * e + rope_dim * 4, small_out_bytes=0,
                     resident_bytes=0, work_buffers=14, fast_ops_per_elem=ops, slow_ops_per_elem=0,
                     instrs_per_chunk=instrs)
        return [AscendRowPhase("forward", **phase), AscendRowPhase("backward", **phase)]

    def ascend_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        from ..errors import UserError
        _, heads, head_dim, rope_dim = problem.shape
        if rope_dim >= head_dim or rope_dim < 2:
            raise UserError(f"rope shape {problem.shape_text}: the AscendC kernel needs 2 <= ROPE_DIM < HEAD_DIM "
                            "(it reads x[j-1] from the nope part)")
        return {"dtype": problem.dtype, "heads": int(heads), "head_dim": int(head_dim), "rope_dim": int(rope_dim),
                "tile_rows": int(knobs["tile_rows"]), "buffers": int(knobs["buffers"]), "chunk": int(knobs["chunk"]),
                "block_dim": int(knobs["block_dim"])}

    def ascend_verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Tokens that leave a tail core and (b, h) runs longer than a tile; then one more head, a
        head width that is not a multiple of 16 and a rope slice that is not either."""
        tokens, heads, head_dim, rope_dim = problem.shape
        t1 = min(tokens, knobs["tile_rows"] + 5)
        if t1 % knobs["block_dim"] == 0 and t1 > 1:
            t1 -= 1
        r2 = rope_dim - 2 if rope_dim % 16 == 0 and rope_dim > 2 else rope_dim
        return [Problem(problem.op, problem.variant, (t1, heads, head_dim, rope_dim), problem.dtype),
                Problem(problem.op, problem.variant, (min(tokens, 7), heads + 1, head_dim + 3, r2), problem.dtype)]

    def ascend_run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""
        from .. import emulator
        from ..emulator import from_bytes, to_bytes
        x, cos, sin = inputs["x"], inputs["cos"], inputs["sin"]
        b, h, s, d = x.shape
        half = cos.shape[-1]
        c32 = cos.float().expand(b, s, half).contiguous()
        s32 = sin.float().expand(b, s, half).contiguous()
        outs, reports = {}, {}
        dy = grad_out["y"].to(x.dtype)
        for phase, entry, src in (("forward", "ak_rope_fwd", x), ("backward", "ak_rope_bwd", dy)):
            if src.stride(-1) != 1 or (s > 1 and src.stride(2) < d):
                src = src.contiguous()
            # the strided tensor's storage span: the kernel walks it with the strides in the tiling
            extent = sum((n - 1) * st for n, st in zip(src.shape, src.stride())) + 1
            span = torch.as_strided(src, (extent,), (1,), src.storage_offset())
            tiling, block_dim = ascend_tiling(src.shape, src.stride(), c32.stride(), 2 * half, problem.dtype.itemsize,
                                              knobs)
            y = torch.full((b, h, s, d), float("nan")).to(x.dtype)
            bufs = [to_bytes(span), to_bytes(c32), to_bytes(s32), to_bytes(y), bytearray(32), tiling]
            reports[phase] = emulator.run(emu.exe(entry, 6), block_dim, bufs)
            outs[phase] = from_bytes(bufs[3], y)
        return {"y": outs["forward"]}, {"x": outs["backward"]}, reports



def ascend_tiling(shape, x_strides, cs_strides, rope_dim: int, itemsize: int,
                  knobs: dict[str, int]) -> tuple[bytearray, int]:
    """AkRopeTiling (templates/ascendc/rope/tiling.h.j2) for x [B, H, S, D] with element strides
    x_strides and cos/sin [B, S, R/2] fp32 with strides cs_strides; and the cores it runs on. The
    host tiling function (host.cpp.j2) computes the same fields."""
    import struct

    from ..planner.ascend import row_split, ub_pitch
    b, h, s, d = shape
    rope_pitch = -(-rope_dim // 16) * 16                 # UB row pitch of the rope slice: 32 B in T and in fp32
    cos_pitch = rope_pitch // 2
    # rows per compute group: a fp32 work chunk; Brcb's repeats (8 cos per repeat) stay <= 255
    group = max(1, min(knobs["chunk"] // rope_pitch, 2040 // cos_pitch))
    work = -(-group * rope_pitch // 64) * 64
    block_rows, block_dim = row_split(b * h * s, knobs["block_dim"])
    fields = [b, h, s, d, rope_dim, d - rope_dim, ub_pitch(d - rope_dim, itemsize), rope_pitch, cos_pitch, block_rows,
              knobs["tile_rows"], group, work, x_strides[0], x_strides[1], x_strides[2], cs_strides[0], cs_strides[1]]
    if any(not 0 <= int(f) < 2 ** 32 for f in fields):
        raise ValueError(f"rope tiling field out of uint32 range: {fields}")
    return bytearray(struct.pack(f"<{len(fields)}I", *map(int, fields))), block_dim

def _call(kernel, entry: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y: torch.Tensor) -> None:
    b, h, s, _ = x.shape
    c32 = cos.float().expand(b, s, cos.shape[-1])
    s32 = sin.float().expand(b, s, sin.shape[-1])
    if c32.stride(-1) != 1 or s32.stride() != c32.stride():
        c32, s32 = c32.contiguous(), s32.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    kernel.call(entry, x, x.stride(0), x.stride(1), x.stride(2), c32, s32, c32.stride(0), c32.stride(1),
                y, b, h, s)


def _forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: str) -> torch.Tensor:
    from ..build import built_kernel
    y = x.new_empty(x.shape)
    _call(built_kernel(kernel), "fwd", x, cos, sin, y)
    return y


def _backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: str) -> torch.Tensor:
    """The inverse rotation (dx keeps dy's shape; rope is orthogonal)."""
    from ..build import built_kernel
    dx = dy.new_empty(dy.shape)
    _call(built_kernel(kernel), "bwd", dy, cos, sin, dx)
    return dx


OP = torch_op("rope", _forward, _backward, fake_forward=lambda x, cos, sin, kernel: x.new_empty(x.shape),
              fake_backward=lambda dy, cos, sin, kernel: dy.new_empty(dy.shape),
              saved=("cos", "sin"), consts=("kernel",), grads=("x",))


def rope_dispatch(lookup, x, cos, sin, unsqueeze_dim: int = 1):
    """Drop-in for v4.apply_rotary_pos_emb with `lookup` bound (functools.partial): the kernel when
    one fits the call, else the reference."""
    if (unsqueeze_dim != 1 or x.dim() != 4 or cos.dim() != 3 or x.device.type != "cpu"
            or cos.requires_grad or sin.requires_grad):
        return SWAP.reference(x, cos, sin, unsqueeze_dim)
    kernel = lookup((x.shape[-1], 2 * cos.shape[-1]), x.dtype)
    if kernel is None:
        return SWAP.reference(x, cos, sin, unsqueeze_dim)
    return OP(x, cos, sin, kernel)


# the modules whose code calls apply_rotary_pos_emb (the attention, the compressors, the indexer)
ROPE_CALLERS = (v4.DeepseekV4Attention, v4.DeepseekV4HCACompressor, v4.DeepseekV4CSACompressor, v4.DeepseekV4Indexer)
SWAP = scoped.FunctionSwap(v4, "apply_rotary_pos_emb")


def call_problem(x, cos, sin, unsqueeze_dim=1):
    """The rope problem of one call (for the profiler's recorder)."""
    if x.dim() != 4 or x.dtype not in (d.torch for d in SPEC.dtypes):
        return None
    b, h, s, d = x.shape
    return Problem("rope", "default", (b * s, h, d, 2 * cos.shape[-1]), DType.from_torch(x.dtype))


SPEC = RopeSpec(
    name="rope",
    summary="interleaved partial RoPE on the trailing rope slice of each head (and its inverse)",
    shape_meaning="TOKENSxHEADSxHEAD_DIMxROPE_DIM",
    shape_rank=4,
    default_shape=(4096, 64, 512, 64),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
    knob_docs={"tile_rows": "(token, head) rows per tile", "threads": "OpenMP threads"},
    entries={"fwd": Entry("ak_rope_fwd", ("ptr", "i64", "i64", "i64", "ptr", "ptr", "i64", "i64", "ptr", "i64", "i64", "i64")),
             "bwd": Entry("ak_rope_bwd", ("ptr", "i64", "i64", "i64", "ptr", "ptr", "i64", "i64", "ptr", "i64", "i64", "i64"))},
)
