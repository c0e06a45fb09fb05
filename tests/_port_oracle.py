"""Shared by the port tests of every worker: random neutral weights, the float64 oracle on
neutral weights, error measures. NumPy only (imported by framework workers and the outer
process alike)."""

from __future__ import annotations

import json
import os

import numpy as np

from multiattn import reference
from multiattn.port.layout import expected_shapes

# A and B on the same float32 inputs: max |A - B| / max |B|. Both compute in float32 with
# different orders of operations; the conformance suite's float32 layer bound is 1e-6
# against the float64 oracle, so two float32 frameworks agree within 2e-6. 1e-5 leaves
# room for the fused kernels of torch and XLA.
PAIR_RTOL = 1e-5
ORACLE_RTOL = 1e-5


def random_weights(kind: str, config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 neutral weights (norm gammas around 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(kind, config).items():
        arr = rng.normal(0.0, 0.5, shape)
        if name.endswith("/gamma"):
            arr = 1.0 + 0.1 * arr
        out[name] = arr.astype(np.float32)
    return out


def inputs(*shapes: tuple[int, ...], seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0.0, 1.0, s).astype(np.float32) for s in shapes]


def _mha_ref(w: dict, prefix: str = "") -> dict:
    return {
        f"{part}_{var}": np.asarray(w[f"{prefix}{part}/{var}"], np.float64)
        for part in ("query", "key", "value", "output")
        for var in ("kernel", "bias")
        if f"{prefix}{part}/{var}" in w
    }


def oracle_mha(weights: dict, query, value, key=None) -> np.ndarray:
    """float64 output of multi-head attention with neutral ``weights``."""
    out, _ = reference.multi_head_attention(query, value, key, weights=_mha_ref(weights))
    return out


def oracle_encoder(weights: dict, config: dict, x) -> np.ndarray:
    """float64 output of the encoder layer with neutral ``weights`` and ``config``."""
    w = {
        "attention": _mha_ref(weights, "attention/"),
        "ffn_w1": weights["ffn_1/kernel"],
        "ffn_b1": weights["ffn_1/bias"],
        "ffn_w2": weights["ffn_2/kernel"],
        "ffn_b2": weights["ffn_2/bias"],
        "norm1_gamma": weights["norm_1/gamma"],
        "norm1_beta": weights["norm_1/beta"],
        "norm2_gamma": weights["norm_2/gamma"],
        "norm2_beta": weights["norm_2/beta"],
    }
    return reference.transformer_encoder_layer(
        x,
        weights=w,
        num_heads=config["num_heads"],
        norm_first=config["norm_first"],
        epsilon=config["epsilon"],
        activation=config["activation"],
    )


def oracle_additive(weights: dict, query, value, key) -> np.ndarray:
    scores = reference.additive_scores(
        query, key, weights["query/kernel"], weights["key/kernel"], weights["score/kernel"]
    )
    out, _ = reference.attention(scores, value)
    return out


def compare(pair: str, got, want, rtol: float) -> tuple[float, float]:
    """max abs and max relative (to max |want|) difference; asserts the relative one.

    With ``MULTIATTN_PORT_ERRORS`` set, appends the numbers to that JSON-lines file."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{pair}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{pair}: NaN or Inf"
    abs_err = float(np.abs(got - want).max())
    rel_err = abs_err / max(float(np.abs(want).max()), 1e-30)
    path = os.environ.get("MULTIATTN_PORT_ERRORS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"pair": pair, "abs": abs_err, "rel": rel_err}) + "\n")
    assert rel_err <= rtol, f"{pair}: max relative difference {rel_err:.3e} > {rtol:.0e}"
    return abs_err, rel_err


def assert_same_weights(a, b) -> None:
    """Two PortableWeights (or dicts) hold bit-identical arrays under the same names."""
    wa = getattr(a, "weights", a)
    wb = getattr(b, "weights", b)
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert wa[name].dtype == wb[name].dtype, name
        assert np.array_equal(wa[name], wb[name]), f"{name} differs after the round trip"
