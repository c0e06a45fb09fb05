"""``tf.function`` traces multiattn's functions without converting their source
(AutoGraph): the public functions carry AutoGraph's mark (`multiattn._autograph`), and
the library's own compiled calls pass ``autograph=False``."""

import numpy as np
import pytest
from _support import BACKEND, TOL, assert_close, cast, to_np

from multiattn import ops
from multiattn import reference as ref
from multiattn._autograph import MARK, as_written


def test_every_public_function_of_the_core_is_marked():
    functions = [getattr(ops, n) for n in ops.__all__ if callable(getattr(ops, n))]
    assert len(functions) > 15
    unmarked = [f.__name__ for f in functions if not hasattr(f, MARK)]
    assert unmarked == []


def test_only_functions_are_marked():
    with pytest.raises(TypeError, match="expected a function; received int"):
        as_written(3)


@pytest.fixture
def converted(monkeypatch):
    """The modules of the functions AutoGraph converts during the test."""
    if BACKEND != "tensorflow":
        pytest.skip("AutoGraph is tf.function's")
    from tensorflow.python.autograph.impl import api

    modules: list[str] = []
    original = api._convert_actual

    def spy(entity, program_ctx):
        modules.append(getattr(entity, "__module__", "") or "")
        return original(entity, program_ctx)

    monkeypatch.setattr(api, "_convert_actual", spy)
    return modules


def test_a_traced_call_converts_the_users_function_only(converted):
    import tensorflow as tf

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))

    def user(q, k, v):
        if q.shape[-1] == 4:  # a Python branch, as users write them
            return ops.scaled_dot_product_attention(q, k, v, causal=True)
        return q

    got = tf.function(user)(*(cast(x, "float32") for x in (q, k, v)))
    want = ref.scaled_dot_product_attention(q, k, v, causal=True)[0]
    assert_close(to_np(got), want, "float32", TOL)
    assert converted and all(m == __name__ for m in converted), converted


def test_the_tensorflow_documents_functions_are_marked(converted):
    from multiattn.backends import tensorflow as adapter

    marked = [n for n in adapter.__all__ if hasattr(getattr(adapter, n), MARK)]
    assert marked == ["point_wise_feed_forward_network", "scaled_dot_product_attention"]
