"""`multiattn.port.masks`: polarity of every form on hand-written masks, round trips between
every pair of forms, and validation. NumPy only (the frameworks' own layers are checked
in tests/backend/test_port_masks_frameworks.py and tests/paddle/test_port_masks_paddle.py)."""

import itertools

import numpy as np
import pytest

from multiattn.port import masks as M

B, H, T, S = 2, 3, 4, 5
RNG = np.random.default_rng(7)


# --- polarity on hand-written masks -----------------------------------------------------


def test_torch_key_padding_mask_true_means_ignore():
    keep = M.from_torch_key_padding_mask(np.array([[False, False, True], [True, False, False]]))
    assert keep.shape == (2, 1, 1, 3)
    assert keep[:, 0, 0].tolist() == [[True, True, False], [False, True, True]]
    additive = np.array([[0.0, -np.inf, 0.0]])
    assert M.from_torch_key_padding_mask(additive)[0, 0, 0].tolist() == [True, False, True]


def test_torch_attn_mask_true_means_not_allowed_and_heads_are_batch_major():
    m = np.zeros((2 * 3, 1, 2), dtype=bool)
    m[4, 0, 1] = True  # batch 1, head 1 (4 = 1 * 3 + 1), key 1 not allowed
    keep = M.from_torch_attn_mask(m, num_heads=3)
    assert keep.shape == (2, 3, 1, 2)
    assert not keep[1, 1, 0, 1]
    assert keep.sum() == keep.size - 1
    assert M.from_torch_attn_mask(np.array([[True, False]])).tolist() == [[[[False, True]]]]


def test_sdpa_keras_jax_paddle_true_means_attend():
    m = np.array([[True, False]])
    for fn in (M.from_sdpa_mask, M.from_jax_mask, M.from_paddle_mask):
        assert fn(m)[0, 0].tolist() == [[True, False]], fn.__name__
    assert M.from_keras_mask(np.array([[[1, 0]]]))[0, 0].tolist() == [[True, False]]
    assert M.from_keras_mask(np.array([[[1.0, 0.0]]]))[0, 0].tolist() == [[True, False]]
    assert M.from_paddle_mask(np.array([[1, 0]]))[0, 0].tolist() == [[True, False]]


def test_additive_masks_zero_means_allowed():
    m = np.array([[0.0, -1e9, -np.inf, float(np.finfo(np.float16).min)]])
    for fn in (M.from_sdpa_mask, M.from_paddle_mask, M.from_torch_attn_mask):
        assert fn(m)[0, 0, 0].tolist() == [True, False, False, False], fn.__name__


def test_tf_document_one_means_masked_out():
    padding = np.array([0.0, 0.0, 1.0]).reshape(1, 1, 1, 3)
    assert M.from_tf_document_mask(padding)[0, 0, 0].tolist() == [True, True, False]
    look_ahead = 1 - np.tril(np.ones((3, 3)))
    assert np.array_equal(M.from_tf_document_mask(look_ahead)[0, 0], np.tril(np.ones((3, 3))) > 0)


def test_valid_lens_keep_a_prefix():
    assert M.from_valid_lens(np.array([2, 0]), 3)[:, 0, 0].tolist() == [
        [True, True, False],
        [False, False, False],
    ]
    per_query = M.from_valid_lens(np.array([[1, 3]]), 3)
    assert per_query.shape == (1, 1, 2, 3)
    assert per_query[0, 0].tolist() == [[True, False, False], [True, True, True]]
    assert M.from_valid_lens(np.array([2.0]), 3)[0, 0, 0].tolist() == [True, True, False]


def test_causal_alignments():
    assert M.causal_keep(2, 3)[0, 0].tolist() == [[True, True, False], [True, True, True]]
    assert M.causal_keep(2, 3, "top_left")[0, 0].tolist() == [
        [True, False, False],
        [True, True, False],
    ]
    assert np.array_equal(M.causal_keep(4, 4), M.causal_keep(4, 4, "top_left"))
    assert not M.causal_keep(3, 1)[0, 0, 0].any()  # more queries than keys: empty first rows


def test_empty_rows_and_combine():
    keep = M.combine(M.from_valid_lens(np.array([3, 0]), 3), M.causal_keep(3, 3))
    assert keep.shape == (2, 1, 3, 3)
    assert M.empty_rows(keep).tolist() == [[[False, False, False]], [[True, True, True]]]
    assert M.empty_rows(keep, (2, 2, 3, 3)).shape == (2, 2, 3)


# --- round trips between every pair of forms ---------------------------------------------
# form name -> (to canonical, from canonical); each "to" takes the full shape.
FORMS = {
    "keep": (M.as_keep, lambda k: M.to_jax_mask(k, (B, H, T, S))),
    "torch_key_padding_bool": (
        M.from_torch_key_padding_mask,
        lambda k: M.to_torch_key_padding_mask(k, (B, H, T, S)),
    ),
    "torch_key_padding_float": (
        M.from_torch_key_padding_mask,
        lambda k: M.to_torch_key_padding_mask(k, (B, H, T, S), additive=True),
    ),
    "torch_attn_mask_bool": (
        lambda m: M.from_torch_attn_mask(m, num_heads=H),
        lambda k: M.to_torch_attn_mask(k, H, (B, H, T, S)),
    ),
    "torch_attn_mask_float": (
        lambda m: M.from_torch_attn_mask(m, num_heads=H),
        lambda k: M.to_torch_attn_mask(k, H, (B, H, T, S), additive=True),
    ),
    "sdpa_bool": (M.from_sdpa_mask, lambda k: M.to_sdpa_mask(k, (B, H, T, S))),
    "sdpa_float": (M.from_sdpa_mask, lambda k: M.to_sdpa_mask(k, (B, H, T, S), additive=True)),
    "keras": (M.from_keras_mask, lambda k: M.to_keras_mask(k, (B, H, T, S))),
    "jax": (M.from_jax_mask, lambda k: M.to_jax_mask(k, (B, H, T, S))),
    "paddle_bool": (M.from_paddle_mask, lambda k: M.to_paddle_mask(k, (B, H, T, S))),
    "paddle_float": (
        M.from_paddle_mask,
        lambda k: M.to_paddle_mask(k, (B, H, T, S), additive=True, dtype="float16"),
    ),
    "tf_document": (M.from_tf_document_mask, lambda k: M.to_tf_document_mask(k, (B, H, T, S))),
    "valid_lens": (lambda m: M.from_valid_lens(m, S), lambda k: M.to_valid_lens(k, (B, H, T, S))),
}
# what each form can express: 0 = key padding only, 1 = plus per-query, 2 = plus per-head
REACH = {
    "torch_key_padding_bool": 0,
    "torch_key_padding_float": 0,
    "valid_lens": 1,
    "keras": 1,
}


def sample_keep(level: int) -> np.ndarray:
    """A keep mask of the full shape that a form of ``level`` can express (as a prefix
    where valid lengths must hold it), with an empty row among them."""
    lens = RNG.integers(0, S + 1, size=(B, 1 if level == 0 else T))
    lens[0, 0] = 0
    keep = np.arange(S) < lens[:, None, :, None]  # (B, 1, T or 1, S)
    keep = np.broadcast_to(keep, (B, H, T, S)).copy()
    if level == 2:  # scattered and different per head
        keep &= RNG.random((B, H, T, S)) > 0.3
    return keep


@pytest.mark.parametrize("a, b", list(itertools.product(FORMS, repeat=2)))
def test_round_trip_between_forms(a, b):
    level = min(REACH.get(a, 2), REACH.get(b, 2))
    keep = sample_keep(level)
    if level == 1 and "valid_lens" not in (a, b):
        keep &= RNG.random((B, 1, T, S)) > 0.3  # per query, not a prefix
    to_a, from_a = FORMS[a][0], FORMS[a][1]
    to_b, from_b = FORMS[b][0], FORMS[b][1]
    through_a = to_a(from_a(keep))
    through_b = to_b(from_b(np.broadcast_to(through_a, (B, H, T, S))))
    assert np.array_equal(np.broadcast_to(through_b, keep.shape), keep)


def test_forms_that_cannot_express_a_mask_say_so():
    per_head = sample_keep(2)
    with pytest.raises(ValueError, match="heads"):
        M.to_keras_mask(per_head)
    with pytest.raises(ValueError, match=r"queries|heads"):
        M.to_torch_key_padding_mask(sample_keep(1))
    with pytest.raises(ValueError, match="prefix"):
        M.to_valid_lens(M.causal_keep(3, 3) & np.array([True, False, True]))
    with pytest.raises(ValueError, match="num_heads"):
        M.to_torch_attn_mask(sample_keep(1))


def test_torch_attn_mask_shared_by_batch_and_heads_stays_2d():
    assert M.to_torch_attn_mask(M.causal_keep(3, 3)).tolist() == [
        [False, True, True],
        [False, False, True],
        [False, False, False],
    ]


def test_to_valid_lens_gives_1d_when_queries_agree():
    lens = np.array([2, 5])
    assert M.to_valid_lens(M.from_valid_lens(lens, S), (B, 1, T, S)).tolist() == [2, 5]
    per_query = np.array([[0, 1, 2, 3], [5, 5, 5, 4]])
    assert M.to_valid_lens(M.from_valid_lens(per_query, S)).tolist() == per_query.tolist()


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: M.as_keep(np.zeros((2, 2))), TypeError, "additive_to_keep"),
        (lambda: M.as_keep(np.ones((1, 1, 1, 1, 2), bool)), ValueError, r"\(1, 1, 1, 1, 2\)"),
        (lambda: M.as_keep(np.array([0, 2])), ValueError, "the value 2"),
        (lambda: M.additive_to_keep(np.array([0.0, -1.0])), ValueError, "-1.0"),
        (lambda: M.additive_to_keep(np.array([0.0, np.nan])), ValueError, "nan"),
        (lambda: M.from_paddle_mask(np.array([[1.0, 0.0]])), ValueError, "1.0"),
        (lambda: M.from_torch_key_padding_mask(np.ones(3, bool)), ValueError, r"\(3,\)"),
        (lambda: M.from_torch_attn_mask(np.ones((4, 2, 2), bool)), ValueError, "num_heads"),
        (
            lambda: M.from_torch_attn_mask(np.ones((4, 2, 2), bool), num_heads=3),
            ValueError,
            "multiple of num_heads=3",
        ),
        (lambda: M.from_torch_attn_mask(np.ones((2, 2), np.int32)), TypeError, "int32"),
        (lambda: M.from_keras_mask(np.ones((2, 2), bool)), ValueError, r"\(2, 2\)"),
        (lambda: M.from_jax_mask(np.ones((2, 2))), TypeError, "boolean"),
        (lambda: M.from_tf_document_mask(np.ones((2, 2), bool)), TypeError, "1 = masked out"),
        (lambda: M.from_tf_document_mask(np.full((2, 2), 0.5)), ValueError, "0.5"),
        (lambda: M.from_valid_lens(np.array([4]), 3), ValueError, r"\[0, 3\]"),
        (lambda: M.from_valid_lens(np.array([1.5]), 3), ValueError, "whole"),
        (lambda: M.from_valid_lens(np.array([1]), -1), ValueError, "num_keys"),
        (lambda: M.causal_keep(2, 2, "top"), ValueError, "'top'"),
        (lambda: M.to_sdpa_mask(np.ones((2, 3), bool), (2, 1, 2, 4)), ValueError, "broadcast"),
        (lambda: M.to_sdpa_mask(np.ones((2, 3), bool), (2, 3)), ValueError, "4 sizes"),
        (lambda: M.keep_to_additive(np.ones(2, bool), fill=-1.0), ValueError, "fill"),
        (lambda: M.keep_to_additive(np.ones(2, bool), dtype="int32"), ValueError, "int32"),
        (lambda: M.combine(None), ValueError, "at least one"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_additive_output_reads_back_and_uses_minus_inf():
    keep = sample_keep(2)
    additive = M.to_sdpa_mask(keep, additive=True)
    assert additive.dtype == np.float32
    assert set(np.unique(additive).tolist()) == {0.0, -np.inf}
    assert np.array_equal(M.from_sdpa_mask(additive), keep)
