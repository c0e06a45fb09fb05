"""How ``generate`` runs its tokens: decoding strategies with one interface, and
`choose_strategy`, the one place where a strategy is chosen.

Every strategy runs the prompt once through the model's caches (``prefill``), checks the
caches once for NaN and infinities, then produces one token per step until the
`multiattn.decoding.stopping.Stopping` rule ends it (`Strategy.decode`). They differ in
how the steps run:

* `CompiledLoop` (``"compiled"``; jax, tensorflow): every token after the prompt in one
  loop compiled by XLA (``jax.lax.while_loop`` under ``jax.jit``, ``tf.while_loop``
  under ``tf.function(jit_compile=True)``); only for a sampler with an in-graph choice
  (`Greedy`);
* `CompiledStepLoop` (``"compiled_step"``; jax, tensorflow): a Python loop over the
  one-token step compiled by XLA; any sampler;
* `TracedLoop` (``"traced"``; torch): a Python loop over the step recorded by
  ``torch.jit.trace`` and replayed (`multiattn.decoding.torch_step`);
* `EagerLoop` (``"eager"``; every backend, Paddle's models included): a Python loop
  over the eager ``model.step``.

All four give the same tokens (the tests compare them). By default
(`choose_strategy` with ``strategy=None``) jax and TensorFlow take `CompiledLoop` for
greedy decoding and `CompiledStepLoop` for sampling (its draws come from a NumPy
generator between steps) and for beam search (`multiattn.decoding.beams.BeamSearch`:
its beams are chosen in NumPy between steps, so `CompiledLoop` refuses it), torch
`TracedLoop`, and the numpy backend and Paddle's models (`multiattn.paddle.models`)
`EagerLoop`. The compiled and recorded functions are kept
on the model (`kept_functions`) and reused by later calls; each is traced per set of
shapes and per settings fingerprint (`multiattn.config.fingerprint`).

A model decodes through two methods of its own (the seams that
`multiattn.models.causal_lm.CausalLM` and `multiattn.models.t5.T5ForConditionalGeneration`
implement): ``_prefill(ids, mask, new, step)`` returns
``(logits, state, first)``: the float ``(batch, vocab)`` logits of the last prompt
position, a dict ``state`` holding at least ``"caches"`` (what ``_feed`` reads), and the
int64 ``(batch, columns)`` first columns of the output; ``_feed(step, token, t,
state)`` feeds int ``(batch,)`` ``token`` (the ``t``-th new one) through ``step``,
updates ``state`` and returns the next logits. ``step`` has the signature of
``model.step``. Beam search needs a third: ``_reorder(state, rows)`` makes row ``i`` of
every cache in ``state`` what row ``rows[i]`` was (int ``(batch,)``; the other entries
of ``state`` are the same for every beam of a prompt).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import keras
import numpy as np

from ..namespaces.keras import framework_of, get_ops, owned_caches
from ..ops.attention import all_finite
from .beams import BeamSearch
from .compiled import with_unit_axes, without_unit_axes, xla_function
from .samplers import Sampler
from .stopping import Stopping

__all__ = [
    "STRATEGIES",
    "CompiledLoop",
    "CompiledStepLoop",
    "EagerLoop",
    "Strategy",
    "TracedLoop",
    "choose_strategy",
    "kept_functions",
    "model_backend",
]


def model_backend(model: Any) -> str | None:
    """The framework ``model`` computes on: the running Keras backend's name for a Keras
    layer; else the framework of its first weight (``"paddle"`` for a Paddle twin, which
    computes on Paddle whatever Keras runs on); None for a model without weights."""
    if isinstance(model, keras.layers.Layer):
        return keras.backend.backend()
    weights = list(getattr(model, "weights", ()))
    return framework_of(weights[0]) if weights else None


def kept_functions(model: Any) -> dict:
    """The decoding functions kept on ``model``, made on first use and reused by later
    ``generate`` calls: ``"prefill"`` and ``"step"`` (XLA), ``"traced"`` (torch) and
    ``("loop", repr(sampler))`` (XLA), by name."""
    return model.__dict__.setdefault("_multiattn_decoding", {})


def caches_finite(caches: Any) -> bool:
    """Whether every cache holds only finite values, by the attention's own screen
    (`multiattn.ops.attention.all_finite`: sums, which NaN and infinities survive; an
    overflowing sum of finite values only keeps the screen on)."""
    leaves = tuple(keras.tree.flatten(caches))
    ops = get_ops(*leaves)
    return bool(ops.convert_to_numpy(all_finite(ops, leaves)))


def _numpy(x: Any) -> np.ndarray:
    """A tensor of any framework (the logits) as a NumPy array."""
    return np.asarray(get_ops(x).convert_to_numpy(x))


def _gradient_free(backend: str | None) -> contextlib.AbstractContextManager:
    """``torch.no_grad()`` on torch (generation needs no gradients), else nothing."""
    if backend != "torch":
        return contextlib.nullcontext()
    import torch

    return torch.no_grad()


class Strategy(ABC):
    """A way of running ``generate``'s tokens. ``name`` is what ``generate(...,
    strategy=name)`` calls it; ``backends`` the frameworks it runs on (None: every one);
    ``in_graph_only`` whether it needs a sampler with an in-graph choice."""

    name: ClassVar[str]
    backends: ClassVar[tuple[str, ...] | None] = None
    in_graph_only: ClassVar[bool] = False

    def check(self, backend: str | None, sampler: Sampler) -> None:
        """Refuse (`ValueError`, naming both) a backend or sampler this strategy cannot
        run."""
        if self.backends is not None and backend not in self.backends:
            raise ValueError(
                f"generate: `strategy`={self.name!r} runs on {' and '.join(self.backends)}; "
                f"this model computes on {backend}."
            )
        if self.in_graph_only and not sampler.in_graph:
            why = getattr(sampler, "not_in_graph", "do_sample=True draws in NumPy")
            raise ValueError(
                f"generate: `strategy`={self.name!r} chooses its tokens inside a compiled "
                f"loop, which {sampler!r} cannot ({why}): use "
                "strategy='compiled_step' or None."
            )

    def decode(self, model: Any, ids: np.ndarray, mask: np.ndarray, sampler: Sampler,
               stopping: Stopping) -> np.ndarray:  # fmt: skip
        """Decode the int64 ``(batch, seq)`` prompt ``ids`` (int64 0/1 ``mask``); returns
        int64 ``(batch, columns + n)``: the model's first columns and ``n <=
        stopping.max_new_tokens`` new tokens. Inside ``owned_caches`` (the caches are
        ``generate``'s own; the prompt and ``max_new_tokens`` were checked against the
        context), the caches checked for NaN and infinities once after the prompt so that
        the steps can skip that screen; under ``torch.no_grad()`` on torch."""
        with _gradient_free(model_backend(model)):
            with owned_caches(index_checked=True):
                step = self.prompt_step(model)
                logits, state, first = model._prefill(ids, mask, stopping.max_new_tokens, step)
            finite = caches_finite(state["caches"])
            with owned_caches(index_checked=True, values_checked=finite):
                return self.run(model, logits, state, first, sampler, stopping)

    @abstractmethod
    def prompt_step(self, model: Any) -> Any:
        """The step the model's ``_prefill`` runs the prompt through (``model.step``'s
        signature)."""

    @abstractmethod
    def run(self, model: Any, logits: Any, state: dict, first: np.ndarray,
            sampler: Sampler, stopping: Stopping) -> np.ndarray:  # fmt: skip
        """The tokens after the prefill: int64 ``(batch, columns + n)``, ``first`` and the
        new columns; ``logits`` float ``(batch, vocab)``, ``state`` as ``_prefill`` left
        it."""


class EagerLoop(Strategy):
    """A Python loop over the model's step: ``sampler`` on the NumPy logits, `Stopping`'s
    rule, then the step for the next token; for beam search
    (`multiattn.decoding.beams.BeamSearch`) the search's own loop, which between two
    steps reorders the caches by the rows the chosen beams came from (the model's
    ``_reorder(state, rows)``). Here the step is ``model.step`` itself, run eagerly
    (every backend; what Paddle's models run); subclasses replace it (`token_step`)."""

    name = "eager"

    def prompt_step(self, model: Any) -> Any:
        return model.step

    def token_step(self, model: Any) -> Any:
        """The one-token step of the loop (``model.step``'s signature)."""
        return model.step

    def run(self, model: Any, logits: Any, state: dict, first: np.ndarray,
            sampler: Sampler, stopping: Stopping) -> np.ndarray:  # fmt: skip
        step, new = self.token_step(model), stopping.max_new_tokens
        if isinstance(sampler, BeamSearch):

            def feed(token: np.ndarray, t: int, rows: np.ndarray) -> np.ndarray:
                if (rows != np.arange(rows.size)).any():  # the beams' caches, reordered
                    model._reorder(state, rows)
                return _numpy(model._feed(step, token, t, state))

            return sampler.search(_numpy(logits), feed, first, stopping)
        done, out = stopping.start(first.shape[0]), [first]
        for t in range(new):
            token, done = stopping.update(sampler(_numpy(logits)), done)
            out.append(token[:, None].astype(np.int64))
            if t == new - 1 or done.all():
                break
            logits = model._feed(step, token, t, state)
        return np.concatenate(out, axis=1)


class TracedLoop(EagerLoop):
    """`EagerLoop` over the step recorded by ``torch.jit.trace`` once per set of input
    shapes and replayed (`multiattn.decoding.torch_step.TracedStep`, kept on the model;
    it reads the weights once per ``generate`` call). The prompt runs eagerly."""

    name = "traced"
    backends = ("torch",)

    def token_step(self, model: Any) -> Any:
        from .torch_step import TracedStep

        kept = kept_functions(model)
        if "traced" not in kept:
            kept["traced"] = TracedStep(model.step, list(model.variables))
        kept["traced"].sync()  # the weights as they are now, read once per `generate`
        return kept["traced"]


class CompiledStepLoop(EagerLoop):
    """`EagerLoop` over the one-token step compiled by XLA (`xla_function`, the caches
    donated on jax: the compiled step writes the new keys and values into their buffers
    instead of copying every cache per token; the cache index is a tensor, so every step
    reuses the trace). The prompt goes through ``model.step`` compiled once per prompt
    shape with the cache index (0) static, so that it attends over the slots it fills,
    as the eager step does."""

    name = "compiled_step"
    backends = ("jax", "tensorflow")

    def prompt_step(self, model: Any) -> Any:
        kept = kept_functions(model)
        if "prefill" not in kept:
            kept["prefill"] = xla_function(model, model.step, static=("index",), donate="caches")
        return kept["prefill"]

    def token_step(self, model: Any) -> Any:
        kept = kept_functions(model)
        if "step" not in kept:
            kept["step"] = xla_function(model, model.step, donate="caches")
        return kept["step"]


class CompiledLoop(CompiledStepLoop):
    """Every token after the prompt in one loop of tensor operations compiled by XLA
    (`InGraphLoop`): the step, the sampler's in-graph choice, the stopping rule and the
    early stop, with no return to Python between tokens; XLA updates the caches it
    carries in place (it copies the caches passed in once, on entry). Kept on the model
    per sampler, traced per prompt shape and stopping rule. The prompt as
    `CompiledStepLoop`.

    Per token (Llama shape, prompt 128, batch 1) it took about a third of
    `CompiledStepLoop`'s time on jax and on TensorFlow (measured: docs/benchmarks.md,
    'Measurements behind the defaults')."""

    name = "compiled"
    in_graph_only = True

    def loop(self, model: Any, sampler: Sampler) -> Any:
        """The compiled `InGraphLoop` of ``model`` and ``sampler``, called as
        ``loop(logits, state, max_new_tokens, eos_token_ids, pad_token_id)``."""
        kept, key = kept_functions(model), ("loop", repr(sampler))
        if key not in kept:
            fn = InGraphLoop(model, sampler)
            kept[key] = xla_function(model, fn, static=("new", "eos", "pad"))
        return kept[key]

    def run(self, model: Any, logits: Any, state: dict, first: np.ndarray,
            sampler: Sampler, stopping: Stopping) -> np.ndarray:  # fmt: skip
        rule = (stopping.max_new_tokens, stopping.eos_token_ids, stopping.pad_token_id)
        tokens, count = self.loop(model, sampler)(logits, state, *rule)
        tokens = keras.ops.convert_to_numpy(tokens)[:, : int(count)]
        return np.concatenate([first, tokens.astype(np.int64)], axis=1)


class InGraphLoop:
    """The tokens after the prefill as one ``keras.ops.while_loop``, for XLA to compile
    whole (`CompiledLoop`): ``loop(logits, state, new, eos, pad)`` with float ``(batch,
    vocab)`` ``logits``, the model's ``state`` and the `Stopping` fields returns int32
    ``(batch, new)`` tokens and the int32 number of columns filled (fewer than ``new``
    when every row ended). The loop carries the caches without their unit axes
    (`without_unit_axes`)."""

    def __init__(self, model: Any, sampler: Sampler) -> None:
        self.model, self.sampler = model, sampler

    def __call__(self, logits: Any, state: dict, new: int, eos: tuple, pad: int | None):
        ops = keras.ops
        body = _LoopBody(self.model, self.sampler, Stopping(new, eos, pad), state)
        token, done = body.choose(logits, ops.zeros((logits.shape[0],), "bool"))
        tokens = ops.zeros((logits.shape[0], new), "int32")
        tokens = ops.slice_update(tokens, (0, 0), ops.expand_dims(token, 1))
        start = ops.convert_to_tensor(0, "int32")
        state = {**state, "caches": without_unit_axes(state["caches"])}
        carried = (start, token, done, tokens, state)
        t, _, _, tokens, _ = ops.while_loop(body.more, body, carried)
        return tokens, t + 1


class _LoopBody:
    """The condition (`more`) and body (``__call__``) of `InGraphLoop`'s while loop."""

    def __init__(self, model: Any, sampler: Sampler, stopping: Stopping, state: dict) -> None:
        self.model, self.sampler, self.stopping = model, sampler, stopping
        self.shapes = [tuple(c.shape) for c in keras.tree.flatten(state["caches"])]

    def choose(self, logits: Any, done: Any) -> tuple:
        token = self.sampler.choose_in_graph(keras.ops, logits)
        return self.stopping.update_in_graph(keras.ops, token, done)

    def more(self, t, token, done, tokens, state) -> Any:
        ops = keras.ops
        left = ops.less(t, self.stopping.max_new_tokens - 1)
        return ops.logical_and(left, ops.logical_not(ops.all(done)))

    def __call__(self, t, token, done, tokens, state) -> tuple:
        ops = keras.ops
        state = {**state, "caches": with_unit_axes(state["caches"], self.shapes)}
        logits = self.model._feed(self.model.step, token, t, state)
        state["caches"] = without_unit_axes(state["caches"])
        token, done = self.choose(logits, done)
        # the starts share one integer dtype (JAX, with 64-bit ints enabled too)
        tokens = ops.slice_update(tokens, (t * 0, t + 1), ops.expand_dims(token, 1))
        return t + 1, token, done, tokens, state


#: The strategies by the name ``generate(..., strategy=name)`` takes.
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (CompiledLoop, CompiledStepLoop, TracedLoop, EagerLoop)
}


def choose_strategy(backend: str | None, sampler: Sampler, strategy: Any = None) -> Strategy:
    """The strategy ``generate`` runs, from static facts only: the framework the model
    computes on (``backend``, `model_backend`), whether ``sampler`` has an in-graph
    choice, and the user's ``strategy``: None (the default: `CompiledLoop` on jax and
    TensorFlow for an in-graph sampler, else `CompiledStepLoop` there: sampling and
    beam search; `TracedLoop` on
    torch; `EagerLoop` elsewhere, Paddle included), a name of `STRATEGIES`
    (``"compiled"``, ``"compiled_step"``, ``"traced"``, ``"eager"``) or a `Strategy`
    object. The only place the choice is made.

    Raises:
        TypeError: ``strategy`` neither None, a str nor a `Strategy`.
        ValueError: an unknown name, or a strategy that cannot run on ``backend`` or with
            ``sampler`` (named).
    """
    if strategy is None:
        if backend in ("jax", "tensorflow"):
            return CompiledLoop() if sampler.in_graph else CompiledStepLoop()
        return TracedLoop() if backend == "torch" else EagerLoop()
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(
                f"generate: `strategy` must be None, one of {sorted(STRATEGIES)} or a "
                f"Strategy; received {strategy!r}."
            )
        strategy = STRATEGIES[strategy]()
    elif not isinstance(strategy, Strategy):
        raise TypeError(
            f"generate: `strategy` must be None, one of {sorted(STRATEGIES)} or a Strategy; "
            f"received {strategy!r}."
        )
    strategy.check(backend, sampler)
    return strategy
