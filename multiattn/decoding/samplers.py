"""How ``generate`` picks the next token from the last position's logits.

A sampler is a small object called on float ``(batch, vocab)`` logits (a NumPy array) that
returns the int64 ``(batch,)`` next tokens: `Greedy` (the argmax) or `Sampling`
(temperature, then top-k, then top-p, as transformers applies them, and a draw from a NumPy
generator seeded by ``seed``). `make_sampler` builds one from ``generate``'s
transformers-style arguments and is where they are checked. A sampler whose choice is
also written as tensor operations (``in_graph``: `Greedy` alone) can run inside a
compiled loop (`multiattn.decoding.strategies.CompiledLoop`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ._checks import check_int

__all__ = ["Greedy", "Sampler", "Sampling", "make_sampler"]


def _check_filters(where: str, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> tuple:
    """``(temperature, top_k, top_p, seed)`` checked and as float, int or None, float or
    None, int or None."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float, np.integer, np.floating))
        or not (np.isfinite(temperature) and temperature > 0)
    ):
        raise ValueError(
            f"{where}: `temperature` must be a positive number; received {temperature!r}."
        )
    if top_p is not None and (
        isinstance(top_p, bool)
        or not isinstance(top_p, (int, float, np.integer, np.floating))
        or not 0 < top_p <= 1
    ):
        raise ValueError(f"{where}: `top_p` must be None or in (0, 1]; received {top_p!r}.")
    return (
        float(temperature),
        check_int(where, "top_k", top_k),
        None if top_p is None else float(top_p),
        check_int(where, "seed", seed, 0),
    )


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _as_logits(where: str, logits: Any) -> np.ndarray:
    """``logits`` as a float64 ``(batch, vocab)`` NumPy array."""
    out = np.asarray(logits, np.float64)
    if out.ndim != 2 or out.shape[1] == 0:
        raise ValueError(
            f"{where}: `logits` must be a (batch, vocab) array with vocab >= 1; received "
            f"shape {out.shape}."
        )
    return out


class Sampler(ABC):
    """The interface of a sampler: ``sampler(logits)`` with float ``(batch, vocab)``
    NumPy logits returns the int64 ``(batch,)`` next tokens. ``in_graph`` says whether the
    sampler also offers ``choose_in_graph(ops, logits)``, the same choice as tensor
    operations of the ``keras.ops``-shaped namespace ``ops`` (int32 ``(batch,)``), which a
    compiled loop needs."""

    in_graph = False

    @abstractmethod
    def __call__(self, logits: Any) -> np.ndarray:
        """int64 ``(batch,)``: the next token of each row of float ``(batch, vocab)``
        ``logits``."""


class Greedy(Sampler):
    """The most likely token of each row (the first one where several tie, as
    ``numpy.argmax``)."""

    in_graph = True

    def __call__(self, logits: Any) -> np.ndarray:
        """int64 ``(batch,)``: the argmax of float ``(batch, vocab)`` ``logits``."""
        return np.argmax(_as_logits("Greedy", logits), axis=-1).astype(np.int64)

    def choose_in_graph(self, kops: Any, logits: Any) -> Any:
        """int32 ``(batch,)``: the argmax of the float ``(batch, vocab)`` tensor ``logits``
        through ``kops`` (``keras.ops``), for a compiled loop."""
        return kops.cast(kops.argmax(logits, axis=-1), "int32")

    def __repr__(self) -> str:
        return "Greedy()"


class Sampling(Sampler):
    """A draw from the softmax of the filtered logits, as transformers samples: the logits
    divided by ``temperature``; only the ``top_k`` largest kept (ties with the k-th kept
    too); then only the smallest set of most likely tokens whose probability reaches
    ``top_p`` (at least one). The draws come from ``numpy.random.default_rng(seed)``, made
    when the sampler is: one sampler per ``generate`` call gives the same tokens for the
    same seed; calling one sampler again continues its stream.

    Args:
        temperature: a positive finite number.
        top_k: None (no limit) or an int >= 1.
        top_p: None (no limit) or a number in ``(0, 1]``.
        seed: None (fresh entropy) or an int >= 0.

    Raises:
        ValueError: ``temperature`` not a positive finite number, ``top_p`` outside
            ``(0, 1]``, ``top_k`` < 1, ``seed`` < 0.
        TypeError: ``top_k`` or ``seed`` not an int (or a bool).
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> None:
        checked = _check_filters("Sampling", temperature, top_k, top_p, seed)
        self.temperature, self.top_k, self.top_p, self.seed = checked
        self._rng = np.random.default_rng(self.seed)

    def filtered(self, logits: Any) -> np.ndarray:
        """float64 ``(batch, vocab)``: ``logits / temperature`` with the tokens outside
        top-k, then outside top-p, set to ``-inf``."""
        raw = _as_logits("Sampling", logits)
        with np.errstate(over="ignore"):
            logits = raw / self.temperature
        if not np.isfinite(logits[np.isfinite(raw)]).all():
            raise ValueError(
                f"Sampling: logits / temperature overflow float64 at temperature="
                f"{self.temperature!r}; give a larger temperature, or do_sample=False for "
                f"the most likely token."
            )
        top_k, top_p = self.top_k, self.top_p
        if top_k is not None and top_k < logits.shape[-1]:
            kth = np.sort(logits, axis=-1)[:, -top_k][:, None]
            logits = np.where(logits < kth, -np.inf, logits)
        if top_p is not None and top_p < 1:
            order = np.argsort(-logits, axis=-1, kind="stable")
            probs = _softmax(np.take_along_axis(logits, order, axis=-1))
            before = np.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above
            drop = np.zeros(logits.shape, bool)
            np.put_along_axis(drop, order, before >= top_p, axis=-1)
            logits = np.where(drop, -np.inf, logits)
        return logits

    def __call__(self, logits: Any) -> np.ndarray:
        """int64 ``(batch,)``: one draw per row of float ``(batch, vocab)`` ``logits`` from
        softmax(`filtered` logits)."""
        probs = _softmax(self.filtered(logits))
        return np.array([self._rng.choice(probs.shape[-1], p=row) for row in probs], np.int64)

    def __repr__(self) -> str:
        return (
            f"Sampling(temperature={self.temperature!r}, top_k={self.top_k!r}, "
            f"top_p={self.top_p!r}, seed={self.seed!r})"
        )


def make_sampler(
    do_sample: Any = False,
    temperature: Any = 1.0,
    top_k: Any = None,
    top_p: Any = None,
    seed: Any = None,
) -> Greedy | Sampling:
    """The sampler of ``generate``'s transformers-style arguments: `Greedy` unless
    ``do_sample``, else ``Sampling(temperature, top_k, top_p, seed)``. Every argument is
    checked whatever ``do_sample`` says (as before: a bad ``temperature`` is refused for
    greedy decoding too).

    Raises:
        TypeError: ``do_sample`` not a bool; ``top_k`` or ``seed`` not an int.
        ValueError: as `Sampling`; errors name the argument and the value received.
    """
    if not isinstance(do_sample, bool):
        raise TypeError(f"generate: `do_sample` must be a bool; received {do_sample!r}.")
    checked = _check_filters("generate", temperature, top_k, top_p, seed)
    return Sampling(*checked) if do_sample else Greedy()
