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
