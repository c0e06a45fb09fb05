"""BertSentenceEncoder (multiattn.models.bert) against the float64 oracle, padding, .keras
round trip and argument checks. The real checkpoint is compared with sentence-transformers
in tests/test_minilm.py."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _bert_oracle import SIZES, random_batch, random_weights, sentence_embedding
from _support import rel_err, to_np

from multiattn.models.bert import BertSentenceEncoder, set_bert_weights


def make_encoder(seed: int = 0, **overrides) -> BertSentenceEncoder:
    encoder = BertSentenceEncoder(**{**SIZES, **overrides})
    set_bert_weights(encoder, random_weights(seed))  # blocks through multiattn.port
    return encoder


@pytest.mark.parametrize("normalize", [True, False])
def test_matches_oracle(normalize):
    w, batch = random_weights(), random_batch()
    encoder = make_encoder(normalize=normalize)
    got = to_np(encoder(batch["token_ids"], batch["attention_mask"], batch["token_type_ids"]))
    want = sentence_embedding(w, **batch, normalize=normalize)
    assert got.shape == (4, SIZES["hidden_size"])
    assert rel_err(got, want) <= 2e-6
    np.testing.assert_array_equal(got[3], 0.0)  # no real token: pools to zeros


def test_token_types_default_to_zero():
    batch = random_batch()
    encoder = make_encoder()
    zeros = np.zeros_like(batch["token_ids"])
    a = to_np(encoder(batch["token_ids"], batch["attention_mask"]))
    b = to_np(encoder(batch["token_ids"], batch["attention_mask"], zeros))
    np.testing.assert_array_equal(a, b)


def test_padding_changes_nothing():
    """A sentence alone and the same sentence padded with arbitrary ids: padded keys get
    exactly zero weight, so only float rounding of the wider batch may differ."""
    batch = random_batch()
    encoder = make_encoder()
    ids, types = batch["token_ids"][1:2, :5], batch["token_type_ids"][1:2, :5]
    alone = to_np(encoder(ids, np.ones_like(ids), types))
    padded = to_np(
        encoder(batch["token_ids"][1:2], batch["attention_mask"][1:2], batch["token_type_ids"][1:2])
    )
    np.testing.assert_allclose(padded, alone, rtol=0, atol=1e-6)


def build_model(encoder: BertSentenceEncoder) -> keras.Model:
    ids = keras.Input((None,), dtype="int32")
    mask = keras.Input((None,), dtype="int32")
    return keras.Model([ids, mask], encoder(ids, mask))


def test_keras_file_round_trip_is_exact(tmp_path):
    batch = random_batch()
    model = build_model(make_encoder())
    inputs = [batch["token_ids"], batch["attention_mask"]]
    path = tmp_path / "bert.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(to_np(model(inputs)), to_np(loaded(inputs)))
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(to_np(a), to_np(b))
    assert loaded.layers[-1].get_config() == model.layers[-1].get_config()


def test_config_round_trip():
    encoder = BertSentenceEncoder(**SIZES, epsilon=1e-7, normalize=False)
    clone = BertSentenceEncoder.from_config(encoder.get_config())
    assert clone.get_config() == encoder.get_config()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"vocab_size": 0}, ValueError, "vocab_size"),
        ({"num_heads": 5}, ValueError, "divisible"),
        ({"normalize": "yes"}, TypeError, "normalize"),
        ({"activation": "nope"}, ValueError, "activation"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        BertSentenceEncoder(**{**SIZES, **kwargs})


def test_bad_inputs():
    encoder = make_encoder()
    ids = np.ones((2, 3), np.int32)
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        encoder(ids[None], ids[None])
    long = np.ones((1, SIZES["max_positions"] + 1), np.int32)
    with pytest.raises(ValueError, match="max_positions"):
        encoder(long, long)


def test_set_weights_checks_names_and_shapes():
    encoder = BertSentenceEncoder(**SIZES)
    w = random_weights()
    w["embeddings/word"] = w["embeddings/word"][:-1]
    with pytest.raises(ValueError, match="embeddings/word"):
        set_bert_weights(encoder, w)
    w = random_weights()
    del w["layer_1/ffn_2/bias"]
    with pytest.raises(ValueError, match="ffn_2/bias"):
        set_bert_weights(encoder, w)
