"""Beam search for ``generate`` (``num_beams > 1``): `BeamSearch`, transformers'
deterministic beam search (``generate(num_beams=k, do_sample=False)``) in NumPy.

The model decodes ``batch * num_beams`` rows (each prompt repeated ``num_beams`` times,
the beams of one prompt next to each other); between two steps `BeamSearch.search`
chooses the beams that continue, and the strategy reorders the caches along the batch
axis by the rows those beams came from (the model's ``_reorder(state, rows)``) before it
feeds their last tokens (`multiattn.decoding.strategies.EagerLoop`). The scores are
float32 sums of float32 log-probabilities, as transformers keeps them (its logits are
cast to float32 before ``log_softmax``, whatever the model's dtype).

One step, for each prompt (``K = max(2, 1 + number of end ids) * num_beams``
candidates, enough that ``num_beams`` of them do not end):

1. every beam's score plus the log-probabilities of its next token; the ``K`` best
   (beam, token) pairs over all beams are the candidates;
2. a candidate ends when its token is an end id or it is the last new token
   (``max_new_tokens``); the ``num_beams`` best candidates that do not end continue;
3. the ended candidates among the ``num_beams`` best ones join the finished
   hypotheses with the score ``sum of log-probabilities / new_tokens ** length_penalty``
   (``new_tokens``: the tokens generated, the end id included, the prompt not counted,
   as transformers 5 counts); the ``num_beams`` best finished hypotheses are kept. None
   joins once a prompt's finished hypotheses are complete (``num_beams`` of them) and
   ``early_stopping=True``, or once it is closed (4);
4. a prompt closes when its ``num_beams`` hypotheses are finished and the best running
   beam's score divided by ``L ** length_penalty`` is no better than the worst finished
   one: ``L`` the tokens generated so far (``early_stopping`` False or True), or
   ``max_new_tokens`` when ``early_stopping="never"`` and ``length_penalty > 0``;
5. decoding stops when every prompt is closed, or (``early_stopping=True``) every
   prompt has its ``num_beams`` finished hypotheses, or every candidate ended.

The result holds each prompt's ``num_return_sequences`` best finished hypotheses, best
first, all cut to the longest of them; a shorter one is filled with ``pad_token_id``
(transformers' rule: the first end id when ``pad_token_id`` is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._checks import check_int
from .stopping import Stopping

__all__ = ["BeamSearch", "make_beam_search"]

#: transformers' score of an impossible beam (float32; adding it again keeps the order).
_NEG = np.float32(-1.0e9)
_EARLY_STOPPING = (False, True, "never")


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 ``log_softmax`` along the last axis of float32 ``logits``."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _best(scores: np.ndarray, k: int) -> np.ndarray:
    """int ``(rows, k)``: the indices of the ``k`` largest ``scores`` of each row, largest
    first (the first index where scores tie)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def _take(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``x`` ``(rows, n, ...)`` at int ``(rows, m)`` ``index`` along axis 1."""
    return np.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


class BeamSearch:
    """transformers' beam search without sampling (the module docstring says how it
    chooses); ``generate(num_beams=k, ...)`` builds one (`make_beam_search`).

    Args:
        num_beams: the beams per prompt, an int >= 2.
        length_penalty: a finite number; a finished hypothesis scores its summed
            log-probabilities divided by ``new_tokens ** length_penalty`` (> 0 favours
            longer ones, < 0 shorter ones).
        early_stopping: False (default: a prompt stops once no running beam can beat its
            finished ones, estimated at the current length), True (once it has
            ``num_beams`` finished hypotheses) or ``"never"`` (the estimate at
            ``max_new_tokens`` when ``length_penalty > 0``).
        num_return_sequences: the hypotheses returned per prompt, best first, an int in
            ``[1, num_beams]``.

    Raises:
        TypeError: a count that is not an int, ``length_penalty`` not a number,
            ``early_stopping`` neither a bool nor ``"never"`` (named).
        ValueError: ``num_beams`` < 2, ``num_return_sequences`` outside ``[1,
            num_beams]``, ``length_penalty`` not finite.
    """

    #: Beam search keeps its beams in NumPy: it cannot run inside a compiled loop.
    in_graph = False
    not_in_graph = "num_beams > 1 chooses its beams in NumPy between steps"

    def __init__(self, num_beams: int, length_penalty: float = 1.0,
                 early_stopping: bool | str = False, num_return_sequences: int = 1) -> None:  # fmt: skip
        where = "BeamSearch"
        self.num_beams = check_int(where, "num_beams", num_beams, 2)
        if self.num_beams is None:
            raise TypeError(f"{where}: `num_beams` must be an int; received None.")
        self.length_penalty = _check_length_penalty(where, length_penalty)
        self.early_stopping = _check_early_stopping(where, early_stopping)
        self.num_return_sequences = _check_returns(where, num_return_sequences, self.num_beams)

    def __repr__(self) -> str:
        return (
            f"BeamSearch(num_beams={self.num_beams}, length_penalty={self.length_penalty!r}, "
            f"early_stopping={self.early_stopping!r}, "
            f"num_return_sequences={self.num_return_sequences})"
        )

    def expand(self, x: np.ndarray) -> np.ndarray:
        """``(batch, ...)`` -> ``(batch * num_beams, ...)``, each row repeated
        ``num_beams`` times in place (the beams of a prompt next to each other)."""
        return np.repeat(x, self.num_beams, axis=0)

    def search(self, logits: Any, feed: Callable[[np.ndarray, int, np.ndarray], Any],
               first: np.ndarray, stopping: Stopping) -> np.ndarray:  # fmt: skip
        """Run the search from the prompt's logits.

        Args:
            logits: float ``(batch * num_beams, vocab)`` NumPy logits of the last prompt
                position (the rows `expand` made).
            feed: ``feed(token, t, rows)`` reorders the caches so that row ``i`` holds
                what row ``rows[i]`` held (int ``(batch * num_beams,)``, within each
                prompt's beams), feeds int64 ``token`` ``(batch * num_beams,)`` as the
                ``t``-th new token and returns the next float ``(batch * num_beams,
                vocab)`` NumPy logits.
            first: int64 ``(batch * num_beams, columns)``: the model's first output
                columns (the prompt, or T5's start token), per expanded row.
            stopping: the end ids, the pad id and ``max_new_tokens``.

        Returns:
            int64 ``(batch * num_return_sequences, columns + n)``: each prompt's best
            finished hypotheses, best first, ``n <= max_new_tokens`` the longest's new
            tokens.
        """
        k, new = self.num_beams, stopping.max_new_tokens
        logits = np.asarray(logits, np.float32)
        batch, vocab = logits.shape[0] // k, logits.shape[1]
        eos = np.asarray(stopping.eos_token_ids, np.int64)
        wide = max(2, 1 + eos.size) * k  # candidates per prompt
        fill = (stopping.pad_token_id or int(eos[0])) if eos.size else -1
        top = np.arange(wide) < k  # only the best num_beams candidates may finish
        offset = np.arange(batch)[:, None] * k
        lp, early = self.length_penalty, self.early_stopping
        # running beams: new tokens (fill beyond), float32 scores (only beam 0 live at first)
        tokens = np.full((batch, k, new), fill, np.int64)
        scores = np.full((batch, k), _NEG, np.float32)
        scores[:, 0] = 0
        # finished hypotheses: tokens, scores, ended flags, lengths; open prompts
        kept, kept_scores = tokens.copy(), np.full((batch, k), _NEG, np.float32)
        ended, lengths = np.zeros((batch, k), bool), np.zeros((batch, k), np.int64)
        open_ = np.ones(batch, bool)
        for t in range(new):
            total = _log_softmax(logits).reshape(batch, k, vocab) + scores[:, :, None]
            flat = total.reshape(batch, k * vocab)
            pick = _best(flat, wide)
            cand = np.take_along_axis(flat, pick, axis=1)
            source, token = pick // vocab, pick % vocab
            cand_tokens = _take(tokens, source)
            cand_tokens[:, :, t] = token
            hits = np.isin(token, eos) | (t == new - 1)
            # the best num_beams candidates that do not end continue
            live = cand + hits.astype(np.float32) * _NEG
            chosen = _best(live, k)
            tokens, scores = _take(cand_tokens, chosen), _take(live, chosen)
            rows = (_take(source, chosen) + offset).reshape(-1)
            # the ended candidates among the best num_beams join the finished ones
            finishing = hits & top
            final = cand / np.float32((t + 1) ** lp)
            full = ended.all(axis=1, keepdims=True) & (early is True)
            final = final + full.astype(np.float32) * _NEG
            final = final + (~open_[:, None]).astype(np.float32) * _NEG
            final = final + (~finishing).astype(np.float32) * _NEG
            merged = np.concatenate([kept_scores, final], axis=1)
            best = _best(merged, k)
            kept_scores = _take(merged, best)
            kept = _take(np.concatenate([kept, cand_tokens], axis=1), best)
            ended = _take(np.concatenate([ended, finishing], axis=1), best)
            lengths = _take(np.concatenate([lengths, np.full(cand.shape, t + 1)], axis=1), best)
            # a prompt closes once no running beam can beat its worst finished hypothesis
            at = new if early == "never" and lp > 0 else t + 1
            hope = scores[:, :1] / np.float32(at**lp)
            worst = np.where(ended, kept_scores.min(axis=1, keepdims=True), _NEG)
            open_ &= (hope > worst).any(axis=1)
            if not open_.any() or (ended.all() and early is True) or hits.all():
                break
            logits = np.asarray(feed(tokens[:, :, t].reshape(-1), t, rows), np.float32)
        returned = self.num_return_sequences
        n = int(lengths[:, :returned].max())
        out = kept[:, :returned, :n].reshape(batch * returned, n)
        head = np.repeat(first[::k], returned, axis=0)
        return np.concatenate([head.astype(np.int64), out], axis=1)


def _check_length_penalty(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where}: `length_penalty` must be a number; received {value!r}.")
    if not np.isfinite(value):
        raise ValueError(f"{where}: `length_penalty` must be finite; received {value!r}.")
    return float(value)


def _check_early_stopping(where: str, value: Any) -> bool | str:
    if isinstance(value, str):
        if value != "never":
            raise ValueError(
                f"{where}: `early_stopping` must be True, False or 'never'; received {value!r}."
            )
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"{where}: `early_stopping` must be True, False or 'never'; received {value!r}."
        )
    return bool(value)


def _check_returns(where: str, value: Any, beams: int) -> int:
    returned = check_int(where, "num_return_sequences", value)
    if returned is None:
        raise TypeError(f"{where}: `num_return_sequences` must be an int; received None.")
    if returned > beams > 1:  # with one beam, make_beam_search names the option
        raise ValueError(
            f"{where}: `num_return_sequences` must be at most `num_beams` ({beams}); "
            f"received {returned}."
        )
    return returned


def make_beam_search(num_beams: Any, length_penalty: Any, early_stopping: Any,
                     num_return_sequences: Any, do_sample: Any) -> BeamSearch | None:  # fmt: skip
    """The `BeamSearch` of ``generate``'s arguments, or None for ``num_beams=1`` (then
    ``length_penalty``, ``early_stopping`` and ``num_return_sequences`` must keep their
    defaults 1.0, False and 1: they mean something only with beams, and are refused by
    name rather than ignored).

    Raises:
        TypeError: as `BeamSearch`; ``num_beams`` not an int.
        ValueError: as `BeamSearch`; ``num_beams`` < 1; ``do_sample=True`` with
            ``num_beams > 1`` (beam sampling is not implemented); a beam option with
            ``num_beams=1``.
    """
    where = "generate"
    beams = check_int(where, "num_beams", num_beams)
    if beams is None:
        raise TypeError(f"{where}: `num_beams` must be an int; received None.")
    penalty = _check_length_penalty(where, length_penalty)
    early = _check_early_stopping(where, early_stopping)
    returned = _check_returns(where, num_return_sequences, beams)
    if beams == 1:
        given = {"length_penalty": (penalty, 1.0), "early_stopping": (early, False),
                 "num_return_sequences": (returned, 1)}  # fmt: skip
        for name, (value, default) in given.items():
            if value != default:
                raise ValueError(
                    f"{where}: `{name}`={value!r} takes effect only with beam search "
                    f"(num_beams > 1); received num_beams=1."
                )
        return None
    if do_sample is True:
        raise ValueError(
            f"{where}: `do_sample`=True with `num_beams`={beams} (beam sampling) is not "
            "implemented; use do_sample=False for beam search or num_beams=1 to sample."
        )
    return BeamSearch(beams, penalty, early, returned)
