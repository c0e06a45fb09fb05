"""Keras' own tests of its attention layers, run against multiattn's (issue: a drop-in for
Keras' attention layers).

The test files are read from the installed Keras wheel
(``keras/src/layers/attention/multi_head_attention_test.py`` and
``grouped_query_attention_test.py``), not copied: each is loaded as a module of its own
whose ``layers`` name resolves ``MultiHeadAttention`` and ``GroupedQueryAttention`` to
multiattn's classes and everything else to Keras' layers. Each test method runs as one
test here. A test that fails because of a deliberate difference is listed in
``DIFFERENCES`` (and in ``docs/keras-drop-in.md``) and must keep failing (strict xfail),
so that the list stays true.
"""

from __future__ import annotations

import importlib.util
import unittest
from pathlib import Path
from types import ModuleType

import keras
import numpy as np
import pytest
from _support import BACKEND

from multiattn import layers as ma_layers

KERAS_TESTS = Path(keras.__file__).resolve().parent / "src" / "layers" / "attention"
FILES = {
    "MultiHeadAttentionTest": "multi_head_attention_test.py",
    "GroupedQueryAttentionTest": "grouped_query_attention_test.py",
}
SWAPPED = {
    "MultiHeadAttention": ma_layers.MultiHeadAttention,
    "GroupedQueryAttention": ma_layers.GroupedQueryAttention,
}

# "Class.test_name" -> why multiattn answers differently on purpose. Empty: every test of
# both files passes.
DIFFERENCES: dict[str, str] = {}


class _Layers(ModuleType):
    """``keras.src.layers`` with the two attention classes swapped for multiattn's."""

    def __init__(self) -> None:
        super().__init__("keras_layers_with_multiattn")

    def __getattr__(self, name: str):
        if name in SWAPPED:
            return SWAPPED[name]
        from keras.src import layers

        return getattr(layers, name)


def _load(filename: str) -> ModuleType:
    path = KERAS_TESTS / filename
    spec = importlib.util.spec_from_file_location(f"multiattn_keras_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.layers = _Layers()
    return module


def _cases() -> list:
    if not KERAS_TESTS.is_dir():  # pragma: no cover - a Keras wheel without its tests
        return []
    out = []
    for cls_name, filename in FILES.items():
        cls = getattr(_load(filename), cls_name)
        for name in unittest.TestLoader().getTestCaseNames(cls):
            marks = []
            key = f"{cls_name}.{name}"
            if key in DIFFERENCES:
                marks.append(pytest.mark.xfail(reason=DIFFERENCES[key], strict=True))
            out.append(pytest.param(cls, name, id=key, marks=marks))
    return out


def _skip_marks(method) -> None:
    """Honour the ``pytest.mark.skipif`` marks of a Keras test method (unittest ignores
    them)."""
    for mark in getattr(method, "pytestmark", []):
        if mark.name == "skipif" and mark.args and mark.args[0]:
            pytest.skip(mark.kwargs.get("reason", "skipped by Keras' test"))
        if mark.name == "requires_trainable_backend" and BACKEND == "numpy":
            pytest.skip("Keras' test needs a trainable backend")


class _Result(unittest.TestResult):
    """A unittest result that keeps a test's ``pytest.skip`` (Keras' tests call it) a skip."""

    def addError(self, test, err):
        if issubclass(err[0], pytest.skip.Exception):
            self.addSkip(test, str(err[1]))
        else:
            super().addError(test, err)


@pytest.mark.skipif(
    BACKEND == "numpy", reason="Keras' attention tests train; numpy is inference-only"
)
@pytest.mark.parametrize(("cls", "name"), _cases())
def test_keras_attention_test_passes(cls, name):
    _skip_marks(getattr(cls, name))
    result = _Result()
    keras.config.disable_flash_attention()
    try:
        cls(name).run(result)
    finally:
        keras.config.enable_flash_attention()
    for _, reason in result.skipped:
        pytest.skip(reason)
    problems = result.errors + result.failures
    assert not problems, "\n".join(trace for _, trace in problems)


def test_keras_test_files_found():
    """The swap is not vacuous: both of Keras' files are there and hold their tests."""
    assert all((KERAS_TESTS / f).is_file() for f in FILES.values())
    assert len(_cases()) >= 80


# --- beyond Keras' files: checkpoints, both APIs in one layer, bad input ------------------------


def _model(cls, ev=6, **kwargs):
    q, v = keras.Input((5, 8)), keras.Input((7, ev))
    return keras.Model([q, v], cls(name="mha", **kwargs)(q, v))


def _inputs(ev=6):
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((2, 5, 8)).astype("float32"),
        rng.standard_normal((2, 7, ev)).astype("float32"),
    ]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"dropout": 0.1, "use_gate": True}, {"output_shape": (3, 2), "use_bias": False}],
    ids=["plain", "gate_dropout", "output_shape"],
)
@pytest.mark.parametrize("kind", ["MultiHeadAttention", "GroupedQueryAttention"])
def test_keras_checkpoints_load_both_ways(kind, kwargs, tmp_path):
    """A ``.weights.h5`` of Keras' layer loads into multiattn's, and back."""
    if kind == "MultiHeadAttention":
        args = dict(num_heads=2, key_dim=4, **kwargs)
    else:
        if "output_shape" in kwargs:
            pytest.skip("GroupedQueryAttention has no output_shape")
        args = dict(head_dim=4, num_query_heads=4, num_key_value_heads=2, **kwargs)
    ours = SWAPPED[kind]
    theirs = (
        keras.layers.MultiHeadAttention
        if kind == "MultiHeadAttention"
        else keras.layers.GroupQueryAttention
    )
    ev = 6 if kind == "MultiHeadAttention" else 8  # Keras' GQA needs equal widths
    x = _inputs(ev)
    for src_cls, dst_cls in ((theirs, ours), (ours, theirs)):
        src, dst = _model(src_cls, ev, **args), _model(dst_cls, ev, **args)
        path = str(tmp_path / "w.weights.h5")
        src.save_weights(path)
        dst.load_weights(path)
        for a, b in zip(src.get_weights(), dst.get_weights()):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(
            dst.predict(x, verbose=0), src.predict(x, verbose=0), rtol=1e-5, atol=1e-5
        )


def test_weights_in_keras_order_and_multiattn_names():
    layer = ma_layers.MultiHeadAttention(2, 4, use_gate=True)
    theirs = keras.layers.MultiHeadAttention(2, 4, use_gate=True)
    x = _inputs()
    layer(x[0], x[1])
    theirs(x[0], x[1])
    assert [tuple(w.shape) for w in layer.weights] == [tuple(w.shape) for w in theirs.weights]
    assert [w.path.split("/", 1)[1] for w in layer.weights] == [
        w.path.split("/", 1)[1] for w in theirs.weights
    ]
    assert layer.query_kernel is layer._query_dense.kernel
    assert layer.output_bias is layer._output_dense.bias


def test_causal_alignments_top_left_and_bottom_right():
    """``use_causal_mask`` (Keras) is aligned top-left, ``causal`` (multiattn) bottom-right;
    with as many queries as keys they agree."""
    layer = ma_layers.MultiHeadAttention(2, 4)
    rng = np.random.default_rng(1)
    q, kv = rng.standard_normal((1, 4, 8)), rng.standard_normal((1, 6, 8))
    layer(q, kv)
    _, top = layer(q, kv, use_causal_mask=True, return_attention_scores=True)
    _, bottom = layer(q, kv, causal=True, return_weights=True)
    top, bottom = keras.ops.convert_to_numpy(top)[0, 0], keras.ops.convert_to_numpy(bottom)[0, 0]
    rows, cols = np.indices((4, 6))
    assert (top[cols > rows] == 0).all() and (top[cols <= rows] > 0).all()
    assert (bottom[cols > rows + 2] == 0).all() and (bottom[cols <= rows + 2] > 0).all()
    same = [layer(q, q, **flag) for flag in ({"use_causal_mask": True}, {"causal": True})]
    np.testing.assert_allclose(*(keras.ops.convert_to_numpy(o) for o in same), atol=1e-6)


def test_fully_masked_row_is_zeros_with_keras_masks():
    """multiattn's guarantee under Keras' arguments: a query row with nothing to attend
    gets zero weights (Keras' layer gives it uniform weights)."""
    layer = ma_layers.MultiHeadAttention(2, 4)
    x = _inputs()[0]
    mask = np.ones((2, 5, 5), bool)
    mask[0, 1] = False
    _, w = layer(x, x, attention_mask=mask, return_attention_scores=True)
    w = keras.ops.convert_to_numpy(w)
    assert (w[0, :, 1] == 0).all()
    np.testing.assert_allclose(w[0, :, 0].sum(-1), 1.0, rtol=1e-5)


def test_lora_and_int8_use_the_sublayers():
    x = _inputs()[0]
    layer = ma_layers.MultiHeadAttention(2, 4)
    before = keras.ops.convert_to_numpy(layer(x, x))
    assert layer._plain(layer._query_dense)
    layer._query_dense.enable_lora(2)
    assert not layer._plain(layer._query_dense)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(x, x)), before, atol=1e-6)
    layer = ma_layers.MultiHeadAttention(2, 4)
    before = keras.ops.convert_to_numpy(layer(x, x))
    layer._value_dense.quantize("int8")
    assert not layer._plain(layer._value_dense)
    after = keras.ops.convert_to_numpy(layer(x, x))
    assert np.abs(after - before).max() < 0.1


BAD = {
    "output_shape": (
        lambda: ma_layers.MultiHeadAttention(2, 4, output_shape=(3, 0)),
        "`output_shape`",
    ),
    "output_dim_conflict": (
        lambda: ma_layers.MultiHeadAttention(2, 4, output_shape=3, output_dim=4),
        "`output_dim`",
    ),
    "attention_axes_type": (
        lambda: ma_layers.MultiHeadAttention(2, 4, attention_axes="1"),
        "`attention_axes`",
    ),
    "attention_axes_range": (
        lambda: ma_layers.MultiHeadAttention(2, 4, attention_axes=3)(_inputs()[0], _inputs()[0]),
        "`attention_axes` (3,)",
    ),
    "attention_mask_shape": (
        lambda: ma_layers.MultiHeadAttention(2, 4)(
            _inputs()[0], _inputs()[0], attention_mask=np.ones((2, 4, 5), bool)
        ),
        "`attention_mask` of shape (2, 4, 5)",
    ),
    "both_masks": (
        lambda: ma_layers.MultiHeadAttention(2, 4)(
            _inputs()[0], _inputs()[0], mask=np.ones((5, 5), bool), attention_mask=np.ones((5, 5))
        ),
        "`attention_mask`",
    ),
    "sliding_window": (
        lambda: ma_layers.MultiHeadAttention(2, 4, sliding_window=1.5),
        "`sliding_window`",
    ),
    "gqa_divisible": (
        lambda: ma_layers.GroupedQueryAttention(4, 3, 2),
        "`num_query_heads` must be divisible by `num_key_value_heads`",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_keras_arguments_raise_value_error_naming_them(case):
    make, fragment = BAD[case]
    with pytest.raises(ValueError) as info:
        make()
    assert fragment in str(info.value), str(info.value)
