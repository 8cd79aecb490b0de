import pytest

from aurakernel.dtypes import DType, parse_shape
from aurakernel.errors import UserError


@pytest.mark.parametrize("text,expected", [("4096x4096", (4096, 4096)), ("7", (7,)), ("1x2x3", (1, 2, 3))])
def test_shapes_parse(text, expected):
    assert parse_shape(text) == expected


@pytest.mark.parametrize("text", ["", "4096X4096", "4096x", "x4096", "4096*4096", "40 96x1", "-1x3", "4096x4096;rm",
                                  "0x5", "5x0", "1.5x2"])
def test_bad_shapes_are_rejected_with_what_is_accepted(text):
    with pytest.raises(UserError) as exc:
        parse_shape(text)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "positive" in msg or ">= 1" in msg


def test_rank_checked():
    with pytest.raises(UserError, match="takes 2"):
        parse_shape("4096", rank=2)


@pytest.mark.parametrize("text,dtype", [("fp32", DType.fp32), ("float32", DType.fp32), ("bf16", DType.bf16),
                                        ("bfloat16", DType.bf16), ("fp16", DType.fp16), ("float16", DType.fp16)])
def test_dtype_aliases(text, dtype):
    assert DType.parse(text) is dtype


@pytest.mark.parametrize("text", ["int8", "fp8", "float64", ""])
def test_unknown_dtype(text):
    with pytest.raises(UserError, match="accepted are fp32/float32, bf16/bfloat16, fp16/float16"):
        DType.parse(text)
