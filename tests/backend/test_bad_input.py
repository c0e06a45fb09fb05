"""Bad input raises ValueError/TypeError naming the argument, never a backend error."""

import keras
import numpy as np
import pytest
from _support import cast, to_np

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


# --- input that used to fail with a backend's error or no name (issue 13, finding 10) ------

Q0 = np.zeros((2, 3, 0), np.float32)  # queries and keys of width 0
K0 = np.zeros((2, 5, 0), np.float32)


def _f32(x):
    return cast(np.asarray(x), "float32")


def _mha(**kwargs):
    layer = layers.MultiHeadAttention(2, 4, **kwargs)
    layer(_f32(Q), _f32(V))
    return layer


def _decoder():
    layer = layers.TransformerDecoderLayer(8, 2, 16)
    layer.build((2, None, 8), (2, None, 8))
    return layer


X8 = np.zeros((2, 3, 8), np.float32)

NAMED_ERRORS = {
    "sdpa_query_none": (
        lambda: ops.scaled_dot_product_attention(None, _f32(K), _f32(V)),
        TypeError,
        "`query`",
    ),
    "sdpa_query_string": (
        lambda: ops.scaled_dot_product_attention("query", _f32(K), _f32(V)),
        TypeError,
        "`query`",
    ),
    "sdpa_query_ragged_list": (
        lambda: ops.scaled_dot_product_attention([[1.0, 2.0], [3.0]], _f32(K), _f32(V)),
        TypeError,
        "`query`",
    ),
    "sdpa_width_0": (
        lambda: ops.scaled_dot_product_attention(_f32(Q0), _f32(K0), _f32(V)),
        ValueError,
        "`query` has width 0",
    ),
    "scaled_dot_scores_width_0": (
        lambda: ops.scaled_dot_scores(_f32(Q0), _f32(K0)),
        ValueError,
        "`query` has width 0",
    ),
    "dot_product_layer_width_0": (
        lambda: layers.DotProductAttention()(_f32(Q0), _f32(V), _f32(K0)),
        ValueError,
        "`query` has width 0",
    ),
    "score_attention_scores_none": (
        lambda: ops.score_attention(None, _f32(V)),
        TypeError,
        "`scores`",
    ),
    "sdpa_seed_string": (
        lambda: ops.scaled_dot_product_attention(_f32(Q), _f32(K), _f32(V), seed="a"),
        TypeError,
        "`seed`",
    ),
    "sdpa_seed_float": (
        lambda: ops.scaled_dot_product_attention(_f32(Q), _f32(K), _f32(V), seed=1.5),
        TypeError,
        "`seed`",
    ),
    "mha_seed_string": (lambda: layers.MultiHeadAttention(2, 4, seed="a"), TypeError, "`seed`"),
    "dot_product_layer_seed_string": (
        lambda: layers.DotProductAttention(seed="a"),
        TypeError,
        "`seed`",
    ),
    "encoder_seed_string": (
        lambda: layers.TransformerEncoderLayer(8, 2, 16, seed="a"),
        TypeError,
        "`seed`",
    ),
    "decoder_seed_string": (
        lambda: layers.TransformerDecoderLayer(8, 2, 16, seed="a"),
        TypeError,
        "`seed`",
    ),
    "mha_query_none": (lambda: _mha()(None, _f32(V)), TypeError, "`query`"),
    "mha_query_int32": (
        lambda: _mha()(keras.ops.convert_to_tensor(np.zeros((2, 3, 4), "int32")), _f32(V)),
        TypeError,
        "`query` must be a floating tensor",
    ),
    "mha_query_complex64": (
        lambda: _mha()(keras.ops.convert_to_tensor(np.zeros((2, 3, 4), "complex64")), _f32(V)),
        TypeError,
        "`query` must be a floating tensor",
    ),
    "mha_value_int32": (
        lambda: _mha()(_f32(Q), keras.ops.convert_to_tensor(np.zeros((2, 5, 6), "int32"))),
        TypeError,
        "`value` must be a floating tensor",
    ),
    "mha_value_width_names_value": (
        lambda: _mha()(_f32(Q), _f32(np.zeros((2, 5, 7)))),
        ValueError,
        "`value` must have width",
    ),
    "mha_kernel_initializer": (
        lambda: layers.MultiHeadAttention(2, 4, kernel_initializer="nope"),
        ValueError,
        "`kernel_initializer`",
    ),
    "mha_rotary_base": (
        lambda: layers.MultiHeadAttention(2, 4, rotary_max_length=8, rotary_base=1.0),
        ValueError,
        "`rotary_base`",
    ),
    "mha_rotary_query_longer_than_the_table": (
        lambda: layers.MultiHeadAttention(2, 4, rotary_max_length=2)(_f32(Q), _f32(Q)),
        ValueError,
        "rotary_max_length=2",
    ),
    "encoder_x_int32": (
        lambda: layers.TransformerEncoderLayer(8, 2, 16)(
            keras.ops.convert_to_tensor(np.zeros((2, 3, 8), "int32"))
        ),
        TypeError,
        "`x` must be a floating tensor",
    ),
    "encoder_x_width": (
        lambda: layers.TransformerEncoderLayer(8, 2, 16)(_f32(np.zeros((2, 3, 6)))),
        ValueError,
        "`x`",
    ),
    "encoder_ragged_list_mask": (
        lambda: layers.TransformerEncoderLayer(8, 2, 16)(
            _f32(X8), mask=[[True, True, False], [True]]
        ),
        ValueError,
        "`mask`",
    ),
    "encoder_mask_shape": (
        lambda: layers.TransformerEncoderLayer(8, 2, 16)(_f32(X8), mask=np.ones((2, 4), bool)),
        ValueError,
        "`mask`",
    ),
    "decoder_x_complex64": (
        lambda: _decoder()(keras.ops.convert_to_tensor(np.zeros((2, 3, 8), "complex64")), _f32(X8)),
        TypeError,
        "`x` must be a floating tensor",
    ),
    "decoder_context_int32": (
        lambda: _decoder()(_f32(X8), keras.ops.convert_to_tensor(np.zeros((2, 3, 8), "int32"))),
        TypeError,
        "`context` must be a floating tensor",
    ),
    "decoder_context_width": (
        lambda: _decoder()(_f32(X8), _f32(np.zeros((2, 3, 6)))),
        ValueError,
        "`context`",
    ),
    "decoder_context_mask_shape": (
        lambda: _decoder()(_f32(X8), _f32(X8), context_mask=np.ones((2, 5), bool)),
        ValueError,
        "`context_mask`",
    ),
    "decoder_ragged_list_context_mask": (
        lambda: _decoder()(_f32(X8), _f32(X8), context_mask=[[True], [True, False]]),
        ValueError,
        "`context_mask`",
    ),
    "additive_value_none": (
        lambda: layers.AdditiveAttention(3)(_f32(Q), None),
        TypeError,
        "`value`",
    ),
    "positional_encoding_int_inputs": (
        lambda: layers.PositionalEncoding(8)(
            keras.ops.convert_to_tensor(np.zeros((2, 3, 4), "int32"))
        ),
        TypeError,
        "`inputs`",
    ),
    "position_embedding_width": (
        lambda: _built(layers.PositionEmbedding(8), X8)(_f32(np.zeros((2, 3, 6)))),
        ValueError,
        "`inputs`",
    ),
    "rotary_layer_rank_3_after_build": (
        lambda: _built(layers.RotaryEmbedding(8), np.zeros((2, 3, 2, 4)))(_f32(X8)),
        ValueError,
        "`x`",
    ),
    "rotary_embedding_base_inf": (
        lambda: ops.rotary_embedding(_f32(np.zeros((1, 2, 1, 4))), base=float("inf")),
        ValueError,
        "`base`",
    ),
    "rotary_embedding_x_none": (lambda: ops.rotary_embedding(None), TypeError, "`x`"),
    "decoder_context_valid_lens_past_the_source": (
        lambda: _decoder()(_f32(X8), _f32(X8), context_valid_lens=np.array([4, 1])),
        ValueError,
        "`context_valid_lens` may not exceed",
    ),
    "decoder_context_valid_lens_negative": (
        lambda: _decoder()(_f32(X8), _f32(X8), context_valid_lens=np.array([1, -1])),
        ValueError,
        "`context_valid_lens` must hold non-negative",
    ),
    "layer_norm_axis_out_of_range": (
        lambda: layers.LayerNormalization(axis=5)(_f32(X8)),
        ValueError,
        "`axis` 5 is out of range",
    ),
    "layer_norm_center_string": (
        lambda: layers.LayerNormalization(center="no"),
        TypeError,
        "`center` must be a bool",
    ),
    "layer_norm_int_inputs": (
        lambda: layers.LayerNormalization()(
            keras.ops.convert_to_tensor(np.ones(X8.shape, "int32"))
        ),
        TypeError,
        "`inputs` must be a floating tensor",
    ),
    "valid_lens_to_mask_scores_shape_string": (
        lambda: ops.valid_lens_to_mask(np.array([1, 2]), "abc"),
        ValueError,
        "`scores_shape`",
    ),
    "valid_lens_to_mask_scores_shape_negative": (
        lambda: ops.valid_lens_to_mask(np.array([0, 0]), (2, 3, -1)),
        ValueError,
        "`scores_shape`",
    ),
}


def _built(layer, x):
    layer(_f32(x))
    return layer


@pytest.mark.parametrize("case", sorted(NAMED_ERRORS))
def test_unclear_errors_now_name_the_argument(case):
    fn, error, fragment = NAMED_ERRORS[case]
    with pytest.raises(error) as info:
        fn()
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("mask_of", ["encoder", "decoder"])
def test_python_list_masks_act_as_arrays(mask_of):
    """A nested Python list is a mask like the NumPy array it spells (it failed with
    `'list' object has no attribute 'shape'`)."""
    x = _f32(np.random.default_rng(0).standard_normal((2, 3, 8)))
    keep = [[True, True, False], [True, False, False]]
    if mask_of == "encoder":
        layer = layers.TransformerEncoderLayer(8, 2, 16, rate=0.0)
        want = layer(x, mask=np.array(keep))
        got = layer(x, mask=keep)
    else:
        layer = layers.TransformerDecoderLayer(8, 2, 16, rate=0.0)
        want = layer(x, x, context_mask=np.array(keep))
        got = layer(x, x, context_mask=keep)
    np.testing.assert_array_equal(to_np(got), to_np(want))


# --- flags and seeds (issue 13, finding 7) ---------------------------------------------------

RNG7 = np.random.default_rng(7)
QF, KF, VF = (RNG7.standard_normal(s).astype(np.float32) for s in ((2, 3, 8), (2, 5, 8), (2, 5, 8)))


def _flag_targets():
    """name -> (call(**flags) with dropout 0.5 active under training, has_return_weights)."""
    mha = layers.MultiHeadAttention(2, 4, dropout=0.5, seed=1)
    dot = layers.DotProductAttention(dropout=0.5, seed=1)
    add = layers.AdditiveAttention(4, dropout=0.5, seed=1)
    enc = layers.TransformerEncoderLayer(8, 2, 16, rate=0.5, seed=1)
    dec = layers.TransformerDecoderLayer(8, 2, 16, rate=0.5, seed=1)
    pe = layers.PositionalEncoding(8, dropout=0.5, seed=1)
    q, k, v = _f32(QF), _f32(KF), _f32(VF)
    scores = _f32(RNG7.standard_normal((2, 3, 5)))
    return {
        "scaled_dot_product_attention": (
            lambda **f: ops.scaled_dot_product_attention(q, k, v, dropout=0.5, seed=3, **f),
            True,
        ),
        "score_attention": (
            lambda **f: ops.score_attention(scores, v, dropout=0.5, seed=3, **f),
            True,
        ),
        "MultiHeadAttention": (lambda **f: mha(q, v, k, **f), True),
        "DotProductAttention": (lambda **f: dot(q, v, k, **f), True),
        "AdditiveAttention": (lambda **f: add(q, v, k, **f), True),
        "TransformerEncoderLayer": (lambda **f: enc(q, **f), False),
        "TransformerDecoderLayer": (lambda **f: dec(q, v, **f), False),
        "PositionalEncoding": (lambda **f: pe(q, **f), False),
    }


FLAG_TARGETS = [
    "scaled_dot_product_attention",
    "score_attention",
    "MultiHeadAttention",
    "DotProductAttention",
    "AdditiveAttention",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "PositionalEncoding",
]


@pytest.mark.parametrize("value", ["False", "True", 2, 0, 1.0], ids=repr)
@pytest.mark.parametrize("target", FLAG_TARGETS)
def test_non_bool_training_raises_type_error(target, value):
    """`"False"` and `2` were truthy: dropout ran. Only bools (and None) are flags."""
    call, _ = _flag_targets()[target]
    with pytest.raises(TypeError, match="`training`"):
        call(training=value)


@pytest.mark.parametrize("value", ["False", 2, 0, None], ids=repr)
@pytest.mark.parametrize("target", [t for t in FLAG_TARGETS if _flag_targets()[t][1]])
def test_non_bool_return_weights_raises_type_error(target, value):
    """`return_weights=2` returned a tuple; None is not a flag here either."""
    call, _ = _flag_targets()[target]
    with pytest.raises(TypeError, match="`return_weights`"):
        call(return_weights=value)


@pytest.mark.parametrize("target", FLAG_TARGETS)
def test_numpy_bools_and_none_act_as_python_bools(target):
    """np.False_ and None (Keras' default, inference outside a training loop) give the
    inference output; np.True_ applies dropout; np.bool_ return_weights returns them."""
    targets = _flag_targets()
    call, has_weights = targets[target]
    inference = to_np(call(training=False))
    np.testing.assert_array_equal(to_np(call(training=np.False_)), inference)
    np.testing.assert_array_equal(to_np(call(training=None)), inference)
    np.testing.assert_array_equal(to_np(call()), inference)
    assert not np.array_equal(to_np(call(training=np.True_)), inference)
    if target in ("scaled_dot_product_attention", "score_attention"):  # an int seed: same mask
        np.testing.assert_array_equal(to_np(call(training=np.True_)), to_np(call(training=True)))
    if has_weights:
        out, weights = call(return_weights=np.True_)  # the explicit path: rounding differs
        np.testing.assert_allclose(to_np(out), inference, rtol=1e-5, atol=1e-6)
        assert tuple(weights.shape)[-1] == 5
        np.testing.assert_array_equal(to_np(call(return_weights=np.False_)), inference)


@pytest.mark.parametrize("seed", [np.int64(5), 5, None])
def test_numpy_integer_seeds_are_seeds(seed):
    """A NumPy integer seed is an int seed (Keras' own check refused it)."""
    q, k, v = _f32(QF), _f32(KF), _f32(VF)
    got = ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=True, seed=seed)
    if seed is not None:
        want = ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=True, seed=5)
        np.testing.assert_array_equal(to_np(got), to_np(want))
    layer = layers.MultiHeadAttention(2, 4, seed=np.int64(3))
    assert layer.get_config()["seed"] == 3 and type(layer.get_config()["seed"]) is int
