"""The masks of `multiattn.layers.MultiHeadAttention` (everything but the cache's).

Polarity, as everywhere in multiattn: True (or a non-zero number) = may attend; masks
combine with AND (`both`), None meaning "no mask". A ``keep`` here is bool and aligned
with the attention scores ``(B, <other axes>, H, <query attention axes>, <key attention
axes>)`` (`multiattn.layers._mha_axes.scores_shape`; ``(B, H, T_q, T_k)`` for rank-3
inputs), any axis of it possibly 1 (broadcast).

What is here:

* the Keras masks that tensors carry (``Embedding(mask_zero=True)``): read from the
  inputs, removed from them, carried to the output (`read_keras_masks`,
  `carry_keras_mask`); ``query_mask`` ``(B, T_q)``, ``value_mask``/``key_mask``
  ``(B, T_k)``, True = valid;
* Keras' mask rules: ``attention_mask`` and the inputs' masks (`keras_rule`, via
  `multiattn.ops.masking.keras_keep`), Keras' top-left ``use_causal_mask`` and the
  sliding-window band (`band_keep`, `axes_band_keep`);
* multiattn's own ``mask`` / ``valid_lens`` / bottom-right ``causal`` of rank-3 inputs
  (`own_keep`, via `multiattn.ops.masking.split_masks`), all of a call's masks together
  (`call_keep`), and all of them folded into one explicit mask for a subclass's
  ``_compute_attention`` (`fold`).
"""

from __future__ import annotations

from typing import Any

from .._checks import broadcast_shape, check_rank, shape_of
from ..ops.masking import (
    block_keep,
    keras_keep,
    lens_rank4,
    split_masks,
    top_left_keep,
    truthy_keep,
    window_keep,
)
from ._base import as_mask, keras_mask_of

try:  # Keras keeps a tensor's mask beside the tensor where it cannot be an attribute (JAX)
    from keras.src.backend import set_keras_mask as _set_keras_mask
except ImportError:  # pragma: no cover - other Keras layouts

    def _set_keras_mask(x: Any, mask: Any) -> None:
        x._keras_mask = mask


# -- the Keras masks tensors carry -------------------------------------------------------


def carry_keras_mask(out: Any, mask: Any) -> None:
    """Put the Keras mask ``mask`` (None: nothing) on ``out`` where it can carry one."""
    if mask is not None:
        try:
            _set_keras_mask(out, mask)
        except (AttributeError, TypeError):
            pass


def _clear_keras_mask(x: Any) -> None:
    if x is not None and keras_mask_of(x) is not None:
        try:
            _set_keras_mask(x, None)
        except (AttributeError, TypeError):
            pass


def read_keras_masks(
    query: Any, value: Any, key: Any, query_mask: Any, value_mask: Any, key_mask: Any,
    clear: bool,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """The Keras masks ``(query's, value's, key's)`` of a call, as Keras' layer reads
    them: the query's from the tensor before the ``query_mask`` argument, the value's and
    key's from the arguments before the tensors. With ``clear`` they are then removed
    from the inputs (so that no sublayer warns about them)."""
    q_mask = keras_mask_of(query)
    q_mask = query_mask if q_mask is None else q_mask
    v_mask = value_mask if value_mask is not None else keras_mask_of(value)
    k_mask = key_mask if key_mask is not None else keras_mask_of(key)
    if clear:
        for t in (query, value, key):
            _clear_keras_mask(t)
    return q_mask, v_mask, k_mask


# -- combining ---------------------------------------------------------------------------


def both(ops: Any, a: Any, b: Any) -> Any:
    """``a AND b``, either of them None (no mask)."""
    if a is None:
        return b
    if b is None:
        return a
    return ops.logical_and(a, b)


def as_rank4(ops: Any, keep: Any) -> Any:
    """``keep`` (rank <= 4, or None) with leading axes of size 1 up to rank 4."""
    if keep is None:
        return None
    for _ in range(4 - len(shape_of(keep))):
        keep = ops.expand_dims(keep, 0)
    return keep


def length(ops: Any, x: Any, axis: int) -> Any:
    """The size of ``x`` along ``axis``: an int where static, else a scalar tensor."""
    s = shape_of(x)[axis]
    return s if s is not None else ops.shape(x)[axis]


def lengths(ops: Any, q: Any, k: Any) -> tuple[Any, Any]:
    """The query and key lengths (axis 1) of projected ``q`` and ``k``."""
    return length(ops, q, 1), length(ops, k, 1)


def keras_rule(ops: Any, where: str, name: str, mask: Any, scores_shape: tuple, n_axes: int) -> Any:
    """`multiattn.ops.masking.keras_keep` of ``mask`` given as a tensor, an array or a
    nested list (Keras' broadcasting against the scores)."""
    return keras_keep(ops, where, name, as_mask(where, name, mask), scores_shape, n_axes)


# -- Keras' causal mask and the sliding window ------------------------------------------


def band_keep(ops: Any, keep: Any, q: Any, k: Any, top_left: bool, window: int | None) -> Any:
    """``keep`` (rank 4 or None) AND Keras' top-left causal mask (query ``i`` sees keys
    ``j <= i``) with ``top_left``, AND the band ``|i - j| < window`` with ``window``, for
    projected rank-4 ``q`` and ``k``."""
    if not top_left and window is None:
        return keep
    tq, tk = lengths(ops, q, k)
    if top_left:
        keep = both(ops, keep, as_rank4(ops, top_left_keep(ops, tq, tk)))
    if window is not None:
        keep = both(ops, keep, as_rank4(ops, window_keep(ops, tq, tk, window)))
    return keep


def keras_causal_keep(
    ops: Any, keep: Any, q: Any, k: Any, causal: bool, top_left: bool, window: int | None
) -> tuple[Any, bool]:
    """``(keep, causal)`` of rank-4 inputs with Keras' ``use_causal_mask`` (``top_left``)
    and the sliding window applied: with as many queries as keys (static) and no
    bottom-right ``causal``, top-left is bottom-right and goes into ``causal``; else into
    ``keep`` (`band_keep`)."""
    tq, tk = shape_of(q)[1], shape_of(k)[1]
    if top_left and not causal and tq is not None and tq == tk:
        causal, top_left = True, False
    return band_keep(ops, keep, q, k, top_left, window), causal


def axes_band_keep(
    ops: Any, where: str, name: str, keep: Any, qs: tuple, ks: tuple, top_left: bool,
    window: int | None, scores: tuple, n_axes: int,
) -> Any:  # fmt: skip
    """`band_keep` for attention over several axes: the top-left mask and the band over
    the first axis after the batch of the projected shapes ``qs`` and ``ks``, put on the
    scores ``scores`` by Keras' rule (errors naming ``name``)."""
    bands = []
    if top_left:
        bands.append(top_left_keep(ops, qs[1], ks[1]))
    if window is not None:
        bands.append(window_keep(ops, qs[1], ks[1], window))
    for m in bands:
        keep = both(ops, keep, keras_rule(ops, where, name, m, scores, n_axes))
    return keep


# -- a call's masks ----------------------------------------------------------------------


def own_keep(
    ops: Any, where: str, shape4: tuple, mask: Any, valid_lens: Any, causal: Any
) -> tuple[Any, Any, Any]:
    """multiattn's ``mask`` (rank <= 3: broadcast to ``(B, T_q, T_k)``, the same for every
    head; rank 4: to ``(B, H, T_q, T_k)``), ``valid_lens`` and ``causal`` checked for the
    scores ``shape4`` (`multiattn.ops.masking.split_masks`: ``(keep, lens, causal)``)."""
    if mask is not None:
        ms = shape_of(mask)
        if len(ms) <= 3:
            b, _, q, k = shape4
            broadcast_shape(where, "mask", ms, (b, q, k))
            if len(ms) == 3:
                mask = ops.expand_dims(mask, 1)
        else:
            check_rank(where, "mask", ms, 0, 4)
    return split_masks(ops, shape4, mask=mask, valid_lens=valid_lens, causal=causal, where=where)


def _inputs_keep(
    ops: Any, where: str, scores: tuple, n_axes: int, masks: tuple, attention_mask: Any
) -> Any:
    """The Keras masks of the inputs ``masks`` (query's, value's, key's) and Keras'
    ``attention_mask`` as one ``keep`` by Keras' rule."""
    keep = None
    auto = None
    names = ("query_mask", "value_mask", "key_mask")
    for name, m, axis in zip(names, masks, (-1, -2, -2)):
        if m is None:
            continue
        m = truthy_keep(ops, where, name, as_mask(where, name, m))
        auto = both(ops, auto, ops.expand_dims(m, axis))
    if auto is not None:
        keep = keras_rule(ops, where, "the inputs' Keras masks", auto, scores, n_axes)
    if attention_mask is not None:
        keep = both(
            ops, keep, keras_rule(ops, where, "attention_mask", attention_mask, scores, n_axes)
        )
    return keep


def call_keep(
    ops: Any, where: str, scores: tuple, axes: tuple, masks: tuple, attention_mask: Any,
    mask: Any, valid_lens: Any, causal: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """The masks of a call as ``(keep, lens)``: ``keep`` bool aligned with the scores
    ``scores`` (rank 4 for rank-3 inputs) or None, ``lens`` the validated lengths or None.
    ``masks`` are the inputs' Keras masks (query's, value's, key's; `read_keras_masks`),
    ``axes`` the attention axes. Validates ``causal`` (multiattn's) too."""
    keep = _inputs_keep(ops, where, scores, len(axes), masks, attention_mask)
    if len(scores) != 4:
        multi = [name for name, a in (("mask", mask), ("valid_lens", valid_lens)) if a is not None]
        if causal is not False:
            multi.append("causal")
        if multi:
            raise ValueError(
                f"{where}: {', '.join(f'`{m}`' for m in multi)} need (batch, sequence, "
                f"features) inputs; with attention over axes {axes} use "
                "`attention_mask` and `use_causal_mask` (Keras' meaning)."
            )
        return keep, None
    own, lens, _ = own_keep(ops, where, scores, mask, valid_lens, causal)
    return both(ops, keep, as_rank4(ops, own)), lens


def fold(
    ops: Any, where: str, q: Any, k: Any, keep: Any, lens: Any, causal: bool, top_left: bool,
    window: int | None, scores: tuple, n_axes: int,
) -> Any:  # fmt: skip
    """Every mask of a call as one explicit bool mask aligned with the scores ``scores``
    of projected ``q`` and ``k``, for a subclass's ``_compute_attention`` (which knows only
    ``attention_mask``)."""
    if len(shape_of(q)) == 4:
        keep = block_keep(ops, keep, lens_rank4(ops, lens), causal, lengths(ops, q, k))
        return band_keep(ops, keep, q, k, top_left, window)
    return axes_band_keep(
        ops, where, "mask", keep, shape_of(q), shape_of(k), top_left, window, scores, n_axes
    )
