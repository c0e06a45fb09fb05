"""The pieces of ``generate`` (`multiattn.decoding`): samplers, the stopping rule and the
choice of a strategy, against expectations written here in plain NumPy and Python (rank
the logits, keep by rule, count draws), not produced by the code under test.

The in-graph forms (`Greedy.choose_in_graph`, `Stopping.update_in_graph`) run on the
backend's tensors, eagerly and under its compiler (``jax.jit``, ``tf.function``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _support import BACKEND, compiler, to_np
from hypothesis import given, settings
from hypothesis import strategies as st

from multiattn.decoding import (
    STRATEGIES,
    CompiledLoop,
    CompiledStepLoop,
    EagerLoop,
    Greedy,
    Sampling,
    Stopping,
    TracedLoop,
    choose_strategy,
    make_sampler,
    make_stopping,
)

RNG = np.random.default_rng(11)


def eager_and_compiled(fn):
    """``fn`` itself and, on jax and TensorFlow, ``fn`` under the backend's compiler."""
    return [fn, compiler()(fn)] if BACKEND in ("jax", "tensorflow") else [fn]


def kept_tokens(row: np.ndarray, temperature: float, top_k, top_p) -> set[int]:
    """The tokens of one row of logits that top-k then top-p keep, by hand: rank the
    tokens (ties by index), keep the k best and every token tied with the k-th, then keep
    tokens in rank order while the probability of those ranked above stays below
    ``top_p``."""
    scaled = [float(x) / temperature for x in row]
    ranked = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    if top_k is not None and top_k < len(ranked):
        kth = scaled[ranked[top_k - 1]]
        ranked = [i for i in ranked if scaled[i] >= kth]
    if top_p is None or top_p >= 1:
        return set(ranked)
    weights = [np.exp(scaled[i] - scaled[ranked[0]]) for i in ranked]
    total, above, kept = sum(weights), 0.0, []
    for i, w in zip(ranked, weights):
        if above >= top_p:
            break
        kept.append(i)
        above += w / total
    return set(kept)


# --- Greedy --------------------------------------------------------------------------------


def test_greedy_takes_the_first_largest_logit():
    logits = np.array([[0.1, 2.0, -1.0, 2.0], [5.0, 4.0, 3.0, 2.0], [-3.0, -2.0, -1.0, -1.5]])
    got = Greedy()(logits)
    assert got.dtype == np.int64 and got.shape == (3,)
    assert got.tolist() == [1, 0, 2]  # the first of the two 2.0 in row 0


def test_greedy_in_graph_equals_its_numpy_choice():
    logits = RNG.normal(size=(4, 13)).astype("float32")
    want = [max(range(13), key=lambda i, r=row: (r[i], -i)) for row in logits]

    def choose(x):
        return Greedy().choose_in_graph(keras.ops, x)

    for fn in eager_and_compiled(choose):
        got = fn(keras.ops.convert_to_tensor(logits))
        assert keras.backend.standardize_dtype(got.dtype) == "int32"
        assert to_np(got).tolist() == want


@pytest.mark.parametrize("bad", [np.zeros(3), np.zeros((2, 0)), np.zeros((1, 2, 3))])
def test_samplers_refuse_logits_of_another_rank(bad):
    for sampler in (Greedy(), Sampling(seed=0)):
        with pytest.raises(ValueError, match="`logits`"):
            sampler(bad)


# --- Sampling ------------------------------------------------------------------------------


def test_sampling_draws_from_the_tempered_softmax():
    """Frequencies of 40000 draws (one call over 40000 equal rows) within 0.01 of
    exp(l / T) / sum exp(l / T), computed here, at two temperatures."""
    logits = np.array([1.0, 0.0, -0.5, 2.0])
    for temperature in (1.0, 0.5):
        p = np.exp(logits / temperature)
        p /= p.sum()
        draws = Sampling(temperature=temperature, seed=3)(np.tile(logits, (40000, 1)))
        freq = np.bincount(draws, minlength=4) / draws.size
        np.testing.assert_allclose(freq, p, atol=0.01)


def test_sampling_is_reproducible_by_seed_and_continues_its_stream():
    logits = RNG.normal(size=(64, 10))
    first, again = Sampling(seed=7), Sampling(seed=7)
    a = first(logits)
    np.testing.assert_array_equal(a, again(logits))
    assert not np.array_equal(a, Sampling(seed=8)(logits))
    assert not np.array_equal(first(logits), a)  # the second call draws afresh
    assert a.dtype == np.int64 and a.shape == (64,)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_top_k_keeps_the_k_largest_and_their_ties(top_k):
    logits = np.array([[3.0, 1.0, 3.0, 0.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    sampler = Sampling(top_k=top_k, seed=0)
    filtered = sampler.filtered(logits)
    for row, out in zip(logits, filtered):
        kept = kept_tokens(row, 1.0, top_k, None)
        assert {i for i in range(5) if np.isfinite(out[i])} == kept
        np.testing.assert_array_equal(out[list(kept)], row[list(kept)])
    assert {int(t) for t in sampler(np.tile(logits[1], (500, 1)))} <= set(range(5 - top_k, 5))


def test_top_p_keeps_the_smallest_most_likely_set_reaching_p():
    # probabilities 0.5, 0.25, 0.125, 0.125: top_p 0.5 keeps 1 token, 0.6 keeps 2, 0.8 keeps 3
    logits = np.log(np.array([[0.5, 0.25, 0.125, 0.125]]))
    for top_p, kept in ((0.5, {0}), (0.6, {0, 1}), (0.8, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        out = Sampling(top_p=top_p, seed=0).filtered(logits)[0]
        assert {i for i in range(4) if np.isfinite(out[i])} == kept, top_p
    tiny = Sampling(top_p=1e-9, seed=0)(np.tile(logits[0], (200, 1)))
    assert (tiny == 0).all()  # the most likely token is always kept


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 3),
    vocab=st.integers(2, 12),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 2.5]),
    top_k=st.one_of(st.none(), st.integers(1, 12)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    seed=st.integers(0, 2**16),
)
def test_every_draw_respects_the_filters(batch, vocab, temperature, top_k, top_p, seed):
    logits = np.random.default_rng(seed).normal(size=(batch, vocab)) * 3
    tokens = Sampling(temperature, top_k, top_p, seed)(logits)
    assert tokens.shape == (batch,)
    for row, token in zip(logits, tokens):
        assert int(token) in kept_tokens(row, temperature, top_k, top_p)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": 0.0}, ValueError, "`temperature`.*0.0"),
        ({"temperature": -1}, ValueError, "`temperature`"),
        ({"temperature": float("nan")}, ValueError, "`temperature`"),
        ({"temperature": float("inf")}, ValueError, "`temperature`"),
        ({"temperature": True}, ValueError, "`temperature`.*True"),
        ({"temperature": "1"}, ValueError, "`temperature`"),
        ({"top_p": 0.0}, ValueError, "`top_p`.*0.0"),
        ({"top_p": 1.5}, ValueError, "`top_p`.*1.5"),
        ({"top_p": True}, ValueError, "`top_p`"),
        ({"top_k": 0}, ValueError, "`top_k`.*0"),
        ({"top_k": 2.0}, TypeError, "`top_k`.*2.0"),
        ({"top_k": True}, TypeError, "`top_k`"),
        ({"seed": -1}, ValueError, "`seed`.*-1"),
        ({"seed": 1.5}, TypeError, "`seed`.*1.5"),
    ],
)
def test_bad_sampling_arguments_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        Sampling(**kwargs)
    with pytest.raises(error, match="generate: " + match):
        make_sampler(True, **kwargs)
    with pytest.raises(error, match=match):  # checked for greedy decoding too
        make_sampler(False, **kwargs)


def test_make_sampler_builds_from_transformers_arguments():
    assert isinstance(make_sampler(), Greedy)
    assert isinstance(make_sampler(False, 0.5, 3, 0.9, 1), Greedy)
    sampler = make_sampler(True, 0.5, np.int64(3), 0.9, 1)
    assert isinstance(sampler, Sampling)
    assert (sampler.temperature, sampler.top_k, sampler.top_p, sampler.seed) == (0.5, 3, 0.9, 1)
    assert type(sampler.top_k) is int
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="`do_sample`"):
            make_sampler(bad)


# --- Stopping ------------------------------------------------------------------------------


def test_stopping_pads_rows_after_their_end():
    """Three rows over four steps, end ids 5 and 6, pad 0: by hand, row 0 ends at step 1
    (then pads), row 1 at step 2 by the second id, row 2 never."""
    stopping = Stopping(4, (5, 6), 0)
    steps = np.array([[1, 2, 3], [5, 4, 3], [9, 6, 3], [5, 5, 5]])
    want = np.array([[1, 2, 3], [5, 4, 3], [0, 6, 3], [0, 0, 5]])
    want_done = [[False] * 3, [True, False, False], [True, True, False], [True, True, True]]
    done = stopping.start(3)
    assert done.dtype == bool and not done.any()
    for chosen, expected, expected_done in zip(steps, want, want_done):
        token, done = stopping.update(chosen, done)
        assert token.tolist() == expected.tolist() and done.tolist() == expected_done


def test_stopping_without_end_ids_changes_nothing():
    stopping = Stopping(3)
    done = stopping.start(2)
    token, done = stopping.update(np.array([4, 7]), done)
    assert token.tolist() == [4, 7] and not done.any()


def test_stopping_in_graph_equals_its_numpy_rule():
    stopping = Stopping(4, (5, 6), 2)
    chosen = np.array([5, 1, 6, 3], np.int32)
    done = np.array([False, True, False, False])
    want_token, want_done = stopping.update(chosen, done)
    ops = keras.ops

    def rule(t, d):
        return stopping.update_in_graph(ops, t, d)

    for fn in eager_and_compiled(rule):
        token, got_done = fn(ops.convert_to_tensor(chosen), ops.convert_to_tensor(done))
        assert to_np(token).tolist() == want_token.tolist() == [5, 2, 6, 3]
        assert to_np(got_done).tolist() == want_done.tolist() == [True, True, True, False]


def test_stopping_is_immutable_and_hashable():
    stopping = Stopping(3, (1,), 0)
    assert hash(stopping) == hash(Stopping(3, (1,), 0)) and stopping == Stopping(3, (1,), 0)
    with pytest.raises(AttributeError):
        stopping.max_new_tokens = 4


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0,), ValueError, "`max_new_tokens`.*0"),
        ((None,), TypeError, "`max_new_tokens`.*None"),
        ((2.0,), TypeError, "`max_new_tokens`.*2.0"),
        ((3, [1]), TypeError, "`eos_token_ids`.*tuple"),
        ((3, (-1,), 0), ValueError, "`eos_token_ids`.*-1"),
        ((3, (1.0,), 0), TypeError, "`eos_token_ids`"),
        ((3, (1,)), ValueError, "`pad_token_id`.*None"),
        ((3, (), -2), ValueError, "`pad_token_id`.*-2"),
    ],
)
def test_bad_stopping_arguments_are_refused_by_name(args, error, match):
    with pytest.raises(error, match="Stopping: " + match):
        Stopping(*args)


def test_make_stopping_builds_from_transformers_arguments():
    assert make_stopping(5, None, None, 10) == Stopping(5, (), None)
    assert make_stopping(5, 3, None, 10) == Stopping(5, (3,), 3)  # pad: the first end id
    assert make_stopping(5, [3, 4], 7, 10) == Stopping(5, (3, 4), 7)
    assert make_stopping(np.int64(2), (np.int32(9),), None, 10) == Stopping(2, (9,), 9)
    with pytest.raises(ValueError, match=r"`eos_token_id`.*\[0, 10\).*10"):
        make_stopping(5, 10, None, 10)
    with pytest.raises(ValueError, match="`eos_token_id`"):
        make_stopping(5, [1, -1], None, 10)
    with pytest.raises(TypeError, match=r"`eos_token_id`.*'a'"):
        make_stopping(5, "a", None, 10)
    with pytest.raises(ValueError, match=r"`pad_token_id`.*-1"):
        make_stopping(5, None, -1, 10)
    with pytest.raises(TypeError, match=r"generate: `max_new_tokens`.*None"):
        make_stopping(None, None, None, 10)


# --- the choice of a strategy --------------------------------------------------------------


@pytest.mark.parametrize(
    ("framework", "greedy", "sampling"),
    [
        ("jax", CompiledLoop, CompiledStepLoop),
        ("tensorflow", CompiledLoop, CompiledStepLoop),
        ("torch", TracedLoop, TracedLoop),
        ("numpy", EagerLoop, EagerLoop),
        ("paddle", EagerLoop, EagerLoop),
        (None, EagerLoop, EagerLoop),
    ],
)
def test_default_strategy_of_each_backend(framework, greedy, sampling):
    assert type(choose_strategy(framework, Greedy())) is greedy
    assert type(choose_strategy(framework, Sampling(seed=0))) is sampling


def test_named_strategies_run_only_where_they_can():
    assert sorted(STRATEGIES) == ["compiled", "compiled_step", "eager", "traced"]
    for framework in ("jax", "tensorflow", "torch", "numpy", "paddle"):
        for name, cls in STRATEGIES.items():
            if cls.backends is None or framework in cls.backends:
                assert type(choose_strategy(framework, Greedy(), name)) is cls
            else:
                with pytest.raises(ValueError, match=f"`strategy`='{name}' runs on"):
                    choose_strategy(framework, Greedy(), name)
    with pytest.raises(ValueError, match=r"'compiled'.*Sampling.*compiled_step"):
        choose_strategy("jax", Sampling(seed=0), "compiled")
    given = EagerLoop()
    assert choose_strategy("jax", Sampling(seed=0), given) is given
    with pytest.raises(ValueError, match=r"`strategy`.*'fast'"):
        choose_strategy("jax", Greedy(), "fast")
    for bad in (1, EagerLoop, ["eager"]):
        with pytest.raises(TypeError, match="`strategy`"):
            choose_strategy("jax", Greedy(), bad)


def test_this_backend_is_named_in_the_refusal():
    other = "traced" if BACKEND != "torch" else "compiled"
    with pytest.raises(ValueError, match=f"computes on {BACKEND}"):
        choose_strategy(BACKEND, Greedy(), other)
