"""Token generation through the KV cache: the one decoding seam of `multiattn.models`.

``model.generate(...)`` (`GenerationMixin.generate`) is a short sequence: check the
arguments, build a sampler and a stopping rule from them, choose a strategy, run it.

* `multiattn.decoding.samplers`: `Greedy` and `Sampling` (temperature, top-k, top-p,
  seed), called on float ``(batch, vocab)`` logits; `make_sampler` builds one from
  ``generate``'s transformers-style arguments.
* `multiattn.decoding.stopping`: `Stopping` (end ids, pad id, ``max_new_tokens``).
* `multiattn.decoding.strategies`: `CompiledLoop` (jax, TensorFlow), `CompiledStepLoop`
  (jax, TensorFlow), `TracedLoop` (torch), `EagerLoop` (every backend, Paddle's models
  included), and `choose_strategy`, the one place where ``generate`` picks one
  (``generate(..., strategy=None | "compiled" | "compiled_step" | "traced" | "eager")``).
* `multiattn.decoding.generation`: `GenerationMixin` and the checks of the prompt.
* `multiattn.decoding.torch_step` and `multiattn.decoding.compiled` (internal): the step
  recorded by ``torch.jit.trace``, and the functions compiled by XLA.

See ``docs/decoding.md``.
"""

from __future__ import annotations

from .generation import GenerationMixin
from .samplers import Greedy, Sampler, Sampling, make_sampler
from .stopping import Stopping, make_stopping
from .strategies import (
    STRATEGIES,
    CompiledLoop,
    CompiledStepLoop,
    EagerLoop,
    Strategy,
    TracedLoop,
    choose_strategy,
)

__all__ = [
    "STRATEGIES",
    "CompiledLoop",
    "CompiledStepLoop",
    "EagerLoop",
    "GenerationMixin",
    "Greedy",
    "Sampler",
    "Sampling",
    "Stopping",
    "Strategy",
    "TracedLoop",
    "choose_strategy",
    "make_sampler",
    "make_stopping",
]
