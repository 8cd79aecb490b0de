"""mHC post then pre, fused across the block boundary: a decoder layer's attention stream update
(mhc_post) followed by its FFN's DeepseekV4HyperConnection (mhc_pre) on the streams it produced.

    streams = post (x) block_output + comb^T @ h          (the layer keeps them: its residual)
    next_post, next_comb, y = HyperConnection(streams)

Apart, mhc_pre reads the streams back from memory right after mhc_post wrote them, and in the
backward autograd adds the two gradients of the streams (mhc_pre's dx and the one from the layer's
second stream update) in a pass of its own before mhc_post's backward reads the sum. Fused, each tile
of streams is read back from cache, and the sum is made as mhc_post's backward loads its two parts:
one pass over the streams fewer each way. The same pair meets across layers: the update that ends a
layer feeds the next layer's attention HyperConnection, and where both layers run this kernel the
model's forward hands that HyperConnection's outputs across its layer loop
(patch/mhc_post_pre.py `link_layers`). 1024x4x4096 bf16 (`python -m benchmarks.mhc_post_pre`, Zen 4):
fused 33.9 ms against 36.9 apart, a pair, forward + backward. At the tiny config's widths
(1024x4x256 fp32, where the streams stay in cache between the kernels) the step's mHC kernels took
the same time within the noise, linked or not (22.8-23.1 against 22.9-23.5 ms a step).
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from ..dtypes import DType
from .base import OpSpec, Problem, Tensors, Tolerance, Work
from .mhc import PRE
from .mhc_post import SPEC as POST, MhcPost

# output / input name -> the tolerance of the kernel it comes from
_TOL_OF = {"streams": (POST, "y"), "next_post": (PRE, "post"), "next_comb": (PRE, "comb"), "y": (PRE, "y"),
           "post": (POST, "post"), "comb": (POST, "comb"), "out": (POST, "out"),
           "h": (PRE, "x"),   # its gradient is mostly mhc_pre's dx, carried back through the update
           "fn": (PRE, "fn"), "base": (PRE, "base"), "scale": (PRE, "scale")}


class MhcPostPre(torch.nn.Module):
    """The reference: the stream update (`update`, an MhcPost) and then the FFN's
    HyperConnection (`hc`) on its result; returns (streams, next_post, next_comb, y)."""

    def __init__(self, hc: torch.nn.Module, update: torch.nn.Module | None = None):
        super().__init__()
        self.hc = hc
        self.update = update if update is not None else MhcPost()

    def forward(self, post, comb, block_output, hidden_states):
        streams = self.update(post, comb, block_output, hidden_states)
        *lead, hc, d = streams.shape   # any leading extents: the HyperConnection takes [batch, seq, hc, d]
        next_post, next_comb, y = self.hc(streams.reshape(1, -1, hc, d))
        return streams, next_post.view(*lead, hc), next_comb.view(*lead, hc, hc), y.view(*lead, d)


class MhcPostPreSpec(OpSpec):
    fuses = ("mhc_post", "mhc_pre")

    def kernel_key(self, problem: Problem) -> tuple[int, ...]:
        return problem.shape[1:]

    def _parts(self, problem: Problem) -> tuple[Problem, Problem]:
        return (Problem(POST.name, "default", problem.shape, problem.dtype),
                Problem(PRE.name, "default", problem.shape, problem.dtype))

    def make_inputs(self, problem: Problem, seed: int) -> Tensors:
        post, pre = self._parts(problem)
        x = PRE.make_inputs(pre, seed + 1)
        return {**POST.make_inputs(post, seed), "fn": x["fn"], "base": x["base"], "scale": x["scale"]}

    def differentiable(self, problem: Problem) -> tuple[str, ...]:
        return ("post", "comb", "out", "h", "fn", "base", "scale")

    def module_call(self, problem: Problem, inputs: Tensors):
        hc, _ = PRE.module_call(self._parts(problem)[1], {**inputs, "x": inputs["h"]})
        return MhcPostPre(hc), tuple(inputs[k] for k in ("post", "comb", "out", "h"))

    def reference(self, problem: Problem, inputs: Tensors) -> Tensors:
        pre = self._parts(problem)[1]
        streams = MhcPost()(inputs["post"], inputs["comb"], inputs["out"], inputs["h"])
        params = dict(zip(PRE.param_names(), (inputs["fn"], inputs["base"], inputs["scale"])))
        next_post, next_comb, y = functional_call(PRE.module(pre), params, (streams.unsqueeze(0),))
        return {"streams": streams, "next_post": next_post[0], "next_comb": next_comb[0], "y": y[0]}

    def visible_outputs(self) -> tuple[str, ...]:
        return ("streams", "next_post", "next_comb", "y")

    def tolerance(self, dtype: DType, output: str) -> Tolerance:
        spec, name = _TOL_OF[output]
        return spec.tolerance(dtype, name)

    def work(self, problem: Problem, backward: bool) -> Work:
        """The two kernels' work less one pass over the streams (rows x hc x d): forward, mhc_pre's
        read of them; backward, mhc_pre's dx written for mhc_post to read."""
        post, pre = (spec.work(p, backward) for spec, p in zip((POST, PRE), self._parts(problem)))
        rows, hc, d = problem.shape
        return Work(post.bytes_moved + pre.bytes_moved - rows * hc * d * problem.dtype.itemsize, post.flops + pre.flops)


SPEC = MhcPostPreSpec(
    name="mhc_post_pre",
    summary="mHC post + the next mHC pre in one (a decoder layer's attention stream update, then its FFN's "
            "HyperConnection on the streams it made; a layer's last update, then the next layer's attention's)",
    shape_meaning="ROWSxHCxD: tokens x streams (hc_mult) x hidden",
    shape_rank=3,
    default_shape=(1024, 4, 4096),
    dtypes=(DType.fp32, DType.bf16, DType.fp16),
    variants=("default",),
)
