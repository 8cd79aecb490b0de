"""mHC post: the stream update at the end of each DeepseekV4DecoderLayer sub-block,

    new_streams = post (x) block_output + comb^T @ streams

written inline in DeepseekV4DecoderLayer.forward (twice per layer). The kernel is one pass over
the streams forward and one backward (all four gradients together). Swapping patches the layer's
forward to route both updates through an `MhcPost` module (Liger-style: the layer's code is
repeated with that one expression replaced).
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

from ..dtypes import DType
from ..planner.costmodel import RowwisePhase, rowwise_model
from ..patch.install import install
from ..patch.torch_op import torch_op
from .base import Entry, OpSpec, Problem, Tensors, Tolerance, Work
from .layout import like_layout

_TOL = {
    DType.fp32: {n: Tolerance(1e-5, 1e-5) for n in ("y", "out", "h")} | {n: Tolerance(1e-4, 1e-4) for n in ("post", "comb")},
    DType.bf16: {n: Tolerance(2e-2, 1.6e-2) for n in ("y", "out", "h")} | {n: Tolerance(2e-2, 2e-2) for n in ("post", "comb")},
    DType.fp16: {n: Tolerance(2e-3, 2e-3) for n in ("y", "out", "h")} | {n: Tolerance(2e-3, 2e-3) for n in ("post", "comb")},
}


class MhcPost(torch.nn.Module):
    """The reference: DeepseekV4DecoderLayer's stream update, verbatim."""

    def forward(self, post, comb, block_output, hidden_states):
        dtype = hidden_states.dtype
        return post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden_states)


class MhcPostSpec(OpSpec):
    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        rows, hc, d = problem.shape
        g = torch.Generator().manual_seed(seed)
        comb = torch.rand(rows, hc, hc, generator=g)
        return {"post": 2 * torch.rand(rows, hc, generator=g), "comb": comb / comb.sum(-1, keepdim=True),
                "out": torch.randn(rows, d, generator=g).to(problem.dtype.torch),
                "h": torch.randn(rows, hc, d, generator=g).to(problem.dtype.torch)}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("post", "comb", "out", "h")

    def module_call(self, problem: Problem, inputs: Tensors):
        return MhcPost(), (inputs["post"], inputs["comb"], inputs["out"], inputs["h"])

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": MhcPost()(inputs["post"], inputs["comb"], inputs["out"], inputs["h"])}

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        return _TOL[dtype][output]

    def work(self, problem: Problem, backward: bool) -> Work:
        rows, hc, d = problem.shape
        e = problem.dtype.itemsize
        if not backward:
            return Work(rows * ((2 * hc + 1) * d * e + (hc + hc * hc) * 4), rows * d * hc * (2 * hc + 2))
        return Work(rows * ((3 * hc + 2) * d * e + 2 * (hc + hc * hc) * 4), rows * d * hc * (4 * hc + 4))

    def tiling_problem(self, problem: Problem, hw):
        rows, hc, d = problem.shape
        e = problem.dtype.itemsize
        phases = [
            RowwisePhase("forward", dram_bytes_per_row=(2 * hc + 1) * d * e + (hc + hc * hc) * 4,
                         vector_elems_per_row=d * hc * (hc + 1), chunked_passes=0,
                         resident_bytes_per_row=0, l1_bytes_per_col=0, l2_bytes_per_tile=0),
            RowwisePhase("backward", dram_bytes_per_row=(3 * hc + 2) * d * e + 2 * (hc + hc * hc) * 4,
                         vector_elems_per_row=d * hc * (2 * hc + 2), chunked_passes=0,
                         resident_bytes_per_row=0, l1_bytes_per_col=0, l2_bytes_per_tile=0),
        ]
        # one pass per row: no column chunking, so col_chunk is the whole row
        return rowwise_model(rows, d, phases, hw, fixed={"col_chunk": d})

    def template(self, target_kind: str) -> str:
        return f"{target_kind}/mhc_post.c.j2"

    def render_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, hc, d = problem.shape
        return {"dtype": problem.dtype, "hc": int(hc), "d": int(d), "tile_rows": int(knobs["tile_rows"]),
                "threads": int(knobs["threads"])}

    def empty_outputs(self, problem: Problem, inputs: Tensors) -> Tensors:
        return {"y": torch.empty_like(inputs["h"])}

    def run_forward(self, kernel, inputs: Tensors, outputs: Tensors) -> None:
        rows = inputs["post"].numel() // inputs["post"].shape[-1]
        kernel.call("fwd", inputs["post"], inputs["comb"], inputs["out"], inputs["h"], outputs["y"], rows)

    def run_backward(self, kernel, inputs: Tensors, outputs: Tensors, grad_outputs: Tensors, grads: Tensors) -> None:
        rows = inputs["post"].numel() // inputs["post"].shape[-1]
        kernel.call("bwd", inputs["post"], inputs["comb"], inputs["out"], inputs["h"], grad_outputs["y"],
                    grads["post"], grads["comb"], grads["out"], grads["h"], rows)

    # --- AscendC (templates/ascendc/mhc_post/): a token's streams go through in column tiles ----
    ascend_split_cols = True

    def ascend_rows_cols(self, problem: Problem) -> tuple[int, int]:
        return problem.shape[0], problem.shape[2]

    def ascend_phases(self, problem: Problem):
        from ..planner.ascend import AscendRowPhase
        hc = problem.shape[1]
        mix = 4 * (-(-hc // 8) * 8 + -(-hc * hc // 8) * 8)     # post and comb blocks, bytes
        return [
            # out + HC streams in, HC out; HC + 1 casts in, HC out, HC x (1 + 2 HC) multiply-adds
            AscendRowPhase("forward", 1 + hc, hc, mix, 0, 0, hc + 3, fast_ops_per_elem=2 * hc + 1 + hc * (1 + 2 * hc),
                           slow_ops_per_elem=0, instrs_per_chunk=2 * hc + 1 + hc * (1 + 2 * hc)),
            # out, HC streams, HC gradients in; d out and HC d streams out; (1 + HC) sums of HC
            # products; HC + HC^2 dot products (Mul + ReduceSum); resident: the gradient block and
            # the dot products' result slots
            AscendRowPhase("backward", 1 + 2 * hc, 1 + hc, mix, 0, mix + 32 * (hc + hc * hc), 2 * hc + 3,
                           fast_ops_per_elem=(2 * hc + 1) + (hc + 1) * (2 * hc) + 2 * (hc + hc * hc),
                           slow_ops_per_elem=0, instrs_per_chunk=(2 * hc + 1) + (hc + 1) * (2 * hc) + 2 * (hc + hc * hc)),
        ]

    def ascend_params(self, problem: Problem, knobs: dict[str, int]) -> dict:
        _, hc, d = problem.shape
        return {"dtype": problem.dtype, "hc": int(hc), "d": int(d), "col_tile": int(knobs["col_tile"]),
                "buffers": int(knobs["buffers"]), "chunk": int(knobs["chunk"]), "block_dim": int(knobs["block_dim"])}

    def ascend_verification_problems(self, problem: Problem, knobs: dict[str, int]) -> list[Problem]:
        """Tokens that leave a tail core, and a width with a short last column tile that is not a
        multiple of 16 elements."""
        rows, hc, d = problem.shape
        return [Problem(problem.op, problem.variant, (min(rows, 2 * knobs["block_dim"] + 3), hc, d), problem.dtype),
                Problem(problem.op, problem.variant, (min(rows, knobs["block_dim"] + 5), hc, d + 3), problem.dtype)]

    def ascend_run(self, problem: Problem, knobs: dict[str, int], inputs: Tensors, grad_out: Tensors, emu):
        """Forward and backward kernels in the emulator: (outputs, grads, {phase: RunReport})."""
        import struct

        from .. import emulator
        from ..emulator import from_bytes, to_bytes
        from ..planner.ascend import row_split, ub_pitch
        h = inputs["h"]
        rows, hc, d = h.shape
        block_rows, block_dim = row_split(rows, knobs["block_dim"])
        col_tile = min(knobs["col_tile"], d)
        tiling = bytearray(struct.pack("<6I", rows, d, ub_pitch(col_tile, h.element_size()), block_rows, col_tile,
                                       knobs["chunk"]))
        post, comb = inputs["post"].float().contiguous(), inputs["comb"].float().contiguous()
        y = torch.full_like(h, float("nan"))
        fwd_bufs = [to_bytes(post), to_bytes(comb), to_bytes(inputs["out"]), to_bytes(h), to_bytes(y), bytearray(32),
                    tiling]
        fwd = emulator.run(emu.exe("ak_mhc_post_fwd", 7), block_dim, fwd_bufs)
        grads = {"post": torch.full_like(post, float("nan")), "comb": torch.full_like(comb, float("nan")),
                 "out": torch.full_like(inputs["out"], float("nan")), "h": torch.full_like(h, float("nan"))}
        bwd_bufs = [to_bytes(post), to_bytes(comb), to_bytes(inputs["out"]), to_bytes(h),
                    to_bytes(grad_out["y"].to(h.dtype))] + [to_bytes(grads[k]) for k in ("post", "comb", "out", "h")]
        bwd_bufs += [bytearray(32), bytearray(tiling)]
        bwd = emulator.run(emu.exe("ak_mhc_post_bwd", 11), block_dim, bwd_bufs)
        grads = {k: from_bytes(bwd_bufs[5 + i], grads[k]) for i, k in enumerate(("post", "comb", "out", "h"))}
        return {"y": from_bytes(fwd_bufs[4], y)}, grads, {"forward": fwd, "backward": bwd}

    def call_problem(self, module: torch.nn.Module, args: tuple) -> Problem | None:
        h = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if h is None or h.dim() < 3 or h.dtype not in (d.torch for d in self.dtypes):
            return None
        hc, d = h.shape[-2], h.shape[-1]
        return Problem(self.name, "default", (h.numel() // (hc * d), hc, d), DType.from_torch(h.dtype))

    def patch(self, module: torch.nn.Module, lookup) -> None:
        if isinstance(module, DeepseekV4DecoderLayer):
            module._ak_post = MhcPost()
            self.patch(module._ak_post, lookup)
            install(module, "forward", _layer_forward)
            return
        module._ak_lookup = lookup
        install(module, "forward", _post_forward)


def _inputs(post, comb, out, h) -> Tensors:
    return {"post": post.float().contiguous(), "comb": comb.float().contiguous(), "out": out.contiguous(),
            "h": h.contiguous()}


def _forward(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor, kernel: str) -> torch.Tensor:
    from ..build import built_kernel
    tensors = _inputs(post, comb, out, h)
    y = torch.empty_like(tensors["h"])
    SPEC.run_forward(built_kernel(kernel), tensors, {"y": y})
    return y


def _backward(g: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor,
              kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..build import built_kernel
    tensors = _inputs(post, comb, out, h)
    grads = {name: torch.empty_like(t) for name, t in tensors.items()}
    SPEC.run_backward(built_kernel(kernel), tensors, {}, {"y": like_layout(g.to(h.dtype), tensors["h"])}, grads)
    return grads["post"].to(post.dtype), grads["comb"].to(comb.dtype), grads["out"], grads["h"]


OP = torch_op("mhc_post", _forward, _backward, fake_forward=lambda post, comb, out, h, kernel: h.new_empty(h.shape),
              saved=("post", "comb", "out", "h"), consts=("kernel",), grads=("post", "comb", "out", "h"))


def _post_forward(module: MhcPost, post, comb, block_output, hidden_states):
    key = tuple(hidden_states.shape[-2:])
    kernel = (module._ak_lookup(key, hidden_states.dtype)
              if hidden_states.device.type == "cpu" and block_output.dtype == hidden_states.dtype else None)
    if kernel is None:
        return MhcPost.forward(module, post, comb, block_output, hidden_states)
    return OP(post, comb, block_output, hidden_states, kernel)


def _layer_forward(self: DeepseekV4DecoderLayer, hidden_states, input_ids=None, **kwargs):
    """DeepseekV4DecoderLayer.forward (transformers 5.24) with both stream updates through _ak_post."""
    post, comb, collapsed = self.attn_hc(hidden_states)
    attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
    hidden_states = self._ak_post(post, comb, attn_output, hidden_states)
    post, comb, collapsed = self.ffn_hc(hidden_states)
    mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
    return self._ak_post(post, comb, mlp_output, hidden_states)


SPEC = MhcPostSpec(
    name="mhc_post",
    summary="mHC post (DeepseekV4DecoderLayer): post-weighted block output + comb^T @ streams",
    shape_meaning="ROWSxHCxD: tokens x streams (hc_mult) x hidden",
    shape_rank=3,
    default_shape=(2048, 4, 4096),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
    knob_docs={"tile_rows": "rows per tile handed to a thread", "threads": "OpenMP threads"},
    entries={"fwd": Entry("ak_mhc_post_fwd", ("ptr",) * 5 + ("i64",)),
             "bwd": Entry("ak_mhc_post_bwd", ("ptr",) * 9 + ("i64",))},
)
