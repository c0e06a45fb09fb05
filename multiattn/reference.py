"""Reference oracle for multiattn: plain float64 NumPy attention.

This module is the ground truth that tests and fixtures compare the keras.ops core against.
It is written plainly from the math, independently of the core, and favours clarity over
speed. Every input is cast to float64 (masks to bool, lengths to int64) and every result is
float64. Only NumPy (and ``math.erf``) is used.

Conventions: score tensors are ``(batch, ..., queries, keys)``; boolean masks use True for
"may attend"; a query row in which no key is allowed gets all-zero attention weights.
"""

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

ORACLE_VERSION = "2"

_LAYOUTS = ("contiguous", "interleaved")


def _f64(x: ArrayLike) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _check_layout(layout: str, allowed: tuple[str, ...] = _LAYOUTS) -> None:
    if layout not in allowed:
        raise ValueError(f"layout must be one of {allowed}, got {layout!r}")


def _check_shape(name: str, arr: np.ndarray, expected: tuple[int | None, ...]) -> None:
    """Raise ValueError unless ``arr.shape`` matches ``expected`` (None matches any size)."""
    ok = arr.ndim == len(expected) and all(
        e is None or e == s for e, s in zip(expected, arr.shape, strict=False)
    )
    if not ok:
        want = tuple("*" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {want}, got {arr.shape}")


def _as_bool_mask(mask: ArrayLike, name: str = "mask") -> np.ndarray:
    """Boolean mask (True = keep). Bool or 0/1 integer arrays are accepted; floats are not."""
    m = np.asarray(mask)
    if m.dtype == bool:
        return m
    if np.issubdtype(m.dtype, np.integer) and np.all((m == 0) | (m == 1)):
        return m.astype(bool)
    raise ValueError(f"{name} must be boolean (True = keep), got dtype {m.dtype}")


def valid_lens_mask(valid_lens: ArrayLike, x_shape: tuple[int, ...]) -> np.ndarray:
    """Key-length mask for scores of shape ``x_shape = (batch, ..., queries, keys)``.

    ``valid_lens`` is ``(batch,)`` (one length for all queries of a batch row) or
    ``(batch, queries)`` (one length per query). Returns a bool array broadcastable to
    ``x_shape``, True where ``key index < valid length``; axes between batch and queries
    (e.g. heads) have size 1 and broadcast.
    """
    x_shape = tuple(x_shape)
    lens = np.asarray(valid_lens)
    if len(x_shape) < 2:
        raise ValueError(f"x_shape must be (batch, ..., queries, keys), got {x_shape}")
    if not (np.issubdtype(lens.dtype, np.integer) or np.all(lens == np.round(lens))):
        raise ValueError(f"valid_lens must hold whole numbers, got {lens!r}")
    lens = lens.astype(np.int64)
    batch, num_keys = x_shape[0], x_shape[-1]
    if lens.ndim == 1:
        _check_shape("valid_lens", lens, (batch,))
    elif lens.ndim == 2 and len(x_shape) >= 3:
        _check_shape("valid_lens", lens, (batch, x_shape[-2]))
    else:
        raise ValueError(
            f"valid_lens must have shape (batch,) or (batch, queries) for scores of shape "
            f"{x_shape}, got {lens.shape}"
        )
    if np.any(lens < 0) or np.any(lens > num_keys):
        raise ValueError(f"valid_lens must lie in [0, {num_keys}] (keys), got {lens.tolist()}")
    # Shape the lengths as (batch, 1, ..., 1, queries or 1, 1) and compare with key indices.
    middle = (1,) * (len(x_shape) - 1 - lens.ndim)
    lens = lens.reshape(lens.shape[:1] + middle + lens.shape[1:] + (1,))
    return np.arange(num_keys) < lens


def causal_mask(query_len: int, key_len: int) -> np.ndarray:
    """Bottom-right aligned causal mask, bool ``(query_len, key_len)``.

    Query i may attend key j iff ``j <= i + (key_len - query_len)``: lower-triangular when the
    lengths match, and the last query sees every key. If ``key_len < query_len`` the first
    queries see no key at all.
    """
    if query_len < 0 or key_len < 0:
        raise ValueError(f"lengths must be >= 0, got query_len={query_len}, key_len={key_len}")
    i = np.arange(query_len)[:, None]
    j = np.arange(key_len)[None, :]
    return j <= i + (key_len - query_len)


def masked_softmax(
    x: ArrayLike,
    valid_lens: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    axis: int = -1,
) -> np.ndarray:
    """Softmax of ``x`` over ``axis`` restricted to allowed positions; same shape as ``x``.

    Allowed = (key < valid_lens, see `valid_lens_mask`; requires ``axis`` to be the last
    axis) AND ``mask`` (bool, True = keep, broadcastable to ``x``). Disallowed positions get
    weight 0 and a row with nothing allowed is all zeros. The max is taken over allowed
    entries only, so the result is numerically stable.
    """
    x = _f64(x)
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis < x.ndim:
        raise ValueError(f"axis out of range for x of shape {x.shape}, got {axis}")
    allowed = _allowed(x.shape, valid_lens, mask, axis)
    row_max = np.max(np.where(allowed, x, -np.inf), axis=axis, keepdims=True, initial=-np.inf)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    exps = np.exp(np.where(allowed, x - row_max, -np.inf))
    total = np.sum(exps, axis=axis, keepdims=True)
    total_b = np.broadcast_to(total, exps.shape)
    return np.divide(exps, total_b, out=np.zeros_like(exps), where=total_b > 0)


def _allowed(
    x_shape: tuple[int, ...], valid_lens: ArrayLike | None, mask: ArrayLike | None, axis: int
) -> np.ndarray:
    """The allowed positions of `masked_softmax` (bool, shape ``x_shape``)."""
    allowed = np.ones(x_shape, dtype=bool)
    if valid_lens is not None:
        if axis != len(x_shape) - 1:
            raise ValueError(f"valid_lens requires axis to be the last axis, got axis={axis}")
        allowed = allowed & valid_lens_mask(valid_lens, x_shape)
    if mask is not None:
        m = _as_bool_mask(mask)
        try:
            fits = np.broadcast_shapes(m.shape, x_shape) == tuple(x_shape)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"mask of shape {m.shape} does not broadcast to x {x_shape}")
        allowed = allowed & m
    return allowed


def dot_scores(q: ArrayLike, k: ArrayLike) -> np.ndarray:
    """Dot-product scores ``q @ k^T``: ``(..., Tq, d) x (..., Tk, d) -> (..., Tq, Tk)``."""
    q, k = _f64(q), _f64(k)
    if q.ndim < 2 or k.ndim < 2 or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q (..., Tq, d) and k (..., Tk, d) must share d, got {q.shape}, {k.shape}"
        )
    return q @ np.swapaxes(k, -1, -2)


def scaled_dot_scores(q: ArrayLike, k: ArrayLike, scale: float | None = None) -> np.ndarray:
    """``dot_scores(q, k) * scale`` with default ``scale = 1/sqrt(d)``; ``(..., Tq, Tk)``."""
    q = _f64(q)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return dot_scores(q, k) * scale


def additive_scores(
    q: ArrayLike, k: ArrayLike, w_q: ArrayLike, w_k: ArrayLike, w_v: ArrayLike
) -> np.ndarray:
    """Bahdanau scores ``s[i, j] = w_v . tanh(q_i @ w_q + k_j @ w_k)``.

    Shapes: q ``(..., Tq, dq)``, k ``(..., Tk, dk)``, w_q ``(dq, h)``, w_k ``(dk, h)``,
    w_v ``(h,)``; result ``(..., Tq, Tk)``.
    """
    q, k, w_q, w_k, w_v = (_f64(a) for a in (q, k, w_q, w_k, w_v))
    _check_shape("w_v", w_v, (None,))
    h = w_v.shape[0]
    _check_shape("w_q", w_q, (q.shape[-1], h))
    _check_shape("w_k", w_k, (k.shape[-1], h))
    qp = (q @ w_q)[..., :, None, :]  # (..., Tq, 1, h)
    kp = (k @ w_k)[..., None, :, :]  # (..., 1, Tk, h)
    return np.tanh(qp + kp) @ w_v


def general_scores(q: ArrayLike, k: ArrayLike, w: ArrayLike) -> np.ndarray:
    """Luong general (bilinear) scores ``s[i, j] = q_i @ w @ k_j``.

    Shapes: q ``(..., Tq, dq)``, k ``(..., Tk, dk)``, w ``(dq, dk)``; result ``(..., Tq, Tk)``.
    """
    q, k, w = _f64(q), _f64(k), _f64(w)
    _check_shape("w", w, (q.shape[-1], k.shape[-1]))
    return q @ w @ np.swapaxes(k, -1, -2)


def attention(
    scores: ArrayLike,
    value: ArrayLike,
    valid_lens: ArrayLike | None = None,
    mask: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Weights = masked_softmax(scores); output[i] = sum of weights[i, j] * value[j] over
    the keys j that row i may attend.

    A key a row may not attend takes no part in its output, whatever its score and value
    hold (NaN, inf): the sum runs over the allowed keys only, since ``0 * NaN`` in
    ``weights @ value`` would be NaN. scores ``(..., Tq, Tk)``, value ``(..., Tk, dv)``;
    returns output ``(..., Tq, dv)`` and weights ``(..., Tq, Tk)``.
    """
    scores, value = _f64(scores), _f64(value)
    if value.ndim < 2 or value.shape[-2] != scores.shape[-1]:
        raise ValueError(f"value must be (..., {scores.shape[-1]}, dv), got {value.shape}")
    weights = masked_softmax(scores, valid_lens=valid_lens, mask=mask)
    allowed = _allowed(scores.shape, valid_lens, mask, scores.ndim - 1)
    with np.errstate(invalid="ignore", over="ignore"):
        terms = weights[..., :, :, None] * value[..., None, :, :]  # (..., Tq, Tk, dv)
    return np.where(allowed[..., None], terms, 0.0).sum(axis=-2), weights


def scaled_dot_product_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    valid_lens: ArrayLike | None = None,
    causal: bool = False,
    scale: float | None = None,
    bias: ArrayLike | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax(q k^T * scale + bias) v with mask, valid_lens and causal_mask(Tq, Tk) ANDed
    together.

    q ``(..., Tq, d)``, k ``(..., Tk, d)``, v ``(..., Tk, dv)``; ``bias`` (float,
    broadcastable to the scores ``(..., Tq, Tk)``) is added to the scaled scores; with
    ``softcap`` ``c`` the scaled scores ``s`` are first replaced by ``c * tanh(s / c)``
    (soft-capping, Gemma 2); returns output ``(..., Tq, dv)`` and weights ``(..., Tq, Tk)``.
    """
    scores = scaled_dot_scores(q, k, scale)
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if bias is not None:
        scores = scores + _f64(bias)
    if causal:
        c = causal_mask(scores.shape[-2], scores.shape[-1])
        mask = c if mask is None else _as_bool_mask(mask) & c
    return attention(scores, v, valid_lens=valid_lens, mask=mask)


def alibi_bias(num_heads: int, q_len: int, k_len: int) -> np.ndarray:
    """ALiBi bias ``(1, H, Tq, Tk)``: ``-m_h * |i + Tk - Tq - j|``, slopes ``m_h`` the
    geometric sequence starting and stepping by ``2**(-8/n)`` for ``n`` a power of two;
    otherwise that sequence for the largest power of two ``p < H`` followed by the odd
    terms ``1, 3, 5, ...`` (counting from 1) of the sequence for ``2p``."""

    def seq(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    p = 2 ** math.floor(math.log2(num_heads))
    slopes = seq(p) + [seq(2 * p)[i] for i in range(0, 2 * p, 2)][: num_heads - p]
    rows = np.arange(q_len)[:, None] + (k_len - q_len)
    dist = np.abs(rows - np.arange(k_len)[None, :]).astype(np.float64)
    return -np.asarray(slopes, np.float64)[None, :, None, None] * dist[None, None]


def split_heads(x: ArrayLike, num_heads: int, layout: str = "contiguous") -> np.ndarray:
    """``(batch, seq, num_heads * depth) -> (batch, num_heads, seq, depth)``.

    contiguous: head h owns features ``h*depth .. (h+1)*depth - 1``.
    interleaved: head h owns features ``h, h + num_heads, ...`` (feature ``d*num_heads + h``).
    """
    x = _f64(x)
    _check_layout(layout)
    _check_shape("x", x, (None, None, None))
    b, t, width = x.shape
    if num_heads < 1 or width % num_heads != 0:
        raise ValueError(f"x width {width} is not divisible by num_heads={num_heads}")
    depth = width // num_heads
    if layout == "contiguous":
        return x.reshape(b, t, num_heads, depth).transpose(0, 2, 1, 3)
    return x.reshape(b, t, depth, num_heads).transpose(0, 3, 1, 2)


def merge_heads(x: ArrayLike, layout: str = "contiguous") -> np.ndarray:
    """Inverse of `split_heads`: ``(batch, num_heads, seq, depth) -> (batch, seq, H*depth)``."""
    x = _f64(x)
    _check_layout(layout)
    _check_shape("x", x, (None, None, None, None))
    b, h, t, depth = x.shape
    if layout == "contiguous":
        return x.transpose(0, 2, 1, 3).reshape(b, t, h * depth)
    return x.transpose(0, 2, 3, 1).reshape(b, t, depth * h)


def sinusoidal_encoding(
    length: int, depth: int, layout: str = "interleaved", base: float = 10000.0
) -> np.ndarray:
    """Sinusoidal position encoding ``(length, depth)`` with ``omega_k = base**(-2k/depth)``.

    interleaved: ``P[t, 2k] = sin(t omega_k)``, ``P[t, 2k+1] = cos(t omega_k)``.
    concatenated: the first ``ceil(depth/2)`` columns are sines, the rest cosines.
    Odd ``depth`` is allowed (one more sine than cosine).
    """
    _check_layout(layout, ("interleaved", "concatenated"))
    if length < 0 or depth < 1 or base <= 0:
        raise ValueError(f"need length >= 0, depth >= 1, base > 0; got {length}, {depth}, {base}")
    n_sin, n_cos = (depth + 1) // 2, depth // 2
    t = np.arange(length, dtype=np.float64)[:, None]
    omega = 1.0 / base ** (2.0 * np.arange(n_sin, dtype=np.float64) / depth)
    sines, cosines = np.sin(t * omega), np.cos(t * omega[:n_cos])
    out = np.zeros((length, depth), dtype=np.float64)
    if layout == "interleaved":
        out[:, 0::2], out[:, 1::2] = sines, cosines
    else:
        out[:, :n_sin], out[:, n_sin:] = sines, cosines
    return out


def multi_head_attention(
    query: ArrayLike,
    value: ArrayLike,
    key: ArrayLike | None = None,
    *,
    weights: dict[str, Any],
    mask: ArrayLike | None = None,
    valid_lens: ArrayLike | None = None,
    causal: bool = False,
    scale: float | None = None,
    rotary_base: float | None = None,
    rotary_dim: int | None = None,
    rotary_interleaved: bool = False,
    rotary_scaling: dict | None = None,
    sliding_window: int | None = None,
    attention_bias: ArrayLike | None = None,
    softcap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Multi-head attention; returns output ``(B, Tq, Eo)`` and weights ``(B, H, Tq, Tk)``.

    The key and value kernels may have fewer heads ``Hkv`` than the query kernel
    (grouped-query attention, ``Hkv`` dividing ``H``): query head ``h`` then uses key/value
    head ``h // (H / Hkv)``. With ``rotary_base`` the projected queries and keys get the
    rotary position embedding (`rotary_embedding`, with ``rotary_dim``,
    ``rotary_interleaved`` and ``rotary_scaling``) at positions ``0, 1, ...``. With
    ``sliding_window`` ``w`` the query at (bottom-right aligned) position ``p`` sees only
    keys ``j > p - w``.

    query ``(B, Tq, Eq)``, value ``(B, Tk, Ev)``, key ``(B, Tk, Ek)`` (defaults to value).
    ``weights``: "query_kernel" ``(Eq, H, D)``, "key_kernel" ``(Ek, H, D)``, "value_kernel"
    ``(Ev, H, Dv)``, "output_kernel" ``(H, Dv, Eo)``, optional "query_bias" ``(H, D)``,
    "key_bias" ``(H, D)``, "value_bias" ``(H, Dv)``, "output_bias" ``(Eo,)``.
    ``mask`` must broadcast to ``(B, H, Tq, Tk)``; a 3-D ``(B, Tq, Tk)`` mask first gets a head
    axis inserted at axis 1. ``valid_lens`` is ``(B,)`` or ``(B, Tq)``. Scale defaults to
    ``1/sqrt(D)``. ``attention_bias`` (float, broadcastable to ``(B, H, Tq, Tk)``) is added
    to the scaled scores, after ``softcap`` (see `scaled_dot_product_attention`). A fully
    masked query row has zero weights, so its output is the output bias.
    """
    query, value = _f64(query), _f64(value)
    key = value if key is None else _f64(key)
    for name in ("query_kernel", "key_kernel", "value_kernel", "output_kernel"):
        if name not in weights:
            raise ValueError(f"weights is missing {name!r}, got keys {sorted(weights)}")
    wq, wk = _f64(weights["query_kernel"]), _f64(weights["key_kernel"])
    wv, wo = _f64(weights["value_kernel"]), _f64(weights["output_kernel"])
    _check_shape("query", query, (None, None, None))
    b = query.shape[0]
    _check_shape("value", value, (b, None, None))
    _check_shape("key", key, (b, value.shape[1], None))
    _check_shape("query_kernel", wq, (query.shape[2], None, None))
    h, d = wq.shape[1:]
    _check_shape("key_kernel", wk, (key.shape[2], None, d))
    hkv = wk.shape[1]
    if h % hkv:
        raise ValueError(f"key/value heads {hkv} must divide the query heads {h}")
    _check_shape("value_kernel", wv, (value.shape[2], hkv, None))
    dv = wv.shape[2]
    _check_shape("output_kernel", wo, (h, dv, None))

    def bias(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if weights.get(name) is None:
            return np.zeros(shape)
        bias_value = _f64(weights[name])
        _check_shape(name, bias_value, shape)
        return bias_value

    # Project every position into every head: (B, T, E) x (E, H, D) -> (B, H, T, D).
    q = np.einsum("bte,ehd->bhtd", query, wq) + bias("query_bias", (h, d))[None, :, None, :]
    k = np.einsum("bte,ehd->bhtd", key, wk) + bias("key_bias", (hkv, d))[None, :, None, :]
    v = np.einsum("bte,ehd->bhtd", value, wv) + bias("value_bias", (hkv, dv))[None, :, None, :]
    if rotary_base is not None:
        options = dict(rotary_dim=rotary_dim, interleaved=rotary_interleaved)
        options["scaling"] = rotary_scaling
        q = rotary_embedding(q, np.arange(q.shape[2]), rotary_base, **options)
        k = rotary_embedding(k, np.arange(k.shape[2]), rotary_base, **options)
    # every key/value head serves h // hkv consecutive query heads
    k, v = np.repeat(k, h // hkv, axis=1), np.repeat(v, h // hkv, axis=1)
    if mask is not None:
        mask = _as_bool_mask(mask)
        if mask.ndim == 3:
            mask = mask[:, None, :, :]
    if sliding_window is not None:
        tq, tk = q.shape[2], k.shape[2]
        query_pos = np.arange(tq)[:, None] + (tk - tq)
        band = query_pos - np.arange(tk)[None, :] < sliding_window
        mask = band if mask is None else mask & band
    context, attn = scaled_dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        valid_lens=valid_lens,
        causal=causal,
        scale=scale,
        bias=attention_bias,
        softcap=softcap,
    )
    out = np.einsum("bhtv,hvo->bto", context, wo) + bias("output_bias", (wo.shape[2],))
    return out, attn


def rotary_inverse_frequencies(
    dim: int, base: float = 10000.0, scaling: dict | None = None
) -> np.ndarray:
    """The rotation speed (radians per position) of each of the ``dim / 2`` planes.

    Plane ``i`` turns by ``base**(-2i/dim)`` per position. ``scaling`` (a Hugging Face
    ``rope_scaling`` dict) changes that: ``"linear"`` divides every speed by ``factor``;
    ``"llama3"`` looks at the plane's wavelength ``2 pi / speed`` against ``n =
    original_max_position_embeddings``: shorter than ``n / high_freq_factor``, the speed
    stays; longer than ``n / low_freq_factor``, it is divided by ``factor``; in between it
    is blended, ``(1 - s) * speed / factor + s * speed`` with ``s = (n / wavelength -
    low_freq_factor) / (high_freq_factor - low_freq_factor)``; ``"per_plane"`` divides plane
    ``i``'s speed by ``factors[i]``.
    """
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    speeds = []
    for i in range(dim // 2):
        speed = base ** (-2.0 * i / dim)
        if kind == "linear":
            speed = speed / scaling["factor"]
        elif kind == "llama3":
            factor = scaling["factor"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            n = scaling["original_max_position_embeddings"]
            wavelength = 2.0 * math.pi / speed
            if wavelength < n / high:
                pass
            elif wavelength > n / low:
                speed = speed / factor
            else:
                s = (n / wavelength - low) / (high - low)
                speed = (1.0 - s) * speed / factor + s * speed
        elif kind == "per_plane":
            speed = speed / scaling["factors"][i]
        elif kind not in (None, "default"):
            raise ValueError(f"unknown rope_type {kind!r}")
        speeds.append(speed)
    return np.array(speeds, dtype=np.float64)


def rotary_embedding(
    x: ArrayLike,
    positions: ArrayLike,
    base: float = 10000.0,
    *,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    scaling: dict | None = None,
) -> np.ndarray:
    """Rotary position embedding of ``x`` ``(..., T, D)`` at ``positions`` ``(T,)``.

    Only the first ``R = rotary_dim`` features (default all ``D``; ``R`` even) are
    rotated, the rest are copied. Feature pair ``(i, i + R/2)`` (or ``(2i, 2i + 1)`` with
    ``interleaved``) is read as the complex number ``a + 1j * b`` and multiplied by
    ``exp(1j * p * speed_i)`` for the token at position ``p`` (``speed_i`` from
    `rotary_inverse_frequencies` of ``R``, ``base`` and ``scaling``), and by a
    ``per_plane`` scaling's ``attention_factor``.
    """
    x = _f64(x)
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    if r % 2 or r > x.shape[-1]:
        raise ValueError(f"rotary_embedding needs an even rotary width <= {x.shape[-1]}, got {r}")
    half = r // 2
    positions = np.asarray(positions, dtype=np.float64)
    freqs = rotary_inverse_frequencies(r, base, scaling)
    phase = np.exp(1j * positions[:, None] * freqs[None, :])  # (T, R/2)
    if scaling is not None and scaling.get("rope_type") == "per_plane":
        phase = phase * scaling["attention_factor"]
    out = x.copy()
    if interleaved:
        z = (x[..., 0:r:2] + 1j * x[..., 1:r:2]) * phase
        out[..., 0:r:2], out[..., 1:r:2] = z.real, z.imag
    else:
        z = (x[..., :half] + 1j * x[..., half:r]) * phase
        out[..., :half], out[..., half:r] = z.real, z.imag
    return out


def layer_norm(x: ArrayLike, gamma: ArrayLike, beta: ArrayLike, epsilon: float) -> np.ndarray:
    """Layer norm over the last axis (biased variance); x ``(..., d)``, gamma/beta ``(d,)``."""
    x, gamma, beta = _f64(x), _f64(gamma), _f64(beta)
    _check_shape("gamma", gamma, (x.shape[-1],))
    _check_shape("beta", beta, (x.shape[-1],))
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma + beta


def rms_norm(x: ArrayLike, scale: ArrayLike | None, epsilon: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + epsilon) * scale``; x ``(..., d)``,
    scale ``(d,)`` or None (a gain of ones). No mean is subtracted."""
    x = _f64(x)
    root_mean_square = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + epsilon)
    out = x / root_mean_square
    if scale is not None:
        scale = _f64(scale)
        _check_shape("scale", scale, (x.shape[-1],))
        out = out * scale
    return out


_erf = np.vectorize(math.erf, otypes=[np.float64])


def feed_forward(
    x: ArrayLike,
    w1: ArrayLike,
    b1: ArrayLike,
    w2: ArrayLike,
    b2: ArrayLike,
    activation: str = "relu",
) -> np.ndarray:
    """``act(x @ w1 + b1) @ w2 + b2``; x ``(..., d)``, w1 ``(d, f)``, b1 ``(f,)``,
    w2 ``(f, o)``, b2 ``(o,)``. activation: "relu", "gelu" (exact, erf-based) or "linear"."""
    x, w1, b1, w2, b2 = (_f64(a) for a in (x, w1, b1, w2, b2))
    _check_shape("w1", w1, (x.shape[-1], None))
    _check_shape("b1", b1, (w1.shape[1],))
    _check_shape("w2", w2, (w1.shape[1], None))
    _check_shape("b2", b2, (w2.shape[1],))
    hidden = x @ w1 + b1
    if activation == "relu":
        hidden = np.maximum(hidden, 0.0)
    elif activation == "gelu":
        hidden = 0.5 * hidden * (1.0 + _erf(hidden / math.sqrt(2.0)))
    elif activation != "linear":
        raise ValueError(f"activation must be 'relu', 'gelu' or 'linear', got {activation!r}")
    return hidden @ w2 + b2


def transformer_encoder_layer(
    x: ArrayLike,
    *,
    weights: dict[str, Any],
    num_heads: int,
    norm_first: bool = False,
    epsilon: float = 1e-6,
    activation: str = "relu",
    mask: ArrayLike | None = None,
    valid_lens: ArrayLike | None = None,
) -> np.ndarray:
    """One transformer encoder layer (inference, no dropout); x and output ``(B, T, d_model)``.

    Post-LN: ``h = LN1(x + MHA(x)); out = LN2(h + FFN(h))``.
    Pre-LN: ``h = x + MHA(LN1(x)); out = h + FFN(LN2(h))``.
    ``weights``: "attention" (see `multi_head_attention`), "ffn_w1" ``(d_model, dff)``,
    "ffn_b1" ``(dff,)``, "ffn_w2" ``(dff, d_model)``, "ffn_b2" ``(d_model,)`` and
    "norm1_gamma", "norm1_beta", "norm2_gamma", "norm2_beta" ``(d_model,)``.
    """
    x = _f64(x)
    heads = np.shape(weights["attention"]["query_kernel"])[1]
    if heads != num_heads:
        raise ValueError(f"num_heads={num_heads} but query_kernel has {heads} heads")

    def mha(inputs: np.ndarray) -> np.ndarray:
        out, _ = multi_head_attention(
            inputs, inputs, weights=weights["attention"], mask=mask, valid_lens=valid_lens
        )
        return out

    def ffn(inputs: np.ndarray) -> np.ndarray:
        w = weights
        return feed_forward(inputs, w["ffn_w1"], w["ffn_b1"], w["ffn_w2"], w["ffn_b2"], activation)

    def ln1(inputs: np.ndarray) -> np.ndarray:
        return layer_norm(inputs, weights["norm1_gamma"], weights["norm1_beta"], epsilon)

    def ln2(inputs: np.ndarray) -> np.ndarray:
        return layer_norm(inputs, weights["norm2_gamma"], weights["norm2_beta"], epsilon)

    if norm_first:
        h = x + mha(ln1(x))
        return h + ffn(ln2(h))
    h = ln1(x + mha(x))
    return ln2(h + ffn(h))


def replaced_softmax(x: ArrayLike, keep: ArrayLike, fill: float) -> np.ndarray:
    """Softmax over the last axis after *replacing* disallowed scores by ``fill``.

    The convention of the d2l-style PyTorch and the PaddlePaddle documents (fill -1e6):
    a row with nothing allowed has all scores equal to ``fill`` and so gets uniform
    weights, unlike `masked_softmax`'s zero rows.
    """
    x = _f64(x)
    z = np.where(_as_bool_mask(keep, "keep"), x, float(fill))
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def transformer_decoder_layer(
    x: ArrayLike,
    context: ArrayLike,
    *,
    weights: dict[str, Any],
    norm_first: bool = False,
    epsilon: float = 1e-6,
    activation: str = "relu",
    context_valid_lens: ArrayLike | None = None,
    context_mask: ArrayLike | None = None,
    rotary_base: float | None = None,
) -> np.ndarray:
    """One transformer decoder layer (inference, no dropout); x and output ``(B, T, d_model)``.

    Post-LN: ``h1 = LN1(x + SelfMHA_causal(x)); h2 = LN2(h1 + CrossMHA(h1, context));
    out = LN3(h2 + FFN(h2))``. Pre-LN: ``h1 = x + SelfMHA_causal(LN1(x));
    h2 = h1 + CrossMHA(LN2(h1), context); out = h2 + FFN(LN3(h2))``.
    ``weights``: "self_attention" and "cross_attention" (see `multi_head_attention`),
    "ffn_w1", "ffn_b1", "ffn_w2", "ffn_b2" and "norm{1,2,3}_{gamma,beta}".
    ``context_valid_lens`` ``(B,)`` / ``context_mask`` ``(B, S)`` (True = real token) mask the
    encoder positions; ``rotary_base`` applies RoPE in the self-attention.
    """
    x, context = _f64(x), _f64(context)
    w = weights
    cmask = None if context_mask is None else _as_bool_mask(context_mask)[:, None, None, :]

    def ln(i: int, inputs: np.ndarray) -> np.ndarray:
        return layer_norm(inputs, w[f"norm{i}_gamma"], w[f"norm{i}_beta"], epsilon)

    def self_mha(inputs: np.ndarray) -> np.ndarray:
        return multi_head_attention(
            inputs, inputs, weights=w["self_attention"], causal=True, rotary_base=rotary_base
        )[0]

    def cross_mha(inputs: np.ndarray) -> np.ndarray:
        return multi_head_attention(
            inputs,
            context,
            weights=w["cross_attention"],
            valid_lens=context_valid_lens,
            mask=cmask,
        )[0]

    def ffn(inputs: np.ndarray) -> np.ndarray:
        return feed_forward(inputs, w["ffn_w1"], w["ffn_b1"], w["ffn_w2"], w["ffn_b2"], activation)

    if norm_first:
        h = x + self_mha(ln(1, x))
        h = h + cross_mha(ln(2, h))
        return h + ffn(ln(3, h))
    h = ln(1, x + self_mha(x))
    h = ln(2, h + cross_mha(h))
    return ln(3, h + ffn(h))


def activation(x: ArrayLike, name: str) -> np.ndarray:
    """The feed-forward activations by their checkpoint names, elementwise in float64:
    "linear", "relu", "gelu" (exact, with erf), "gelu_tanh" / "gelu_new" /
    "gelu_pytorch_tanh" (``x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``), "silu" /
    "swish" (``x / (1 + exp(-x))``)."""
    x = _f64(x)
    if name == "linear":
        return x
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name in ("gelu_tanh", "gelu_new", "gelu_pytorch_tanh"):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name in ("silu", "swish"):
        with np.errstate(over="ignore"):
            return x / (1.0 + np.exp(-x))
    raise ValueError(f"unknown activation {name!r}")


def gated_feed_forward(
    x: ArrayLike, weights: dict[str, Any], activation_name: str, gated: bool
) -> np.ndarray:
    """Plain ``down(act(up(x)))`` or gated ``down(act(gate(x)) * up(x))`` feed-forward.

    x ``(..., d)``; ``weights``: "up_kernel" ``(d, f)``, "down_kernel" ``(f, o)``,
    "gate_kernel" ``(d, f)`` when gated, and optional "up_bias", "gate_bias" ``(f,)``,
    "down_bias" ``(o,)`` (missing biases are zero).
    """
    x = _f64(x)

    def dense(name: str, inputs: np.ndarray) -> np.ndarray:
        kernel = _f64(weights[f"{name}_kernel"])
        _check_shape(f"{name}_kernel", kernel, (inputs.shape[-1], None))
        out = inputs @ kernel
        if weights.get(f"{name}_bias") is not None:
            out = out + _f64(weights[f"{name}_bias"])
        return out

    if gated:
        hidden = activation(dense("gate", x), activation_name) * dense("up", x)
    else:
        hidden = activation(dense("up", x), activation_name)
    return dense("down", hidden)


def transformer_decoder_only_layer(
    x: ArrayLike,
    *,
    weights: dict[str, Any],
    norm: str = "layer",
    norm_first: bool = False,
    epsilon: float = 1e-6,
    activation_name: str = "relu",
    gated: bool = False,
    rotary_base: float | None = None,
    rotary_dim: int | None = None,
    rotary_interleaved: bool = False,
    rotary_scaling: dict | None = None,
    sliding_window: int | None = None,
    mask: ArrayLike | None = None,
) -> np.ndarray:
    """One decoder-only block (inference, no dropout); x and output ``(B, T, d_model)``.

    Pre-norm: ``h = x + SelfMHA_causal(N1(x)); out = h + FFN(N2(h))``. Post-norm:
    ``h = N1(x + SelfMHA_causal(x)); out = N2(h + FFN(h))``. ``N`` is `layer_norm`
    (``norm="layer"``; weights "norm{1,2}_gamma", "norm{1,2}_beta") or `rms_norm`
    (``norm="rms"``; weights "norm{1,2}_scale"). ``weights["attention"]`` as
    `multi_head_attention` takes it; ``weights["ffn"]`` as `gated_feed_forward`. The
    rotary options and ``sliding_window`` go to the attention; ``mask`` (``(B, T, T)``
    or ``(B, H, T, T)``, True = may attend) is ANDed with the causal mask.
    """
    x = _f64(x)
    w = weights

    def normalise(i: int, inputs: np.ndarray) -> np.ndarray:
        if norm == "rms":
            return rms_norm(inputs, w[f"norm{i}_scale"], epsilon)
        return layer_norm(inputs, w[f"norm{i}_gamma"], w[f"norm{i}_beta"], epsilon)

    def attend(inputs: np.ndarray) -> np.ndarray:
        return multi_head_attention(
            inputs,
            inputs,
            weights=w["attention"],
            mask=mask,
            causal=True,
            rotary_base=rotary_base,
            rotary_dim=rotary_dim,
            rotary_interleaved=rotary_interleaved,
            rotary_scaling=rotary_scaling,
            sliding_window=sliding_window,
        )[0]

    def ffn(inputs: np.ndarray) -> np.ndarray:
        return gated_feed_forward(inputs, w["ffn"], activation_name, gated)

    if norm_first:
        h = x + attend(normalise(1, x))
        return h + ffn(normalise(2, h))
    h = normalise(1, x + attend(x))
    return normalise(2, h + ffn(h))
