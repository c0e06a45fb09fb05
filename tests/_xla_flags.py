"""XLA:CPU's quick-compile options for test processes: the jax and tensorflow workers,
and the ``core`` worker, whose tests start processes of every framework (the
conformance run, the examples, the benchmark, the distributed and model checks).

LLVM without optimisation and the older loop emitters: XLA runs the same operations
either way, and those tests mostly wait on its compiler. On a 2-core AMD EPYC (AVX2) an
elementwise operation compiled in 38 ms against 76, jax's random numbers in 0.15 s
against 0.46, three jax test files ran in 23 s against 44, TensorFlow's compiled
decoding loops (``jit_compile``) in 67 s against 91. The conformance suite's multi-head
attention cases on jax (forward and gradient under ``jax.jit``) compiled in 0.30 s
against 1.42 s each, and the RNN examples' training on jax took 47 s against 67.
`tests/test_conformance.py::test_keras_jax_with_xla_defaults` runs a case of every kind
with XLA's defaults, which users get (these options are set only here).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

FAST_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
)

#: backend -> a program that makes its XLA read ``XLA_FLAGS``
PROBES = {
    "jax": "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()",
    "tensorflow": "import tensorflow as tf; tf.function(lambda: tf.zeros(1), jit_compile=True)()",
}


@functools.cache
def fast_compile_flags(backend: str) -> str | None:
    """``XLA_FLAGS`` for a process computing on ``backend`` (a key of `PROBES`): the
    caller's, with each option of `FAST_COMPILE` it does not set itself (unprobed when
    it sets them all: a worker's child processes inherit them). None (leave
    ``XLA_FLAGS`` as it is) for other backends, when ``MULTIATTN_TEST_XLA_FAST_COMPILE=0``,
    or when the backend's XLA refuses the options (XLA ends a process on an unknown
    flag: a subprocess tries them first)."""
    probe = PROBES.get(backend)
    if probe is None or os.environ.get("MULTIATTN_TEST_XLA_FAST_COMPILE", "1").strip() == "0":
        return None
    current = os.environ.get("XLA_FLAGS", "")
    added = [f for f in FAST_COMPILE if f.split("=")[0] not in current]
    flags = " ".join([current, *added]).strip()
    if not added:  # the caller's options already hold every one (an inherited setting)
        return flags
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return None
    return flags if proc.returncode == 0 else None


def fast_compile_env(*backends: str) -> dict[str, str]:
    """``{"XLA_FLAGS": ...}`` with the options of `FAST_COMPILE` for a process computing
    on ``backends`` (default: both XLAs, jax's and TensorFlow's), where all of them take
    the options; empty otherwise (a backend without XLA among them included)."""
    flags = {fast_compile_flags(backend) for backend in backends or PROBES}
    return {"XLA_FLAGS": flags.pop()} if len(flags) == 1 and None not in flags else {}


def without_fast_compile() -> str:
    """The caller's ``XLA_FLAGS`` without the options of `FAST_COMPILE` (XLA's
    defaults for them)."""
    names = {f.split("=")[0] for f in FAST_COMPILE}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] not in names]
    return " ".join(kept)
