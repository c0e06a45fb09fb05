"""Token generation for `multiattn.models.causal_lm.CausalLM` (and, through the seams
`GenerationMixin._inputs`, `_begin` and `_advance`, the encoder-decoder
`multiattn.models.t5.T5ForConditionalGeneration`) through the KV cache.

The prompt is run once through every block's cache (prefill), then one token per step.
Choosing a token (greedy, or sampling after temperature, top-k and top-p) is done in
NumPy float64 on the last position's logits, with a NumPy generator seeded by ``seed``.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import keras
import numpy as np
from keras import layers as _keras_layers  # Keras' own, also in the Paddle twins

from .._namespace import owned_caches

__all__ = ["GenerationMixin", "choose_tokens"]


def _int_or_none(name: str, value: Any, low: int = 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"generate: `{name}` must be an int or None; received {value!r}.")
    if value < low:
        raise ValueError(f"generate: `{name}` must be >= {low}; received {value!r}.")
    return int(value)


def _eos_ids(value: Any, vocab: int) -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    out = tuple(_int_or_none("eos_token_id", v, 0) for v in items)
    if any(v is None or v >= vocab for v in out):
        raise ValueError(
            f"generate: `eos_token_id` must be None, a token id in [0, {vocab}) or a list of "
            f"them; received {value!r}."
        )
    return out


def _sampling(do_sample, temperature, top_k, top_p, seed) -> dict:
    if not isinstance(do_sample, bool):
        raise TypeError(f"generate: `do_sample` must be a bool; received {do_sample!r}.")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (np.isfinite(temperature) and temperature > 0)
    ):
        raise ValueError(
            f"generate: `temperature` must be a positive number; received {temperature!r}."
        )
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
    ):
        raise ValueError(f"generate: `top_p` must be None or in (0, 1]; received {top_p!r}.")
    return {
        "do_sample": do_sample,
        "temperature": float(temperature),
        "top_k": _int_or_none("top_k", top_k),
        "top_p": None if top_p is None else float(top_p),
        "seed": _int_or_none("seed", seed, 0),
    }


def prompt_arrays(input_ids: Any, attention_mask: Any, vocab: int) -> tuple:
    """``input_ids`` as int64 ``(batch, seq)`` token ids in ``[0, vocab)`` and its mask
    as int64 0/1 (all ones when None), any padding pattern; errors name the argument."""
    ids = np.asarray(keras.ops.convert_to_numpy(input_ids))
    if ids.ndim != 2 or ids.dtype.kind not in "iu" or ids.shape[1] == 0:
        raise ValueError(
            f"generate: `input_ids` must be a non-empty integer (batch, seq) array; received "
            f"shape {ids.shape} of {ids.dtype}."
        )
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(
            f"generate: `input_ids` must hold token ids in [0, {vocab}); received values in "
            f"[{ids.min()}, {ids.max()}]."
        )
    if attention_mask is None:
        return ids.astype(np.int64), np.ones(ids.shape, np.int64)
    mask = np.asarray(keras.ops.convert_to_numpy(attention_mask))
    if mask.shape != ids.shape:
        raise ValueError(
            f"generate: `attention_mask` must have the shape of `input_ids` {ids.shape}; "
            f"received {mask.shape}."
        )
    return ids.astype(np.int64), (mask != 0).astype(np.int64)


def _prompt(input_ids: Any, attention_mask: Any, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompt as int64 ``(batch, seq)`` and its mask as int64 0/1 (left padding)."""
    ids, mask = prompt_arrays(input_ids, attention_mask, vocab)
    if not mask[:, -1].all() or (np.diff(mask, axis=1) < 0).any():
        raise ValueError(
            "generate: `attention_mask` must be left padding (each row zeros then ones, "
            f"ending with a real token); received {mask.tolist()}."
        )
    return ids.astype(np.int64), mask


def _check_lengths(seq: int, max_new_tokens: Any, context: int) -> int:
    new = _int_or_none("max_new_tokens", max_new_tokens)
    if new is None:
        raise TypeError("generate: `max_new_tokens` must be an int; received None.")
    if seq > context:
        raise ValueError(
            f"generate: the prompt holds {seq} tokens, more than the context "
            f"(max_position_embeddings={context})."
        )
    if seq + new > context:
        raise ValueError(
            f"generate: max_new_tokens={new} past the context: the prompt holds {seq} "
            f"tokens and max_position_embeddings={context} allows at most {context - seq} "
            "new ones."
        )
    return new


def _filter(logits: np.ndarray, top_k: int | None, top_p: float | None) -> np.ndarray:
    """``logits`` with the tokens outside top-k, then outside top-p, set to -inf."""
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


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def choose_tokens(logits: Any, options: dict, rng: np.random.Generator) -> np.ndarray:
    """The next token of each row from float ``(batch, vocab)`` logits: the argmax, or
    (``do_sample``) a draw from softmax(filtered logits / temperature)."""
    logits = np.asarray(logits, np.float64)
    if not options["do_sample"]:
        return np.argmax(logits, axis=-1)
    logits = _filter(logits / options["temperature"], options["top_k"], options["top_p"])
    probs = _softmax(logits)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs], np.int64)


class GenerationMixin:
    """``generate`` for a model with ``step``, ``init_caches``, ``vocab_size`` and
    ``max_positions`` (see `multiattn.models.causal_lm.CausalLM`).

    The token loop (choosing, end-of-sequence handling, the compiled one-token step) is
    written once here; a model changes what the prompt is and how a step is fed by
    overriding three seams: `_inputs` (validate the prompt and the number of new tokens),
    `_begin` (the prefill: first logits, the loop's state, the output's first columns)
    and `_advance` (one step of the compiled ``step`` from that state)."""

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
    ) -> np.ndarray:
        """Continue left-padded prompts; returns prompt + new tokens, int64 NumPy.

        Args:
            input_ids: int ``(batch, seq)`` prompts (NumPy or backend tensor), left padded.
            attention_mask: ``(batch, seq)``, 1 = real token, 0 = pad (pads only on the
                left); default all ones.
            max_new_tokens: tokens to add; ``seq + max_new_tokens`` must not exceed the
                context (``max_position_embeddings`` / ``n_positions``).
            do_sample: draw from the distribution instead of taking the argmax.
            temperature, top_k, top_p: sampling filters, applied in that order (as
                transformers): logits divided by ``temperature``; only the ``top_k``
                largest kept; then only the smallest set of most likely tokens whose
                probability reaches ``top_p``.
            eos_token_id: an id or a list of ids; a row that emitted one emits
                ``pad_token_id`` afterwards; generation stops early once every row has.
            pad_token_id: default ``eos_token_id`` (its first id).
            seed: seed of the NumPy generator used for sampling (reproducible draws).

        Returns:
            int64 ``(batch, seq + n)`` with ``n <= max_new_tokens`` (fewer only when every
            row ended).

        Raises:
            ValueError: a prompt longer than the context, ``max_new_tokens`` past it, ids
                out of the vocabulary, a mask that is not left padding, bad options.
            TypeError: an option of the wrong type (named).
        """
        ids, mask, new = self._inputs(input_ids, attention_mask, max_new_tokens)
        options = _sampling(do_sample, temperature, top_k, top_p, seed)
        eos = () if eos_token_id is None else _eos_ids(eos_token_id, self.vocab_size)
        pad = _int_or_none("pad_token_id", pad_token_id, 0)
        pad = eos[0] if pad is None and eos else pad
        return self._decode(ids, mask, new, options, eos, pad)

    def _inputs(self, input_ids, attention_mask, max_new_tokens) -> tuple:
        """``(ids, mask, new)``: the left-padded prompt as int64 ``(batch, seq)``, its
        mask as int64 0/1 and the number of new tokens, checked against the context."""
        ids, mask = _prompt(input_ids, attention_mask, self.vocab_size)
        return ids, mask, _check_lengths(ids.shape[1], max_new_tokens, self.max_positions)

    def _begin(self, ids, mask, new) -> tuple:
        """The prefill: ``(logits of the last position (batch, vocab), state, first)``,
        ``state`` what `_advance` needs, ``first`` the output's first columns (the
        prompt)."""
        batch, seq = ids.shape
        caches = self.init_caches(batch, seq + new)
        slots = keras.ops.convert_to_tensor(
            np.concatenate([mask, np.ones((batch, new), np.int64)], axis=1).astype(bool)
        )
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        logits, caches = self._prefill_step()(ids, positions, caches, 0, slots)
        return logits, {"caches": caches, "slots": slots, "mask": mask, "seq": seq}, ids

    def _advance(self, step, token, t, state) -> Any:
        """Feed ``token`` (int ``(batch,)``, the ``t``-th new one) through ``step`` (the
        compiled `step`); updates ``state`` and returns the next logits."""
        step_positions = (state["mask"].sum(axis=1) + t)[:, None].astype(np.int32)
        index = np.asarray(state["seq"] + t, np.int32)
        logits, state["caches"] = step(token[:, None].astype(np.int32), step_positions,
                                       state["caches"], index, state["slots"])  # fmt: skip
        return logits

    def _backend(self) -> str | None:
        """The Keras backend this model computes on, or None for a model that is not a
        Keras layer (a Paddle twin, which computes on Paddle whatever Keras runs on: its
        ``keras`` global is `multiattn.paddle._holder.keras_on_paddle`, whose ``ops`` are
        Paddle's, so the conversions in this module give Paddle tensors there)."""
        return keras.backend.backend() if isinstance(self, _keras_layers.Layer) else None

    def _decode(self, ids, mask, new, options, eos, pad) -> np.ndarray:
        """`_loop` with the caches it makes written in place (`owned_caches`), under
        ``torch.no_grad()`` on torch: generation needs no gradients."""
        with contextlib.ExitStack() as scope:
            scope.enter_context(owned_caches())
            if self._backend() == "torch":
                import torch

                scope.enter_context(torch.no_grad())
            return self._loop(ids, mask, new, options, eos, pad)

    def _loop(self, ids, mask, new, options, eos, pad) -> np.ndarray:

        logits, state, first = self._begin(ids, mask, new)
        batch = ids.shape[0]
        rng, done, out = np.random.default_rng(options["seed"]), np.zeros(batch, bool), [first]
        step = self._compiled_step()
        for t in range(new):
            token = choose_tokens(keras.ops.convert_to_numpy(logits), options, rng)
            if eos:
                token = np.where(done, pad, token)
                done |= np.isin(token, eos)
            out.append(token[:, None].astype(np.int64))
            if t == new - 1 or done.all():
                break
            logits = self._advance(step, token, t, state)
        return np.concatenate(out, axis=1)

    def _compiled_step(self):
        """The one-token step, compiled once and kept for later calls (the cache index is
        a tensor, so every step reuses the trace): ``jax.jit``, ``tf.function``, or on
        torch a ``torch.jit.trace`` recording (`multiattn.models.torch_step`).

        ``tf.function`` reads the weights as variables. Under ``jax.jit`` they are
        arguments of the compiled step (read through ``keras.StatelessScope``), not
        constants of its trace, so the kept step follows weights changed later (training,
        ``set_weights``)."""
        from .. import config

        backend = self._backend()
        makers = {"jax": self._jax_step, "tensorflow": self._tf_step, "torch": self._torch_step}
        if backend not in makers or (backend == "torch" and not config.get_torch_traced_step()):
            return self.step
        kept = self.__dict__.get("_multiattn_step")
        if kept is None:
            kept = makers[backend]()
            self.__dict__["_multiattn_step"] = kept
        return kept

    def _torch_step(self):
        """`step` recorded by ``torch.jit.trace`` once per set of input shapes and
        dtypes, and replayed (`multiattn.models.torch_step.TracedStep`); eager `step`
        under ``config.settings(torch_traced_step=False)``."""
        from .torch_step import TracedStep

        return TracedStep(self.step, list(self.variables))

    def _tf_step(self):
        """``tf.function`` of `step`, traced once per set of shapes: the cache length
        must stay static (``reduce_retracing`` would relax it to unknown on the first
        call with another ``max_new_tokens`` or prompt length, which the cache refuses)."""
        import tensorflow as tf

        return tf.function(self.step, reduce_retracing=False)

    def _prefill_step(self):
        """`step` for the prompt: on jax compiled once per prompt shape, with the cache
        index (0) static, so that the prompt attends over the slots it fills, as the
        eager step does; elsewhere `step` itself."""
        if self._backend() != "jax":
            return self.step
        kept = self.__dict__.get("_multiattn_prefill")
        if kept is None:
            kept = self.__dict__["_multiattn_prefill"] = self._jax_step(static_index=True)
        return kept

    def _jax_step(self, static_index: bool = False):
        """`step` under ``jax.jit``, the weights passed as arguments and the caches
        donated: the compiled step writes the new keys and values into their buffers
        (`owned_caches`) instead of copying every cache per token."""
        import jax

        variables = list(self.variables)

        def pure(values, *args):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return self.step(*args)

        names = list(inspect.signature(self.step).parameters)
        static = (1 + names.index("index"),) if static_index else ()
        compiled = jax.jit(pure, donate_argnums=(1 + names.index("caches"),),
                           static_argnums=static)  # fmt: skip
        return lambda *args: compiled([v.value for v in variables], *args)
