"""Every kernel that reaches a model is a torch.library custom op: torch.compile(fullgraph=True) of
an applied model runs every kernel (no fallback to the reference), trains like the eager applied
model, torch.library.opcheck passes for each op's forward and backward, and FusedAdamW updates
FSDP2's local shards."""

import collections
import copy
from pathlib import Path

import pytest
import torch

from aurakernel import apply
from aurakernel.targets.host.library import Kernel
from aurakernel.targets.host.build import build_kernel
from aurakernel.dtypes import DType
from aurakernel.ops import get_op
from aurakernel.ops.base import Problem
from aurakernel.patch.torch_op import REGISTRY, TorchOp
from trainer.config import load_config
from trainer.model import build_model

from conftest import TINY
from test_swap import planned_knobs, plan_for
from aurakernel.patch.deepseek_v4 import patch_of

STEPS = 3


@pytest.fixture(scope="module")
def applied():
    cfg = load_config(TINY)
    model = build_model(cfg.model, 0)
    report = apply(model, plan_for(model))
    assert not report.reference and not report.rejected, report.to_dict()
    ids = torch.randint(0, cfg.model["vocab_size"], (2, 160), generator=torch.Generator().manual_seed(0))
    return model, ids


class _Counts:
    """Kernel entry calls by (template, entry) and, in eager runs (`ops=True`: the counter would be
    traced into a compiled graph), TorchOp calls by op name with one call's args."""

    def __init__(self, monkeypatch, ops: bool = True):
        self.kernel, self.ops, self.args = collections.Counter(), collections.Counter(), {}
        call, op_call = Kernel.call, TorchOp.__call__
        counts = self

        def counting_call(kernel, name, *args):
            counts.kernel[(kernel.source.template, name)] += 1
            return call(kernel, name, *args)

        def counting_op(op, *args):
            counts.ops[op.name] += 1
            counts.args.setdefault(op.name, args)
            return op_call(op, *args)

        monkeypatch.setattr(Kernel, "call", counting_call)
        if ops:
            monkeypatch.setattr(TorchOp, "__call__", counting_op)


def _train(model, ids, steps=STEPS):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def test_compiled_fullgraph_model_runs_every_kernel_and_trains_like_eager(applied, monkeypatch):
    from torch._inductor.compile_fx import compile_fx

    model, ids = applied
    with monkeypatch.context() as patched:
        counts = _Counts(patched)
        eager_losses = _train(copy.deepcopy(model), ids)
    eager_kernel, eager_ops = dict(counts.kernel), dict(counts.ops)
    counts = _Counts(monkeypatch, ops=False)

    graph_ops = collections.Counter()

    def counting_backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("aurakernel."):
                graph_ops[str(node.target).split(".")[1].removesuffix("_fwd")] += 1
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True, backend=counting_backend)
    compiled_losses = _train(compiled, ids)

    # every op of the plan is in the one compiled graph, as often as the eager forward calls it
    expected = {"rms_norm", "mhc_pre", "mhc_head", "mhc_post", "mhc_post_pre", "router_select", "router", "swiglu", "rope",
                "sparse_attention", "compressor", "indexer_score", "linear", "grouped_linear", "moe_permute", "moe_unpermute",
                "block_linear"}
    assert set(eager_ops) == expected
    assert dict(graph_ops) == {name: n // STEPS for name, n in eager_ops.items()}
    # and at run time the kernels do all the work, forward and backward: no call took the reference
    assert dict(counts.kernel) == eager_kernel
    assert any(entry == "bwd" for _, entry in eager_kernel)
    torch.testing.assert_close(torch.tensor(compiled_losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5)
    assert compiled_losses[-1] < compiled_losses[0]


def _opcheck_args(op: TorchOp, args: tuple) -> tuple:
    """Fresh copies of one recorded call's args; gradient inputs require grad."""
    grad_positions = set(op._grads)
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            a = a.detach().clone()
            if i in grad_positions and a.is_floating_point():
                a.requires_grad_(True)
        out.append(a)
    return tuple(out)


def _cross_entropy_call():
    """A cross_entropy kernel and one call's args (the trainer's loss, not a model module)."""
    spec = get_op("cross_entropy")
    problem = Problem("cross_entropy", "default", (40, 512), DType.fp32)
    kernel = build_kernel(spec, problem, {"tile_rows": 4, "col_chunk": 128, "threads": 2})   # 4 chunks a row
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 512, (40,), generator=g)
    labels[::7] = -100
    return (torch.randn(40, 512, generator=g), labels, kernel.source_hash)


def _linear_cross_entropy_call():
    """A linear_cross_entropy kernel (3 chunks of 16 tokens, the last short) and one call's args."""
    spec = get_op("linear_cross_entropy")
    problem = Problem("linear_cross_entropy", "default", (40, 32, 300), DType.fp32)
    kernel = build_kernel(spec, problem, planned_knobs(problem, chunk_rows=16, col_chunk=128, threads=2))
    inputs = spec.make_inputs(problem, 3)
    return (inputs["hidden"], inputs["weight"], inputs["labels"], kernel.source_hash)


def test_opcheck_passes_for_every_custom_op(applied, monkeypatch):
    model, ids = applied
    counts = _Counts(monkeypatch)
    out = copy.deepcopy(model)(input_ids=ids, labels=ids)
    out.loss.backward()
    monkeypatch.undo()
    calls = dict(counts.args)
    calls["cross_entropy"] = _cross_entropy_call()
    calls["linear_cross_entropy"] = _linear_cross_entropy_call()
    # the attention softmax runs where the sparse attention has no kernel: a model with only that one
    cfg = load_config(TINY)
    softmax_only = build_model(cfg.model, 0)
    apply(softmax_only, plan_for(softmax_only, ops={"attn_softmax"}))
    counts = _Counts(monkeypatch)
    softmax_only(input_ids=ids)
    monkeypatch.undo()
    calls["attn_softmax"] = counts.args["attn_softmax"]
    assert set(calls) == set(REGISTRY), "every registered op is exercised"
    for name, args in sorted(calls.items()):
        op = REGISTRY[name]
        args = _opcheck_args(op, args)
        torch.library.opcheck(op.fwd, args)
        if op.bwd is None:
            continue
        with torch.no_grad():
            output = op.fwd(*args)
        outs = output[: op.outputs] if isinstance(output, tuple) else (output,)
        grads = tuple(torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o.dtype) for o in outs)
        detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(op.bwd, op.backward_args(detached, output, grads))


def _adamw_kernel() -> str:
    spec = get_op("adamw")
    return build_kernel(spec, Problem("adamw", "default", (4096,), DType.fp32), {"tile_rows": 2, "threads": 1}).source_hash


def _fsdp_adamw_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from aurakernel.patch.adamw import FusedAdamW

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    ref = copy.deepcopy(ours)
    for model in (ours, ref):
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    our_opt = FusedAdamW(ours.parameters(), kernel=_adamw_kernel(), **hyper)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **hyper)
    updates = []
    call = Kernel.call
    # one call a step for every local shard: (p, g, m, v, numel) rows of its table
    Kernel.call = lambda k, name, *a: (updates.append(a[0][:, 4].tolist()) if name == "update_many" else None,
                                       call(k, name, *a))[1]
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 64, generator=g)
        for model, opt in ((ours, our_opt), (ref, ref_opt)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    Kernel.call = call
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert isinstance(a, DTensor) and a.to_local().numel() * world == a.numel()
        torch.testing.assert_close(a.to_local(), b.to_local(), atol=1e-6, rtol=1e-5)
    local = sum(p.to_local().numel() for p in ours.parameters())
    (Path(out_dir) / f"rank{rank}.txt").write_text(f"{len(updates)} {sum(map(len, updates))} {sum(map(sum, updates))} {local}")
    dist.destroy_process_group()


def test_fused_adamw_updates_the_local_shards_under_fsdp2(tmp_path):
    """Two ranks (gloo, CPU): FusedAdamW on fully_shard'ed parameters matches torch's AdamW shard by
    shard, and its kernel ran on every parameter's local shard in each of the 3 steps, in one call a step."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_adamw_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        calls, tensors, elements, local = map(int, (tmp_path / f"rank{rank}.txt").read_text().split())
        assert calls == 3 and tensors == 3 * 4 and elements == 3 * local   # 4 parameters' shards, one call a step


@pytest.mark.parametrize("op,shape,with_reference", [("swiglu", "64x128", False), ("rms_norm", "64x256", False),
                                                     ("rope", "24x4x32x16", True)])
def test_bench_times_the_kernel_inside_torch_compile(op, shape, with_reference, monkeypatch):
    """The bench's fourth column: the patched module under torch.compile runs the kernel (forward
    and backward) and computes what the patched module computes eagerly. rope reaches the attention
    by swapping its module-level function (swap_globals), whose code is the reference's: compiled
    after the reference module (the bench's second column), the patched module must run a compiled
    frame of its own, not the reference's (which ran the reference or failed with a NameError)."""
    spec = get_op(op)
    problem = spec.problem(shape, "fp32")
    kernel = build_kernel(spec, problem, planned_knobs(problem))
    candidates, notes = patch_of(spec).timing_candidates(problem, kernel.source_hash, with_compiled=with_reference,
                                                         with_compiled_kernel=True)
    assert set(candidates) == {"eager", "aurakernel", "aurakernel_compiled"} | ({"compiled"} if with_reference else set())
    assert not notes
    counts = _Counts(monkeypatch, ops=False)
    compiled_grads = candidates["aurakernel_compiled"]()
    assert {entry for _, entry in counts.kernel} == {"fwd", "bwd"}
    for a, b in zip(compiled_grads, candidates["aurakernel"]()):
        if a is not None:
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rope_writes_in_its_inputs_layout_and_its_fake_says_so(dtype):
    """The attention output reaches rope as the transposed view of [B, S, H, D]; rope's output and its
    gradient keep that layout (the reshape after it is then a view, not a copy), a contiguous input gives
    a contiguous output, the values are the reference's, and opcheck finds the fake implementations'
    strides the same as the kernel's (what a compiled graph relies on)."""
    from aurakernel.ops.rope import SWAP
    from aurakernel.patch import rope

    spec = get_op("rope")
    problem = Problem("rope", "default", (40, 4, 64, 16), DType.parse(dtype))
    kernel = build_kernel(spec, problem, {"tile_rows": 4, "threads": 2}).source_hash
    inputs = spec.make_inputs(problem, seed=0)
    cos, sin = inputs["cos"], inputs["sin"]
    for x in (inputs["x"], inputs["x"].contiguous()):
        x = x.detach().requires_grad_(True)
        y = rope.OP(x, cos, sin, kernel)
        assert y.stride() == x.stride()
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        (dx,) = torch.autograd.grad(y, x, g)
        assert rope.OP.bwd(g, cos, sin, kernel).stride() == g.stride()
        ref_x = x.detach().clone().requires_grad_(True)
        ref = SWAP.reference(ref_x, cos, sin, 1)
        tol = {} if dtype == "fp32" else {"atol": 8e-3, "rtol": 1.6e-2}   # bf16: the reference's backward rounds twice
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(dx, torch.autograd.grad(ref, ref_x, g)[0], **tol)
        torch.library.opcheck(rope.OP.fwd, (x.detach(), cos, sin, kernel))
        torch.library.opcheck(rope.OP.bwd, (g, cos, sin, kernel))
