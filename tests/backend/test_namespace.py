"""The Keras namespace of the running backend: its class, the contract, caching, and the
``TypeError`` for tensors of a framework Keras is not running on."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _support import BACKEND, cast

from multiattn import ops
from multiattn.namespaces.contract import check_namespace
from multiattn.namespaces.keras import (
    _KERAS_NAMESPACES,
    KerasNamespace,
    framework_of,
    get_ops,
    keras_namespace,
)

# a framework Keras is not running on here (both are installed with the test extras)
FOREIGN = "jax" if BACKEND == "torch" else "torch"


def _foreign(shape):
    if FOREIGN == "torch":
        import torch

        return torch.ones(shape)
    import jax.numpy as jnp

    return jnp.ones(shape)


def test_the_namespace_is_the_backends_and_cached():
    ns = get_ops()
    assert type(ns) is _KERAS_NAMESPACES[BACKEND]
    assert isinstance(ns, KerasNamespace) and ns.backend == BACKEND
    assert ns is keras_namespace() is get_ops(cast(np.ones(2), "float32"), None, [1.0], 2.0)
    check_namespace(ns)
    assert ns.has_fused_attention and ns.softmax_exact_zeros
    assert ns.fused_attention_streams is (BACKEND == "torch")


def test_an_operation_outside_the_contract_is_an_attribute_error():
    with pytest.raises(AttributeError, match=r"no attribute 'cumsum'.*namespace contract"):
        get_ops().cumsum  # noqa: B018


def test_frameworks_of_tensors():
    assert framework_of(np.ones(2)) is None and framework_of([1, 2]) is None
    assert framework_of(np.float32(1.0)) is None and framework_of(None) is None
    assert framework_of(keras.Variable(np.ones(2, "float32"))) == "keras"
    assert framework_of(keras.KerasTensor((2, 3))) == "keras"
    assert framework_of(_foreign((2,))) == FOREIGN
    if BACKEND != "numpy":
        assert framework_of(cast(np.ones(2), "float32")) == BACKEND


def test_keras_variables_and_symbolic_tensors_go_with_the_backends_tensors():
    q = cast(np.ones((2, 3, 4)), "float32")
    v = keras.Variable(np.ones((2, 3, 4), "float32"))
    assert get_ops(q, v) is get_ops(v, q) is get_ops()
    out = ops.scaled_dot_product_attention(q, v, np.ones((2, 3, 4), "float32"))
    assert tuple(out.shape) == (2, 3, 4)


def test_a_tensor_of_another_framework_is_a_type_error():
    q = np.ones((2, 3, 4), "float32")
    with pytest.raises(
        TypeError, match=rf"`query` is a .*\({FOREIGN}\), but Keras runs on its '{BACKEND}'"
    ):
        ops.scaled_dot_product_attention(_foreign((2, 3, 4)), q, q)
    with pytest.raises(
        TypeError, match=rf"`valid_lens` is a .*\({FOREIGN}\), but Keras runs on its '{BACKEND}'"
    ):
        ops.masked_softmax(q, valid_lens=_foreign((2,)))


@pytest.mark.skipif(BACKEND == "numpy", reason="numpy: the backend's tensors are NumPy arrays")
def test_two_frameworks_in_one_call_are_a_type_error():
    q = cast(np.ones((2, 3, 4)), "float32")
    with pytest.raises(
        TypeError, match=rf"`key` is a .*\({FOREIGN}\) but `query` is a .*\({BACKEND}\)"
    ):
        ops.scaled_dot_product_attention(q, _foreign((2, 3, 4)), q)
