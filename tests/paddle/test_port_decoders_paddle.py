"""The decoder blocks across frameworks in the Paddle worker (Keras numpy backend): a
multiattn Keras block converted to its Paddle twin and back keeps its weights bit for bit
and the config's settings; both agree with the float64 oracle."""

from __future__ import annotations

import keras
import numpy as np
import paddle
import pytest
from _port_decoders import DECODER, DECODER_ONLY, block_options, oracle, weights
from _port_oracle import ORACLE_RTOL, assert_same_weights, compare, inputs

import multiattn.paddle.layers as pl
from multiattn import layers, port

CASES = [("decoder_only", n) for n in DECODER_ONLY] + [("decoder", n) for n in DECODER]


def _run(kind, block, x, context):
    out = block(x) if kind == "decoder_only" else block(x, context)
    return (
        out.numpy()
        if isinstance(out, paddle.Tensor)
        else np.asarray(keras.ops.convert_to_numpy(out))
    )


@pytest.mark.parametrize("kind,case", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_keras_block_to_paddle_twin_and_back(backend, kind, case):
    config = (DECODER_ONLY if kind == "decoder_only" else DECODER)[case]
    options = block_options(config)
    make = {"decoder_only": lambda m: m.TransformerDecoderOnlyLayer(config=options),
            "decoder": lambda m: m.TransformerDecoderLayer(**options)}[kind]  # fmt: skip
    w = weights(kind, config, seed=3)
    source = port.set_weights(make(layers), w)
    twin = port.convert(source, to="multiattn-paddle")
    assert isinstance(twin, paddle.nn.Layer)
    twin.eval()
    assert_same_weights(port.get_weights(twin), port.get_weights(source))
    x, context = inputs((2, 5, config["d_model"]), (2, 3, config.get("context_width", 16)), seed=4)
    want = oracle(kind, config, w, x, context)
    compare(f"paddle {kind} {case}", _run(kind, twin, x, context), want, ORACLE_RTOL)
    back = port.convert(twin, to="multiattn")
    assert_same_weights(port.get_weights(back), w)
    compare(f"keras {kind} {case}", _run(kind, back, x, context), want, ORACLE_RTOL)
    other = port.set_weights(make(pl), port.get_weights(twin))  # an unbuilt twin: built from them
    assert np.array_equal(
        _run(kind, other.eval() or other, x, context), _run(kind, twin, x, context)
    )
