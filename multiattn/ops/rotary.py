"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer").

The first ``rotary_dim`` features of each head (all ``dim`` by default) are rotated in
``rotary_dim / 2`` planes by the angle ``t * theta_i``, ``t`` the token's position and
``theta_i = base**(-2i / rotary_dim)`` the inverse wavelength of plane ``i`` (optionally
rescaled, see `rotary_frequencies`). Plane ``i`` holds either features ``i`` and
``i + rotary_dim/2`` (the "rotate half" pairing of GPT-NeoX and Llama checkpoints, the
default) or features ``2i`` and ``2i + 1`` (``interleaved``: RoFormer's and GPT-J's
pairing). Features past ``rotary_dim`` pass through unchanged (partial rotary, as in
GPT-NeoX and Phi). The dot product of a rotated query at position ``m`` and a rotated
key at position ``n`` then depends on ``m - n`` only.

The cos/sin tables depend on no input tensor: they are computed once in float64 with
NumPy and cast, so every backend receives bit-identical values.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._checks import (
    as_array,
    check_float,
    check_integer_scalar,
    check_positive_int,
    check_rank,
    fmt_shape,
    shape_of,
    to_tensor,
)
from ..namespaces.keras import get_ops

__all__ = [
    "ROTARY_SCALINGS",
    "apply_rotary",
    "check_rotary_scaling",
    "rotary_angles",
    "rotary_embedding",
    "rotary_frequencies",
    "rotary_table",
]

#: The frequency scalings `rotary_frequencies` knows, with the keys each one needs
#: (besides ``"rope_type"``; ``"type"`` is read as ``"rope_type"``, its older name).
ROTARY_SCALINGS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "per_plane": ("factors", "attention_factor"),
}


def _check_base(where: str, base: Any, name: str = "base") -> float:
    if (
        isinstance(base, bool)
        or not isinstance(base, (int, float, np.integer, np.floating))
        or not math.isfinite(base)
        or not base > 1
    ):
        raise ValueError(f"{where}: `{name}` must be a finite number > 1; received {base!r}.")
    return float(base)


def _positive_number(where: str, name: str, key: str, value: Any) -> float:
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(value)
        or not value > 0
    ):
        raise ValueError(
            f"{where}: `{name}[{key!r}]` must be a finite number > 0; received {value!r}."
        )
    return float(value)


def check_rotary_scaling(where: str, scaling: Any, name: str = "scaling") -> dict | None:
    """A frequency scaling as a plain dict (``None`` and ``{"rope_type": "default"}``
    give None): ``{"rope_type": "linear", "factor": f}`` or ``{"rope_type": "llama3",
    "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
    "original_max_position_embeddings": n}`` (the keys of a Hugging Face ``rope_scaling``;
    ``"type"`` is accepted for ``"rope_type"``). Numbers must be finite and positive,
    ``factor >= 1`` and ``high_freq_factor > low_freq_factor``; or ``{"rope_type":
    "per_plane", "factors": [f_0, ...], "attention_factor": a}`` (one positive divisor per
    plane, the list's length checked against the rotated width where that is known, and
    the tables' magnitude: the short factors of Phi-3's longrope). Unknown types or keys,
    and missing keys, raise ``ValueError`` naming ``name``."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(
            f"{where}: `{name}` must be None or a dict such as {{'rope_type': 'linear', "
            f"'factor': 2.0}}; received {type(scaling).__name__}."
        )
    items = dict(scaling)
    if "type" in items and "rope_type" not in items:
        items["rope_type"] = items.pop("type")
    kind = items.pop("rope_type", None)
    if kind not in ROTARY_SCALINGS:
        raise ValueError(
            f"{where}: `{name}['rope_type']` must be one of {sorted(ROTARY_SCALINGS)}; "
            f"received {kind!r}."
        )
    needed = ROTARY_SCALINGS[kind]
    extra, missing = sorted(set(items) - set(needed)), [k for k in needed if k not in items]
    if extra or missing:
        raise ValueError(
            f"{where}: `{name}` of type {kind!r} takes exactly the keys {list(needed)}; "
            f"received {sorted(scaling)} (give the base as `base`/`rotary_base` and a "
            "partial rotation as `rotary_dim`)."
        )
    if kind == "default":
        return None
    if kind == "per_plane":
        return _per_plane(where, name, items)
    out = {"rope_type": kind}
    for key in needed:
        out[key] = _positive_number(where, name, key, items[key])
    if out["factor"] < 1:
        raise ValueError(f"{where}: `{name}['factor']` must be >= 1; received {out['factor']}.")
    if kind == "llama3":
        out["original_max_position_embeddings"] = int(
            check_positive_int(
                where,
                f"{name}['original_max_position_embeddings']",
                items["original_max_position_embeddings"],
            )
        )
        if not out["high_freq_factor"] > out["low_freq_factor"]:
            raise ValueError(
                f"{where}: `{name}['high_freq_factor']` ({out['high_freq_factor']}) must be "
                f"greater than `{name}['low_freq_factor']` ({out['low_freq_factor']})."
            )
    return out


def _per_plane(where: str, name: str, items: dict) -> dict:
    factors = items["factors"]
    if not isinstance(factors, (list, tuple)) or not factors:
        raise ValueError(
            f"{where}: `{name}['factors']` must be a non-empty list of numbers; received "
            f"{factors!r}."
        )
    return {
        "rope_type": "per_plane",
        "factors": [_positive_number(where, name, "factors", f) for f in factors],
        "attention_factor": _positive_number(where, name, "attention_factor",
                                             items["attention_factor"]),
    }  # fmt: skip


def check_plane_count(where: str, scaling: dict | None, dim: int, name: str = "rotary_scaling"):
    """A ``per_plane`` scaling must hold one factor per plane of the ``dim`` rotated
    features (``ValueError`` naming ``name`` otherwise); other scalings pass."""
    if scaling is not None and scaling["rope_type"] == "per_plane":
        if len(scaling["factors"]) != dim // 2:
            raise ValueError(
                f"{where}: `{name}['factors']` must hold {dim // 2} factors (one per plane of "
                f"the {dim} rotated features); received {len(scaling['factors'])}."
            )


def rotary_frequencies(dim: int, base: float = 10000.0, scaling: dict | None = None) -> np.ndarray:
    """The inverse wavelengths ``theta_i`` of the ``dim / 2`` planes, float64 ``(dim/2,)``
    (validated arguments; ``scaling`` as returned by `check_rotary_scaling`; internal).

    Unscaled, ``theta_i = base**(-2i/dim)``. ``"linear"`` divides every ``theta_i`` by
    ``factor`` (position ``t`` is rotated as position ``t / factor`` would be).
    ``"llama3"`` (Llama 3.1) rescales by wavelength ``w_i = 2 pi / theta_i``, against
    ``n = original_max_position_embeddings``: planes with ``w_i < n / high_freq_factor``
    are kept, planes with ``w_i > n / low_freq_factor`` are divided by ``factor``, and
    between the two ``theta_i`` is multiplied by ``(1 - s) / factor + s`` with ``s = (n /
    w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)``, which runs from
    ``1 / factor`` to 1 across the band. ``"per_plane"`` divides ``theta_i`` by
    ``factors[i]``.
    """
    theta = base ** (-2.0 * np.arange(dim // 2, dtype=np.float64) / dim)
    if scaling is not None and scaling["rope_type"] == "per_plane":
        check_plane_count("rotary_frequencies", scaling, dim, "scaling")
        return theta / np.asarray(scaling["factors"], np.float64)
    kind = None if scaling is None else scaling["rope_type"]
    if kind == "linear":
        return theta / scaling["factor"]
    if kind == "llama3":
        factor, low, high = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
        context = float(scaling["original_max_position_embeddings"])
        wavelength = 2.0 * np.pi / theta
        s = (context / wavelength - low) / (high - low)
        between = theta * ((1.0 - s) / factor + s)
        scaled = np.where(wavelength > context / low, theta / factor, theta)
        band = (wavelength >= context / high) & (wavelength <= context / low)
        return np.where(band, between, scaled)
    return theta


def rotary_angles(
    positions: np.ndarray, dim: int, base: float = 10000.0, scaling: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of the rotation angles of the given positions, float64 NumPy
    arrays ``(len(positions), dim/2)`` (validated ``dim``, ``base`` and ``scaling``;
    internal).

    Entry ``[j, i]`` is for position ``positions[j]`` and plane ``i``, angle
    ``positions[j] * theta_i`` (see `rotary_frequencies`): the rows of `rotary_table` at
    those positions, bit for bit, computed without the rows before them. A ``per_plane``
    scaling's ``attention_factor`` multiplies both tables (every rotated query and key
    feature is scaled by it).
    """
    theta = rotary_frequencies(dim, base, scaling)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * theta[None, :]
    gain = 1.0 if scaling is None else scaling.get("attention_factor", 1.0)
    return np.cos(angles) * gain, np.sin(angles) * gain


def rotary_table(
    length: int, dim: int, base: float = 10000.0, scaling: dict | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of the rotation angles as float64 NumPy arrays ``(length, dim/2)``.

    Entry ``[t, i]`` belongs to position ``t`` and plane ``i`` (angle ``t * theta_i``, see
    `rotary_frequencies`; ``scaling`` as ``rotary_embedding`` takes it). ``dim`` (the
    rotated width) must be even.
    """
    where = "rotary_table"
    length = check_positive_int(where, "length", length)
    dim = check_positive_int(where, "dim", dim)
    if dim % 2:
        raise ValueError(f"{where}: `dim` must be even (features rotate in pairs); received {dim}.")
    base = _check_base(where, base)
    scaling = check_rotary_scaling(where, scaling)
    return rotary_angles(np.arange(length), dim, base, scaling)


def compute_dtype(dtype: str) -> str:
    """The dtype the rotation is computed in: float64 stays, everything else float32."""
    return "float64" if dtype == "float64" else "float32"


def check_rotary_dim(where: str, rotary_dim: Any, dim: int | None, name: str = "rotary_dim"):
    """``rotary_dim``: None (all ``dim`` features) or a positive even int ``<= dim``
    (``dim`` None: not checked against it yet). Returns it as an int or None."""
    rotary_dim = check_positive_int(where, name, rotary_dim, allow_none=True)
    if rotary_dim is None:
        return None
    if rotary_dim % 2:
        raise ValueError(
            f"{where}: `{name}` must be even (features rotate in pairs); received {rotary_dim}."
        )
    if dim is not None and rotary_dim > dim:
        raise ValueError(
            f"{where}: `{name}` ({rotary_dim}) must not exceed the per-head width {dim}."
        )
    return rotary_dim


def _interleave_order(dim: int) -> np.ndarray:
    """Feature order taking ``[a_0 .. a_{n-1}, b_0 .. b_{n-1}]`` (``n = dim/2``) to
    ``[a_0, b_0, a_1, b_1, ...]``."""
    return np.arange(dim).reshape(2, dim // 2).T.reshape(-1).astype("int32")


def apply_rotary(ops: Any, x: Any, cos: Any, sin: Any, interleaved: bool = False) -> Any:
    """Rotate ``x`` ``(B, T, H, D)`` by ``cos``/``sin`` ``(T, R/2)`` (validated; internal).

    The first ``R`` features are rotated (``R <= D``, even), the others pass through;
    the pairs are ``(i, i + R/2)``, or ``(2i, 2i + 1)`` with ``interleaved``. The tables
    are in ``compute_dtype(x.dtype)``; half-precision ``x`` is rotated in float32 and the
    result cast back.
    """
    dtype = ops.dtype_name(x)
    if dtype != compute_dtype(dtype):
        x = ops.cast(x, "float32")
    half, dim = shape_of(cos)[-1], shape_of(x)[-1]
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
    cos = ops.expand_dims(cos, 1)  # (T, 1, R/2): broadcast over heads
    sin = ops.expand_dims(sin, 1)
    if ops.broadcasts_slowly:  # each table is used twice: broadcast it once
        cos, sin = (ops.broadcast_to(t, ops.shape(x1)) for t in (cos, sin))
    out = ops.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if interleaved:
        order = ops.convert_to_tensor(_interleave_order(2 * half), dtype="int32")
        out = ops.take(out, order, axis=-1)
    if 2 * half < dim:
        out = ops.concatenate([out, x[..., 2 * half :]], axis=-1)
    return out if dtype == compute_dtype(dtype) else ops.cast(out, dtype)


def rotary_embedding(
    x: Any,
    *,
    offset: int = 0,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scaling: dict | None = None,
) -> Any:
    """Rotary position embedding of ``x`` ``(batch, seq, heads, dim)``.

    With ``R = rotary_dim`` (default ``dim``) and the token at position ``p = offset +
    s``, plane ``i < R/2`` is rotated by the angle ``p * theta_i`` (``theta_i =
    base**(-2i/R)`` unless ``scaling`` rescales it, see `rotary_frequencies`). Half-split
    pairs (default)::

        out[..., i]       = x[..., i] cos - x[..., i + R/2] sin
        out[..., i + R/2] = x[..., i + R/2] cos + x[..., i] sin

    interleaved pairs: the same with features ``2i`` and ``2i + 1``. Features ``R ..
    dim - 1`` are returned unchanged.

    Args:
        x: ``(batch, seq, heads, dim)`` floating, ``seq`` and ``dim`` static: a tensor of
            the active backend (or a Paddle tensor), a NumPy array or a nested list.
        offset: position of the first token, a non-negative integer (0 for a whole
            sequence, the cache index when decoding token by token): a Python or NumPy
            integer, or an integer scalar tensor whose value is known (eager). Under
            ``jax.jit`` / ``tf.function`` a traced offset is refused (``TypeError``): the
            angles are computed in float64 NumPy from the value; use `RotaryEmbedding`,
            which takes traced offsets.
        base: the wavelength base (10000 in RoFormer; ``rope_theta`` in Hugging Face
            configs), a finite number > 1.
        rotary_dim: how many leading features of each head are rotated, an even int
            ``<= dim``; None (default): all (``dim`` must then be even). GPT-NeoX and
            Phi rotate a fraction (``partial_rotary_factor * dim``).
        interleaved: pair features ``(2i, 2i + 1)`` instead of ``(i, i + R/2)``.
        scaling: frequency scaling, a dict as Hugging Face's ``rope_scaling``: None or
            ``{"rope_type": "default"}`` (none), ``{"rope_type": "linear", "factor":
            f}``, or ``{"rope_type": "llama3", "factor": ..., "low_freq_factor": ...,
            "high_freq_factor": ..., "original_max_position_embeddings": ...}`` (Llama
            3.1). Neither scales the cos/sin values themselves.

    Returns:
        The rotated tensor, same shape and dtype as ``x``. Only the ``seq`` rows of
        angles needed (positions ``offset .. offset + seq - 1``) are computed, in float64,
        and rounded to float32 (kept in float64 for float64 ``x``): any offset costs the
        same. float16/bfloat16 ``x`` is rotated in float32 and the result cast back.
    """
    where = "rotary_embedding"
    ops = get_ops(x)
    x = to_tensor(ops, as_array(x))
    dtype = check_float(where, "x", x, ops)
    shape = shape_of(x)
    check_rank(where, "x", shape, 4, 4)
    if shape[1] is None or shape[3] is None:
        raise ValueError(
            f"{where}: the sequence and feature axes of `x` must be static; received "
            f"{fmt_shape(shape)}."
        )
    rotary_dim = check_rotary_dim(where, rotary_dim, shape[3])
    if rotary_dim is None and shape[3] % 2:
        raise ValueError(
            f"{where}: the feature axis of `x` must be even; received shape {fmt_shape(shape)}."
        )
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"{where}: `interleaved` must be a bool; received {interleaved!r}.")
    base = _check_base(where, base)
    scaling = check_rotary_scaling(where, scaling)
    offset = check_integer_scalar(where, "offset", offset, ops)
    if not isinstance(offset, int):
        raise TypeError(
            f"{where}: `offset` must have a value when the call runs; received a symbolic "
            "(traced) tensor. Use multiattn.layers.RotaryEmbedding for traced offsets."
        )
    if offset < 0:
        raise ValueError(f"{where}: `offset` must be a non-negative int; received {offset!r}.")
    width = rotary_dim or shape[3]
    cos, sin = rotary_angles(offset + np.arange(shape[1]), width, base, scaling)
    wide = compute_dtype(dtype)
    cos = ops.convert_to_tensor(cos.astype(wide), dtype=wide)
    sin = ops.convert_to_tensor(sin.astype(wide), dtype=wide)
    return apply_rotary(ops, x, cos, sin, bool(interleaved))
