"""A third-party operator, added as a user would without editing AuraKernel: a package outside the
repository with its definition, host kernel template, torch op and patch, registered through the
`aurakernel.ops` entry-point group (or `aurakernel.register`). `aurakernel ops` lists it, `tune`
plans, builds, verifies and measures it, and `apply` swaps it into a model."""

import copy
import json
import os
import subprocess

import pytest
import torch

from conftest import AURAKERNEL, REPO

PLUGIN = '''
"""toy_silu: y = x * sigmoid(x) over rows, replacing torch.nn.SiLU modules."""
from pathlib import Path

import torch

from aurakernel.dtypes import DType
from aurakernel.ops.base import OpSpec, Problem, Tolerance, Work
from aurakernel.patch.base import Patch
from aurakernel.patch.install import install
from aurakernel.patch.torch_op import torch_op
from aurakernel.planner.costmodel import RowwisePhase, rowwise_model
from aurakernel.targets.host.kernel import HostKernel
from aurakernel.targets.host.library import Entry, built_kernel


class ToySiluSpec(OpSpec):
    template_dirs = (Path(__file__).parent / "templates",)

    def kernel_key(self, problem):
        return (problem.shape[1],)

    def make_inputs(self, problem, seed):
        g = torch.Generator().manual_seed(seed)
        return {"x": (torch.randn(problem.shape, generator=g) * 3).to(problem.dtype.torch)}

    def differentiable(self, problem):
        return ("x",)

    def reference(self, problem, inputs):
        return {"y": torch.nn.functional.silu(inputs["x"])}

    def tolerance(self, dtype, output):
        return Tolerance(1e-5, 1e-5) if dtype is DType.fp32 else Tolerance(2e-2, 1.6e-2)

    def work(self, problem, backward):
        rows, cols = problem.shape
        return Work(rows * cols * problem.dtype.itemsize * (3 if backward else 2), rows * cols * (8 if backward else 4))

    def module_call(self, problem, inputs):
        return torch.nn.SiLU(), (inputs["x"],)


SPEC = ToySiluSpec(
    name="toy_silu", summary="SiLU over rows (a third-party example)", shape_meaning="ROWSxCOLS", shape_rank=2,
    default_shape=(256, 512), dtypes=(DType.fp32, DType.bf16), variants=("default",))


class ToySiluHost(HostKernel):   # its template: host/toy_silu.c.j2 under the spec's template_dirs
    entries = {"fwd": Entry("toy_silu_fwd", ("ptr", "ptr", "i64")), "bwd": Entry("toy_silu_bwd", ("ptr", "ptr", "ptr", "i64"))}
    knob_docs = {"tile_rows": "rows per tile", "threads": "OpenMP threads"}

    def tiling_problem(self, problem, hw):
        rows, cols = problem.shape
        e = problem.dtype.itemsize
        return rowwise_model(rows, cols, [RowwisePhase("forward", 2 * cols * e, 4 * cols, 0, 0, 0, 0),
                                          RowwisePhase("backward", 3 * cols * e, 8 * cols, 0, 0, 0, 0)],
                             hw, fixed={"col_chunk": cols})

    def render_params(self, problem, knobs):
        return {"dtype": problem.dtype, "cols": int(problem.shape[1]), "tile_rows": int(knobs["tile_rows"]),
                "threads": int(knobs["threads"])}

    def empty_outputs(self, problem, inputs):
        return {"y": torch.empty_like(inputs["x"])}

    def run_forward(self, kernel, inputs, outputs):
        kernel.call("fwd", inputs["x"], outputs["y"], inputs["x"].shape[0])

    def run_backward(self, kernel, inputs, outputs, grad_outputs, grads):
        kernel.call("bwd", inputs["x"], grad_outputs["y"].contiguous(), grads["x"], inputs["x"].shape[0])


class ToySiluPatch(Patch):   # where it goes in a model: every torch.nn.SiLU
    def call_problem(self, module, args):
        x = args[0]
        return Problem(self.spec.name, "default", (x.numel() // x.shape[-1], x.shape[-1]), DType.from_torch(x.dtype))

    def sites(self, model):
        return [(name, module, "default", None) for name, module in model.named_modules()
                if isinstance(module, torch.nn.SiLU)]

    def patch(self, module, lookup):
        module._ak_lookup = lookup
        install(module, "forward", _silu_forward)


PARTS = (SPEC, ToySiluHost(SPEC), ToySiluPatch(SPEC))


def _forward(x: torch.Tensor, kernel: str) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    built_kernel(kernel).call("fwd", x, y, x.numel() // x.shape[-1])
    return y


def _backward(dy: torch.Tensor, x: torch.Tensor, kernel: str) -> torch.Tensor:
    x = x.contiguous()
    dx = torch.empty_like(x)
    built_kernel(kernel).call("bwd", x, dy.contiguous(), dx, x.numel() // x.shape[-1])
    return dx


OP = torch_op("toy_silu", _forward, _backward, fake_forward=lambda x, kernel: torch.empty_like(x),
              saved=("x",), consts=("kernel",), grads=("x",))


def _silu_forward(self, x):
    kernel = self._ak_lookup((x.shape[-1],), x.dtype)
    return OP(x, kernel) if kernel is not None else torch.nn.functional.silu(x)
'''

TEMPLATE = '''/* toy_silu, {{ dtype.value }}, cols={{ cols }}: a third-party operator's host kernel. */
{% include "host/_common.h.j2" %}
#define COLS {{ cols }}
#define TILE_ROWS {{ tile_rows }}
#define THREADS {{ threads }}

void toy_silu_fwd(const elem_t* restrict x, elem_t* restrict y, int64_t rows) {
    const int64_t ntiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    #pragma omp parallel for num_threads(THREADS) schedule(static)
    for (int64_t t = 0; t < ntiles; ++t)
        for (int64_t r = t * TILE_ROWS; r < AK_MIN((t + 1) * TILE_ROWS, rows); ++r)
            #pragma omp simd
            for (int i = 0; i < COLS; ++i) {
                const float v = ak_load(x[r * COLS + i]);
                y[r * COLS + i] = ak_store(v * ak_sigmoidf(v));
            }
}

void toy_silu_bwd(const elem_t* restrict x, const elem_t* restrict dy, elem_t* restrict dx, int64_t rows) {
    const int64_t ntiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    #pragma omp parallel for num_threads(THREADS) schedule(static)
    for (int64_t t = 0; t < ntiles; ++t)
        for (int64_t r = t * TILE_ROWS; r < AK_MIN((t + 1) * TILE_ROWS, rows); ++r)
            #pragma omp simd
            for (int i = 0; i < COLS; ++i) {
                const float v = ak_load(x[r * COLS + i]), s = ak_sigmoidf(v);
                dx[r * COLS + i] = ak_store(ak_load(dy[r * COLS + i]) * s * (1.0f + v * (1.0f - s)));
            }
}
'''


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """An installed-looking package outside the repo: its module, template and dist-info entry point."""
    root = tmp_path_factory.mktemp("site")
    pkg = root / "ak_toy_silu"
    (pkg / "templates" / "host").mkdir(parents=True)
    (pkg / "__init__.py").write_text(PLUGIN)
    (pkg / "templates" / "host" / "toy_silu.c.j2").write_text(TEMPLATE)
    info = root / "ak_toy_silu-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ak-toy-silu\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[aurakernel.ops]\ntoy_silu = ak_toy_silu:PARTS\n")
    return root


def _cli(plugin_dir, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*AURAKERNEL, *args], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def test_an_entry_point_operator_is_listed_and_tuned_by_the_cli(plugin_dir, tmp_path):
    listed = _cli(plugin_dir, "ops")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "toy_silu" in listed.stdout
    tuned = _cli(plugin_dir, "tune", "toy_silu", "--shape", "300x256", "--dtype", "fp32", "--no-compiled", "--json",
                 "--db", str(tmp_path / "db.sqlite"))
    assert tuned.returncode == 0, tuned.stderr[-2000:]
    result = json.loads(tuned.stdout)
    assert result["verified"] is True and result["measured_us"] > 0 and result["eager_us"] > 0


def test_a_registered_operator_is_tuned_and_applied_to_a_model(plugin_dir, tmp_path, monkeypatch, request):
    import aurakernel
    from aurakernel.agent import tune
    from aurakernel.errors import UserError
    from aurakernel.ops import OPS
    from aurakernel.patch.torch_op import REGISTRY
    from aurakernel.patch.base import PATCHES
    from aurakernel.targets.host.kernel import KERNELS
    from aurakernel.planfile import KernelPlan, PlanEntry

    monkeypatch.syspath_prepend(str(plugin_dir))
    import ak_toy_silu

    # this process's operator library and torch ops are as before once the test is done
    request.addfinalizer(lambda: (OPS.pop("toy_silu", None), REGISTRY.pop("toy_silu", None),
                                  KERNELS.pop("toy_silu", None), PATCHES.pop("toy_silu", None)))
    assert "toy_silu" not in OPS and "toy_silu" not in KERNELS
    assert aurakernel.register(*ak_toy_silu.PARTS) is ak_toy_silu.SPEC
    assert aurakernel.register(*ak_toy_silu.PARTS) is ak_toy_silu.SPEC   # the same parts again: a no-op
    with pytest.raises(UserError, match="already registered"):
        aurakernel.register(copy.copy(ak_toy_silu.SPEC))   # another operator under the same name
    with pytest.raises(UserError, match="already has a host kernel"):
        aurakernel.register(ak_toy_silu.ToySiluHost(ak_toy_silu.SPEC))   # a second kernel for the same target
    with pytest.raises(UserError, match="register takes an OpSpec"):
        aurakernel.register("toy_silu")
    r = tune("toy_silu", "300x256", "fp32", with_compiled=False, db_path=tmp_path / "db.sqlite")
    assert r.verified, r.verification.summary
    plan = KernelPlan(target="host", kernels=[PlanEntry("toy_silu", "default", [256], "fp32", "300x256",
                                                         r.plan.knobs, r.source_hash)])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 8))
    x = torch.randn(32, 64)
    expected = model(x).detach()
    report = aurakernel.apply(model, plan)
    assert [s["op"] for s in report.swapped] == ["toy_silu"] and not report.rejected
    calls = []
    lookup = model[1]._ak_lookup
    model[1]._ak_lookup = lambda *a: calls.append(a) or lookup(*a)
    y = model(x)
    y.sum().backward()
    assert calls and torch.allclose(y, expected, atol=1e-5)


def test_a_broken_entry_point_is_a_warning_not_a_broken_library(tmp_path):
    info = tmp_path / "ak_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ak-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[aurakernel.ops]\nbroken = ak_no_such_module:SPEC\n")
    listed = _cli(tmp_path, "ops")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "rms_norm" in listed.stdout
    assert "'broken'" in listed.stderr and "was not loaded" in listed.stderr
