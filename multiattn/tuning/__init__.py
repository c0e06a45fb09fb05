"""Measured kernel choices, opt-in: timed on the running machine only when asked.

Where two kernels compute the same thing and which is faster depends on the CPU (AVX-512
or only AVX2, the BLAS a framework ships, the cores), each choice has a documented
default that depends only on the call's static facts (`multiattn.ops.plan`), and this
package is not even imported for it. ``multiattn.config.settings(autotune=True)`` (or
``MULTIATTN_AUTOTUNE=1``) hands the choices to this package instead: the first call of
each *shape class* (sizes rounded up to powers of two, the dtype, the layout, the thread
count) times the candidates, later calls of the class take the faster one.
`save_decisions` writes what was decided to a file and `load_decisions` takes it back in
another process on the same CPU (``multiattn tune MODEL_DIR`` makes one for a model's
``generate``); loaded decisions apply with autotune off too (`multiattn.config.tuner`).

The choices (each, when nothing is timed, its default):

* ``attention``: the backend's fused attention kernel or the core's explicit path
  (`fused_attention_pays`; default: the namespace's ``fused_attention_pays``);
* ``attention-chunks``: how many slices of the batch the explicit path runs in
  (`attention_chunks`; default: `multiattn.ops.plan.default_chunks`);
* ``attention-backward``: automatic differentiation of the explicit path or its own
  backward pass (`attention_backward`; default: automatic differentiation);
* ``torch-linear``: a projection's product on PyTorch CPU in float32, oneDNN's linear
  operator or PyTorch's BLAS (`multiattn.tuning.torch_linear`; default: BLAS);
* ``paddle-batch-slices``: the slices the Paddle document layers run in
  (`multiattn.backends.paddle`; default: one piece).

Blockwise or direct attention is not one: the memory budget and a forced block size
decide it. How a decision is timed is `decide`'s: interleaved rounds, the lower median,
for the layers' choices only by more than `MARGIN` over the default; nothing while a
compiler traces the caller on PyTorch; under ``jax.jit`` and ``tf.function`` compiled
the same way and timed at trace time outside the trace, so the program holds only the
winner.
"""

from __future__ import annotations

from ._store import (
    MARGIN,
    MIN_SAMPLE_S,
    REPEATS,
    UNTUNED,
    bucket,
    decide,
    decisions,
    describe_decision,
    describe_decisions,
    has_decisions,
    load_decisions,
    reset,
    save_decisions,
)
from .attention import (
    ATTENTION_FLOP_CAP,
    CHUNK_MIN_BYTES,
    attention_backward,
    attention_chunks,
    backward_margin,
    fused_attention_pays,
)
from .choices import Fixed, Measured
from .cpu import cpu_info, parse_cpuinfo

#: The tuner of ``settings(autotune=True)`` (`multiattn.config.tuner`).
MEASURED = Measured()

__all__ = [
    "ATTENTION_FLOP_CAP",
    "CHUNK_MIN_BYTES",
    "MARGIN",
    "MEASURED",
    "MIN_SAMPLE_S",
    "REPEATS",
    "UNTUNED",
    "Fixed",
    "Measured",
    "attention_backward",
    "attention_chunks",
    "backward_margin",
    "bucket",
    "cpu_info",
    "decide",
    "decisions",
    "describe_decision",
    "describe_decisions",
    "fused_attention_pays",
    "has_decisions",
    "load_decisions",
    "parse_cpuinfo",
    "reset",
    "save_decisions",
]
