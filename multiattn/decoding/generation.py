"""``generate`` for the models of `multiattn.models` (`GenerationMixin`) and the checks of
its prompt.

``generate`` checks its arguments where they enter, builds a sampler
(`multiattn.decoding.samplers.make_sampler`) and a stopping rule
(`multiattn.decoding.stopping.make_stopping`), asks
`multiattn.decoding.strategies.choose_strategy` how to run the tokens and runs them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._system import available_memory
from ..namespaces.keras import get_ops
from ._checks import check_int
from .beams import make_beam_search
from .samplers import make_sampler
from .stopping import make_stopping
from .strategies import choose_strategy, model_backend

__all__ = [
    "GenerationMixin",
    "check_cache_size",
    "check_lengths",
    "left_padded_prompt",
    "prompt_arrays",
]

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _numpy(where: str, name: str, x: Any) -> np.ndarray:
    return np.asarray(get_ops(x, names=(name,), where=where).convert_to_numpy(x))


def prompt_arrays(input_ids: Any, attention_mask: Any, vocab: int) -> tuple:
    """``input_ids`` as int64 ``(batch, seq)`` token ids in ``[0, vocab)`` and its mask
    as int64 0/1 (all ones when None), any padding pattern. ``input_ids`` and
    ``attention_mask``: NumPy arrays, nested lists or tensors of any framework.

    Raises:
        ValueError: ``input_ids`` not a non-empty integer ``(batch, seq)`` array, ids
            outside the vocabulary, a mask of another shape or with a row of pads only
            (named)."""
    ids = _numpy("generate", "input_ids", input_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or 0 in ids.shape:
        raise ValueError(
            f"generate: `input_ids` must be a non-empty integer (batch, seq) array (batch and "
            f"seq at least 1); received "
            f"shape {ids.shape} of {ids.dtype}."
        )
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(
            f"generate: `input_ids` must hold token ids in [0, {vocab}); received values in "
            f"[{ids.min()}, {ids.max()}]."
        )
    if attention_mask is None:
        return ids.astype(np.int64), np.ones(ids.shape, np.int64)
    mask = _numpy("generate", "attention_mask", attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(
            f"generate: `attention_mask` must have the shape of `input_ids` {ids.shape}; "
            f"received {mask.shape}."
        )
    empty = np.flatnonzero(~(mask != 0).any(axis=1))
    if empty.size:  # a row of pads only: nothing to continue
        raise ValueError(
            f"generate: every row of `attention_mask` must hold a real token (a non-zero "
            f"entry); rows {empty.tolist()} hold none."
        )
    return ids.astype(np.int64), (mask != 0).astype(np.int64)


def left_padded_prompt(input_ids: Any, attention_mask: Any, vocab: int) -> tuple:
    """`prompt_arrays` for a decoder-only model: the mask must be left padding (each row
    zeros then ones, ending with a real token), else `ValueError`."""
    ids, mask = prompt_arrays(input_ids, attention_mask, vocab)
    if not mask[:, -1].all() or (np.diff(mask, axis=1) < 0).any():
        raise ValueError(
            "generate: `attention_mask` must be left padding (each row zeros then ones, "
            f"ending with a real token); received {mask.tolist()}."
        )
    return ids, mask


def check_new_tokens(max_new_tokens: Any) -> int:
    """``max_new_tokens`` as an int >= 1 (`TypeError` for None or another type,
    `ValueError` below 1)."""
    new = check_int("generate", "max_new_tokens", max_new_tokens)
    if new is None:
        raise TypeError("generate: `max_new_tokens` must be an int; received None.")
    return new


def check_lengths(seq: int, max_new_tokens: Any, context: int) -> int:
    """``max_new_tokens`` checked (`check_new_tokens`) and against the context: a prompt
    of ``seq`` tokens plus the new ones must fit in ``context`` positions, else
    `ValueError` naming both."""
    new = check_new_tokens(max_new_tokens)
    if seq > context:
        raise ValueError(
            f"generate: the prompt (`input_ids`) holds {seq} tokens, more than the context "
            f"(max_position_embeddings={context})."
        )
    if seq + new > context:
        raise ValueError(
            f"generate: max_new_tokens={new} past the context: the prompt holds {seq} "
            f"tokens and max_position_embeddings={context} allows at most {context - seq} "
            "new ones."
        )
    return new


def check_cache_size(values: int, dtype: str) -> None:
    """Refuse, before anything is allocated, key/value caches of ``values`` entries of
    ``dtype`` that would take more than the available memory (`available_memory`):
    `ValueError` with the bytes they would take."""
    nbytes = values * _ITEMSIZE.get(str(dtype), 4)
    available = available_memory()
    if available is not None and nbytes > available:
        raise ValueError(
            f"generate: the key/value caches would take {nbytes:,} bytes "
            f"({nbytes / 2**30:.1f} GiB), more than the {available:,} bytes available; "
            "lower max_new_tokens, the batch or num_beams."
        )


class GenerationMixin:
    """``generate`` for a model with ``vocab_size``, ``step``, ``init_caches`` and
    ``variables`` and three methods of its own: ``_decoding_inputs(input_ids,
    attention_mask, max_new_tokens)`` returns the checked int64 ``(batch, seq)`` prompt,
    its int64 0/1 mask and the number of new tokens; ``_prefill`` and ``_feed`` (see
    `multiattn.decoding.strategies`) run the prompt and one token through the caches
    (`multiattn.models.causal_lm.CausalLM`, `multiattn.models.t5.T5ForConditionalGeneration`
    and their Paddle twins)."""

    def generate(
        self,
        input_ids: Any,
        attention_mask: Any = None,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: Any = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        strategy: Any = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_return_sequences: int = 1,
    ) -> np.ndarray:
        """Continue the prompts; returns prompt + new tokens, int64 NumPy.

        Args:
            input_ids: int ``(batch, seq)`` prompts (NumPy or backend tensor); left
                padded for a decoder-only model.
            attention_mask: ``(batch, seq)``, 1 = real token, 0 = pad (pads only on the
                left for a decoder-only model); default all ones.
            max_new_tokens: tokens to add; ``seq + max_new_tokens`` must not exceed the
                context (``max_position_embeddings`` / ``n_positions``).
            do_sample: draw from the distribution instead of taking the argmax.
            temperature, top_k, top_p: sampling filters, applied in that order (as
                transformers): logits divided by ``temperature``; only the ``top_k``
                largest kept; then only the smallest set of most likely tokens whose
                probability reaches ``top_p`` (`multiattn.decoding.samplers.Sampling`).
            eos_token_id: an id or a list of ids; a row that emitted one emits
                ``pad_token_id`` afterwards; generation stops early once every row has.
            pad_token_id: default ``eos_token_id`` (its first id); an id in ``[0,
                vocab_size)``.
            seed: seed of the NumPy generator used for sampling (reproducible draws).
            strategy: how the tokens run (`multiattn.decoding.strategies`): None (the
                default of `choose_strategy`: ``"compiled"`` on jax and TensorFlow for
                greedy decoding, ``"compiled_step"`` there for sampling, ``"traced"`` on
                torch, ``"eager"`` elsewhere), one of those names or a ``Strategy``
                object. Every strategy gives the same tokens. Beam search runs in the
                Python loops only (``"compiled_step"`` on jax and TensorFlow by default).
            num_beams: 1 (default: greedy or sampled), or the beams per prompt of
                transformers' beam search (`multiattn.decoding.beams.BeamSearch`, with
                ``do_sample=False`` only): the model decodes ``batch * num_beams`` rows.
            length_penalty: beam search only: a finished hypothesis scores its summed
                log-probabilities over ``new_tokens ** length_penalty``.
            early_stopping: beam search only: False, True or ``"never"``, as
                transformers defines them (`multiattn.decoding.beams`).
            num_return_sequences: beam search only: the best hypotheses returned per
                prompt (at most ``num_beams``), best first.

        Returns:
            int64 ``(batch * num_return_sequences, seq + n)`` (T5: ``(...,  1 + n)``,
            from the decoder's start token) with ``n <= max_new_tokens`` (fewer only
            when every row ended; with beams, the longest returned hypothesis's length,
            shorter ones filled with ``pad_token_id``); the rows of one prompt are next
            to each other.

        Raises:
            ValueError: a prompt longer than the context, ``max_new_tokens`` past it, ids
                out of the vocabulary, a mask that is not left padding or with a row of
                pads only, key/value caches larger than the memory the system reports
                available (`check_cache_size`, before anything is allocated), bad
                options, a strategy that cannot run on this backend or with this sampler.
            TypeError: an option of the wrong type (named).
        """
        ids, mask, new = self._decoding_inputs(input_ids, attention_mask, max_new_tokens)
        sampler = make_sampler(do_sample, temperature, top_k, top_p, seed)
        beams = make_beam_search(num_beams, length_penalty, early_stopping,
                                 num_return_sequences, do_sample)  # fmt: skip
        stopping = make_stopping(new, eos_token_id, pad_token_id, self.vocab_size)
        if beams is not None:  # every prompt once per beam; their caches checked again
            sampler, ids, mask = beams, beams.expand(ids), beams.expand(mask)
            self._decoding_inputs(ids, mask, new)
        chosen = choose_strategy(model_backend(self), sampler, strategy)
        return chosen.decode(self, ids, mask, sampler, stopping)
