"""Head split/merge and the sinusoidal positional encoding against the oracle."""

import numpy as np
import pytest
from _support import DTYPES, assert_close, cast, to_np

from multiattn import ops
from multiattn import reference as ref


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_split_and_merge(layout):
    x = np.arange(2 * 3 * 12, dtype=np.float64).reshape(2, 3, 12)
    split = to_np(ops.split_heads(cast(x, "float64"), 4, layout=layout))
    np.testing.assert_array_equal(split, ref.split_heads(x, 4, layout=layout))
    merged = to_np(ops.merge_heads(cast(split, "float64"), layout=layout))
    np.testing.assert_array_equal(merged, x)


def test_paddle_document_split_interleaved_merge_contiguous():
    x = np.arange(24, dtype=np.float64).reshape(1, 2, 12)
    heads = ops.split_heads(cast(x, "float64"), 3, layout="interleaved")
    merged = to_np(ops.merge_heads(heads, layout="contiguous"))
    want = ref.merge_heads(ref.split_heads(x, 3, layout="interleaved"), layout="contiguous")
    np.testing.assert_array_equal(merged, want)
    assert not np.array_equal(merged, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
@pytest.mark.parametrize("depth", [1, 7, 32])
def test_sinusoidal_encoding(dtype, layout, depth):
    got = ops.sinusoidal_encoding(50, depth, layout=layout, dtype=dtype)
    want = ref.sinusoidal_encoding(50, depth, layout=layout)
    assert_close(got, want, dtype)
