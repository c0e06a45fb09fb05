"""When ``generate`` stops: `Stopping`, the end-of-sequence ids, the pad id and the
number of new tokens.

A row that emitted an end id emits the pad id afterwards; decoding stops after
``max_new_tokens`` tokens, or earlier once every row has ended (as transformers does).
`make_stopping` builds one from ``generate``'s arguments and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._checks import check_int

__all__ = ["Stopping", "make_stopping"]


@dataclass(frozen=True)
class Stopping:
    """The stopping rule of one ``generate`` call (immutable and hashable).

    Args:
        max_new_tokens: the most tokens to add, an int >= 1.
        eos_token_ids: a tuple of token ids (ints >= 0) that end a row; empty: rows never
            end before ``max_new_tokens``.
        pad_token_id: the id a row emits after its end; None only when
            ``eos_token_ids`` is empty (`make_stopping` takes the first end id then).

    Raises:
        TypeError: a count or id that is not an int.
        ValueError: ``max_new_tokens`` < 1, a negative id, ``pad_token_id`` None while
            there are end ids.
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        new = check_int("Stopping", "max_new_tokens", self.max_new_tokens)
        if new is None:
            raise TypeError("Stopping: `max_new_tokens` must be an int; received None.")
        if not isinstance(self.eos_token_ids, tuple):
            raise TypeError(
                f"Stopping: `eos_token_ids` must be a tuple of ints; received "
                f"{self.eos_token_ids!r}."
            )
        eos = tuple(check_int("Stopping", "eos_token_ids", v, 0) for v in self.eos_token_ids)
        pad = check_int("Stopping", "pad_token_id", self.pad_token_id, 0)
        if eos and pad is None:
            raise ValueError(
                f"Stopping: `pad_token_id` must be an id when `eos_token_ids` is given "
                f"({eos}); received None."
            )
        object.__setattr__(self, "max_new_tokens", new)
        object.__setattr__(self, "eos_token_ids", eos)
        object.__setattr__(self, "pad_token_id", pad)

    def start(self, batch: int) -> np.ndarray:
        """bool ``(batch,)``: no row has ended."""
        return np.zeros(batch, bool)

    def update(self, token: np.ndarray, done: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(token, done)`` after one step: int ``(batch,)`` ``token`` with the rows that
        had ended (bool ``(batch,)`` ``done``) set to the pad id, and ``done`` with the
        rows that emitted an end id now set. Without end ids both come back as given."""
        if not self.eos_token_ids:
            return token, done
        token = np.where(done, self.pad_token_id, token)
        return token, done | np.isin(token, self.eos_token_ids)

    def update_in_graph(self, kops: Any, token: Any, done: Any) -> tuple[Any, Any]:
        """`update` as tensor operations of the ``keras.ops``-shaped namespace ``kops``
        (int32 ``(batch,)`` ``token``, bool ``(batch,)`` ``done``), for a compiled loop."""
        if not self.eos_token_ids:
            return token, done
        stop = kops.convert_to_tensor(np.asarray(self.eos_token_ids, np.int32))
        token = kops.where(done, self.pad_token_id, token)
        ended = kops.any(kops.equal(kops.expand_dims(token, 1), stop), axis=1)
        return token, kops.logical_or(done, ended)


def make_stopping(
    max_new_tokens: Any, eos_token_id: Any, pad_token_id: Any, vocab: int
) -> Stopping:
    """The `Stopping` of ``generate``'s arguments: ``eos_token_id`` None, an id or a list
    (or tuple) of ids in ``[0, vocab)``; ``pad_token_id`` None (then the first end id) or
    an id in ``[0, vocab)`` (a finished row's next step reads it back); ``max_new_tokens`` an int >= 1 (the model checks it against its context
    first).

    Raises:
        TypeError: an id or ``max_new_tokens`` not an int (named).
        ValueError: an end id or the pad id outside ``[0, vocab)``.
    """
    eos: tuple = ()
    if eos_token_id is not None:
        items = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
        eos = tuple(check_int("generate", "eos_token_id", v, 0) for v in items)
        if any(v is None or v >= vocab for v in eos):
            raise ValueError(
                f"generate: `eos_token_id` must be None, a token id in [0, {vocab}) or a "
                f"list of them; received {eos_token_id!r}."
            )
    pad = check_int("generate", "pad_token_id", pad_token_id, 0)
    if pad is not None and pad >= vocab:  # a finished row feeds it back as an id
        raise ValueError(
            f"generate: `pad_token_id` must be None or a token id in [0, {vocab}); "
            f"received {pad_token_id!r}."
        )
    new = check_int("generate", "max_new_tokens", max_new_tokens)
    if new is None:
        raise TypeError("generate: `max_new_tokens` must be an int; received None.")
    return Stopping(new, eos, eos[0] if pad is None and eos else pad)
