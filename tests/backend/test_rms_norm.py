"""RMS normalisation (`ops.rms_norm`, `layers.RMSNormalization`) against the float64 oracle:
every dtype, gradients, other axes, config and .keras round trips, bad input; and what
`layers.LayerNormalization(rms_scaling=True)` computes instead."""

import keras
import numpy as np
import pytest
from _support import (
    BACKEND,
    DTYPES,
    LAYER_TOL,
    TOL,
    assert_close,
    cast,
    gradients,
    numeric_grad,
    requires_grad,
    rounded,
    to_np,
)

from multiattn import layers, ops
from multiattn import reference as ref

RNG = np.random.default_rng(13)
X = RNG.standard_normal((2, 5, 8)) * 3 + 1  # rows of non-zero mean: RMSNorm != LayerNorm
SCALE = RNG.standard_normal(8)


def acc(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


@pytest.mark.parametrize("with_scale", [True, False], ids=["scale", "no_scale"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_against_oracle(dtype, with_scale):
    scale = cast(SCALE, dtype) if with_scale else None
    got = ops.rms_norm(cast(X, dtype), scale, epsilon=1e-5)
    want = ref.rms_norm(rounded(X, dtype), rounded(SCALE, dtype) if with_scale else None, 1e-5)
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    assert tuple(got.shape) == X.shape
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gradients_against_oracle(dtype):
    """d sum(rms_norm(x, scale) * w) / d(x, scale) against central differences of the
    oracle, with a row of zeros among the inputs (finite gradient 1/sqrt(epsilon))."""
    x = X.copy()
    x[1, 2] = 0.0
    w = RNG.standard_normal(x.shape)

    def fn(xt, st):
        out = keras.ops.cast(ops.rms_norm(xt, st, epsilon=1e-3), acc(dtype))
        return keras.ops.sum(out * cast(w, acc(dtype)))

    got = gradients(fn, cast(x, dtype), cast(SCALE, dtype))
    want = numeric_grad(
        lambda a, s: float((ref.rms_norm(a, s, 1e-3) * w).sum()),
        rounded(x, dtype),
        rounded(SCALE, dtype),
    )
    bound = max(TOL[dtype] * 10, 1e-7)
    for g, ww in zip(got, want):
        assert np.all(np.isfinite(g))
        err = np.abs(g - ww).max() / np.abs(ww).max()
        assert err <= bound, f"gradient error {err:.3e} > {bound:.1e} ({dtype}, {BACKEND})"


def test_rms_norm_default_epsilon_is_1e_6():
    """Rows whose mean square is 1e-6 show the default epsilon: x / sqrt(2e-6)."""
    x = np.full((2, 4), 1e-3)
    x[1] = [1e-3, -1e-3, 1e-3, -1e-3]
    got = ops.rms_norm(cast(x, "float32"))
    assert ops.RMS_NORM_EPSILON == 1e-6
    assert_close(got, ref.rms_norm(rounded(x, "float32"), None, 1e-6), "float32")
    np.testing.assert_allclose(to_np(got)[0], np.sqrt(0.5), rtol=1e-5)
    layer = layers.RMSNormalization()
    assert layer.epsilon == 1e-6
    assert_close(layer(cast(x, "float32")), to_np(got), "float32")


def test_rms_norm_accepts_numpy_and_lists():
    want = ref.rms_norm(rounded(X, "float32"), SCALE.astype(np.float32), 1e-6)
    got = ops.rms_norm(X.astype(np.float32), SCALE.astype(np.float32).tolist())
    assert_close(got, want, "float32")


def test_rms_norm_scale_is_cast_to_the_input_dtype():
    """A float64 scale with float32 inputs gives float32, as layer_norm's parameters do."""
    got = ops.rms_norm(cast(X, "float32"), SCALE)
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    assert_close(got, ref.rms_norm(rounded(X, "float32"), SCALE, 1e-6), "float32")


# --- the layer ---------------------------------------------------------------------------


def flat_oracle(x, scale, axes, epsilon):
    """The oracle over several axes: those axes moved last and flattened into one."""
    rest = [a for a in range(x.ndim) if a not in axes]
    moved = np.transpose(x, rest + axes)
    flat = moved.reshape(*moved.shape[: len(rest)], -1)
    out = ref.rms_norm(flat, scale.reshape(-1), epsilon).reshape(moved.shape)
    return np.transpose(out, np.argsort(rest + axes))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_normalization_layer_against_oracle(dtype):
    layer = layers.RMSNormalization(epsilon=1e-5, dtype=dtype)
    layer.build(X.shape)
    assert tuple(layer.scale.shape) == (8,)
    np.testing.assert_array_equal(to_np(layer.scale), np.ones(8))  # initialised to ones
    layer.scale.assign(SCALE)
    got = layer(cast(X, dtype))
    assert keras.backend.standardize_dtype(got.dtype) == dtype
    want = ref.rms_norm(rounded(X, dtype), rounded(SCALE, dtype), 1e-5)
    assert_close(got, want, dtype)
    np.testing.assert_array_equal(
        to_np(got), to_np(ops.rms_norm(cast(X, dtype), layer.scale, epsilon=1e-5))
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_rms_normalization_mixed_precision(policy):
    """float32 inputs and float32 scale under a mixed policy: normalised in float32, the
    result cast to the half compute dtype."""
    layer = layers.RMSNormalization(dtype=policy)
    layer.build(X.shape)
    layer.scale.assign(SCALE)
    assert keras.backend.standardize_dtype(layer.scale.dtype) == "float32"
    got = layer(cast(X, "float32"))
    half = policy.removeprefix("mixed_")
    assert keras.backend.standardize_dtype(got.dtype) == half
    assert_close(got, ref.rms_norm(rounded(X, "float32"), SCALE, 1e-6), half)


@pytest.mark.parametrize(
    "axis", [-1, 1, 0, [1, 2], [-2, -1], (0, 2)], ids=["last", "1", "0", "12", "neg", "02"]
)
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float64", "float32")])
def test_rms_normalization_axes(dtype, axis):
    x = RNG.standard_normal((3, 4, 5)) * 2 + 0.5
    layer = layers.RMSNormalization(axis=axis, epsilon=1e-5, dtype=dtype)
    layer.build(x.shape)
    axes = sorted(a % 3 for a in ([axis] if isinstance(axis, int) else axis))
    assert tuple(layer.scale.shape) == tuple(x.shape[a] for a in axes)
    scale = RNG.standard_normal(tuple(layer.scale.shape))
    layer.scale.assign(scale)
    got = layer(cast(x, dtype))
    want = flat_oracle(rounded(x, dtype), rounded(scale, dtype), axes, 1e-5)
    assert_close(got, want, dtype)


def test_rms_normalization_gradients_against_oracle():
    requires_grad()
    dtype = "float64" if "float64" in DTYPES else "float32"
    layer = layers.RMSNormalization(axis=[1, 2], epsilon=1e-4, dtype=dtype)
    layer.build(X.shape)
    scale = RNG.standard_normal((5, 8))
    w = RNG.standard_normal(X.shape)

    def fn(xt, st):
        out, _ = layer.stateless_call([st], [], xt)
        return keras.ops.sum(out * cast(w, dtype))

    got = gradients(fn, cast(X, dtype), cast(scale, dtype))
    want = numeric_grad(
        lambda a, s: float((flat_oracle(a, s, [1, 2], 1e-4) * w).sum()), X.copy(), scale.copy()
    )
    for g, ww in zip(got, want):
        assert np.abs(g - ww).max() / np.abs(ww).max() <= 1e-7


def build_model(axis):
    inputs = keras.Input((5, 8))
    x = keras.layers.Dense(8)(inputs)
    x = layers.RMSNormalization(axis=axis, epsilon=1e-5, name="rms")(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


@pytest.mark.parametrize("axis", [-1, 1], ids=["last", "1"])
def test_rms_normalization_in_a_compiled_model(axis):
    """Symbolic build (compute_output_shape), then predict (jit / tf.function, unknown
    batch size) against the oracle."""
    model = build_model(axis)
    rms = model.get_layer("rms")
    assert rms.compute_output_shape((None, 5, 8)) == (None, 5, 8)
    scale = RNG.standard_normal(tuple(rms.scale.shape))
    rms.scale.assign(scale)
    x = RNG.standard_normal((3, 5, 8)).astype("float32")
    dense_in, dense_out = model.layers[1], model.layers[3]
    h = x.astype(np.float64) @ to_np(dense_in.kernel) + to_np(dense_in.bias)
    normed = flat_oracle(h, scale, [axis % 3], 1e-5)
    want = normed @ to_np(dense_out.kernel) + to_np(dense_out.bias)
    assert_close(model.predict(x, batch_size=2, verbose=0), want, "float32", LAYER_TOL)


def test_rms_normalization_keras_file_and_config_round_trip(tmp_path):
    model = build_model([1, 2])
    model.get_layer("rms").scale.assign(RNG.standard_normal((5, 8)))
    x = RNG.standard_normal((3, 5, 8)).astype("float32")
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded.get_layer("rms"), layers.RMSNormalization)
    np.testing.assert_array_equal(to_np(model(x)), to_np(loaded(x)))
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    layer = model.get_layer("rms")
    config = layer.get_config()
    assert config["axis"] == [1, 2] and config["epsilon"] == 1e-5
    assert loaded.get_layer("rms").get_config() == config
    clone = layers.RMSNormalization.from_config(config)
    assert clone.get_config() == config
    assert [w.path.split("/")[-1] for w in layer.weights] == ["scale"]


def test_rms_normalization_training_step_updates_scale():
    requires_grad()
    keras.utils.set_random_seed(0)
    model = build_model(-1)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = RNG.standard_normal((4, 5, 8)).astype("float32")
    y = RNG.standard_normal((4, 5, 1)).astype("float32")
    before = to_np(model.get_layer("rms").scale)
    history = model.fit(x, y, epochs=2, batch_size=2, verbose=0)
    assert all(np.isfinite(history.history["loss"]))
    assert not np.array_equal(before, to_np(model.get_layer("rms").scale))


# --- LayerNormalization(rms_scaling=True) is not RMSNorm ------------------------------------


def test_layer_norm_rms_scaling_keeps_keras_centred_variance():
    """``rms_scaling=True`` divides by the centred variance, as in Keras 3.15 (which warns
    that it is deprecated): x / sqrt(var(x) + eps) * gamma, no mean subtracted, no beta.
    On rows of non-zero mean this is far from RMSNorm."""
    with pytest.warns(UserWarning, match="RMSNormalization"):
        layer = layers.LayerNormalization(epsilon=1e-6, rms_scaling=True)
    layer.build(X.shape)
    layer.gamma.assign(SCALE)
    assert layer.beta is None
    got = to_np(layer(cast(X, "float32")))
    xr = rounded(X, "float32")
    variance = np.mean((xr - xr.mean(axis=-1, keepdims=True)) ** 2, axis=-1, keepdims=True)
    assert_close(got, xr / np.sqrt(variance + 1e-6) * SCALE, "float32", {"float32": 2e-6})
    rms = to_np(layers.RMSNormalization(epsilon=1e-6)(cast(X, "float32")))
    assert np.abs(got / SCALE - rms).max() > 0.1


# --- bad input ------------------------------------------------------------------------------

F32 = np.zeros((2, 3, 4), np.float32)

BAD = {
    "x_int": (lambda: ops.rms_norm(np.zeros((2, 4), np.int32)), TypeError, "`x`"),
    "x_none": (lambda: ops.rms_norm(None), TypeError, "`x`"),
    "x_scalar": (lambda: ops.rms_norm(cast(np.float64(2.0), "float32")), ValueError, "`x`"),
    "scale_width": (
        lambda: ops.rms_norm(cast(F32, "float32"), cast(np.ones(5), "float32")),
        ValueError,
        "`scale` must have shape (4,)",
    ),
    "scale_rank": (
        lambda: ops.rms_norm(cast(F32, "float32"), cast(np.ones((3, 4)), "float32")),
        ValueError,
        "`scale` must have shape (4,)",
    ),
    "scale_int": (
        lambda: ops.rms_norm(cast(F32, "float32"), np.ones(4, np.int32)),
        TypeError,
        "`scale`",
    ),
    "epsilon_zero": (lambda: ops.rms_norm(F32, epsilon=0.0), ValueError, "`epsilon`"),
    "epsilon_negative": (lambda: ops.rms_norm(F32, epsilon=-1e-6), ValueError, "-1e-06"),
    "epsilon_nan": (lambda: ops.rms_norm(F32, epsilon=float("nan")), ValueError, "`epsilon`"),
    "epsilon_inf": (lambda: ops.rms_norm(F32, epsilon=float("inf")), ValueError, "`epsilon`"),
    "epsilon_str": (lambda: ops.rms_norm(F32, epsilon="1e-6"), TypeError, "'1e-6'"),
    "epsilon_none": (lambda: ops.rms_norm(F32, epsilon=None), TypeError, "`epsilon`"),
    "epsilon_bool": (lambda: ops.rms_norm(F32, epsilon=True), TypeError, "`epsilon`"),
    "layer_epsilon": (lambda: layers.RMSNormalization(epsilon=0), ValueError, "`epsilon`"),
    "layer_axis_type": (lambda: layers.RMSNormalization(axis="last"), TypeError, "`axis`"),
    "layer_axis_empty": (lambda: layers.RMSNormalization(axis=[]), TypeError, "`axis`"),
    "layer_axis_repeated": (lambda: layers.RMSNormalization(axis=[1, 1]), ValueError, "[1, 1]"),
    "layer_axis_range": (
        lambda: layers.RMSNormalization(axis=3)(cast(F32, "float32")),
        ValueError,
        "`axis` 3 is out of range",
    ),
    "layer_axis_same_axis": (
        lambda: layers.RMSNormalization(axis=[2, -1])(cast(F32, "float32")),
        ValueError,
        "names an axis twice",
    ),
    "layer_width": (
        lambda: _built_layer()(cast(np.zeros((2, 3, 5)), "float32")),
        ValueError,
        "`inputs`",
    ),
    "layer_int_inputs": (
        lambda: layers.RMSNormalization()(np.zeros((2, 4), np.int32)),
        TypeError,
        "`inputs`",
    ),
}


def _built_layer():
    layer = layers.RMSNormalization()
    layer(cast(F32, "float32"))
    return layer


@pytest.mark.parametrize("case", sorted(BAD))
def test_rms_norm_rejects_bad_input_naming_the_argument(case):
    fn, error, fragment = BAD[case]
    with pytest.raises(error) as info:
        fn()
    assert fragment in str(info.value), str(info.value)
