"""Token generation for `multiattn.models.causal_lm.CausalLM` (and, through the seams
`GenerationMixin._inputs`, `_begin` and `_advance`, the encoder-decoder
`multiattn.models.t5.T5ForConditionalGeneration`) through the KV cache.

The prompt is run once through every block's cache (prefill), then one token per step.
Sampling (temperature, top-k and top-p) is done in NumPy float64 on the last position's
logits, with a NumPy generator seeded by ``seed``, in a Python loop over the compiled
step. Greedy decoding on jax and TensorFlow runs all its steps in one compiled loop
(`GenerationMixin._greedy`), the argmax included; elsewhere the Python loop takes the
argmax in NumPy. Both loops give the same tokens.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import keras
import numpy as np
import optree
from keras import layers as _keras_layers  # Keras' own, also in the Paddle twins

from .._namespace import cache_kept_axes, cache_scope, enter_cache_scope, owned_caches
from ..ops.attention import all_finite

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


def step_index(index: Any) -> Any:
    """A step's cache index: a NumPy int32 for a Python int (the Python loop), the int32
    tensor itself in the compiled loop."""
    return np.int32(index) if isinstance(index, int) else index


def step_token(token: Any) -> Any:
    """Int ``(batch,)`` chosen tokens as the int32 ``(batch, 1)`` ids of a step."""
    return keras.ops.expand_dims(keras.ops.cast(token, "int32"), 1)


def _finite(caches: Any) -> bool:
    """Whether every cache holds only finite values, by the attention's own screen
    (`multiattn.ops.attention.all_finite`: sums, which NaN and infinities survive; an
    overflowing sum of finite values only keeps the screen on)."""
    finite = all_finite(keras.ops, tuple(keras.tree.flatten(caches)))
    return bool(keras.ops.convert_to_numpy(finite))


def _without_unit_axes(caches: Any) -> Any:
    """Each cache ``(B, H_kv, L, D)`` with its batch and head axes dropped where they are
    1, as the compiled loop carries it (`_with_unit_axes` restores them in each step).

    XLA:CPU reads a cache through a bitcast that drops its unit axes; when the loop
    carries the cache with a unit axis, the in-place update of the cache and that read
    meet, and XLA copies the whole cache several times per step. Carried without them
    (the reshapes are bitcasts), the update stays in place. A toy loop of 4 layers
    (8 heads, 576 slots of 32, batch 1) on jax: 945 microseconds per step with the batch
    axis carried, 179 without."""
    return keras.tree.map_structure(
        lambda c: keras.ops.reshape(c, tuple(c.shape[i] for i in cache_kept_axes(c.shape))),
        caches,
    )


def _with_unit_axes(caches: Any, shapes: list) -> Any:
    """The inverse of `_without_unit_axes`: ``caches`` reshaped to ``shapes`` (theirs,
    flattened)."""
    flat = keras.tree.flatten(caches)
    return keras.tree.pack_sequence_as(
        caches, [keras.ops.reshape(c, shape) for c, shape in zip(flat, shapes)]
    )


def _tf_compiled(fn):
    """``fn`` under ``tf.function(jit_compile=True)`` (`GenerationMixin._compile`), called
    through the concrete function of each signature of its arguments, kept here by
    `_signature`: TensorFlow's own dispatch (binding every argument, building its trace
    type, looking it up in the function's cache) cost 1.6 ms of Python per call of a
    function of 12 tensors and a few Python values, a kept concrete function 0.4 ms. A
    decoding loop is one call per ``generate`` and group of rows, each holding Python's
    lock while the others wait; the Python loop over the compiled step is one per
    token."""
    import tensorflow as tf

    from .. import config

    def scoped(scope, settings, *args):
        with enter_cache_scope(scope):
            return fn(*args)

    # autograph=False: the model's code is not to be converted (multiattn._autograph)
    compiled = tf.function(scoped, reduce_retracing=False, jit_compile=True, autograph=False)
    kept: dict = {}

    def call(*args):
        head = (cache_scope(), config.fingerprint())
        key = _signature((head, args))
        concrete = kept.get(key)
        if concrete is None:
            concrete = kept.setdefault(key, compiled.get_concrete_function(*head, *args))
        return concrete(*head, *args)

    call.optimized_hlo = lambda *args: compiled.experimental_get_compiler_ir(
        cache_scope(), config.fingerprint(), *args
    )(stage="optimized_hlo")
    return call


def _signature(tree: Any) -> tuple:
    """What selects a TensorFlow trace of a call with arguments ``tree``: their structure,
    each array's (a tensor's, a NumPy array's or scalar's) shape and dtype, and each
    Python value's type and value (static in ``tf.function``)."""
    leaves, structure = optree.tree_flatten(tree, none_is_leaf=True)

    def leaf(x):
        shape = None if isinstance(x, (int, float, str, type(None))) else getattr(x, "shape", None)
        return (type(x), x) if shape is None else (tuple(shape), str(x.dtype))

    return structure, tuple(leaf(x) for x in leaves)


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
        lengths = mask.sum(axis=1).astype(np.int32)
        return logits, {"caches": caches, "slots": slots, "lengths": lengths, "seq": seq}, ids

    def _advance(self, step, token, t, state) -> Any:
        """Feed ``token`` (int ``(batch,)``, the ``t``-th new one) through ``step`` (the
        compiled `step`); updates ``state`` and returns the next logits. ``token`` and
        ``t`` may be traced (the compiled loop, `_greedy`)."""
        ops = keras.ops
        positions = ops.expand_dims(ops.convert_to_tensor(state["lengths"]) + t, 1)
        logits, state["caches"] = step(step_token(token), positions, state["caches"],
                                       step_index(state["seq"] + t), state["slots"])  # fmt: skip
        return logits

    def _backend(self) -> str | None:
        """The Keras backend this model computes on, or None for a model that is not a
        Keras layer (a Paddle twin, which computes on Paddle whatever Keras runs on: its
        ``keras`` global is `multiattn.paddle._holder.keras_on_paddle`, whose ``ops`` are
        Paddle's, so the conversions in this module give Paddle tensors there)."""
        return keras.backend.backend() if isinstance(self, _keras_layers.Layer) else None

    def _decode(self, ids, mask, new, options, eos, pad) -> np.ndarray:
        """The prompt pass of the whole batch (`_begin`), then its tokens (`_tokens`),
        under ``torch.no_grad()`` on torch: generation needs no gradients. The caches
        are checked once for NaN and infinities after the prompt, so the steps skip that
        screen (`owned_caches`)."""
        with contextlib.ExitStack() as scope:
            if self._backend() == "torch":
                import torch

                scope.enter_context(torch.no_grad())
            with owned_caches(index_checked=True):  # `_check_lengths`
                logits, state, first = self._begin(ids, mask, new)
            finite = _finite(state["caches"])
            with owned_caches(index_checked=True, values_checked=finite):
                return self._tokens(logits, state, first, new, options, eos, pad)

    def _tokens(self, logits, state, first, new, options, eos, pad) -> np.ndarray:
        """The tokens after the prefill: ``first`` and the new columns, greedy in the
        compiled loop (`_compiled_loop`) where there is one, else in a Python loop over
        the compiled step."""
        loop = None if options["do_sample"] else self._compiled_loop()
        if loop is not None:
            tokens, count = loop(logits, state, new, eos, pad)
            tokens = keras.ops.convert_to_numpy(tokens)[:, : int(count)]
            return np.concatenate([first, tokens.astype(np.int64)], axis=1)
        batch = first.shape[0]
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

    def _greedy(self, logits, state, new, eos, pad) -> tuple:
        """Greedy decoding after the prefill as one loop of tensor operations (compiled
        whole by `_compiled_loop`): int32 ``(batch, new)`` tokens and the number of
        columns filled (fewer than ``new`` when every row ended)."""
        ops = keras.ops
        stop = ops.convert_to_tensor(np.asarray(eos or (-1,), np.int32))

        def choose(logits, done):
            token = ops.cast(ops.argmax(logits, axis=-1), "int32")
            if not eos:
                return token, done
            token = ops.where(done, pad, token)
            ended = ops.any(ops.equal(ops.expand_dims(token, 1), stop), axis=1)
            return token, ops.logical_or(done, ended)

        token, done = choose(logits, ops.zeros((logits.shape[0],), "bool"))
        tokens = ops.zeros((logits.shape[0], new), "int32")
        tokens = ops.slice_update(tokens, (0, 0), ops.expand_dims(token, 1))

        def more(t, token, done, tokens, state):
            return ops.logical_and(ops.less(t, new - 1), ops.logical_not(ops.all(done)))

        shapes = [tuple(c.shape) for c in keras.tree.flatten(state["caches"])]

        def body(t, token, done, tokens, state):
            state = {**state, "caches": _with_unit_axes(state["caches"], shapes)}
            logits = self._advance(self.step, token, t, state)
            state["caches"] = _without_unit_axes(state["caches"])
            token, done = choose(logits, done)
            # the starts share one integer dtype (JAX, with 64-bit ints enabled too)
            tokens = ops.slice_update(tokens, (t * 0, t + 1), ops.expand_dims(token, 1))
            return t + 1, token, done, tokens, state

        start = ops.convert_to_tensor(0, "int32")
        state = {**state, "caches": _without_unit_axes(state["caches"])}
        t, _, _, tokens, _ = ops.while_loop(more, body, (start, token, done, tokens, state))
        return tokens, t + 1

    def _compiled_loop(self):
        """`_greedy` compiled once per model (traced per prompt shape and options):
        under ``jax.jit`` (weights as arguments) or ``tf.function`` with XLA; None on the
        other backends and under ``settings(compiled_loop=False)``, where `_tokens` loops
        in Python.

        One compiled loop has no return to Python between tokens, and XLA updates the
        caches it carries in place (it copies the caches passed in once, on entry: they
        are not outputs, so donating them would only draw jax's warning that the donated
        buffers were not usable). Per token, Llama shape, prompt 128, batch 1: 0.45 ms on
        jax and 0.81 ms on TensorFlow, against 1.34 ms and 2.33 ms in the Python loop
        over the compiled step."""
        from .. import config

        if self._backend() not in ("jax", "tensorflow") or not config.get_compiled_loop():
            return None
        kept = self.__dict__.get("_multiattn_loop")
        if kept is None:
            kept = self.__dict__["_multiattn_loop"] = self._compile(
                self._greedy, static=("new", "eos", "pad")
            )
        return kept

    def _compiled_step(self):
        """The one-token step, compiled once and kept for later calls (the cache index is
        a tensor, so every step reuses the trace): XLA on jax and TensorFlow
        (`_compile`, the caches donated on jax: the compiled step writes the new keys and
        values into their buffers, `owned_caches`, instead of copying every cache per
        token), or on torch a ``torch.jit.trace`` recording
        (`multiattn.models.torch_step`)."""
        from .. import config

        backend = self._backend()
        if backend == "torch" and not config.get_torch_traced_step():
            return self.step
        if backend not in ("jax", "tensorflow", "torch"):
            return self.step
        kept = self.__dict__.get("_multiattn_step")
        if kept is None:
            kept = self._torch_step() if backend == "torch" else self._compile(
                self.step, donate="caches"
            )  # fmt: skip
            self.__dict__["_multiattn_step"] = kept
        if backend == "torch":
            kept.sync()  # the weights as they are now, read once per `generate`
        return kept

    def _torch_step(self):
        """`step` recorded by ``torch.jit.trace`` once per set of input shapes and
        dtypes, and replayed (`multiattn.models.torch_step.TracedStep`); eager `step`
        under ``config.settings(torch_traced_step=False)``."""
        from .torch_step import TracedStep

        return TracedStep(self.step, list(self.variables))

    def _prefill_step(self):
        """`step` for the prompt: on jax and TensorFlow compiled once per prompt shape,
        with the cache index (0) static, so that the prompt attends over the slots it
        fills, as the eager step does; elsewhere `step` itself."""
        if self._backend() not in ("jax", "tensorflow"):
            return self.step
        kept = self.__dict__.get("_multiattn_prefill")
        if kept is None:
            kept = self._compile(self.step, static=("index",), donate="caches")
            self.__dict__["_multiattn_prefill"] = kept
        return kept

    def _compile(self, fn, static: tuple = (), donate: str | None = None):
        """``fn`` (a method of this model) compiled by XLA.

        On TensorFlow, ``tf.function(jit_compile=True)``, traced once per set of shapes
        and Python values (which are static there): the cache length must stay static
        (``reduce_retracing`` would relax it to unknown on the first call with another
        ``max_new_tokens`` or prompt length, which the cache refuses); it reads the
        weights as variables, and each trace is called through its concrete function
        (`_tf_compiled`). On jax, ``jax.jit`` with the arguments named in ``static``
        static, the one named ``donate`` donated, and the weights passed as arguments
        (read through ``keras.StatelessScope``), not constants of the trace, so the kept
        function follows weights changed later (training, ``set_weights``). Either way
        the `owned_caches` block in force at the call (`cache_scope`) and the settings
        that shape attention (`multiattn.config.fingerprint`) are arguments that select
        the trace: a trace made under one block or one setting is not reused under
        another.

        The returned function has an ``optimized_hlo(*args)`` attribute: XLA's optimised
        program for those arguments, as text (the tests read it for copies of a cache)."""
        from .. import config

        names = list(inspect.signature(fn).parameters)
        if self._backend() == "tensorflow":
            return _tf_compiled(fn)
        import jax

        variables = list(self.variables)

        def pure(values, scope, settings, *args):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                with enter_cache_scope(scope):
                    return fn(*args)

        compiled = jax.jit(
            pure,
            static_argnums=(1, 2, *(3 + names.index(n) for n in static)),
            donate_argnums=() if donate is None else (3 + names.index(donate),),
        )

        def leading() -> tuple:
            return [v.value for v in variables], cache_scope(), config.fingerprint()

        def call(*args):
            return compiled(*leading(), *args)

        def optimized_hlo(*args):
            return compiled.lower(*leading(), *args).compile().as_text()

        call.optimized_hlo = optimized_hlo
        return call
