"""PyTorch adapter for the d2l-style attention code of document 002.

Code written against that document (``masked_softmax``, ``AdditiveAttention``,
``DotProductAttention``) runs unchanged on these definitions and gives the document's
results, while every score, softmax and weighted sum is computed by `multiattn.ops`.
This module only converts: argument names and order, ``nn.Linear`` weights (stored
``(out, in)``) to the core's ``(in, out)`` kernels, and the document's masking rule to
the core's boolean masks.

The document's masking rule: key positions ``>= valid_len`` are *replaced* by ``-1e6``
before the softmax. For rows that keep at least one key this gives exactly the core's
masked softmax (the masked terms are ``exp(-1e6 - max) == 0`` in float32 and float64).
For a row with ``valid_len == 0`` every entry is ``-1e6``, so the document returns a
*uniform* row (``1 / num_keys``), where the core returns zeros. The adapter reproduces
the uniform row by giving the core a constant row with every key allowed.

Importing this module selects Keras' torch backend when Keras is not imported yet; if
Keras already runs (or ``KERAS_BACKEND`` names) another backend it raises ImportError.
"""

from __future__ import annotations

from ._select import require_keras_backend

require_keras_backend("torch")

from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from multiattn import ops as _ops  # noqa: E402
from multiattn._checks import fmt_shape  # noqa: E402

__all__ = ["MASK_FILL", "AdditiveAttention", "DotProductAttention", "masked_softmax"]

MASK_FILL = -1e6
"""The document's fill value for masked scores; a row with nothing valid is all ``MASK_FILL``
and so uniform after the softmax."""


def _document_fill(
    where: str, scores: torch.Tensor, valid_lens: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores and a core mask (True = may attend) that reproduce the ``-1e6`` fill.

    Args:
        scores: ``(batch, queries, keys)`` (any rank the core accepts).
        valid_lens: None, ``(batch,)`` or ``(batch, queries)``.

    Returns:
        ``(scores', keep)``: rows with no valid key are replaced by the constant
        `MASK_FILL` and may attend every key (a uniform row, no gradient to the scores,
        as in the document); other rows are unchanged with keys ``>= valid_len`` masked.
        ``keep`` is None when ``valid_lens`` is None.
    """
    if valid_lens is None:
        return scores, None
    keep = _ops.valid_lens_to_mask(valid_lens, tuple(scores.shape), where=where)
    row_any = torch.any(keep, dim=-1, keepdim=True)
    fill = torch.full((), MASK_FILL, dtype=scores.dtype, device=scores.device)
    return torch.where(row_any, scores, fill), torch.logical_or(keep, torch.logical_not(row_any))


def masked_softmax(X: torch.Tensor, valid_lens: Any = None) -> torch.Tensor:
    """Softmax over the last axis with keys ``>= valid_lens`` masked, as in document 002.

    Args:
        X: floating scores ``(batch, queries, keys)``. Never modified.
        valid_lens: None (plain softmax), ``(batch,)`` (one length per batch row, used for
            every query) or ``(batch, queries)`` (one length per query); whole numbers in
            ``[0, keys]``.

    Returns:
        ``(batch, queries, keys)`` weights. Masked keys get exactly 0; a row whose length
        is 0 is uniform (``1 / keys``), the document's ``-1e6`` fill result.

    Raises:
        ValueError: ``valid_lens`` of the wrong shape, negative, fractional or larger
            than the number of keys (the document would silently accept the last three).
        TypeError: non-floating ``X`` or non-numeric ``valid_lens``.
    """
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"masked_softmax: `X` must be a torch.Tensor; received {type(X).__name__}.")
    if not X.is_floating_point():
        raise TypeError(f"masked_softmax: `X` must be floating; received dtype {X.dtype}.")
    scores, keep = _document_fill("masked_softmax", X, valid_lens)
    return _ops.masked_softmax(scores, mask=keep)


def _check_inputs(
    where: str,
    queries: Any,
    keys: Any,
    values: Any,
    query_size: int | None = None,
    key_size: int | None = None,
) -> None:
    """Rank-3 floating tensors with matching batch, key count and (optional) widths."""
    named = (("queries", queries), ("keys", keys), ("values", values))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{where}: `{name}` must be a torch.Tensor; received {type(t).__name__}."
            )
        if t.dim() != 3:
            raise ValueError(
                f"{where}: `{name}` must have rank 3 (batch, positions, features); received "
                f"shape {fmt_shape(tuple(t.shape))}."
            )
        if not t.is_floating_point():
            raise TypeError(f"{where}: `{name}` must be floating; received dtype {t.dtype}.")
    qs, ks, vs = (tuple(t.shape) for _, t in named)
    if not qs[0] == ks[0] == vs[0]:
        raise ValueError(
            f"{where}: `queries`, `keys` and `values` must share the batch size; received "
            f"{fmt_shape(qs)}, {fmt_shape(ks)} and {fmt_shape(vs)}."
        )
    if ks[1] != vs[1]:
        raise ValueError(
            f"{where}: `keys` and `values` must have the same number of positions; received "
            f"keys {fmt_shape(ks)} and values {fmt_shape(vs)}."
        )
    for name, size, shape, width in (
        ("queries", "query_size", qs, query_size),
        ("keys", "key_size", ks, key_size),
    ):
        if width is not None and shape[-1] != width:
            raise ValueError(
                f"{where}: `{name}` must have {size}={width} features; received shape "
                f"{fmt_shape(shape)}."
            )


class AdditiveAttention(nn.Module):
    """Additive attention ``w_v . tanh(W_q q + W_k k)`` with the document's parameters.

    Parameters (names and shapes as in document 002, so its state dicts load strictly):
    ``W_k.weight (num_hiddens, key_size)``, ``W_q.weight (num_hiddens, query_size)``,
    ``w_v.weight (1, num_hiddens)``, all bias-free ``nn.Linear``; ``dropout`` is an
    ``nn.Dropout`` on the attention weights (active in train mode only).

    Args:
        key_size: key width ``d_k``.
        query_size: query width ``d_q``.
        num_hiddens: hidden width of the scoring layer.
        dropout: drop probability on the attention weights.
        **kwargs: passed to ``nn.Module``.
    """

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float, **kwargs: Any
    ):
        super().__init__(**kwargs)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights: torch.Tensor | None = None

    def forward(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid_lens: Any = None,
    ) -> torch.Tensor:
        """Attend.

        Args:
            queries: ``(batch, num_queries, query_size)``.
            keys: ``(batch, num_kv, key_size)``.
            values: ``(batch, num_kv, value_dim)``.
            valid_lens: None, ``(batch,)`` or ``(batch, num_queries)`` valid key counts.

        Returns:
            ``(batch, num_queries, value_dim)``. ``self.attention_weights`` holds the
            weights ``(batch, num_queries, num_kv)`` before dropout.
        """
        where = "AdditiveAttention"
        _check_inputs(where, queries, keys, values, self.W_q.in_features, self.W_k.in_features)
        scores = _ops.additive_scores(
            queries, keys, self.W_q.weight.T, self.W_k.weight.T, self.w_v.weight[0]
        )
        return _attend(self, where, scores, values, valid_lens)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention ``softmax(q k^T / sqrt(d)) v`` (document 002).

    Args:
        dropout: drop probability on the attention weights (``self.dropout``, an
            ``nn.Dropout``), active in train mode only.
    """

    def __init__(self, dropout: float, **kwargs: Any):
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights: torch.Tensor | None = None

    def forward(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid_lens: Any = None,
    ) -> torch.Tensor:
        """Attend.

        Args:
            queries: ``(batch, num_queries, d)``.
            keys: ``(batch, num_kv, d)``.
            values: ``(batch, num_kv, value_dim)``.
            valid_lens: None, ``(batch,)`` or ``(batch, num_queries)`` valid key counts.

        Returns:
            ``(batch, num_queries, value_dim)``; ``self.attention_weights`` holds the
            weights ``(batch, num_queries, num_kv)`` before dropout.
        """
        where = "DotProductAttention"
        _check_inputs(where, queries, keys, values)
        if queries.shape[-1] != keys.shape[-1]:
            raise ValueError(
                f"{where}: `queries` and `keys` must have the same width; received queries "
                f"{fmt_shape(tuple(queries.shape))} and keys {fmt_shape(tuple(keys.shape))}."
            )
        scores = _ops.scaled_dot_scores(queries, keys)
        return _attend(self, where, scores, values, valid_lens)


def _attend(
    module: AdditiveAttention | DotProductAttention,
    where: str,
    scores: torch.Tensor,
    values: torch.Tensor,
    valid_lens: Any,
) -> torch.Tensor:
    """The document's masked softmax, dropout on the weights and weighted sum, via the core.

    With ``seed=None`` the core's dropout is ``torch.nn.functional.dropout``, i.e. what
    ``module.dropout`` would draw from torch's global generator.
    """
    scores, keep = _document_fill(where, scores, valid_lens)
    rate = module.dropout.p if module.training else 0.0
    out, weights = _ops.score_attention(
        scores, values, mask=keep, dropout=rate, training=module.training, return_weights=True
    )
    module.attention_weights = weights
    return out
