"""The blockwise path within the memory budget: given by
``settings(autotune=Fixed(blockwise=True))``, kept off by ``False``, and measured against
the direct path in compiled calls whose scores take at least
``multiattn.ops.plan.BLOCKWISE_MIN_BYTES`` (`multiattn.tuning.blockwise_attention_pays`);
every way against the float64 oracle."""

import numpy as np
import pytest
from _support import BACKEND, TOL, assert_close, attention_cases, cast, compiler, sdpa_call, to_np

from multiattn import config, ops, tuning
from multiattn import reference as ref
from multiattn.ops import blockwise_grad, plan
from multiattn.tuning import Fixed, choices

# the timing of choices is what these tests exercise
pytestmark = pytest.mark.usefixtures("autotuned")

RNG = np.random.default_rng(41)
B, H, TQ, TK, D = 2, 3, 9, 7, 8
CASES = attention_cases(RNG, B, H, TQ, TK, [7, 3])
#: scores of 1 * 4 * 512 * 512 float32 (4 MiB): at the timing threshold as the tests below
#: set it (`at_threshold`)
LARGE = (1, 4, 512, 32)
#: float32 over 512 keys: about 1e-6 from the oracle on either path
LARGE_TOL = {"float32": 1e-5}


@pytest.fixture(autouse=True)
def at_threshold(monkeypatch):
    """The timing threshold lowered to ``LARGE``'s scores: what is timed, and when, does
    not depend on the threshold's value, and timing both paths at the shipped one (32 MiB
    of scores, forward and backward) took 20 to 45 s per test on a 2-core CPU."""
    b, h, t, _ = LARGE
    monkeypatch.setattr(plan, "BLOCKWISE_MIN_BYTES", b * h * t * t * 4)


@pytest.fixture
def blockwise_calls(monkeypatch):
    """The blocks of each call the core ran on the blockwise path during the test."""
    calls: list = []
    original = blockwise_grad.attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("blocks"))
        return original(*args, **kwargs)

    monkeypatch.setattr(blockwise_grad, "attention", spy)
    return calls


def _oracle(q, k, v, kw):
    return ref.scaled_dot_product_attention(q, k, v, **kw)[0]


def _decisions() -> list[dict]:
    return [d for d in tuning.decisions() if d["op"] == "attention-blockwise"]


def test_the_shipped_threshold_is_two_preferred_blocks(monkeypatch):
    monkeypatch.undo()  # the module's own value
    assert plan.BLOCKWISE_MIN_BYTES == 2 * plan.PREFERRED_BLOCK_BYTES == 32 << 20


@pytest.mark.parametrize("case", list(CASES))
def test_forced_on_gives_the_oracle_values_on_the_blockwise_path(blockwise_calls, case):
    """Fixed(blockwise=True): the blockwise path for scores far below the
    budget (eagerly too, and on torch where its kernel streams), the oracle's values."""
    q, k, v = (RNG.standard_normal((B, H, t, D)) for t in (TQ, TK, TK))
    with config.settings(autotune=Fixed(blockwise=True)):
        got = sdpa_call(*(cast(a, "float32") for a in (q, k, v)), CASES[case])
    assert_close(got, _oracle(q, k, v, CASES[case]), "float32", TOL)
    assert len(blockwise_calls) == 1


def test_forced_on_leaves_the_weights_to_the_direct_path(blockwise_calls):
    q, k, v = (cast(RNG.standard_normal((B, H, t, D)), "float32") for t in (TQ, TK, TK))
    with config.settings(autotune=Fixed(blockwise=True)):
        out, weights = ops.scaled_dot_product_attention(q, k, v, return_weights=True)
    want, want_weights = ref.scaled_dot_product_attention(*(to_np(t) for t in (q, k, v)))
    assert_close(out, want, "float32", TOL)
    assert_close(weights, want_weights, "float32", TOL)
    assert blockwise_calls == []


@pytest.fixture
def only_blockwise_timed(monkeypatch):
    """The measuring tuner's other attention choices given (one piece, automatic
    differentiation): only blockwise or direct is timed."""
    monkeypatch.setattr(choices, "attention_chunks", lambda *args: 1)
    monkeypatch.setattr(choices, "attention_backward", lambda *args: "autodiff")


def _large(causal: bool = False):
    qkv = [cast(RNG.standard_normal(LARGE), "float32") for _ in range(3)]

    def f(q, k, v):
        with config.settings(fused_attention=False):
            return ops.scaled_dot_product_attention(q, k, v, causal=causal)

    return qkv, f


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_compiled_calls_measure_the_choice_once_per_class(only_blockwise_timed, causal):
    jit = compiler()
    tuning.reset()
    qkv, f = _large(causal)
    got = jit(f)(*qkv)
    want = ref.scaled_dot_product_attention(*(to_np(t) for t in qkv), causal=causal)[0]
    assert_close(got, want, "float32", LARGE_TOL)
    found = _decisions()
    assert len(found) == 1 and found[0]["how"] == "measured", found
    assert set(found[0]["median_ms"]) == {"direct", "blockwise"}
    if found[0]["choice"] == "blockwise":  # then timed forward and backward too
        assert [d["op"] for d in tuning.decisions() if "backward" in d["op"]] == [
            "attention-blockwise-backward"
        ]
    assert found[0]["shape_class"]["causal"] is causal
    jit(f)(*qkv)  # a second trace: the decision is reused, not timed again
    assert len(_decisions()) == 1
    tuning.reset()


@pytest.mark.parametrize("forced", [False, True])
def test_forced_either_way_in_compiled_calls_times_nothing(blockwise_calls, forced):
    jit = compiler()
    tuning.reset()
    qkv, f = _large()

    def scoped(q, k, v):
        with config.settings(autotune=Fixed(blockwise=forced)):
            return f(q, k, v)

    got = jit(scoped)(*qkv)
    assert_close(got, _oracle(*(to_np(t) for t in qkv), {}), "float32", LARGE_TOL)
    assert _decisions() == []
    assert len(blockwise_calls) == (1 if forced else 0)
    tuning.reset()


def test_eager_calls_and_small_scores_are_not_timed(only_blockwise_timed, blockwise_calls):
    """Eager calls within the budget take the direct path untimed (the eager torch and
    numpy suites included); so do compiled calls of scores under the threshold."""
    tuning.reset()
    qkv, f = _large()
    f(*qkv)
    assert _decisions() == [] and blockwise_calls == []
    if BACKEND in ("jax", "tensorflow"):
        small = [cast(RNG.standard_normal((B, H, TQ, D)), "float32") for _ in range(3)]
        compiler()(f)(*small)
        assert _decisions() == [] and blockwise_calls == []
    tuning.reset()
