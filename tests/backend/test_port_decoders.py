"""multiattn.port for the decoder blocks (`TransformerDecoderLayer`,
`TransformerDecoderOnlyLayer`) in every Keras worker: neutral weights set into a block give
the float64 oracle's output; ``get_weights`` returns them bit for bit with the config that
rebuilds the block; ``convert``, ``set_weights`` and a ``save_portable`` file carry every
setting; what cannot hold a block is refused by name."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from _port_decoders import DECODER, DECODER_ONLY, block_options, oracle, weights
from _port_oracle import ORACLE_RTOL, assert_same_weights, compare, inputs
from _support import to_np

from multiattn import port
from multiattn.layers import (
    DecoderBlockConfig,
    TransformerDecoderLayer,
    TransformerDecoderOnlyLayer,
)
from multiattn.port.decoders import DEFAULTS

CASES = [("decoder_only", n) for n in DECODER_ONLY] + [("decoder", n) for n in DECODER]


def _block(kind: str, config: dict):
    options = block_options(config)
    if kind == "decoder_only":
        return TransformerDecoderOnlyLayer(config=options)
    return TransformerDecoderLayer(**options)


def _call(kind: str, block, x, context):
    return to_np(block(x) if kind == "decoder_only" else block(x, context))


@pytest.mark.parametrize("kind,case", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_block_round_trip_matches_the_oracle(backend, kind, case, tmp_path):
    config = (DECODER_ONLY if kind == "decoder_only" else DECODER)[case]
    w = weights(kind, config)
    block = port.set_weights(_block(kind, config), w)  # built from the weights' shapes
    x, context = inputs((2, 5, config["d_model"]), (2, 3, config.get("context_width", 16)))
    got = _call(kind, block, x, context)
    compare(f"{kind} {case}", got, oracle(kind, config, w, x, context), ORACLE_RTOL)

    source = port.get_weights(block)
    assert source.kind == kind
    assert source.config == port.PortableWeights(kind, {**config, "dropout": 0.1}, w).config
    assert_same_weights(source, w)
    other = port.convert(block, to="multiattn")
    assert np.array_equal(_call(kind, other, x, context), got)
    port.save_portable(source, tmp_path / "block.safetensors")
    loaded = port.load_portable(tmp_path / "block.safetensors")
    assert loaded.kind == kind and loaded.config == source.config
    assert_same_weights(loaded, source)
    assert np.array_equal(
        _call(kind, port.set_weights(_block(kind, config), loaded), x, context), got
    )


def test_block_refusals_name_the_setting(backend):
    llama = DECODER_ONLY["llama"]
    block = port.set_weights(_block("decoder_only", llama), weights("decoder_only", llama))
    source = port.get_weights(block)
    for to in ("keras", "torch", "flax", "tensorflow-doc"):
        with pytest.raises(ValueError, match="only multiattn's layers hold a decoder_only block"):
            port.convert(block, to=to)
    other = _block("decoder_only", {**llama, "sliding_window": 4})
    with pytest.raises(ValueError, match=r"sliding_window=3.*sliding_window=4"):
        port.set_weights(other, source)
    w = dict(source.weights)
    w["ffn/up/kernel"] = w["ffn/up/kernel"][:, :5]
    with pytest.raises(
        ValueError, match=r"'ffn/up/kernel' must have shape \(16, 24\); received \(16, 5\)"
    ):
        port.set_weights(_block("decoder_only", llama), w)
    del w["ffn/up/kernel"]
    with pytest.raises(ValueError, match=r"missing \['ffn/up/kernel'\]"):
        port.set_weights(_block("decoder_only", llama), w)
    bad = {"norm": "batch", "activation": "tanhh", "rotary_base": -1.0, "head_dim": 0,
           "gated": 1, "dropout": 1.5, "sliding_window": 2.5, "colour": 1}  # fmt: skip
    for key, value in bad.items():
        with pytest.raises(ValueError, match=f"`{key}`|'{key}'"):
            port.PortableWeights("decoder_only", {**llama, key: value}, source.weights)
    with pytest.raises(ValueError, match="`num_key_value_heads` \\(3\\) must divide"):
        port.PortableWeights("decoder", {**DECODER["post"], "num_key_value_heads": 3}, {})


def test_neutral_defaults_are_the_blocks_defaults(backend):
    fields = {f.name: f.default for f in dataclasses.fields(DecoderBlockConfig)}
    fields["dropout"] = fields.pop("rate")
    for key, (_, default) in DEFAULTS["decoder_only"].items():
        assert fields[key] == default, key
    signature = inspect.signature(TransformerDecoderLayer.__init__).parameters
    for key, (_, default) in DEFAULTS["decoder"].items():
        name = {"dropout": "rate"}.get(key, key)
        if key != "context_width":
            assert signature[name].default == default, key
