"""Bad input raises ValueError/TypeError naming the argument, never a backend error."""

import numpy as np
import pytest
from _support import cast

from multiattn import layers, ops

Q = np.zeros((2, 3, 4), np.float32)
K = np.zeros((2, 5, 4), np.float32)
V = np.zeros((2, 5, 6), np.float32)


def sdpa(**kw):
    args = {"query": Q, "key": K, "value": V}
    args.update({k: v for k, v in kw.items() if k in args})
    rest = {k: v for k, v in kw.items() if k not in args}
    return ops.scaled_dot_product_attention(
        *(cast(a, "float32") if a.dtype.kind == "f" else a for a in args.values()), **rest
    )


CASES = {
    "key_width": (
        lambda: sdpa(key=np.zeros((2, 5, 3), np.float32)),
        ValueError,
        "`query` and `key`",
    ),
    "value_len": (
        lambda: sdpa(value=np.zeros((2, 4, 6), np.float32)),
        ValueError,
        "`key` and `value`",
    ),
    "rank": (lambda: sdpa(query=np.zeros((3,), np.float32)), ValueError, "`query` must have rank"),
    "int_query": (lambda: sdpa(query=np.zeros((2, 3, 4), np.int32)), TypeError, "floating"),
    "lens_len": (
        lambda: sdpa(valid_lens=np.array([1, 2, 3])),
        ValueError,
        "`valid_lens` must have shape (2,)",
    ),
    "lens_neg": (lambda: sdpa(valid_lens=np.array([1, -1])), ValueError, "non-negative"),
    "lens_long": (lambda: sdpa(valid_lens=np.array([1, 6])), ValueError, "may not exceed"),
    "lens_rank": (
        lambda: sdpa(valid_lens=np.zeros((2, 3, 1), np.int32)),
        ValueError,
        "`valid_lens`",
    ),
    "lens_2d_queries": (lambda: sdpa(valid_lens=np.ones((2, 4), np.int32)), ValueError, "(2, 3)"),
    "mask_shape": (
        lambda: sdpa(mask=np.ones((2, 3, 4), bool)),
        ValueError,
        "`mask` of shape (2, 3, 4)",
    ),
    "mask_float": (
        lambda: sdpa(mask=np.ones((2, 3, 5), np.float32)),
        TypeError,
        "`mask` must be boolean",
    ),
    "scale": (lambda: sdpa(scale=-1.0), ValueError, "`scale`"),
    "dropout": (lambda: sdpa(dropout=1.5), ValueError, "`dropout`"),
    "causal_type": (lambda: sdpa(causal="yes"), TypeError, "`causal`"),
    "softmax_axis": (lambda: ops.masked_softmax(cast(Q, "float32"), axis=3), ValueError, "`axis`"),
    "softmax_int": (lambda: ops.masked_softmax(np.zeros((2, 3), np.int32)), TypeError, "`x`"),
    "split_heads": (lambda: ops.split_heads(cast(Q, "float32"), 3), ValueError, "num_heads=3"),
    "layout": (
        lambda: ops.split_heads(cast(Q, "float32"), 2, layout="strided"),
        ValueError,
        "`layout`",
    ),
    "general_w": (
        lambda: ops.general_scores(
            cast(Q, "float32"), cast(V, "float32"), cast(np.zeros((4, 5)), "float32")
        ),
        ValueError,
        "`w` must have shape (4, 6)",
    ),
    "additive_wk": (
        lambda: ops.additive_scores(
            cast(Q, "float32"),
            cast(V, "float32"),
            cast(np.zeros((4, 3)), "float32"),
            cast(np.zeros((4, 3)), "float32"),
            cast(np.zeros(3), "float32"),
        ),
        ValueError,
        "`w_k`",
    ),
    "pe_depth": (lambda: ops.sinusoidal_encoding(4, 0), ValueError, "`depth`"),
    "mha_heads": (lambda: layers.MultiHeadAttention(0, 4), ValueError, "`num_heads`"),
    "mha_dropout": (lambda: layers.MultiHeadAttention(2, 4, dropout=-0.1), ValueError, "`dropout`"),
    "mha_width": (
        lambda: _built_mha()(cast(np.zeros((2, 3, 5)), "float32"), cast(V, "float32")),
        ValueError,
        "`query` must have width 4",
    ),
    "mha_mask": (
        lambda: _built_mha()(cast(Q, "float32"), cast(V, "float32"), mask=np.ones((2, 4, 5), bool)),
        ValueError,
        "`mask`",
    ),
    "mha_rank": (
        lambda: layers.MultiHeadAttention(2, 4)(
            cast(np.zeros((2, 4)), "float32"), cast(V, "float32")
        ),
        ValueError,
        "rank 3",
    ),
    "encoder_divide": (lambda: layers.TransformerEncoderLayer(10, 3, 16), ValueError, "divisible"),
    "encoder_activation": (
        lambda: layers.TransformerEncoderLayer(8, 2, 16, activation="nope"),
        ValueError,
        "`activation`",
    ),
    "pe_length": (
        lambda: layers.PositionalEncoding(2)(cast(Q, "float32")),
        ValueError,
        "max_length=2",
    ),
}


def _built_mha():
    layer = layers.MultiHeadAttention(2, 4)
    layer(cast(Q, "float32"), cast(V, "float32"))
    return layer


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejected_with_named_argument(case):
    fn, error, fragment = CASES[case]
    with pytest.raises(error) as info:
        fn()
    assert fragment in str(info.value), str(info.value)
