"""Feed the public API invalid arguments and classify how it refuses them.

Run from the repository root with the project's virtualenv::

    .venv/bin/python docs/scripts/bad_input_sweep.py                    # every backend
    .venv/bin/python docs/scripts/bad_input_sweep.py --backends torch --details
    .venv/bin/python docs/scripts/bad_input_sweep.py --json sweep.json --strict
    .venv/bin/python docs/scripts/bad_input_sweep.py --list             # the catalogue

The catalogue (`CASES`) holds invalid calls of `multiattn.ops` and `multiattn.layers`:
wrong ranks and shapes, mismatched dtypes, integer/complex/bool/None/string inputs, ragged
Python lists, NaN/negative/zero/huge/float/bool values for integer settings, non-bool
flags, bad seeds, out-of-range cache indices and rotary offsets (as Python ints, NumPy
integers and eager tensors), masks and valid lengths of the wrong shape, dtype or range,
tensors of a second framework; and the model surfaces, on tiny random models that
transformers makes and saves once per worker (``HF_HUB_OFFLINE=1``; `HF_MODELS`): model
calls (`CALLS`: ids negative, ``>= vocab_size``, int64 beyond int32, float; bad masks,
unknown arguments, empty inputs), ``generate`` (max_new_tokens, sampling filters, NumPy
scalars that must be accepted when valid, pad/eos ids, a row of pads only, batch 0),
checkpoint folders (`FOLDERS`, each a changed copy: config errors, missing, unexpected,
mis-shaped, NaN, float8 or truncated tensors, a FIFO as a shard, links out of the folder,
a pickle), ``save_pretrained``, and the CLIs (``multiattn port --from hf`` and
``multiattn conformance --model`` on the hostile folders, each run as a subprocess: clear
is exit code 1 or 2 with a last line of stderr naming the problem and no traceback; they
run in the numpy worker only, the CLI being the same whatever that worker's backend).
Each case names the argument (or file, tensor, option) the error must name.

Every case runs once per backend, each backend in a subprocess of its own (Keras reads
``KERAS_BACKEND`` once; importing paddle after tensorflow crashes): ``jax`` (with
``JAX_ENABLE_X64=1``, as the test suite runs it), ``torch``, ``tensorflow``, ``numpy``,
and ``paddle`` (the `multiattn.ops` cases that take tensors, on Paddle tensors through
the Paddle namespace, and the model and checkpoint cases through
``from_pretrained(..., framework="paddle")``; the layers are Keras layers and do not run
there). A run is

* **clear**: ``ValueError`` or ``TypeError`` whose message names the argument (as a
  whole word: ``key`` is not named by ``key_dim``; the list of the call's arguments that
  Keras appends to an exception leaving a layer does not count);
* **unclear**: any other exception, a ``ValueError``/``TypeError`` that does not name the
  argument, a crash of the worker process (segfault) or a case that hung past the
  backend's timeout;
* **silent**: no exception, a result came back.

Cases a worker never reached (its timeout expired first) count as ``not_run``; a case
whose *valid* set-up failed counts as ``setup_error`` (the harness or a regression).
A worker that crashes is restarted after the case that crashed it.

The counts are given per backend and per surface (``ops``, ``layers``, ``model.call``,
``model.generate``, ``checkpoint.from_pretrained``, ``checkpoint.save_pretrained``,
``cli.port``, ``cli.conformance``). ``--details`` lists every non-clear case with its exception and message (one row per
case and behaviour, with the backends that showed it); ``--json PATH`` writes everything
(the catalogue, every run with its exception type, message and raising frame, the
versions); ``--cases GLOB`` picks cases by id; the exit code is 0 unless ``--strict`` is
given and some run was not clear. ``tests/test_bad_input_sweep.py`` runs the ops and
layers catalogue and a sample of the model surfaces on the numpy backend and checks the
harness (``BAD_INPUT_SWEEP_SELFTEST=1``
adds ``_selftest:*`` cases: a crash, a hang, ...), not the counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import fnmatch
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("jax", "torch", "tensorflow", "numpy", "paddle")
OUTCOMES = ("clear", "unclear", "silent")
EXTRA = ("not_run", "setup_error")
MESSAGE_LIMIT = 2000  # characters of an exception message kept in the JSON

# Shapes of the valid inputs every case starts from.
B, TQ, TK, D = 2, 3, 4, 8  # batch, queries, keys, width
HEADS, KEY_DIM = 2, 4  # MultiHeadAttention(2, 4) on width-8 inputs
CACHE_LEN = 6
#: Set to 1 to add the ``_selftest:*`` cases (a clear error, a crash, a hang, ...) that
#: the harness's own test runs.
SELFTEST_ENV = "BAD_INPUT_SWEEP_SELFTEST"


# --------------------------------------------------------------------------- classification


def names_argument(message: str, names: Sequence[str]) -> bool:
    """Whether ``message`` names one of ``names`` as a whole word (``key`` is not in
    ``key_dim``, ``valid_lens`` is not in ``context_valid_lens``)."""
    return any(
        re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names
    )


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_KERAS_ARGUMENTS = "\n\nArguments received by "


def library_message(exc: BaseException) -> str:
    """The message of ``exc`` without terminal colour codes and without the list of the
    call's arguments that Keras appends when an exception leaves a layer's ``call``
    ("Arguments received by X.call(): query=..., valid_lens=..."): that list names every
    argument and says nothing about which one was wrong."""
    text = _ANSI.sub("", str(exc))
    cut = text.find(_KERAS_ARGUMENTS)
    return text if cut < 0 else text[:cut]


def classify(exc: BaseException | None, names: Sequence[str]) -> str:
    """``"silent"`` (no exception), ``"clear"`` (ValueError/TypeError whose message, see
    `library_message`, names one of ``names``) or ``"unclear"`` (anything else)."""
    if exc is None:
        return "silent"
    if isinstance(exc, (ValueError, TypeError)) and names_argument(library_message(exc), names):
        return "clear"
    return "unclear"


# --------------------------------------------------------------------------- the catalogue


@dataclasses.dataclass(frozen=True)
class Case:
    """One invalid call.

    ``build(env)`` does the valid set-up (tensors, a built layer) and returns the call to
    classify, a zero-argument callable. ``args``: the argument names an error may name
    (any one is enough). ``paddle``: the case also runs on Paddle tensors.
    """

    id: str
    target: str
    args: tuple[str, ...]
    what: str
    build: Callable[[Any], Callable[[], Any]]
    paddle: bool = False
    only: tuple[str, ...] = ()  # the backends it runs on, if not all

    @property
    def surface(self) -> str:
        """``ops``, ``layers``, else the target (``model.call``, ``cli.port``, ...)."""
        head = self.target.split(".")[0]
        return head if head in ("ops", "layers") else self.target

    def runs_on(self, backend: str) -> bool:
        return (backend != "paddle" or self.paddle) and (not self.only or backend in self.only)


CASES: list[Case] = []


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def case(target, args, what, build, *, paddle: bool = False, only: tuple[str, ...] = ()):
    args = (args,) if isinstance(args, str) else tuple(args)
    cid = f"{target}:{_slug(what)}"
    if any(c.id == cid for c in CASES):
        raise ValueError(f"duplicate case id {cid}")
    CASES.append(Case(cid, target, args, what, build, paddle, tuple(only)))


NAN, INF = float("nan"), float("inf")
RAGGED = [[1.0, 2.0], [3.0]]


# ---- multiattn.ops.masked_softmax


def _softmax(e, x=None, **kw):
    x = e.f(B, TQ, TK) if x is None else x
    return e.call(e.ops.masked_softmax, x, **kw)


def _lens(e, values, dtype="int32"):
    return e.t(np.asarray(values).astype(dtype))


T = "ops.masked_softmax"
for what, arg, build in [
    ("x int32", "x", lambda e: _softmax(e, e.i(np.ones((B, TQ, TK))))),
    ("x complex64", "x", lambda e: _softmax(e, e.c(B, TQ, TK))),
    ("x None", "x", lambda e: e.call(e.ops.masked_softmax, None)),
    ("x ragged list", "x", lambda e: _softmax(e, RAGGED)),
    ("axis out of range", "axis", lambda e: _softmax(e, axis=5)),
    ("axis string", "axis", lambda e: _softmax(e, axis="last")),
    ("mask wrong shape", "mask", lambda e: _softmax(e, mask=e.b(np.ones((B, TQ, TK + 1))))),
    ("mask float", "mask", lambda e: _softmax(e, mask=e.f(B, TQ, TK))),
    (
        "mask of another framework",
        "mask",
        lambda e: _softmax(e, mask=e.foreign(np.ones((B, TQ, TK), bool))),
    ),
    ("valid_lens past the keys", "valid_lens", lambda e: _softmax(e, valid_lens=e.i([2, TK + 1]))),
    ("valid_lens negative", "valid_lens", lambda e: _softmax(e, valid_lens=e.i([-1, 2]))),
    (
        "valid_lens fractional float",
        "valid_lens",
        lambda e: _softmax(e, valid_lens=_lens(e, [1.5, 2.0], "float32")),
    ),
    (
        "valid_lens NaN",
        "valid_lens",
        lambda e: _softmax(e, valid_lens=_lens(e, [NAN, 2.0], "float32")),
    ),
    ("valid_lens wrong batch", "valid_lens", lambda e: _softmax(e, valid_lens=e.i([1, 2, 3]))),
    ("valid_lens bool", "valid_lens", lambda e: _softmax(e, valid_lens=e.b([True, False]))),
    (
        "valid_lens huge int64",
        "valid_lens",
        lambda e: _softmax(e, valid_lens=e.i([2**40, 1], "int64")),
    ),
    (
        "valid_lens Python list past the keys",
        "valid_lens",
        lambda e: _softmax(e, valid_lens=[TK + 3, 1]),
    ),
]:
    case(T, arg, what, build, paddle=True)


# ---- multiattn.ops.scaled_dot_product_attention


def _sdpa(e, **kw):
    query = kw.pop("query") if "query" in kw else e.f(B, TQ, D)
    key = kw.pop("key") if "key" in kw else e.f(B, TK, D)
    value = kw.pop("value") if "value" in kw else e.f(B, TK, D)
    return e.call(e.ops.scaled_dot_product_attention, query, key, value, **kw)


T = "ops.scaled_dot_product_attention"
for what, arg, build in [
    ("query rank 1", "query", lambda e: _sdpa(e, query=e.f(D))),
    ("key width differs from query", "key", lambda e: _sdpa(e, key=e.f(B, TK, D + 1))),
    ("value length differs from key", "value", lambda e: _sdpa(e, value=e.f(B, TK + 1, D))),
    ("key batch differs", "key", lambda e: _sdpa(e, key=e.f(B + 1, TK, D))),
    ("query int32", "query", lambda e: _sdpa(e, query=e.i(np.ones((B, TQ, D))))),
    (
        "key float64 with float32 query",
        "key",
        lambda e: _sdpa(e, key=e.f(B, TK, D, dtype="float64")),
    ),
    ("query complex64", "query", lambda e: _sdpa(e, query=e.c(B, TQ, D))),
    ("query None", "query", lambda e: _sdpa(e, query=None)),
    ("query string", "query", lambda e: _sdpa(e, query="query")),
    ("query width 0", "query", lambda e: _sdpa(e, query=e.f(B, TQ, 0), key=e.f(B, TK, 0))),
    (
        "key of another framework",
        "key",
        lambda e: _sdpa(e, key=e.foreign(np.ones((B, TK, D), np.float32))),
    ),
    ("mask wrong shape", "mask", lambda e: _sdpa(e, mask=e.b(np.ones((B, TQ + 1, TK))))),
    ("mask float", "mask", lambda e: _sdpa(e, mask=e.f(B, TQ, TK))),
    ("valid_lens past the keys", "valid_lens", lambda e: _sdpa(e, valid_lens=e.i([1, TK + 1]))),
    ("valid_lens negative", "valid_lens", lambda e: _sdpa(e, valid_lens=e.i([-2, 1]))),
    (
        "valid_lens fractional float",
        "valid_lens",
        lambda e: _sdpa(e, valid_lens=_lens(e, [0.5, 1.0], "float32")),
    ),
    ("causal float 1.0", "causal", lambda e: _sdpa(e, causal=1.0)),
    ("scale 0", "scale", lambda e: _sdpa(e, scale=0)),
    ("scale NaN", "scale", lambda e: _sdpa(e, scale=NAN)),
    ("dropout 1.5", "dropout", lambda e: _sdpa(e, dropout=1.5)),
    ("dropout negative", "dropout", lambda e: _sdpa(e, dropout=-0.1)),
    ("training string False", "training", lambda e: _sdpa(e, dropout=0.5, training="False")),
    ("seed string", "seed", lambda e: _sdpa(e, dropout=0.5, training=True, seed="a")),
    ("return_weights 2", "return_weights", lambda e: _sdpa(e, return_weights=2)),
    ("block_size 0", "block_size", lambda e: _sdpa(e, block_size=0)),
    ("block_size one-element tuple", "block_size", lambda e: _sdpa(e, block_size=(2,))),
]:
    case(T, arg, what, build, paddle=True)


# ---- multiattn.ops.score_attention


def _score(e, **kw):
    scores = kw.pop("scores") if "scores" in kw else e.f(B, TQ, TK)
    value = kw.pop("value") if "value" in kw else e.f(B, TK, D)
    return e.call(e.ops.score_attention, scores, value, **kw)


T = "ops.score_attention"
for what, arg, build in [
    ("scores int32", "scores", lambda e: _score(e, scores=e.i(np.ones((B, TQ, TK))))),
    ("scores None", "scores", lambda e: _score(e, scores=None)),
    ("value length differs from keys", "value", lambda e: _score(e, value=e.f(B, TK + 2, D))),
    (
        "value float64 with float32 scores",
        "value",
        lambda e: _score(e, value=e.f(B, TK, D, dtype="float64")),
    ),
    (
        "value of another framework",
        "value",
        lambda e: _score(e, value=e.foreign(np.ones((B, TK, D), np.float32))),
    ),
    ("mask float", "mask", lambda e: _score(e, mask=e.f(B, TQ, TK))),
    ("valid_lens past the keys", "valid_lens", lambda e: _score(e, valid_lens=e.i([TK + 1, 1]))),
    ("causal float 1.0", "causal", lambda e: _score(e, causal=1.0)),
    ("dropout 1.5", "dropout", lambda e: _score(e, dropout=1.5)),
    ("return_weights 2", "return_weights", lambda e: _score(e, return_weights=2)),
]:
    case(T, arg, what, build, paddle=True)


# ---- multiattn.ops scoring functions


def _additive(e, **kw):
    args = {
        "query": e.f(B, TQ, D),
        "key": e.f(B, TK, 6),
        "w_q": e.f(D, 5),
        "w_k": e.f(6, 5),
        "w_v": e.f(5),
    }
    args.update(kw)
    return e.call(e.ops.additive_scores, *args.values())


def _general(e, **kw):
    args = {"query": e.f(B, TQ, D), "key": e.f(B, TK, 6), "w": e.f(D, 6)}
    args.update(kw)
    return e.call(e.ops.general_scores, *args.values())


T = "ops.additive_scores"
for what, arg, build in [
    ("w_q wrong input width", "w_q", lambda e: _additive(e, w_q=e.f(D + 1, 5))),
    ("w_k units differ from w_q", "w_k", lambda e: _additive(e, w_k=e.f(6, 4))),
    ("w_v float64", "w_v", lambda e: _additive(e, w_v=e.f(5, dtype="float64"))),
    ("w_q None", "w_q", lambda e: _additive(e, w_q=None)),
    ("query int32", "query", lambda e: _additive(e, query=e.i(np.ones((B, TQ, D))))),
]:
    case(T, arg, what, build, paddle=True)

T = "ops.general_scores"
for what, arg, build in [
    ("w wrong shape", "w", lambda e: _general(e, w=e.f(6, D))),
    ("w int32", "w", lambda e: _general(e, w=e.i(np.ones((D, 6))))),
    ("key complex64", "key", lambda e: _general(e, key=e.c(B, TK, 6))),
]:
    case(T, arg, what, build, paddle=True)

for target, arg, what, build in [
    (
        "ops.dot_scores",
        "key",
        "key width differs",
        lambda e: e.call(e.ops.dot_scores, e.f(B, TQ, D), e.f(B, TK, D + 2)),
    ),
    (
        "ops.scaled_dot_scores",
        "scale",
        "scale 0",
        lambda e: e.call(e.ops.scaled_dot_scores, e.f(B, TQ, D), e.f(B, TK, D), scale=0.0),
    ),
    (
        "ops.scaled_dot_scores",
        "key",
        "key bool",
        lambda e: e.call(e.ops.scaled_dot_scores, e.f(B, TQ, D), e.b(np.ones((B, TK, D)))),
    ),
]:
    case(target, arg, what, build, paddle=True)


# ---- multiattn.ops.rotary_embedding / rotary_table


def _rope(e, x=None, **kw):
    x = e.f(B, TQ, HEADS, KEY_DIM) if x is None else x
    return e.call(e.ops.rotary_embedding, x, **kw)


T = "ops.rotary_embedding"
for what, arg, build in [
    ("x rank 3", "x", lambda e: _rope(e, e.f(B, TQ, D))),
    ("x odd feature axis", "x", lambda e: _rope(e, e.f(B, TQ, HEADS, 5))),
    ("x int32", "x", lambda e: _rope(e, e.i(np.ones((B, TQ, HEADS, KEY_DIM))))),
    ("offset negative", "offset", lambda e: _rope(e, offset=-1)),
    ("offset float", "offset", lambda e: _rope(e, offset=1.5)),
    ("offset bool", "offset", lambda e: _rope(e, offset=True)),
    ("offset negative np.int64", "offset", lambda e: _rope(e, offset=np.int64(-1))),
    ("offset negative eager tensor", "offset", lambda e: _rope(e, offset=e.t(np.int32(-1)))),
    ("base 1", "base", lambda e: _rope(e, base=1)),
    ("base inf", "base", lambda e: _rope(e, base=INF)),
]:
    case(T, arg, what, build, paddle=True)

T = "ops.rotary_table"
for what, arg, build in [
    ("length 0", "length", lambda e: e.call(e.ops.rotary_table, 0, 4)),
    ("length NaN", "length", lambda e: e.call(e.ops.rotary_table, NAN, 4)),
    ("dim odd", "dim", lambda e: e.call(e.ops.rotary_table, 4, 5)),
]:
    case(T, arg, what, build)


# ---- multiattn.ops.causal_mask / valid_lens_to_mask / combine_masks

T = "ops.causal_mask"
for what, arg, build in [
    ("query_len 0", "query_len", lambda e: e.call(e.ops.causal_mask, 0)),
    ("query_len negative", "query_len", lambda e: e.call(e.ops.causal_mask, -3)),
    ("query_len float", "query_len", lambda e: e.call(e.ops.causal_mask, 2.0)),
    ("query_len bool", "query_len", lambda e: e.call(e.ops.causal_mask, True)),
    ("key_len string", "key_len", lambda e: e.call(e.ops.causal_mask, 3, "4")),
]:
    case(T, arg, what, build)

T = "ops.valid_lens_to_mask"
SHAPE = (B, TQ, TK)
for what, arg, build in [
    (
        "valid_lens past the keys",
        "valid_lens",
        lambda e: e.call(e.ops.valid_lens_to_mask, e.i([TK + 1, 0]), SHAPE),
    ),
    (
        "valid_lens negative",
        "valid_lens",
        lambda e: e.call(e.ops.valid_lens_to_mask, e.i([-1, 0]), SHAPE),
    ),
    (
        "valid_lens fractional float",
        "valid_lens",
        lambda e: e.call(e.ops.valid_lens_to_mask, _lens(e, [1.25, 2.0], "float32"), SHAPE),
    ),
    (
        "scores_shape string",
        "scores_shape",
        lambda e: e.call(e.ops.valid_lens_to_mask, e.i([1, 2]), "abc"),
    ),
    (
        "scores_shape rank 1",
        ("scores_shape", "valid_lens"),
        lambda e: e.call(e.ops.valid_lens_to_mask, e.i([1, 2]), (TK,)),
    ),
    (
        "scores_shape negative key axis",
        "scores_shape",
        lambda e: e.call(e.ops.valid_lens_to_mask, e.i([0, 0]), (B, TQ, -1)),
    ),
]:
    case(T, arg, what, build, paddle=True)

T = "ops.combine_masks"
for what, arg, build in [
    (
        "causal string",
        "causal",
        lambda e: e.call(e.ops.combine_masks, SHAPE, mask=e.b(np.ones(SHAPE)), causal="yes"),
    ),
    ("mask float", "mask", lambda e: e.call(e.ops.combine_masks, SHAPE, mask=e.f(*SHAPE))),
]:
    case(T, arg, what, build, paddle=True)


# ---- multiattn.ops.layer_norm


def _ln(e, x=None, gamma=None, beta=None, **kw):
    x = e.f(B, TQ, D) if x is None else x
    return e.call(e.ops.layer_norm, x, gamma, beta, **kw)


T = "ops.layer_norm"
for what, arg, build in [
    ("epsilon negative", "epsilon", lambda e: _ln(e, epsilon=-1.0)),
    ("epsilon 0", "epsilon", lambda e: _ln(e, epsilon=0.0)),
    ("epsilon NaN", "epsilon", lambda e: _ln(e, epsilon=NAN)),
    ("epsilon string", "epsilon", lambda e: _ln(e, epsilon="1e-6")),
    ("x int32", "x", lambda e: _ln(e, e.i(np.ones((B, TQ, D))))),
    ("gamma wrong width", "gamma", lambda e: _ln(e, gamma=e.f(D + 1))),
    ("beta int32", "beta", lambda e: _ln(e, beta=e.i(np.ones(D)))),
    (
        "gamma of another framework",
        "gamma",
        lambda e: _ln(e, gamma=e.foreign(np.ones(D, np.float32))),
    ),
]:
    case(T, arg, what, build, paddle=True)


# ---- multiattn.ops.split_heads / merge_heads


def _split(e, x=None, num_heads=HEADS, **kw):
    x = e.f(B, TQ, D) if x is None else x
    return e.call(e.ops.split_heads, x, num_heads, **kw)


T = "ops.split_heads"
for what, arg, build in [
    ("num_heads 0", "num_heads", lambda e: _split(e, num_heads=0)),
    ("num_heads not dividing the width", "num_heads", lambda e: _split(e, num_heads=3)),
    ("num_heads float", "num_heads", lambda e: _split(e, num_heads=2.0)),
    ("layout unknown", "layout", lambda e: _split(e, layout="rows")),
    ("x rank 2", "x", lambda e: _split(e, e.f(TQ, D))),
]:
    case(T, arg, what, build, paddle=True)

T = "ops.merge_heads"
for what, arg, build in [
    ("x rank 3", "x", lambda e: e.call(e.ops.merge_heads, e.f(B, TQ, D))),
    (
        "layout int",
        "layout",
        lambda e: e.call(e.ops.merge_heads, e.f(B, HEADS, TQ, KEY_DIM), layout=1),
    ),
]:
    case(T, arg, what, build, paddle=True)


# ---- multiattn.ops.sinusoidal_encoding

T = "ops.sinusoidal_encoding"
for what, arg, build in [
    ("length 0", "length", lambda e: e.call(e.ops.sinusoidal_encoding, 0, D)),
    ("length inf", "length", lambda e: e.call(e.ops.sinusoidal_encoding, INF, D)),
    ("depth negative", "depth", lambda e: e.call(e.ops.sinusoidal_encoding, 4, -8)),
    ("layout unknown", "layout", lambda e: e.call(e.ops.sinusoidal_encoding, 4, D, layout="x")),
    ("base 1", "base", lambda e: e.call(e.ops.sinusoidal_encoding, 4, D, base=1.0)),
    ("dtype int32", "dtype", lambda e: e.call(e.ops.sinusoidal_encoding, 4, D, dtype="int32")),
    ("dtype None", "dtype", lambda e: e.call(e.ops.sinusoidal_encoding, 4, D, dtype=None)),
]:
    case(T, arg, what, build)


# ---- multiattn.layers.MultiHeadAttention: constructor (constructed, then called once)


def _mha_new(e, **kw):
    x = e.f(B, TQ, D)
    args = {"num_heads": HEADS, "key_dim": KEY_DIM, **kw}
    return e.call(lambda: e.layers.MultiHeadAttention(**args)(x, x))


T = "layers.MultiHeadAttention"
for what, arg, build in [
    ("num_heads 0", "num_heads", lambda e: _mha_new(e, num_heads=0)),
    ("num_heads float", "num_heads", lambda e: _mha_new(e, num_heads=2.0)),
    ("num_heads NaN", "num_heads", lambda e: _mha_new(e, num_heads=NAN)),
    ("num_heads bool", "num_heads", lambda e: _mha_new(e, num_heads=True)),
    ("key_dim 0", "key_dim", lambda e: _mha_new(e, key_dim=0)),
    ("key_dim float", "key_dim", lambda e: _mha_new(e, key_dim=4.5)),
    ("output_dim negative", "output_dim", lambda e: _mha_new(e, output_dim=-1)),
    ("dropout 1.5", "dropout", lambda e: _mha_new(e, dropout=1.5)),
    ("dropout string", "dropout", lambda e: _mha_new(e, dropout="0.1")),
    ("use_bias string", "use_bias", lambda e: _mha_new(e, use_bias="False")),
    ("seed string", "seed", lambda e: _mha_new(e, seed="a")),
    (
        "kernel_initializer unknown",
        "kernel_initializer",
        lambda e: _mha_new(e, kernel_initializer="nope"),
    ),
    ("num_key_value_heads 0", "num_key_value_heads", lambda e: _mha_new(e, num_key_value_heads=0)),
    (
        "num_key_value_heads not dividing num_heads",
        "num_key_value_heads",
        lambda e: _mha_new(e, num_heads=4, num_key_value_heads=3),
    ),
    (
        "num_key_value_heads float",
        "num_key_value_heads",
        lambda e: _mha_new(e, num_key_value_heads=1.0),
    ),
    ("rotary_max_length 0", "rotary_max_length", lambda e: _mha_new(e, rotary_max_length=0)),
    ("rotary with odd key_dim", "key_dim", lambda e: _mha_new(e, key_dim=3, rotary_max_length=8)),
    ("rotary_base 1", "rotary_base", lambda e: _mha_new(e, rotary_max_length=8, rotary_base=1.0)),
]:
    case(T, arg, what, build)


# ---- multiattn.layers.MultiHeadAttention: call


def _mha(e, **layer_kw):
    """A MultiHeadAttention(2, 4) built on width-8 inputs."""
    layer = e.layers.MultiHeadAttention(HEADS, KEY_DIM, **layer_kw)
    layer(e.f(B, TQ, D), e.f(B, TK, D))
    return layer


def _mha_call(e, *args, layer_kw=None, **kw):
    layer = _mha(e, **(layer_kw or {}))
    if not args:
        args = (e.f(B, TQ, D), e.f(B, TK, D))
    return e.call(layer, *args, **kw)


T = "layers.MultiHeadAttention.call"
for what, arg, build in [
    ("query rank 2", "query", lambda e: _mha_call(e, e.f(TQ, D), e.f(B, TK, D))),
    (
        "query width differs from the build",
        "query",
        lambda e: _mha_call(e, e.f(B, TQ, D - 2), e.f(B, TK, D)),
    ),
    ("query int32", "query", lambda e: _mha_call(e, e.i(np.ones((B, TQ, D))), e.f(B, TK, D))),
    ("query None", "query", lambda e: _mha_call(e, None, e.f(B, TK, D))),
    ("query ragged list", "query", lambda e: _mha_call(e, RAGGED, e.f(B, TK, D))),
    (
        "value width differs from the build",
        "value",
        lambda e: _mha_call(e, e.f(B, TQ, D), e.f(B, TK, D + 2)),
    ),
    (
        "key length differs from value",
        "key",
        lambda e: _mha_call(e, e.f(B, TQ, D), e.f(B, TK, D), e.f(B, TK + 1, D)),
    ),
    # A tensor of another framework given to a layer is not in this catalogue: Keras'
    # Layer.__call__ converts array-like inputs to the backend's tensors before `call`
    # runs, as it does for keras.layers.MultiHeadAttention (the ops refuse them).
    ("mask wrong shape", "mask", lambda e: _mha_call(e, mask=e.b(np.ones((B, TQ, TK + 1))))),
    ("mask float", "mask", lambda e: _mha_call(e, mask=e.f(B, TQ, TK))),
    ("valid_lens past the keys", "valid_lens", lambda e: _mha_call(e, valid_lens=e.i([TK + 2, 1]))),
    ("causal float 1.0", "causal", lambda e: _mha_call(e, causal=1.0)),
    ("return_weights 2", "return_weights", lambda e: _mha_call(e, return_weights=2)),
    (
        "training string False",
        "training",
        lambda e: _mha_call(e, training="False", layer_kw={"dropout": 0.5}),
    ),
    (
        "key_value a single tensor",
        "key_value",
        lambda e: _mha_call(e, e.f(B, TQ, D), key_value=e.f(B, TK, HEADS, KEY_DIM)),
    ),
    (
        "key_value wrong batch",
        "key_value",
        lambda e: _mha_call(e, e.f(B, TQ, D), key_value=(e.f(B + 1, TK, HEADS, KEY_DIM),) * 2),
    ),
    ("cache_index without cache", "cache_index", lambda e: _mha_call(e, cache_index=0)),
]:
    case(T, arg, what, build)


# ---- multiattn.layers.MultiHeadAttention: init_cache and the cache


def _mha_cached(e, cache_index, *, t=1, cache=None, layer_kw=None, max_length=CACHE_LEN, **kw):
    layer = _mha(e, **(layer_kw or {}))
    cache = layer.init_cache(B, max_length) if cache is None else cache
    return e.call(layer, e.f(B, t, D), cache=cache, cache_index=cache_index, **kw)


def _init_cache(e, *args):
    return e.call(_mha(e).init_cache, *args)


def _cache_of(e, dtype):
    """A cache made by init_cache with ``dtype``, used for one step (init and step are
    classified together: the error may come from either)."""
    layer = _mha(e)
    x = e.f(B, 1, D)
    return e.call(lambda: layer(x, cache=layer.init_cache(B, CACHE_LEN, dtype), cache_index=0))


T = "layers.MultiHeadAttention.init_cache"
for what, arg, build in [
    ("batch_size 0", "batch_size", lambda e: _init_cache(e, 0, CACHE_LEN)),
    ("max_length negative", "max_length", lambda e: _init_cache(e, B, -1)),
    ("max_length float", "max_length", lambda e: _init_cache(e, B, 2.5)),
    ("max_length NaN", "max_length", lambda e: _init_cache(e, B, NAN)),
    ("dtype unknown", "dtype", lambda e: _init_cache(e, B, CACHE_LEN, "nope")),
    ("dtype int32, then a step", ("dtype", "cache"), lambda e: _cache_of(e, "int32")),
    ("dtype bool, then a step", ("dtype", "cache"), lambda e: _cache_of(e, "bool")),
]:
    case(T, arg, what, build)

ROPE = {"rotary_max_length": 8}
T = "layers.MultiHeadAttention(cache)"
for what, arg, build in [
    ("cache_index negative int", "cache_index", lambda e: _mha_cached(e, -1)),
    ("cache_index int past the end", "cache_index", lambda e: _mha_cached(e, CACHE_LEN)),
    (
        "cache_index int, tokens overflow the end",
        "cache_index",
        lambda e: _mha_cached(e, CACHE_LEN - 1, t=2),
    ),
    ("cache_index negative np.int64", "cache_index", lambda e: _mha_cached(e, np.int64(-1))),
    (
        "cache_index np.int64 past the end",
        "cache_index",
        lambda e: _mha_cached(e, np.int64(CACHE_LEN)),
    ),
    (
        "cache_index np.int32 far past the end",
        "cache_index",
        lambda e: _mha_cached(e, np.int32(100)),
    ),
    (
        "cache_index negative eager tensor",
        "cache_index",
        lambda e: _mha_cached(e, e.t(np.int32(-1))),
    ),
    (
        "cache_index eager tensor past the end",
        "cache_index",
        lambda e: _mha_cached(e, e.t(np.int32(CACHE_LEN))),
    ),
    ("cache_index float", "cache_index", lambda e: _mha_cached(e, 1.5)),
    ("cache_index NaN", "cache_index", lambda e: _mha_cached(e, NAN)),
    ("cache_index bool", "cache_index", lambda e: _mha_cached(e, True)),
    ("cache_index float tensor", "cache_index", lambda e: _mha_cached(e, e.t(np.float32(1.0)))),
    ("cache_index vector tensor", "cache_index", lambda e: _mha_cached(e, e.i([0, 1]))),
    ("cache_index missing", "cache_index", lambda e: _mha_cached(e, None)),
    (
        "cache a single tensor",
        "cache",
        lambda e: _mha_cached(e, 0, cache=e.f(B, CACHE_LEN, HEADS, KEY_DIM)),
    ),
    (
        "cache wrong head width",
        "cache",
        lambda e: _mha_cached(e, 0, cache=(e.f(B, CACHE_LEN, HEADS, KEY_DIM + 1),) * 2),
    ),
    (
        "cache int32 tensors",
        "cache",
        lambda e: _mha_cached(e, 0, cache=(e.i(np.zeros((B, CACHE_LEN, HEADS, KEY_DIM))),) * 2),
    ),
    (
        "query longer than the cache",
        ("query", "cache"),
        lambda e: _mha_cached(e, 0, t=CACHE_LEN + 2),
    ),
    ("cache with causal", "causal", lambda e: _mha_cached(e, 0, causal=True)),
    (
        "rotary: int cache_index past the rotary table",
        ("cache_index", "rotary_max_length"),
        lambda e: _mha_cached(e, 10, layer_kw=ROPE, max_length=16),
    ),
    (
        "rotary: tensor cache_index past the rotary table",
        ("cache_index", "rotary_max_length"),
        lambda e: _mha_cached(e, e.t(np.int32(10)), layer_kw=ROPE, max_length=16),
    ),
    (
        "rotary: query longer than the rotary table",
        ("query", "rotary_max_length"),
        lambda e: _mha_call(e, e.f(B, 10, D), e.f(B, 10, D), layer_kw=ROPE),
    ),
]:
    case(T, arg, what, build)


# ---- TransformerEncoderLayer / TransformerDecoderLayer: constructors


def _block_new(e, cls, **kw):
    x = e.f(B, TQ, D)
    args = {"d_model": D, "num_heads": HEADS, "dff": 16, **kw}
    if cls == "TransformerEncoderLayer":
        return e.call(lambda: e.layers.TransformerEncoderLayer(**args)(x))
    ctx = e.f(B, TK, D)
    return e.call(lambda: e.layers.TransformerDecoderLayer(**args)(x, ctx))


for cls, what, arg, kw in [
    ("TransformerEncoderLayer", "d_model 0", "d_model", {"d_model": 0}),
    (
        "TransformerEncoderLayer",
        "d_model not divisible by num_heads",
        ("d_model", "num_heads"),
        {"num_heads": 3},
    ),
    ("TransformerEncoderLayer", "dff float", "dff", {"dff": 2.5}),
    ("TransformerEncoderLayer", "rate 1.5", "rate", {"rate": 1.5}),
    ("TransformerEncoderLayer", "norm_first string", "norm_first", {"norm_first": "yes"}),
    ("TransformerEncoderLayer", "epsilon negative", "epsilon", {"epsilon": -1.0}),
    ("TransformerEncoderLayer", "epsilon NaN", "epsilon", {"epsilon": NAN}),
    ("TransformerEncoderLayer", "activation unknown", "activation", {"activation": "nope"}),
    ("TransformerEncoderLayer", "seed string", "seed", {"seed": "a"}),
    ("TransformerEncoderLayer", "seed float", "seed", {"seed": 1.5}),
    ("TransformerDecoderLayer", "epsilon negative", "epsilon", {"epsilon": -1.0}),
    ("TransformerDecoderLayer", "seed string", "seed", {"seed": "a"}),
    (
        "TransformerDecoderLayer",
        "num_key_value_heads not dividing num_heads",
        "num_key_value_heads",
        {"num_heads": 4, "num_key_value_heads": 3},
    ),
    (
        "TransformerDecoderLayer",
        "num_key_value_heads 0",
        "num_key_value_heads",
        {"num_key_value_heads": 0},
    ),
    (
        "TransformerDecoderLayer",
        "rotary_max_length 0",
        "rotary_max_length",
        {"rotary_max_length": 0},
    ),
    (
        "TransformerDecoderLayer",
        "rotary_max_length float",
        "rotary_max_length",
        {"rotary_max_length": 1.5},
    ),
]:
    case(f"layers.{cls}", arg, what, functools.partial(_block_new, cls=cls, **kw))


# ---- TransformerEncoderLayer / TransformerDecoderLayer: calls


def _enc_call(e, x=None, **kw):
    layer = e.layers.TransformerEncoderLayer(D, HEADS, 16, rate=0.5)
    layer(e.f(B, TQ, D))
    x = e.f(B, TQ, D) if x is None else x
    return e.call(layer, x, **kw)


T = "layers.TransformerEncoderLayer.call"
for what, arg, build in [
    ("x width differs from d_model", "x", lambda e: _enc_call(e, e.f(B, TQ, D - 2))),
    ("x int32", "x", lambda e: _enc_call(e, e.i(np.ones((B, TQ, D))))),
    ("mask wrong shape", "mask", lambda e: _enc_call(e, mask=e.b(np.ones((B, TQ + 2))))),
    (
        "valid_lens past the length",
        "valid_lens",
        lambda e: _enc_call(e, valid_lens=e.i([TQ + 1, 1])),
    ),
    ("causal float 1.0", "causal", lambda e: _enc_call(e, causal=1.0)),
    ("training string False", "training", lambda e: _enc_call(e, training="False")),
]:
    case(T, arg, what, build)


def _dec(e):
    layer = e.layers.TransformerDecoderLayer(D, HEADS, 16, rate=0.5)
    layer(e.f(B, TQ, D), e.f(B, TK, D))
    return layer


def _dec_call(e, *args, **kw):
    layer = _dec(e)
    if not args:
        args = (e.f(B, TQ, D), e.f(B, TK, D))
    return e.call(layer, *args, **kw)


def _dec_cached(e, cache_index, **kw):
    layer = _dec(e)
    cache = layer.init_cache(B, CACHE_LEN)
    return e.call(layer, e.f(B, 1, D), e.f(B, TK, D), cache=cache, cache_index=cache_index, **kw)


def _dec_call_kv(e):
    layer = _dec(e)
    ctx = e.f(B, TK, D)
    kv = layer.precompute_context(ctx)
    return e.call(layer, e.f(B, TQ, D), ctx, context_key_value=kv)


def _dec_dtype_step(e, dtype):
    layer = _dec(e)
    x, ctx = e.f(B, 1, D), e.f(B, TK, D)
    return e.call(lambda: layer(x, ctx, cache=layer.init_cache(B, CACHE_LEN, dtype), cache_index=0))


T = "layers.TransformerDecoderLayer.call"
for what, arg, build in [
    ("context missing", "context", lambda e: _dec_call(e, e.f(B, TQ, D))),
    ("context and context_key_value", ("context", "context_key_value"), _dec_call_kv),
    (
        "context width differs from the build",
        "context",
        lambda e: _dec_call(e, e.f(B, TQ, D), e.f(B, TK, D - 2)),
    ),
    (
        "context_mask wrong shape",
        "context_mask",
        lambda e: _dec_call(e, context_mask=e.b(np.ones((B, TK + 1)))),
    ),
    (
        "context_valid_lens past the source",
        "context_valid_lens",
        lambda e: _dec_call(e, context_valid_lens=e.i([TK + 1, 1])),
    ),
    (
        "context_valid_lens negative",
        "context_valid_lens",
        lambda e: _dec_call(e, context_valid_lens=e.i([1, -1])),
    ),
    ("cache_index without cache", "cache_index", lambda e: _dec_call(e, cache_index=0)),
    ("mask with cache", "mask", lambda e: _dec_cached(e, 0, mask=e.b(np.ones((B, 1, CACHE_LEN))))),
    ("cache_index int past the end", "cache_index", lambda e: _dec_cached(e, CACHE_LEN)),
    (
        "cache_index np.int64 past the end",
        "cache_index",
        lambda e: _dec_cached(e, np.int64(CACHE_LEN)),
    ),
    (
        "cache_index eager tensor past the end",
        "cache_index",
        lambda e: _dec_cached(e, e.t(np.int32(CACHE_LEN + 1))),
    ),
    (
        "init_cache dtype int32, then a step",
        ("dtype", "cache"),
        lambda e: _dec_dtype_step(e, "int32"),
    ),
]:
    case(T, arg, what, build)


# ---- RotaryEmbedding / PositionEmbedding / PositionalEncoding layers


def _rot_new(e, x=None, **kw):
    x = e.f(B, TQ, HEADS, KEY_DIM) if x is None else x
    return e.call(lambda: e.layers.RotaryEmbedding(**kw)(x))


def _rot_call(e, x=None, **kw):
    layer = e.layers.RotaryEmbedding(8)
    layer(e.f(B, TQ, HEADS, KEY_DIM))
    x = e.f(B, TQ, HEADS, KEY_DIM) if x is None else x
    return e.call(layer, x, **kw)


T = "layers.RotaryEmbedding"
for what, arg, build in [
    ("max_length 0", "max_length", lambda e: _rot_new(e, max_length=0)),
    ("base 1", "base", lambda e: _rot_new(e, base=1)),
    ("call: x rank 3", "x", lambda e: _rot_call(e, e.f(B, TQ, D))),
    ("call: x odd feature axis", "x", lambda e: _rot_new(e, e.f(B, TQ, HEADS, 5), max_length=8)),
    (
        "call: x longer than max_length",
        ("x", "max_length"),
        lambda e: _rot_call(e, e.f(B, 10, HEADS, KEY_DIM)),
    ),
    ("call: offset int past the table", "offset", lambda e: _rot_call(e, offset=6)),
    ("call: offset np.int64 past the table", "offset", lambda e: _rot_call(e, offset=np.int64(7))),
    (
        "call: offset eager tensor past the table",
        "offset",
        lambda e: _rot_call(e, offset=e.t(np.int32(7))),
    ),
    (
        "call: offset negative eager tensor",
        "offset",
        lambda e: _rot_call(e, offset=e.t(np.int32(-2))),
    ),
    ("call: offset float tensor", "offset", lambda e: _rot_call(e, offset=e.t(np.float32(1.0)))),
]:
    case(T, arg, what, build)


def _pemb_new(e, **kw):
    x = e.f(B, TQ, D)
    return e.call(lambda: e.layers.PositionEmbedding(**kw)(x))


def _pemb_call(e, x=None, **kw):
    layer = e.layers.PositionEmbedding(8)
    layer(e.f(B, TQ, D))
    x = e.f(B, TQ, D) if x is None else x
    return e.call(layer, x, **kw)


T = "layers.PositionEmbedding"
for what, arg, build in [
    ("max_length 0", "max_length", lambda e: _pemb_new(e, max_length=0)),
    (
        "embeddings_initializer unknown",
        "embeddings_initializer",
        lambda e: _pemb_new(e, max_length=8, embeddings_initializer="nope"),
    ),
    (
        "call: inputs width differs from the build",
        "inputs",
        lambda e: _pemb_call(e, e.f(B, TQ, D + 2)),
    ),
    (
        "call: inputs longer than max_length",
        ("inputs", "max_length"),
        lambda e: _pemb_call(e, e.f(B, 10, D)),
    ),
    ("call: offset int past the table", "offset", lambda e: _pemb_call(e, offset=6)),
    ("call: offset np.int64 past the table", "offset", lambda e: _pemb_call(e, offset=np.int64(6))),
    (
        "call: offset eager tensor past the table",
        "offset",
        lambda e: _pemb_call(e, offset=e.t(np.int32(6))),
    ),
    (
        "call: offset negative eager tensor",
        "offset",
        lambda e: _pemb_call(e, offset=e.t(np.int32(-1))),
    ),
]:
    case(T, arg, what, build)


def _penc_new(e, **kw):
    x = e.f(B, TQ, D)
    return e.call(lambda: e.layers.PositionalEncoding(**kw)(x))


def _penc_call(e, x=None, **kw):
    layer = e.layers.PositionalEncoding(8, dropout=0.5)
    layer(e.f(B, TQ, D))
    x = e.f(B, TQ, D) if x is None else x
    return e.call(layer, x, **kw)


T = "layers.PositionalEncoding"
for what, arg, build in [
    ("max_length 0", "max_length", lambda e: _penc_new(e, max_length=0)),
    ("layout unknown", "layout", lambda e: _penc_new(e, layout="x")),
    ("dropout 1.5", "dropout", lambda e: _penc_new(e, dropout=1.5)),
    (
        "call: inputs longer than max_length",
        ("inputs", "max_length"),
        lambda e: _penc_call(e, e.f(B, 10, D)),
    ),
    ("call: inputs int32", "inputs", lambda e: _penc_call(e, e.i(np.ones((B, TQ, D))))),
]:
    case(T, arg, what, build)


# ---- LayerNormalization


def _lnorm(e, x=None, **kw):
    x = e.f(B, TQ, D) if x is None else x
    return e.call(lambda: e.layers.LayerNormalization(**kw)(x))


T = "layers.LayerNormalization"
for what, arg, build in [
    ("epsilon negative", "epsilon", lambda e: _lnorm(e, epsilon=-1.0)),
    ("epsilon string", "epsilon", lambda e: _lnorm(e, epsilon="a")),
    ("axis out of range", "axis", lambda e: _lnorm(e, axis=5)),
    ("center string", "center", lambda e: _lnorm(e, center="no")),
    ("call: inputs int32", "inputs", lambda e: _lnorm(e, e.i(np.ones((B, TQ, D))))),
]:
    case(T, arg, what, build)


# ---- DotProductAttention / AdditiveAttention layers


def _attn_new(e, cls, **kw):
    q, v = e.f(B, TQ, D), e.f(B, TK, D)
    return e.call(lambda: getattr(e.layers, cls)(**kw)(q, v))


def _attn_call(e, cls, *args, layer_kw=None, **kw):
    default = {"units": 5} if cls == "AdditiveAttention" else {}
    layer = getattr(e.layers, cls)(**(layer_kw or default))
    layer(e.f(B, TQ, D), e.f(B, TK, D))
    if not args:
        args = (e.f(B, TQ, D), e.f(B, TK, D))
    return e.call(layer, *args, **kw)


DPA, AA = "DotProductAttention", "AdditiveAttention"
T = "layers.DotProductAttention"
for what, arg, build in [
    ("scale 0", "scale", lambda e: _attn_new(e, DPA, scale=0.0)),
    (
        "call: query width 0",
        "query",
        lambda e: _attn_call(e, DPA, e.f(B, TQ, 0), e.f(B, TK, D), e.f(B, TK, 0)),
    ),
    (
        "call: key width differs from query",
        "key",
        lambda e: _attn_call(e, DPA, e.f(B, TQ, D), e.f(B, TK, D), e.f(B, TK, D + 1)),
    ),
    ("call: mask float", "mask", lambda e: _attn_call(e, DPA, mask=e.f(B, TQ, TK))),
    ("call: causal float 1.0", "causal", lambda e: _attn_call(e, DPA, causal=1.0)),
    (
        "call: training string False",
        "training",
        lambda e: _attn_call(e, DPA, training="False", layer_kw={"dropout": 0.5}),
    ),
]:
    case(T, arg, what, build)

T = "layers.AdditiveAttention"
for what, arg, build in [
    ("units 0", "units", lambda e: _attn_new(e, AA, units=0)),
    ("seed float", "seed", lambda e: _attn_new(e, AA, units=5, seed=1.5)),
    (
        "call: query int32",
        "query",
        lambda e: _attn_call(e, AA, e.i(np.ones((B, TQ, D))), e.f(B, TK, D)),
    ),
    ("call: value None", "value", lambda e: _attn_call(e, AA, e.f(B, TQ, D), None)),
    ("call: causal string", "causal", lambda e: _attn_call(e, AA, causal="no")),
]:
    case(T, arg, what, build)


# ---- FeatureMapAttention / Seq2SeqEncoder layers


def _fmap_new(e, *args, **kw):
    q, feats = e.f(B, D), e.f(B, 3, 3, 6)
    return e.call(lambda: e.layers.FeatureMapAttention(*args, **kw)(q, feats))


def _fmap_call(e, **kw):
    layer = e.layers.FeatureMapAttention(5)
    layer(e.f(B, D), e.f(B, 3, 3, 6))
    return e.call(layer, e.f(B, D), e.f(B, 3, 3, 6), **kw)


def _s2s_enc(e, tokens=None, **kw):
    layer = e.layers.Seq2SeqEncoder(10, 4, 6)
    layer(e.i(np.ones((B, 5))))
    tokens = e.i(np.ones((B, 5))) if tokens is None else tokens
    return e.call(layer, tokens, **kw)


for target, arg, what, build in [
    ("layers.FeatureMapAttention", "units", "units 0", lambda e: _fmap_new(e, 0)),
    (
        "layers.FeatureMapAttention",
        "mask",
        "call: mask wrong shape",
        lambda e: _fmap_call(e, mask=e.b(np.ones((B, 3, 4)))),
    ),
    ("layers.Seq2SeqEncoder", "tokens", "call: tokens float", lambda e: _s2s_enc(e, e.f(B, 5))),
    (
        "layers.Seq2SeqEncoder",
        "valid_lens",
        "call: valid_lens past the length",
        lambda e: _s2s_enc(e, valid_lens=e.i([7, 1])),
    ),
]:
    case(target, arg, what, build)


# ---- the model surfaces: tiny random transformers models, saved once per worker
#
# Every case below builds on `Env.folder(name)` (a transformers `save_pretrained` folder,
# random weights) and `Env.model(name)` (that folder loaded by `from_pretrained`, on Paddle
# with framework="paddle"); the checkpoint and CLI cases change a fresh copy of a folder.

VOCAB, CTX = 40, 32  # vocabulary and context of the tiny models
HF_MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=CTX)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=CTX)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=VOCAB, d_model=16, d_kv=8, num_heads=2, num_layers=1, d_ff=24,
        decoder_start_token_id=0)),
    "bert": ("BertModel", "BertConfig", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=CTX, type_vocab_size=2)),
}  # fmt: skip
IDS = np.array([[1, 2, 3], [4, 5, 6]])


def _with(ids, at=(0, 1), value=-1, dtype="int64"):
    out = np.array(ids, dtype=dtype)
    out[at] = value
    return out


def _model_call(e, name, **kw):
    inputs = {"input_ids": IDS}
    if name == "t5":
        inputs["decoder_input_ids"] = np.zeros((len(IDS), 2), np.int64)
    inputs.update(kw)
    return e.call(e.model(name), **{k: v for k, v in inputs.items() if v is not ...})


CALLS = [  # (what, the argument to name, the call's changed inputs); then per family
    ("input_ids negative", "input_ids", {"input_ids": _with(IDS)}),
    ("input_ids = vocab_size", "input_ids", {"input_ids": _with(IDS, value=VOCAB)}),
    ("input_ids int64 2**32 + 5", "input_ids", {"input_ids": _with(IDS, value=2**32 + 5)}),
    ("input_ids float", "input_ids", {"input_ids": IDS + 0.7}),
    ("input_ids rank 1", "input_ids", {"input_ids": IDS[0]}),
    ("input_ids empty batch", "input_ids", {"input_ids": np.zeros((0, 3), np.int64)}),
    ("input_ids (2, 0)", "input_ids", {"input_ids": np.zeros((2, 0), np.int64)}),
    ("input_ids missing", "input_ids", {"input_ids": ...}),
    ("input_ids string", "input_ids", {"input_ids": "hello"}),
    ("input_ids past the context", "input_ids", {"input_ids": np.ones((1, CTX + 1), int)}),
    ("attention_mask wrong shape", "attention_mask", {"attention_mask": np.ones((2, 4))}),
    ("attention_mask values 2", "attention_mask", {"attention_mask": np.full((2, 3), 2)}),
    ("attention_mask fractional", "attention_mask", {"attention_mask": np.full((2, 3), 0.5)}),
    ("attention_mask string", "attention_mask", {"attention_mask": "all"}),
    ("unknown argument labels", "labels", {"labels": IDS}),
    ("unknown argument past_key_values", "past_key_values", {"past_key_values": ()}),
]
FAMILY_CALLS = {
        "bert": [
            ("token_type_ids 2", "token_type_ids", {"token_type_ids": _with(IDS, value=2)}),
            ("token_type_ids negative", "token_type_ids", {"token_type_ids": _with(IDS)}),
            ("token_type_ids float", "token_type_ids", {"token_type_ids": IDS * 0.0 + 0.5}),
        ],
        "t5": [
            ("decoder_input_ids missing", "decoder_input_ids", {"decoder_input_ids": ...}),
            ("decoder_input_ids negative", "decoder_input_ids",
             {"decoder_input_ids": _with(IDS)}),
            ("decoder_attention_mask wrong shape", "decoder_attention_mask",
             {"decoder_attention_mask": np.ones((2, 5))}),
        ],
}  # fmt: skip
T = "model.call"
for name in ("llama", "gpt2", "t5", "bert"):
    for what, arg, kw in CALLS + FAMILY_CALLS.get(name, []):
        if name != "t5" or "context" not in what:  # T5 has no position limit
            build = functools.partial(_model_call, name=name, **kw)
            case(T, arg, f"{name}: {what}", build, paddle=True)


def _generate(e, name, ids=IDS, *, valid=None, **kw):
    """``model.generate(ids, max_new_tokens=2, **kw)``; ``valid``: options of a call that
    must succeed first (NumPy scalars), in the set-up."""
    model = e.model(name)
    if valid is not None:
        model.generate(IDS, max_new_tokens=1, do_sample=True, seed=0, **valid)
    kw.setdefault("max_new_tokens", 2)
    return e.call(model.generate, ids, **kw)


T = "model.generate"
S = {"do_sample": True, "seed": 0}
for name in ("llama", "t5"):
    for what, arg, kw in [
        ("max_new_tokens 0", "max_new_tokens", {"max_new_tokens": 0}),
        ("max_new_tokens negative", "max_new_tokens", {"max_new_tokens": -1}),
        ("max_new_tokens 10**9", "max_new_tokens", {"max_new_tokens": 10**9}),
        ("max_new_tokens float", "max_new_tokens", {"max_new_tokens": 2.5}),
        ("max_new_tokens bool", "max_new_tokens", {"max_new_tokens": True}),
        ("max_new_tokens string", "max_new_tokens", {"max_new_tokens": "2"}),
        ("temperature 0", "temperature", {**S, "temperature": 0.0}),
        ("temperature negative", "temperature", {**S, "temperature": -1.0}),
        ("temperature NaN", "temperature", {**S, "temperature": NAN}),
        ("temperature inf", "temperature", {**S, "temperature": INF}),
        ("temperature 1e-320", "temperature", {**S, "temperature": 1e-320}),
        ("temperature string", "temperature", {**S, "temperature": "0.7"}),
        ("temperature np.float32 negative (np.float32(0.7) accepted first)", "temperature",
         {**S, "temperature": np.float32(-0.7), "valid": {"temperature": np.float32(0.7)}}),
        ("top_p 0", "top_p", {**S, "top_p": 0.0}),
        ("top_p 1.5", "top_p", {**S, "top_p": 1.5}),
        ("top_p NaN", "top_p", {**S, "top_p": NAN}),
        ("top_p np.float64 1.5 (np.float64(0.9) accepted first)", "top_p",
         {**S, "top_p": np.float64(1.5), "valid": {"top_p": np.float64(0.9)}}),
        ("top_k 0", "top_k", {**S, "top_k": 0}),
        ("top_k negative", "top_k", {**S, "top_k": -1}),
        ("top_k float", "top_k", {**S, "top_k": 2.5}),
        ("top_k np.int64 0 (np.int64(5) accepted first)", "top_k",
         {**S, "top_k": np.int64(0), "valid": {"top_k": np.int64(5)}}),
        ("do_sample string", "do_sample", {"do_sample": "yes"}),
        ("seed string", "seed", {**S, "seed": "a"}),
        ("pad_token_id = vocab_size", "pad_token_id", {"pad_token_id": VOCAB}),
        ("pad_token_id negative", "pad_token_id", {"pad_token_id": -1}),
        ("pad_token_id 10**6 with eos", "pad_token_id", {"pad_token_id": 10**6, "eos_token_id": 3}),
        ("eos_token_id = vocab_size", "eos_token_id", {"eos_token_id": VOCAB}),
        ("eos_token_id list with a negative", "eos_token_id", {"eos_token_id": [3, -1]}),
        ("eos_token_id float", "eos_token_id", {"eos_token_id": 3.0}),
        ("strategy unknown", "strategy", {"strategy": "fastest"}),
        ("input_ids negative", "input_ids", {"ids": _with(IDS)}),
        ("input_ids int64 2**32 + 5", "input_ids", {"ids": _with(IDS, value=2**32 + 5)}),
        ("input_ids float", "input_ids", {"ids": IDS + 0.5}),
        ("input_ids batch 0", "input_ids", {"ids": np.zeros((0, 3), np.int64)}),
        ("input_ids (2, 0)", "input_ids", {"ids": np.zeros((2, 0), np.int64)}),
        ("attention_mask a row of pads only", "attention_mask",
         {"attention_mask": np.array([[1, 1, 1], [0, 0, 0]])}),
        ("attention_mask wrong shape", "attention_mask", {"attention_mask": np.ones((2, 4))}),
        ("attention_mask right padding", "attention_mask",
         {"attention_mask": np.array([[1, 1, 1], [1, 1, 0]])}),
        ("prompt past the context", ("input_ids", "max_new_tokens"),
         {"ids": np.ones((1, CTX + 1), int)}),
    ]:  # fmt: skip
        if name == "t5" and ("right padding" in what or "context" in what):
            continue  # T5's encoder takes any padding and has no position limit
        case(T, arg, f"{name}: {what}", functools.partial(_generate, name=name, **kw),
             paddle=True)  # fmt: skip


# ---- checkpoint folders: one table of hostile folders, loaded by from_pretrained and
# handed to the CLIs. A maker returns the folder (a fresh copy, changed).


def _copy(e, name="llama"):
    import shutil

    dst = Path(tempfile.mkdtemp(prefix=f"{name}_", dir=e.scratch))
    shutil.copytree(e.folder(name), dst, dirs_exist_ok=True)
    return dst


def _config(e, name="llama", **changes):
    """A copy whose config.json has ``changes`` (``...`` deletes a key)."""
    folder = _copy(e, name)
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        cfg.pop(k, None) if v is ... else cfg.__setitem__(k, v)
    (folder / "config.json").write_text(json.dumps(cfg))  # NaN/Infinity as Python writes them
    return folder


def _state(e, name="llama", change=None):
    """A copy whose model.safetensors holds ``change(tensors)`` (a dict of arrays)."""
    from safetensors.numpy import load_file, save_file

    folder = _copy(e, name)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    save_file(change(dict(tensors)), path, metadata={"format": "pt"})
    return folder


def _edit(tensors, name, fn):
    tensors[name] = fn(tensors[name])
    return tensors


Q = "model.layers.0.self_attn.q_proj.weight"


def _nan(a):
    a = a.copy()
    a.flat[0] = np.nan
    return a


def _float8(e):
    """model.safetensors written by hand with ``q_proj`` as F8_E4M3 (NumPy has no float8)."""
    from safetensors.numpy import load_file

    folder = _copy(e)
    path = folder / "model.safetensors"
    tensors, header, blobs, offset = load_file(path), {}, [], 0
    for k, v in tensors.items():
        dtype, data = ("F8_E4M3", bytes(v.size)) if k == Q else ("F32", v.tobytes())
        header[k] = {
            "dtype": dtype,
            "shape": list(v.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    return folder


def _truncated(e):
    folder = _copy(e)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return folder


def _fifo_shard(e):
    from safetensors.numpy import load_file

    folder = _copy(e)
    names = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _link_out(e):
    folder = _copy(e)
    outside = Path(tempfile.mkdtemp(dir=e.scratch)) / "weights.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "model.safetensors").symlink_to(outside)
    return folder


def _index_escape(e):
    """An index naming a shard outside the folder (``../../../../../etc/passwd``)."""
    from safetensors.numpy import load_file

    folder = _copy(e)
    names = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    index = {"weight_map": dict.fromkeys(names, "../../../../../etc/passwd")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _pickle(e):
    import torch
    from safetensors.numpy import load_file

    folder = _copy(e)
    state = {k: torch.from_numpy(v) for k, v in load_file(folder / "model.safetensors").items()}
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def _file_edit(name, text):
    def make(e):
        folder = _copy(e)
        path = folder / name
        path.unlink() if text is None else path.write_text(text)
        return folder

    return make


def _missing(e):
    return Path(e.scratch) / "no such folder"


FOLDERS = [  # (what, names a clear error gives, maker)
    ("missing folder", ("path", "folder", "no such folder"), _missing),
    ("no config.json", "config.json", _file_edit("config.json", None)),
    ("config.json not JSON", "config.json", _file_edit("config.json", "{not json")),
    ("config.json a list", "config.json", _file_edit("config.json", "[1, 2]")),
    ("no weights file", ("model.safetensors", "weights"), _file_edit("model.safetensors", None)),
    ("unknown model_type", "model_type", lambda e: _config(e, model_type="mamba")),
    ("model_type missing", "model_type", lambda e: _config(e, model_type=...)),
    ("vocab_size missing", "vocab_size", lambda e: _config(e, vocab_size=...)),
    ("vocab_size string", "vocab_size", lambda e: _config(e, vocab_size="40")),
    ("hidden_size float", "hidden_size", lambda e: _config(e, hidden_size=16.5)),
    ("num_attention_heads 0", "num_attention_heads", lambda e: _config(e, num_attention_heads=0)),
    ("rms_norm_eps Infinity", "rms_norm_eps", lambda e: _config(e, rms_norm_eps=INF)),
    ("rms_norm_eps NaN", "rms_norm_eps", lambda e: _config(e, rms_norm_eps=NAN)),
    ("rope_theta negative", "rope_theta", lambda e: _config(e, rope_theta=-1.0)),
    ("max_position_embeddings 0", "max_position_embeddings",
     lambda e: _config(e, max_position_embeddings=0)),
    ("num_hidden_layers 10**6", "num_hidden_layers", lambda e: _config(e, num_hidden_layers=10**6)),
    ("gpt2 n_layer 10**7", "n_layer", lambda e: _config(e, "gpt2", n_layer=10**7)),
    ("bert type_vocab_size string", "type_vocab_size",
     lambda e: _config(e, "bert", type_vocab_size="2")),
    ("t5 relative_attention_num_buckets 1", "relative_attention_num_buckets",
     lambda e: _config(e, "t5", relative_attention_num_buckets=1)),
    ("t5 relative_attention_max_distance 4", "relative_attention_max_distance",
     lambda e: _config(e, "t5", relative_attention_max_distance=4)),
    ("config dtype float16, tensors float32", ("dtype", "float16"),
     lambda e: _config(e, dtype="float16", torch_dtype=...)),
    ("config dtype unknown", "dtype", lambda e: _config(e, dtype="float7", torch_dtype=...)),
    ("tensor missing", Q, lambda e: _state(e, change=lambda t: (t.pop(Q), t)[1])),
    ("tensor unexpected", "extra.weight",
     lambda e: _state(e, change=lambda t: {**t, "extra.weight": np.zeros(3, np.float32)})),
    ("tensor mis-shaped", Q, lambda e: _state(e, change=lambda t: _edit(t, Q, lambda a: a[:-1]))),
    ("tensor int32", Q, lambda e: _state(e, change=lambda t: _edit(t, Q, lambda a: a.astype("int32")))),
    ("NaN weight", Q, lambda e: _state(e, change=lambda t: _edit(t, Q, _nan))),
    ("float8 tensor (header by hand)", Q, _float8),
    ("truncated model.safetensors", "model.safetensors", _truncated),
    ("model.safetensors not safetensors", "model.safetensors",
     _file_edit("model.safetensors", "hello")),
    ("a FIFO named as a shard", "model-00001-of-00001.safetensors", _fifo_shard),
    ("model.safetensors a link out of the folder", ("model.safetensors", "link"), _link_out),
    ("index naming ../../../../../etc/passwd", ("../../../../../etc/passwd", "passwd"),
     _index_escape),
    ("pytorch_model.bin without trust_pickle", ("trust_pickle", "--trust-pickle"), _pickle),
]  # fmt: skip

T = "checkpoint.from_pretrained"
for what, names, maker in FOLDERS:
    case(T, names, what, lambda e, maker=maker: e.call(e.load, maker(e)), paddle=True)
for what, arg, kw in [
    ("trust_pickle string", "trust_pickle", {"trust_pickle": "yes"}),
    ("dtype int8", "dtype", {"dtype": "int8"}),
    ("framework unknown", "framework", {"framework": "mxnet"}),
    ("path None", "path", {"path": None}),
    ("path an int", "path", {"path": 3}),
]:
    case(T, arg, what, lambda e, kw=kw: e.call(e.load, kw.pop("path", e.folder("llama")), **kw),
         paddle=True)  # fmt: skip


def _save(e, path=None, **kw):
    model = e.model("llama")
    return e.call(model.save_pretrained, Path(e.scratch) / "saved" if path is None else path, **kw)


def _unwritable(e):
    """A folder this process cannot write into (read-only; as root, a folder of /proc)."""
    if os.geteuid() == 0:
        return Path("/proc/self/multiattn_save")
    folder = Path(tempfile.mkdtemp(dir=e.scratch))
    folder.chmod(0o500)
    return folder / "model"


def _under_a_file(e):
    parent = Path(tempfile.mkdtemp(dir=e.scratch)) / "a_file"
    parent.write_text("x")
    return parent / "model"


def _nonempty(e):
    return _copy(e)


T = "checkpoint.save_pretrained"
for what, arg, build in [
    ("overwrite string 'no'", "overwrite", lambda e: _save(e, _nonempty(e), overwrite="no")),
    ("overwrite 1", "overwrite", lambda e: _save(e, overwrite=1)),
    ("path None", "path", lambda e: e.call(e.model("llama").save_pretrained, None)),
    ("path an int", "path", lambda e: e.call(e.model("llama").save_pretrained, 3)),
    ("path a file", "path", lambda e: _save(e, _under_a_file(e).parent)),
    ("parent a file", ("path", "Not a directory", "a_file"), lambda e: _save(e, _under_a_file(e))),
    ("folder not empty, no overwrite", ("overwrite", "non-empty"), lambda e: _save(e, _nonempty(e))),
    ("read-only parent", ("path", "Permission denied", "Read-only", "No such file"),
     lambda e: _save(e, _unwritable(e))),
]:  # fmt: skip
    case(T, arg, what, build, paddle=True)


# ---- the CLIs, each run as a subprocess: clear = exit code 1 or 2 and a last line of
# stderr that names the problem, no traceback


class CLIError(ValueError):
    """A CLI's one-line error (exit code 1 or 2, no traceback)."""


_PROGRESS = re.compile(r"\d+%\|")


def _cli(argv: list[str], timeout: float = 120) -> str:
    cmd = [sys.executable, "-c", "import sys; from multiattn.cli import main; sys.exit(main())"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        proc = subprocess.run(cmd + argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"hung: still running after {timeout:.0f} s") from None
    # The last line, progress bars (transformers' "Loading weights: 100%|...") left out.
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not _PROGRESS.search(ln)]
    lines = lines or [ln for ln in proc.stdout.splitlines() if ln.strip()]
    last = lines[-1] if lines else "(no message)"
    if proc.returncode == 0:
        return f"exit 0: {proc.stdout.strip()[-150:]}"
    if proc.returncode in (1, 2) and "Traceback (most recent call last)" not in proc.stderr:
        raise CLIError(last)
    raise RuntimeError(f"exit {proc.returncode}: {last}")


def _cli_case(e, maker, kind):
    folder = maker(e)
    out = Path(tempfile.mkdtemp(dir=e.scratch)) / "out"
    if kind == "port":
        return e.call(_cli, ["port", "--from", "hf", "--to", "hf", str(folder), str(out)])
    argv = ["conformance", "--model", str(folder), "--frameworks", "numpy", "--tokens", "2"]
    return e.call(_cli, [*argv, "--timeout", "100"])


CLI_FOLDERS = {"missing folder", "no config.json", "config.json not JSON", "unknown model_type",
               "vocab_size missing", "bert type_vocab_size string", "rms_norm_eps Infinity",
               "num_hidden_layers 10**6", "tensor mis-shaped", "NaN weight",
               "truncated model.safetensors", "a FIFO named as a shard",
               "model.safetensors a link out of the folder",
               "index naming ../../../../../etc/passwd", "pytorch_model.bin without trust_pickle"}  # fmt: skip
for what, names, maker in FOLDERS:
    if what in CLI_FOLDERS:
        for kind in ("port", "conformance"):
            build = functools.partial(_cli_case, maker=maker, kind=kind)
            case(f"cli.{kind}", names, what, build, only=("numpy",))
for what, arg, argv in [
    ("port: --to hf into a parent that is a file", ("dst", "a_file", "Not a directory"),
     lambda e, f: ["port", "--from", "hf", "--to", "hf", f, str(_under_a_file(e))]),
    ("port: --max-size 1 on a bigger folder", ("--max-size", "max-size", "max_size"),
     lambda e, f: ["port", "--from", "hf", "--to", "hf", "--max-size", "1", f,
                   str(Path(tempfile.mkdtemp(dir=e.scratch)) / "out")]),
    ("port: --num-heads with --from hf", ("--num-heads", "num-heads"),
     lambda e, f: ["port", "--from", "hf", "--to", "hf", "--num-heads", "3", f,
                   str(Path(tempfile.mkdtemp(dir=e.scratch)) / "out")]),
    ("conformance: --length past the context", ("--length", "length", "max_position_embeddings"),
     lambda e, f: ["conformance", "--model", f, "--frameworks", "numpy", "--length", "100"]),
    ("conformance: --json into a missing folder", ("--json", "json"),
     lambda e, f: ["conformance", "--model", f, "--frameworks", "numpy", "--json",
                   str(Path(e.scratch) / "missing" / "r.json")]),
]:  # fmt: skip
    target = "cli.port" if what.startswith("port") else "cli.conformance"
    case(target, arg, what.split(": ", 1)[1],
         lambda e, argv=argv: e.call(_cli, argv(e, str(e.folder("llama")))), only=("numpy",))  # fmt: skip


# ---- the harness's own checks (tests/test_bad_input_sweep.py), only on request


def _raise(exc: BaseException) -> None:
    raise exc


def _crash() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGSEGV)


if os.environ.get(SELFTEST_ENV) == "1":
    for what, build in [
        ("clear", lambda e: e.call(_raise, ValueError("f: `x` must be positive."))),
        ("unclear", lambda e: e.call(_raise, RuntimeError("f: `x` must be positive."))),
        ("silent", lambda e: e.call(lambda: np.zeros(2))),
        ("setup fails", lambda e: 1 / 0),
        ("segfault", lambda e: e.call(_crash)),
        ("after the segfault", lambda e: e.call(_raise, TypeError("`x`"))),
        ("hang", lambda e: e.call(time.sleep, 3600)),
        ("after the hang", lambda e: e.call(lambda: None)),
    ]:
        case("_selftest", "x", what, build, paddle=True)


# --------------------------------------------------------------------------- worker side


class Env:
    """What a case builds its inputs with, in one worker process (one backend)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.rng = np.random.default_rng(0)
        if backend == "paddle":
            import multiattn.backends.paddle  # noqa: F401  (first: registers the namespace)
            import paddle

            self._paddle = paddle
        import keras

        from multiattn import layers, ops

        self.keras, self.ops, self.layers = keras, ops, layers
        self._scratch: tempfile.TemporaryDirectory | None = None
        self._folders: dict[str, Path] = {}
        self._models: dict[str, Any] = {}

    # the model surfaces: tiny transformers models, made once per worker ------------------
    @property
    def scratch(self) -> str:
        """This worker's temporary folder (removed when the worker ends)."""
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="bad_input_models_")
        return self._scratch.name

    def folder(self, name: str) -> Path:
        """A transformers ``save_pretrained`` folder of `HF_MODELS` ``name`` (seed 0)."""
        if name not in self._folders:
            import torch
            import transformers

            model_cls, config_cls, kw = HF_MODELS[name]
            torch.manual_seed(0)
            config = getattr(transformers, config_cls)(**kw)
            path = Path(self.scratch) / f"hf_{name}"
            getattr(transformers, model_cls)(config).save_pretrained(path)
            self._folders[name] = path
        return self._folders[name]

    def load(self, path: Any, **kw: Any) -> Any:
        """``from_pretrained(path, **kw)``, with framework="paddle" on Paddle."""
        from multiattn.models import from_pretrained

        if self.backend == "paddle":
            kw.setdefault("framework", "paddle")
        return from_pretrained(path, **kw)

    def model(self, name: str) -> Any:
        """`folder` ``name`` loaded (once per worker)."""
        if name not in self._models:
            self._models[name] = self.load(self.folder(name))
        return self._models[name]

    def versions(self) -> dict[str, str]:
        out = {"keras": self.keras.__version__, "keras_backend": self.keras.backend.backend()}
        module = {"jax": "jax", "torch": "torch", "tensorflow": "tensorflow"}.get(self.backend)
        if self.backend == "paddle":
            out["paddle"] = self._paddle.__version__
        elif module:
            out[module] = __import__(module).__version__
        out["numpy"] = np.__version__
        return out

    # tensors of this backend -----------------------------------------------------------
    def t(self, x: Any) -> Any:
        """``x`` (NumPy data) as a tensor of this backend, dtype kept."""
        arr = np.asarray(x)
        if self.backend == "paddle":
            return self._paddle.to_tensor(arr)
        return self.keras.ops.convert_to_tensor(arr, dtype=arr.dtype.name)

    def f(self, *shape: int, dtype: str = "float32") -> Any:
        return self.t(self.rng.standard_normal(shape).astype(dtype))

    def i(self, values: Any, dtype: str = "int32") -> Any:
        return self.t(np.asarray(values).astype(dtype))

    def b(self, values: Any) -> Any:
        return self.t(np.asarray(values).astype(bool))

    def c(self, *shape: int) -> Any:
        return self.t((self.rng.standard_normal(shape) + 1j).astype(np.complex64))

    def foreign(self, x: np.ndarray) -> Any:
        """``x`` as a tensor of a second framework (torch, or jax on the torch backend)."""
        if self.backend == "torch":
            import jax.numpy as jnp

            return jnp.asarray(x)
        import torch

        return torch.from_numpy(np.ascontiguousarray(x))

    @staticmethod
    def call(fn: Callable, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        return functools.partial(fn, *args, **kwargs)

    # results -----------------------------------------------------------------------------
    def materialize(self, value: Any) -> Any:
        """NumPy copies of every tensor in ``value`` (forces lazy backends to compute)."""
        if isinstance(value, (tuple, list)):
            return type(value)(self.materialize(v) for v in value)
        if isinstance(value, dict):
            return {k: self.materialize(v) for k, v in value.items()}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if self.backend == "paddle" and isinstance(value, self._paddle.Tensor):
            return value.numpy()
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            return np.asarray(self.keras.ops.convert_to_numpy(value))
        return value


def describe(value: Any) -> str:
    """A short description of a materialized result."""
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value[:4])
        return f"{type(value).__name__}({inner}{', ...' if len(value) > 4 else ''})"
    if isinstance(value, np.ndarray):
        text = f"{value.dtype} {tuple(value.shape)}"
        if value.dtype.kind in "fc" and value.size and not np.all(np.isfinite(value)):
            text += " with NaN/Inf"
        return text
    return type(value).__name__


def _emit(out, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def run_case(env: Env, c: Case) -> dict:
    """Build and run one case; the record of its result."""
    record: dict[str, Any] = {"event": "result", "id": c.id}
    start = time.perf_counter()
    try:
        thunk = c.build(env)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        record.update(
            outcome="setup_error",
            exc_type=_qualname(exc),
            message=library_message(exc)[:MESSAGE_LIMIT],
            traceback=traceback.format_exc(limit=-4)[-MESSAGE_LIMIT:],
        )
        record["seconds"] = round(time.perf_counter() - start, 4)
        return record
    exc = result = None
    try:
        result = env.materialize(thunk())
    except KeyboardInterrupt:
        raise
    except BaseException as err:
        exc = err
    record["outcome"] = classify(exc, c.args)
    if exc is None:
        record["result"] = describe(result)
    else:
        record.update(exc_type=_qualname(exc), message=library_message(exc)[:MESSAGE_LIMIT])
        if record["outcome"] == "unclear":
            record["where"] = _raise_site(exc)
    record["seconds"] = round(time.perf_counter() - start, 4)
    return record


def _qualname(exc: BaseException) -> str:
    cls = type(exc)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _raise_site(exc: BaseException) -> str:
    """``file:line in function`` of the innermost frame that raised ``exc``."""
    tb = exc.__traceback__
    frames = traceback.extract_tb(tb) if tb is not None else []
    if not frames:
        return ""
    frame = frames[-1]
    path = frame.filename
    try:
        path = str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        parts = Path(path).parts
        if "site-packages" in parts:
            path = "/".join(parts[parts.index("site-packages") + 1 :])
    return f"{path}:{frame.lineno} in {frame.name}"


def worker(backend: str, ids_file: str, results_file: str) -> None:
    import warnings

    warnings.simplefilter("ignore")
    by_id = {c.id: c for c in CASES}
    ids = json.loads(Path(ids_file).read_text())
    if any(not by_id[cid].target.startswith(("ops.", "layers.", "_selftest")) for cid in ids):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if backend != "paddle":  # torch's stack before TensorFlow (conformance/import_order.py)
            from conformance.import_order import import_triton_first

            import_triton_first()
            import transformers  # noqa: F401
    with open(results_file, "a", encoding="utf-8") as out:
        env = Env(backend)
        _emit(out, {"event": "versions", "versions": env.versions()})
        for cid in ids:
            _emit(out, {"event": "start", "id": cid})
            _emit(out, run_case(env, by_id[cid]))
        _emit(out, {"event": "done"})


# --------------------------------------------------------------------------- parent side


def cases_for(backend: str, patterns: Sequence[str] = ()) -> list[Case]:
    chosen = [c for c in CASES if c.runs_on(backend)]
    if patterns:
        chosen = [c for c in chosen if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]
    return chosen


def worker_env(backend: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KERAS_BACKEND", None)
    if backend != "paddle":
        env["KERAS_BACKEND"] = backend
    if backend == "jax":
        env["JAX_ENABLE_X64"] = "1"  # as the test suite runs jax: float64 stays float64
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_backend(
    backend: str, cases: list[Case], timeout: float, max_restarts: int = 20
) -> dict[str, Any]:
    """Run ``cases`` in worker processes for ``backend``; a worker that crashes is noted
    and a fresh one resumes after the crashing case; the whole backend gets ``timeout``
    seconds, after which the case in progress is unclear (timeout) and the rest not run."""
    results: dict[str, dict] = {}
    versions: dict[str, str] = {}
    notes: list[str] = []
    pending = [c.id for c in cases]
    deadline = time.monotonic() + timeout
    start = time.monotonic()
    restarts = 0
    with tempfile.TemporaryDirectory(prefix="bad_input_sweep_") as tmp:
        while pending:
            ids_file, results_file = Path(tmp) / "ids.json", Path(tmp) / "results.jsonl"
            ids_file.write_text(json.dumps(pending))
            results_file.write_text("")
            log_file = Path(tmp) / "worker.log"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", backend]
            cmd += ["--ids-file", str(ids_file), "--results-file", str(results_file)]
            remaining = deadline - time.monotonic()
            timed_out = False
            with open(log_file, "w", encoding="utf-8") as log:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=worker_env(backend), stdout=log, stderr=subprocess.STDOUT
                )
                try:
                    proc.wait(timeout=max(remaining, 1.0))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    proc.kill()
                    proc.wait()
            in_progress, done = None, False
            for line in results_file.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec["event"] == "versions":
                    versions = rec["versions"]
                elif rec["event"] == "start":
                    in_progress = rec["id"]
                elif rec["event"] == "result":
                    results[rec["id"]] = rec
                    in_progress = None
                elif rec["event"] == "done":
                    done = True
            pending = [cid for cid in pending if cid not in results]
            if done and not pending:
                break
            log_tail = log_file.read_text(encoding="utf-8", errors="replace")[-1500:]
            if timed_out:
                notes.append(f"timeout after {timeout:.0f} s")
                if in_progress is not None:
                    results[in_progress] = {
                        "id": in_progress,
                        "outcome": "unclear",
                        "exc_type": "timeout",
                        "message": f"the case was still running when the backend's {timeout:.0f} s ran out",
                    }
                for cid in pending:
                    results.setdefault(cid, {"id": cid, "outcome": "not_run"})
                break
            code = proc.returncode
            why = f"signal {-code}" if code < 0 else f"exit code {code}"
            if in_progress is None:  # died before or between cases: harness or import failure
                notes.append(f"worker failed ({why}) outside any case: {log_tail[-500:]}")
                for cid in pending:
                    results.setdefault(
                        cid, {"id": cid, "outcome": "not_run", "message": log_tail[-500:]}
                    )
                break
            notes.append(f"worker crashed ({why}) in {in_progress}")
            results[in_progress] = {
                "id": in_progress,
                "outcome": "unclear",
                "exc_type": "crash",
                "message": f"the worker process died ({why}); output tail: {log_tail[-600:]}",
            }
            pending = [cid for cid in pending if cid != in_progress]
            restarts += 1
            if restarts > max_restarts:
                notes.append("too many crashes: the remaining cases were not run")
                for cid in pending:
                    results.setdefault(cid, {"id": cid, "outcome": "not_run"})
                break
    by_id = {c.id: c for c in cases}
    rows = []
    for c in cases:
        rec = dict(results.get(c.id, {"id": c.id, "outcome": "not_run"}))
        rec.pop("event", None)
        rec.update(backend=backend, target=c.target, args=list(c.args), what=c.what)
        rows.append(rec)
    counts = {k: 0 for k in (*OUTCOMES, *EXTRA)}
    for rec in rows:
        counts[rec["outcome"]] += 1
    assert set(by_id) == {r["id"] for r in rows}
    return {
        "backend": backend,
        "cases": len(cases),
        "counts": counts,
        "seconds": round(time.monotonic() - start, 1),
        "versions": versions,
        "notes": notes,
        "results": rows,
    }


def tree_revision() -> str | None:
    """The checked-out commit (read only; the working tree may differ from it)."""
    try:
        proc = subprocess.run(
            ["git", "--no-optional-locks", "rev-parse", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None


def _short(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render(report: dict, details: bool, width: int = 160) -> None:
    """The counts per backend and, with ``details``, the runs that were not clear (every
    cell is plain text: messages such as "dtype must be any of [bool, ...]" are not rich
    markup)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=width)
    table = Table(title="Invalid inputs per backend", title_justify="left")
    for col in ("backend", "cases", "clear", "unclear", "silent", "not run", "setup error", "s"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    table.add_column("notes", max_width=60)
    totals = {k: 0 for k in (*OUTCOMES, *EXTRA)}
    for b in report["backends"]:
        c = b["counts"]
        for k in totals:
            totals[k] += c[k]
        table.add_row(
            b["backend"],
            str(b["cases"]),
            *(str(c[k]) for k in (*OUTCOMES, *EXTRA)),
            f"{b['seconds']:.0f}",
            Text(_short("; ".join(b["notes"]), 300)),
        )
    if len(report["backends"]) > 1:
        table.add_row(
            "total",
            str(sum(b["cases"] for b in report["backends"])),
            *(str(totals[k]) for k in (*OUTCOMES, *EXTRA)),
            "",
            "",
            style="bold",
        )
    console.print(table)
    surfaces = surface_counts(report)
    if len(surfaces) > 1:
        by = Table(title="Runs per surface (every backend)", title_justify="left")
        by.add_column("surface")
        for col in ("runs", "clear", "unclear", "silent", "not run", "setup error"):
            by.add_column(col, justify="right")
        for name, c in surfaces.items():
            by.add_row(name, str(sum(c.values())), *(str(c[k]) for k in (*OUTCOMES, *EXTRA)))
        console.print(by)
    if not details:
        return
    grouped = group_non_clear(report)
    if not grouped:
        console.print("Every run gave a clear error.")
        return
    det = Table(title="Runs that were not clear", title_justify="left")
    det.add_column("case", overflow="fold", ratio=3)
    det.add_column("must name", overflow="fold", ratio=1)
    det.add_column("backends", overflow="fold", ratio=1)
    det.add_column("outcome", no_wrap=True)
    det.add_column("what happened", overflow="fold", ratio=5)
    for g in grouped:
        if g["outcome"] == "silent":
            happened = f"returned {g['result']}"
        elif g["exc_type"]:
            happened = f"{g['exc_type'].rsplit('.', 1)[-1]}: {g['message']}"
        else:
            happened = g["message"] or "-"
        det.add_row(
            Text(g["id"]),
            Text(", ".join(g["args"])),
            Text(", ".join(g["backends"])),
            g["outcome"],
            Text(_short(happened, 200)),
        )
    console.print(det)


def surface_counts(report: dict) -> dict[str, dict[str, int]]:
    """The counts of every backend's runs per surface (`Case.surface`), catalogue order."""
    surface = {c["id"]: c.get("surface", c["target"]) for c in report["catalogue"]}
    out: dict[str, dict[str, int]] = {}
    for s in surface.values():
        out.setdefault(s, {k: 0 for k in (*OUTCOMES, *EXTRA)})
    for b in report["backends"]:
        for r in b["results"]:
            out[surface[r["id"]]][r["outcome"]] += 1
    return {k: v for k, v in out.items() if sum(v.values())}


def group_non_clear(report: dict) -> list[dict]:
    """The non-clear runs, one row per case and behaviour, with the backends that showed it."""
    groups: dict[tuple, dict] = {}
    order = {c["id"]: i for i, c in enumerate(report["catalogue"])}
    for b in report["backends"]:
        for r in b["results"]:
            if r["outcome"] == "clear":
                continue
            message = _short(r.get("message", ""), 200)
            key = (r["id"], r["outcome"], r.get("exc_type", ""), message, r.get("result", ""))
            g = groups.setdefault(
                key,
                {
                    "id": r["id"],
                    "args": r["args"],
                    "outcome": r["outcome"],
                    "exc_type": r.get("exc_type", ""),
                    "message": message,
                    "result": r.get("result", ""),
                    "backends": [],
                },
            )
            g["backends"].append(b["backend"])
    return sorted(groups.values(), key=lambda g: (order.get(g["id"], 1e9), g["backends"]))


def sweep(backends: Sequence[str], patterns: Sequence[str], timeout: float) -> dict:
    started = dt.datetime.now(dt.timezone.utc)
    results = [run_backend(b, cases_for(b, patterns), timeout) for b in backends]
    return {
        "started": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "revision": tree_revision(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "classification": {
            "clear": "ValueError or TypeError whose message names the argument (a whole word)",
            "unclear": "any other exception, a ValueError/TypeError not naming it, a crash or a hang",
            "silent": "no exception: a result was returned",
        },
        "catalogue": [
            {
                "id": c.id,
                "target": c.target,
                "args": list(c.args),
                "what": c.what,
                "surface": c.surface,
                "backends": [b for b in BACKENDS if c.runs_on(b)],
            }
            for c in CASES
            if not patterns or any(fnmatch.fnmatchcase(c.id, p) for p in patterns)
        ],
        "backends": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="comma-separated subset of " + ",".join(BACKENDS),
    )
    parser.add_argument(
        "--cases",
        action="append",
        default=[],
        metavar="GLOB",
        help="only the case ids matching GLOB (repeatable), e.g. 'ops.masked_softmax:*'",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per backend (default 600)"
    )
    parser.add_argument("--details", action="store_true", help="list every run that was not clear")
    parser.add_argument("--json", metavar="PATH", help="write the whole report (every run) to PATH")
    parser.add_argument("--strict", action="store_true", help="exit 1 unless every run was clear")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--ids-file", help=argparse.SUPPRESS)
    parser.add_argument("--results-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.ids_file, args.results_file)
        return 0
    if args.list:
        for c in CASES:
            if not args.cases or any(fnmatch.fnmatchcase(c.id, p) for p in args.cases):
                flag = f"  (only {', '.join(c.only)})" if c.only else ""
                flag += "" if c.paddle or c.only else "  (no paddle)"
                print(f"{c.id}  [must name: {', '.join(c.args)}]{flag}")
        return 0
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not backends:
        parser.error(f"--backends: unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    report = sweep(backends, args.cases, args.timeout)
    render(report, args.details)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    bad = sum(b["counts"][k] for b in report["backends"] for k in ("unclear", "silent", *EXTRA))
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
